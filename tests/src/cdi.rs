//! The container runtime's side of CDI, as containerd and CRI-O apply it: each CDI device the
//! kubelet names in `CreateContainer` (`vendor/class=name`) is looked up in the JSON specs of
//! one directory, and its container edits (the spec's own, then the device's) are applied to
//! the container. A device no spec describes fails the container's creation, as an
//! "unresolvable CDI devices" error does in containerd. Specs are JSON or YAML (`.json`, `.yaml`,
//! `.yml`), as CDI allows: gpushare writes JSON, NVIDIA's DRA driver YAML. The environment, mounts
//! and device nodes are applied; hooks are not run.

use std::collections::BTreeMap;
use std::path::Path;

/// What the CDI devices of a container edit: its environment, mounts and device nodes (host path,
/// container path each).
#[derive(Debug)]
pub struct Edits<'a> {
    /// The environment.
    pub envs: &'a mut BTreeMap<String, String>,
    /// The mounts.
    pub mounts: &'a mut Vec<(String, String)>,
    /// The container paths of the mounts that are read-only (CDI's `ro` option).
    pub read_only: &'a mut Vec<String>,
    /// The device nodes.
    pub devices: &'a mut Vec<(String, String)>,
}

/// Applies the CDI devices `names` found in `dir` to `edits`.
///
/// # Errors
/// The devices no spec in `dir` describes, or a spec that cannot be read.
pub fn apply(dir: &Path, names: &[String], edits: &mut Edits<'_>) -> Result<(), String> {
    if names.is_empty() {
        return Ok(());
    }
    let mut specs = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            let yaml = match path.extension().and_then(|e| e.to_str()) {
                Some("json") => false,
                Some("yaml" | "yml") => true,
                _ => continue,
            };
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("reading CDI spec {}: {e}", path.display()))?;
            let spec: serde_json::Value = if yaml {
                serde_saphyr::from_str(&text).map_err(|e| format!("CDI spec {}: {e}", path.display()))?
            } else {
                serde_json::from_str(&text).map_err(|e| format!("CDI spec {}: {e}", path.display()))?
            };
            specs.push(spec);
        }
    }
    let mut unresolved = Vec::new();
    for qualified in names {
        let Some((kind, name)) = qualified.split_once('=') else {
            unresolved.push(qualified.clone());
            continue;
        };
        let found = specs.iter().find_map(|spec| {
            (spec["kind"] == kind).then_some(())?;
            let device = spec["devices"].as_array()?.iter().find(|d| d["name"] == name)?;
            Some((spec, device))
        });
        let Some((spec, device)) = found else {
            unresolved.push(qualified.clone());
            continue;
        };
        for container_edits in [&spec["containerEdits"], &device["containerEdits"]] {
            for kv in container_edits["env"].as_array().into_iter().flatten().filter_map(|v| v.as_str()) {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                edits.envs.insert(k.to_owned(), v.to_owned());
            }
            for m in container_edits["mounts"].as_array().into_iter().flatten() {
                let path = |key: &str| m[key].as_str().unwrap_or_default().to_owned();
                // As CDI does: a mount replaces one at the same container path (so a device
                // named twice mounts once).
                edits.mounts.retain(|(_, c)| *c != path("containerPath"));
                edits.read_only.retain(|c| *c != path("containerPath"));
                edits.mounts.push((path("hostPath"), path("containerPath")));
                if m["options"].as_array().into_iter().flatten().any(|o| o == "ro") {
                    edits.read_only.push(path("containerPath"));
                }
            }
            for d in container_edits["deviceNodes"].as_array().into_iter().flatten() {
                // `hostPath` defaults to `path`; a node at the same path is replaced.
                let path = d["path"].as_str().unwrap_or_default().to_owned();
                let host = d["hostPath"].as_str().map_or_else(|| path.clone(), str::to_owned);
                edits.devices.retain(|(_, c)| *c != path);
                edits.devices.push((host, path));
            }
        }
    }
    if unresolved.is_empty() {
        Ok(())
    } else {
        Err(format!("unresolvable CDI devices {} (no spec in {} describes them)", unresolved.join(", "), dir.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_applied_from_their_spec_and_unknown_ones_refused() {
        let dir = tempfile::tempdir().unwrap();
        let spec = serde_json::json!({
            "cdiVersion": "0.6.0", "kind": "gpushare.io/gpu",
            "containerEdits": {"env": ["COMMON=1"]},
            "devices": [{"name": "claim-a", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-1", "X=a=b"],
                "mounts": [{"hostPath": "/run/mps", "containerPath": "/run/mps", "options": ["rbind"]}]}}],
        });
        std::fs::write(dir.path().join("a.json"), spec.to_string()).unwrap();
        std::fs::write(dir.path().join(".a.tmp"), "not json").unwrap();
        let mut envs = BTreeMap::from([("X".to_owned(), "old".to_owned())]);
        let (mut mounts, mut devices) = (Vec::new(), Vec::new());
        let mut read_only = Vec::new();
        let mut edits =
            Edits { envs: &mut envs, mounts: &mut mounts, read_only: &mut read_only, devices: &mut devices };
        let twice = ["gpushare.io/gpu=claim-a".to_owned(), "gpushare.io/gpu=claim-a".to_owned()];
        apply(dir.path(), &twice, &mut edits).unwrap();
        let e = apply(dir.path(), &["gpushare.io/gpu=claim-b".to_owned()], &mut edits).unwrap_err();
        assert!(e.contains("unresolvable CDI devices gpushare.io/gpu=claim-b"), "{e}");
        assert_eq!(mounts, [("/run/mps".to_owned(), "/run/mps".to_owned())]);
        assert!(devices.is_empty());
        assert_eq!(envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1");
        assert_eq!(envs["X"], "a=b");
        assert_eq!(envs["COMMON"], "1");
    }

    #[test]
    fn yaml_specs_are_read_with_their_device_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let spec = "---\ncdiVersion: 0.5.0\nkind: k8s.gpu.nvidia.com/claim\ndevices:\n    - name: uid-gpu-0\n      \
                    containerEdits:\n        deviceNodes:\n            - path: /dev/nvidia0\n              \
                    hostPath: /root/dev/nvidia0\n              major: 195\ncontainerEdits:\n    env:\n        - \
                    NVIDIA_VISIBLE_DEVICES=void\n    deviceNodes:\n        - path: /dev/nvidiactl\n";
        std::fs::write(dir.path().join("k8s.gpu.nvidia.com-claim_uid.yaml"), spec).unwrap();
        let (mut envs, mut mounts, mut devices) = (BTreeMap::new(), Vec::new(), Vec::new());
        let mut read_only = Vec::new();
        let mut edits =
            Edits { envs: &mut envs, mounts: &mut mounts, read_only: &mut read_only, devices: &mut devices };
        apply(dir.path(), &["k8s.gpu.nvidia.com/claim=uid-gpu-0".to_owned()], &mut edits).unwrap();
        assert_eq!(envs["NVIDIA_VISIBLE_DEVICES"], "void");
        let want = [("/dev/nvidiactl", "/dev/nvidiactl"), ("/root/dev/nvidia0", "/dev/nvidia0")];
        assert_eq!(devices, want.map(|(h, c)| (h.to_owned(), c.to_owned())));
    }
}
