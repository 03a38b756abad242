//go:build tools

// Package peers pins the peer systems gpushare is measured against, for tests/peers/build.
// Nothing here is built into gpushare.
package peers

import (
	_ "github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin"
	// The CDI hook NVIDIA's DRA driver names in the specs it writes (it must exist to start).
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook"
)
