//! CDI specs for prepared claims: one JSON file per claim in `[dra] cdi_dir`, describing one
//! device (`gpushare.io/gpu=claim-<uid>`) whose container edits carry the claim's environment,
//! on `dra-mps` GPUs the MPS pipe directory as a bind mount, and with `[device_nodes]` enabled
//! the GPUs' device nodes.
//! The runtime (containerd, CRI-O, or the test box's) applies the device the kubelet names in
//! `CreateContainer`. A spec is written whole (a temporary file, fsynced, renamed) before the
//! prepare is answered, and removed when the claim is unprepared.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use gpushare_core::dra;
use serde_json::json;

use crate::config::DeviceNode;

/// The CDI specification version the specs are written in (environment and mount edits: any
/// runtime that reads CDI 0.5 or later accepts them).
pub const CDI_VERSION: &str = "0.6.0";

/// The spec file of a claim: `<dir>/gpushare.io-gpu-claim-<uid>.json`.
#[must_use]
pub fn spec_path(dir: &Path, claim_uid: &str) -> PathBuf {
    dir.join(format!("gpushare.io-gpu-{}.json", dra::cdi_device(claim_uid)))
}

/// What a claim's CDI device does to each container: `envs` set, each of `mounts` bind-mounted
/// at the same path (read-only where its flag says so), each of `devices` made.
#[derive(Clone, Copy, Debug)]
pub struct Edits<'a> {
    /// Environment variables.
    pub envs: &'a BTreeMap<String, String>,
    /// Host directories, and whether read-only.
    pub mounts: &'a [(PathBuf, bool)],
    /// Device nodes (those [`DeviceNode::named`] now).
    pub devices: &'a [DeviceNode],
}

/// The spec of a claim whose device makes `edits`. A device node names its path in the
/// container and on the host; the runtime reads its type and numbers from the host's node.
#[must_use]
pub fn spec(claim_uid: &str, Edits { envs, mounts, devices }: Edits<'_>) -> serde_json::Value {
    let env: Vec<String> = envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut edits = json!({ "env": env });
    if !mounts.is_empty() {
        edits["mounts"] =
            mounts
                .iter()
                .map(|(m, read_only)| {
                    json!({ "hostPath": m, "containerPath": m, "options": ["rbind", if *read_only { "ro" } else { "rw" }] })
                })
                .collect();
    }
    let nodes: Vec<serde_json::Value> = devices
        .iter()
        .filter(|d| d.named())
        .map(|d| json!({ "path": d.container_path, "hostPath": d.host_path, "permissions": "rw" }))
        .collect();
    if !nodes.is_empty() {
        edits["deviceNodes"] = nodes.into();
    }
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": dra::CDI_KIND,
        "devices": [{ "name": dra::cdi_device(claim_uid), "containerEdits": edits }],
    })
}

/// Writes the claim's spec into `dir` (created if missing), durably.
///
/// # Errors
/// The I/O error, with the path.
pub fn write(dir: &Path, claim_uid: &str, edits: Edits<'_>) -> Result<PathBuf, String> {
    let path = spec_path(dir, claim_uid);
    let io = |what: &str, e: std::io::Error| format!("{what} {}: {e}", path.display());
    std::fs::create_dir_all(dir).map_err(|e| io("creating the CDI directory for", e))?;
    // A dot-named temporary file: CDI readers take only *.json and *.yaml.
    let tmp = dir.join(format!(".{}.tmp", dra::cdi_device(claim_uid)));
    let text =
        serde_json::to_vec_pretty(&spec(claim_uid, edits)).map_err(|e| format!("encoding {}: {e}", path.display()))?;
    let mut f = std::fs::File::create(&tmp).map_err(|e| io("writing", e))?;
    f.write_all(&text).and_then(|()| f.sync_all()).map_err(|e| io("writing", e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io("renaming into", e))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(path)
}

/// Removes the claim's spec; one already gone is fine.
///
/// # Errors
/// The I/O error, with the path.
pub fn remove(dir: &Path, claim_uid: &str) -> Result<(), String> {
    let path = spec_path(dir, claim_uid);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("removing {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_is_written_whole_and_removed_once() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("cdi");
        let envs = BTreeMap::from([("A".to_owned(), "1".to_owned()), ("B".to_owned(), "x=y".to_owned())]);
        let plain = Edits { envs: &envs, mounts: &[], devices: &[] };
        let path = write(&cdi, "u-1", plain).unwrap();
        assert_eq!(path, cdi.join("gpushare.io-gpu-claim-u-1.json"));
        let read: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(read["kind"], "gpushare.io/gpu");
        assert_eq!(read["devices"][0]["name"], "claim-u-1");
        assert_eq!(read["devices"][0]["containerEdits"]["env"], json!(["A=1", "B=x=y"]));
        assert!(read["devices"][0]["containerEdits"].get("mounts").is_none());
        assert!(read["devices"][0]["containerEdits"].get("deviceNodes").is_none());
        let mps = [(PathBuf::from("/run/nvidia-mps"), true)];
        write(&cdi, "u-1", Edits { mounts: &mps, ..plain }).unwrap();
        let read: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            read["devices"][0]["containerEdits"]["mounts"],
            json!([{"hostPath": "/run/nvidia-mps", "containerPath": "/run/nvidia-mps", "options": ["rbind", "ro"]}])
        );
        let host = dir.path().join("dev");
        std::fs::create_dir(&host).unwrap();
        std::fs::write(host.join("nvidiactl"), "").unwrap();
        let node = |name: &str, required| DeviceNode {
            host_path: host.join(name),
            container_path: Path::new("/dev").join(name),
            required,
        };
        let devices = [node("nvidia2", true), node("nvidiactl", false), node("nvidia-uvm", false)];
        write(&cdi, "u-1", Edits { devices: &devices, ..plain }).unwrap();
        let read: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            read["devices"][0]["containerEdits"]["deviceNodes"],
            json!([
                {"path": "/dev/nvidia2", "hostPath": host.join("nvidia2"), "permissions": "rw"},
                {"path": "/dev/nvidiactl", "hostPath": host.join("nvidiactl"), "permissions": "rw"},
            ]),
            "the GPU's node always, a control node only where the host has it"
        );
        let names: Vec<_> = std::fs::read_dir(&cdi).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "no temporary file is left: {names:?}");
        remove(&cdi, "u-1").unwrap();
        remove(&cdi, "u-1").unwrap();
        assert!(!path.exists());
    }
}
