// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * packaging/vmtest's stand-in for NVIDIA's character devices: registers the device groups the
 * NVIDIA driver registers in /proc/devices (nvidia-frontend at its fixed major 195, nvidia-caps
 * at a dynamic major) and one group of no GPU's (gpushare-vmtest-other), each with an open and
 * a read that succeed and return nothing. Built a second time as nvidia-uvm.ko (vmtest_uvm.c,
 * VMTEST_UVM), it registers nvidia-uvm alone, as NVIDIA's unified memory module does when
 * loaded. The units' DeviceAllow=char-nvidia* rules are resolved against these names when a unit
 * starts, so a probe in the unit can open the NVIDIA nodes and is refused (EPERM) the other
 * group's node. Built against the virtual machine's kernel headers; never loaded on a real host.
 */
#include <linux/fs.h>
#include <linux/kernel.h>
#include <linux/module.h>

static int vmtest_open(struct inode *inode, struct file *file)
{
	return 0;
}

static ssize_t vmtest_read(struct file *file, char __user *buf, size_t len, loff_t *off)
{
	return 0;
}

static const struct file_operations vmtest_fops = {
	.owner = THIS_MODULE,
	.open = vmtest_open,
	.read = vmtest_read,
	.llseek = noop_llseek,
};

#ifdef VMTEST_UVM
static const char *const names[] = { "nvidia-uvm" };
static const unsigned int fixed[] = { 0 };
#else
static const char *const names[] = { "nvidia-frontend", "nvidia-caps", "gpushare-vmtest-other" };
static const unsigned int fixed[] = { 195, 0, 0 };
#endif
static int majors[ARRAY_SIZE(names)];

static void vmtest_unregister(size_t n)
{
	while (n-- > 0)
		unregister_chrdev(majors[n], names[n]);
}

static int __init vmtest_init(void)
{
	size_t i;
	int r;

	for (i = 0; i < ARRAY_SIZE(names); i++) {
		r = register_chrdev(fixed[i], names[i], &vmtest_fops);
		if (r < 0) {
			pr_err("vmtest_devices: cannot register %s: %d\n", names[i], r);
			vmtest_unregister(i);
			return r;
		}
		majors[i] = fixed[i] ? fixed[i] : r;
	}
	return 0;
}

static void __exit vmtest_exit(void)
{
	vmtest_unregister(ARRAY_SIZE(names));
}

module_init(vmtest_init);
module_exit(vmtest_exit);
MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("gpushare vmtest: stand-in NVIDIA character device groups");
