//! The container runtime's side of CDI, as containerd and CRI-O apply it: each CDI device the
//! kubelet names in `CreateContainer` (`vendor/class=name`) is looked up in the JSON specs of
//! one directory, and its container edits (the spec's own, then the device's) are applied to
//! the container. A device no spec describes fails the container's creation, as an
//! "unresolvable CDI devices" error does in containerd. The environment and mounts are applied:
//! they are all gpushare's specs carry.

use std::collections::BTreeMap;
use std::path::Path;

/// Applies the CDI devices `names` found in `dir` to `envs` and `mounts` (host path, container
/// path).
///
/// # Errors
/// The devices no spec in `dir` describes, or a spec that cannot be read.
pub fn apply(
    dir: &Path,
    names: &[String],
    envs: &mut BTreeMap<String, String>,
    mounts: &mut Vec<(String, String)>,
) -> Result<(), String> {
    if names.is_empty() {
        return Ok(());
    }
    let mut specs = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let text = std::fs::read(&path).map_err(|e| format!("reading CDI spec {}: {e}", path.display()))?;
            let spec: serde_json::Value =
                serde_json::from_slice(&text).map_err(|e| format!("CDI spec {}: {e}", path.display()))?;
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
        for edits in [&spec["containerEdits"], &device["containerEdits"]] {
            for kv in edits["env"].as_array().into_iter().flatten().filter_map(|v| v.as_str()) {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                envs.insert(k.to_owned(), v.to_owned());
            }
            for m in edits["mounts"].as_array().into_iter().flatten() {
                let path = |key: &str| m[key].as_str().unwrap_or_default().to_owned();
                // As CDI does: a mount replaces one at the same container path (so a device
                // named twice mounts once).
                mounts.retain(|(_, c)| *c != path("containerPath"));
                mounts.push((path("hostPath"), path("containerPath")));
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
        let mut mounts = Vec::new();
        let twice = ["gpushare.io/gpu=claim-a".to_owned(), "gpushare.io/gpu=claim-a".to_owned()];
        apply(dir.path(), &twice, &mut envs, &mut mounts).unwrap();
        assert_eq!(mounts, [("/run/mps".to_owned(), "/run/mps".to_owned())]);
        assert_eq!(envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1");
        assert_eq!(envs["X"], "a=b");
        assert_eq!(envs["COMMON"], "1");
        let e = apply(dir.path(), &["gpushare.io/gpu=claim-b".to_owned()], &mut envs, &mut mounts).unwrap_err();
        assert!(e.contains("unresolvable CDI devices gpushare.io/gpu=claim-b"), "{e}");
    }
}
