// Command etcd is etcd's server, built from go.etcd.io/etcd/server/v3 at the version
// k8s.io/kubernetes pins, for gpushare's real-cluster tests.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
