//! What a container's process in the real-runtime box reported about itself: every container
//! on containerd runs `probe` (`tests/runtime/cmd/probe`), which prints one line,
//! `gpushare-probe {json}`, with its environment, device nodes, mounts, cgroups and PID, and for
//! each directory its `PROBE_WRITE` names whether it could write there. The kubelet's pod logs
//! keep the line; [`seen`] reads every report back, so that the suites check what reached the
//! process rather than what the kubelet asked for.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;

/// One device node a process saw under `/dev`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct Device {
    /// Its path in the container.
    pub path: String,
    /// `c` (character) or `b` (block).
    pub kind: String,
    /// Its major number.
    pub major: u32,
    /// Its minor number.
    pub minor: u32,
}

/// One mount a process saw (a line of `/proc/self/mounts`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct Mount {
    /// The source as the kernel names it (a device, `overlay`, `tmpfs`).
    pub source: String,
    /// Where it is in the container.
    pub target: String,
    /// Its file system type.
    pub fstype: String,
    /// Its options (`ro` or `rw` first).
    pub options: String,
}

impl Mount {
    /// Whether it is mounted read-only.
    #[must_use]
    pub fn read_only(&self) -> bool {
        self.options.split(',').any(|o| o == "ro")
    }
}

/// What one container's process reported about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// The container's name.
    pub container: String,
    /// Which start of the container this was (0 first).
    pub attempt: u32,
    /// Its environment.
    pub env: BTreeMap<String, String>,
    /// The device nodes under its `/dev`.
    pub devices: Vec<Device>,
    /// Its mounts.
    pub mounts: Vec<Mount>,
    /// Its `/proc/self/cgroup`.
    pub cgroup: String,
    /// Its PID, as its PID namespace numbers it.
    pub pid: u32,
    /// For each directory its `PROBE_WRITE` named: `ok` if it could create a file there, or
    /// the error that stopped it.
    pub writes: BTreeMap<String, String>,
}

impl Seen {
    /// The mount at `target`, if the process saw one there.
    #[must_use]
    pub fn mount(&self, target: &str) -> Option<&Mount> {
        self.mounts.iter().rev().find(|m| m.target == target)
    }
}

#[derive(serde::Deserialize)]
struct Report {
    env: BTreeMap<String, String>,
    #[serde(default)]
    devices: Option<Vec<Device>>,
    #[serde(default)]
    mounts: Option<Vec<Mount>>,
    #[serde(default)]
    cgroup: String,
    pid: u32,
    #[serde(default)]
    writes: BTreeMap<String, String>,
}

/// The marker of the probe's report line.
const MARKER: &str = "gpushare-probe ";

/// Every report under a kubelet's pod logs folder (`podLogsDir`): one per container start, in
/// the kubelet's layout `<namespace>_<pod>_<uid>/<container>/<attempt>.log` of CRI log lines.
///
/// # Errors
/// If the folder cannot be read, or a report line is not the probe's JSON.
pub fn seen(logs: &Path) -> anyhow::Result<Vec<Seen>> {
    let mut all = Vec::new();
    let pods = match std::fs::read_dir(logs) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(all),
        Err(e) => return Err(e).with_context(|| format!("reading {}", logs.display())),
    };
    for pod in pods {
        let pod = pod?;
        let name = pod.file_name().to_string_lossy().into_owned();
        let mut parts = name.splitn(3, '_');
        let (Some(namespace), Some(pod_name), Some(uid)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        for container in std::fs::read_dir(pod.path())? {
            let container = container?;
            if !container.file_type()?.is_dir() {
                continue;
            }
            for log in std::fs::read_dir(container.path())? {
                let log = log?.path();
                let Some(attempt) = log.file_stem().and_then(|s| s.to_str()?.parse::<u32>().ok()) else { continue };
                let text = std::fs::read_to_string(&log).with_context(|| format!("reading {}", log.display()))?;
                // A CRI log line: `<time> stdout F <text>`.
                for line in text.lines() {
                    let Some(json) = line.split_once(MARKER).map(|(_, j)| j) else { continue };
                    let r: Report = serde_json::from_str(json)
                        .with_context(|| format!("a probe report in {} is not its JSON", log.display()))?;
                    all.push(Seen {
                        namespace: namespace.to_owned(),
                        pod: pod_name.to_owned(),
                        pod_uid: uid.to_owned(),
                        container: container.file_name().to_string_lossy().into_owned(),
                        attempt,
                        env: r.env,
                        devices: r.devices.unwrap_or_default(),
                        mounts: r.mounts.unwrap_or_default(),
                        cgroup: r.cgroup,
                        pid: r.pid,
                        writes: r.writes,
                    });
                }
            }
        }
    }
    all.sort_by(|a, b| {
        (&a.namespace, &a.pod, &a.container, a.attempt).cmp(&(&b.namespace, &b.pod, &b.container, b.attempt))
    });
    Ok(all)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn seen_reads_each_report_from_the_kubelets_log_layout() {
        let logs = tempfile::tempdir().unwrap();
        let dir = logs.path().join("ml_train-0_u-1").join("main");
        std::fs::create_dir_all(&dir).unwrap();
        let report = r#"{"args":["/probe"],"env":{"GPUSHARE_MEMORY_MIB":"6000"},"devices":[{"path":"/dev/null","kind":"c","major":1,"minor":3}],"mounts":[{"source":"overlay","target":"/","fstype":"overlay","options":"rw,relatime"},{"source":"tmpfs","target":"/run/mps","fstype":"tmpfs","options":"ro,nosuid"}],"cgroup":"0::/","uid":0,"pid":1,"writes":{"/run/mps":"open /run/mps/probe-1: read-only file system"}}"#;
        std::fs::write(dir.join("0.log"), format!("2026-11-28T14:37:09.8Z stdout F {MARKER}{report}\n")).unwrap();
        // A second start, and a line of another kind: only reports count.
        std::fs::write(
            dir.join("1.log"),
            format!("2026-11-28T14:38:00Z stderr F noise\n2026-11-28T14:38:00Z stdout F {MARKER}{report}\n"),
        )
        .unwrap();
        let seen = seen(logs.path()).unwrap();
        assert_eq!(seen.len(), 2);
        let s = &seen[1];
        assert_eq!(
            (s.namespace.as_str(), s.pod.as_str(), s.pod_uid.as_str(), s.container.as_str()),
            ("ml", "train-0", "u-1", "main")
        );
        assert_eq!((seen[0].attempt, s.attempt, s.pid), (0, 1, 1));
        assert_eq!(s.env["GPUSHARE_MEMORY_MIB"], "6000");
        assert_eq!(s.devices[0], Device { path: "/dev/null".into(), kind: "c".into(), major: 1, minor: 3 });
        assert!(s.mount("/run/mps").unwrap().read_only());
        assert!(!s.mount("/").unwrap().read_only());
        assert!(s.mount("/etc").is_none());
        assert!(s.writes["/run/mps"].ends_with("read-only file system"));
    }

    #[test]
    fn a_report_that_is_not_the_probes_json_is_an_error_naming_its_file() {
        let logs = tempfile::tempdir().unwrap();
        let dir = logs.path().join("ml_p_u").join("main");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("0.log"), format!("t stdout F {MARKER}{{not json\n")).unwrap();
        let err = format!("{:#}", seen(logs.path()).unwrap_err());
        assert!(err.contains("0.log") && err.contains("not its JSON"), "{err}");
        assert!(seen(&logs.path().join("absent")).unwrap().is_empty(), "no logs yet is no report");
    }
}
