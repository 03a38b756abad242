//go:build tools

// Package peers pins the peer systems gpushare is measured against, for tests/peers/build.
// Nothing here is built into gpushare.
package peers

import _ "github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin"
