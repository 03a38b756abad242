// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * packaging/vmtest's stand-in for NVIDIA's unified memory module: built as nvidia-uvm.ko, loaded
 * by gpushared-mps-uvm.service's modprobe, it registers the nvidia-uvm device group only
 * (vmtest_devices.c with VMTEST_UVM).
 */
#define VMTEST_UVM
#include "vmtest_devices.c"
