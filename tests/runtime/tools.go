//go:build tools

// The components of the real-runtime box, pinned by go.mod and go.sum and built by ./build:
// containerd 2 with its runc shim and ctr, runc, and the CNI plugins a pod network needs.

package runtime

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
	_ "github.com/opencontainers/runc"
)
