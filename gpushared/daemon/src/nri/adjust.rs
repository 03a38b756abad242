//! A container's grant as NRI's `ContainerAdjustment`: its variables, its mounts as bind
//! mounts, and its device nodes with the type, numbers, mode and owner of the host's nodes,
//! which the runtime needs to make them in the container and to allow them in its device
//! cgroup (as it does for a device plugin's device specs).

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};

use gpushare_proto::nri as api;

use crate::allocation::allocator::{Edits, Mount};
use crate::config::DeviceNode;

/// The adjustment that gives a container `edits`.
///
/// # Errors
/// Why a GPU's own device node cannot be named: it is not on the host, or is not a character
/// device. The container is then refused, as the runtime refuses a device plugin's answer
/// that names a missing node.
pub(super) fn adjustment(edits: Edits) -> Result<api::ContainerAdjustment, String> {
    let mut devices = Vec::with_capacity(edits.devices.len());
    for node in edits.devices.iter().filter(|n| n.named()) {
        if let Some(device) = linux_device(node)? {
            devices.push(device);
        }
    }
    Ok(api::ContainerAdjustment {
        mounts: edits.mounts.iter().map(bind_mount).collect(),
        env: env(edits.envs),
        linux: (!devices.is_empty()).then_some(api::LinuxContainerAdjustment { devices }),
    })
}

/// Variables as NRI carries them.
pub(super) fn env(envs: BTreeMap<String, String>) -> Vec<api::KeyValue> {
    envs.into_iter().map(|(key, value)| api::KeyValue { key, value }).collect()
}

/// A host directory bind-mounted at the same path, as the runtime mounts a device plugin's.
fn bind_mount(m: &Mount) -> api::Mount {
    let path = m.path.display().to_string();
    let access = if m.read_only { "ro" } else { "rw" };
    api::Mount {
        destination: path.clone(),
        r#type: "bind".to_owned(),
        source: path,
        options: ["rbind", "rprivate", access].map(str::to_owned).to_vec(),
    }
}

/// `node` as the runtime makes it in the container: `None` for a control node that went away
/// since it was named (it is named only where the host has it).
fn linux_device(node: &DeviceNode) -> Result<Option<api::LinuxDevice>, String> {
    let meta = match std::fs::metadata(&node.host_path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !node.required => return Ok(None),
        Err(e) => {
            return Err(format!(
                "the GPU's device node {} cannot be read on the host: {e}; is the NVIDIA driver loaded, and does \
                 [device_nodes] host_dir name where its nodes are?",
                node.host_path.display()
            ));
        }
    };
    if !meta.file_type().is_char_device() {
        return Err(format!(
            "{} is not a character device; [device_nodes] host_dir must name where the NVIDIA driver's nodes are",
            node.host_path.display()
        ));
    }
    let (major, minor) = numbers(meta.rdev());
    Ok(Some(api::LinuxDevice {
        path: node.container_path.display().to_string(),
        r#type: "c".to_owned(),
        major,
        minor,
        file_mode: Some(api::OptionalFileMode { value: meta.mode() & 0o777 }),
        uid: Some(api::OptionalUInt32 { value: meta.uid() }),
        gid: Some(api::OptionalUInt32 { value: meta.gid() }),
    }))
}

/// A device number's major and minor, as Linux encodes them (glibc's `major` and `minor`).
fn numbers(rdev: u64) -> (i64, i64) {
    let major = ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0x0fff);
    let minor = ((rdev >> 12) & 0xffff_ff00) | (rdev & 0xff);
    (major.cast_signed(), minor.cast_signed())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::PathBuf;

    use super::*;

    fn node(host: &str, container: &str, required: bool) -> DeviceNode {
        DeviceNode { host_path: PathBuf::from(host), container_path: PathBuf::from(container), required }
    }

    #[test]
    fn numbers_decode_as_linux_encodes_them() {
        // makedev(195, 255), makedev(510, 0), and numbers past 8 and 12 bits.
        assert_eq!(numbers((195 << 8) | 255), (195, 255));
        assert_eq!(numbers(510 << 8), (510, 0));
        let (major, minor) = (0x1234_u64, 0x0567_89ab_u64);
        let rdev = ((major & 0xfff) << 8) | ((major & !0xfff) << 32) | (minor & 0xff) | ((minor & !0xff) << 12);
        assert_eq!(numbers(rdev), (0x1234, 0x0567_89ab));
    }

    #[test]
    fn a_node_is_named_with_the_hosts_numbers_at_its_container_path() {
        // /dev/null is character device 1:3 on every Linux host.
        let d = linux_device(&node("/dev/null", "/dev/nvidia0", true)).unwrap().unwrap();
        assert_eq!((d.path.as_str(), d.r#type.as_str(), d.major, d.minor), ("/dev/nvidia0", "c", 1, 3));
        assert_eq!(d.file_mode.unwrap().value, 0o666);
        assert_eq!((d.uid.unwrap().value, d.gid.unwrap().value), (0, 0));
    }

    #[test]
    fn a_missing_gpu_node_refuses_and_a_missing_control_node_is_left_out() {
        let err = linux_device(&node("/nonexistent/nvidia7", "/dev/nvidia7", true)).unwrap_err();
        assert!(err.contains("/nonexistent/nvidia7") && err.contains("host_dir"), "{err}");
        assert_eq!(linux_device(&node("/nonexistent/nvidia-uvm", "/dev/nvidia-uvm", false)).unwrap(), None);
        let err = linux_device(&node("/etc/hostname", "/dev/nvidia0", true)).unwrap_err();
        assert!(err.contains("not a character device"), "{err}");
    }

    #[test]
    fn mounts_bind_the_same_path_read_only_where_asked() {
        let edits = Edits {
            envs: BTreeMap::from([("A".to_owned(), "1".to_owned())]),
            mounts: vec![Mount { path: PathBuf::from("/run/nvidia-mps"), read_only: true }],
            devices: vec![node("/nonexistent/nvidia-uvm-tools", "/dev/nvidia-uvm-tools", false)],
        };
        let a = adjustment(edits).unwrap();
        assert_eq!(a.env, [api::KeyValue { key: "A".into(), value: "1".into() }]);
        let m = &a.mounts[0];
        assert_eq!(
            (m.destination.as_str(), m.source.as_str(), m.r#type.as_str()),
            ("/run/nvidia-mps", "/run/nvidia-mps", "bind")
        );
        assert_eq!(m.options, ["rbind", "rprivate", "ro"]);
        assert_eq!(a.linux, None, "no node the host has: no linux adjustment");
    }
}
