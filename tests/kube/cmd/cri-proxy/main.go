// Command cri-proxy forwards the CRI from one unix socket to another, for the real-cluster box's
// kubelets older than 1.31: their CRI client sends the socket's path as the HTTP/2 :authority,
// which the box's recording runtime (Rust, h2) refuses as malformed. It serves HTTP/2 without
// TLS on the first socket and forwards every call, with authority "localhost", to the second.
//
// Usage: cri-proxy LISTEN-SOCKET UPSTREAM-SOCKET
package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http/httputil"
	"os"

	"golang.org/x/net/http2"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: cri-proxy LISTEN-SOCKET UPSTREAM-SOCKET")
		os.Exit(2)
	}
	listen, upstream := os.Args[1], os.Args[2]
	if err := os.Remove(listen); err != nil && !os.IsNotExist(err) {
		fmt.Fprintf(os.Stderr, "cri-proxy: removing the stale %s: %v\n", listen, err)
		os.Exit(1)
	}
	l, err := net.Listen("unix", listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "cri-proxy: %v\n", err)
		os.Exit(1)
	}
	transport := &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, _, _ string, _ *tls.Config) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", upstream)
		},
	}
	proxy := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.Out.URL.Scheme = "http"
			r.Out.URL.Host = "localhost"
			r.Out.Host = "localhost"
		},
		Transport:     transport,
		FlushInterval: -1,
	}
	server := &http2.Server{}
	for {
		conn, err := l.Accept()
		if err != nil {
			fmt.Fprintf(os.Stderr, "cri-proxy: %v\n", err)
			os.Exit(1)
		}
		go server.ServeConn(conn, &http2.ServeConnOpts{Handler: proxy})
	}
}
