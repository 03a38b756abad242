//! `[device_nodes]`: whether gpushared names each container's NVIDIA device nodes itself — in
//! its `Allocate` answers, in the CDI specs of DRA claims, and in NRI's adjustments on a node
//! whose kubelet counts the memory — for hosts whose container runtime
//! does not run NVIDIA's container toolkit on `NVIDIA_VISIBLE_DEVICES`; and which nodes those
//! are: `/dev/nvidia<minor>` of each of the container's GPUs, and the control nodes.

use std::path::PathBuf;

use serde::Deserialize;

use super::{AbsPath, abs};

/// `[device_nodes]` (docs/gpushared.md).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceNodesConfig {
    /// Name the device nodes (off by default: NVIDIA's container toolkit adds them itself).
    #[serde(default)]
    pub enabled: bool,
    /// Where the host's NVIDIA device nodes are; in the container they are always under `/dev`.
    #[serde(default = "default_host_dir")]
    pub host_dir: AbsPath,
    /// The control nodes every container with a GPU gets, each where the host has it when the
    /// container is answered (`nvidia-uvm` appears on first CUDA use).
    #[serde(default = "default_control", deserialize_with = "node_names")]
    pub control: Vec<String>,
}

impl Default for DeviceNodesConfig {
    fn default() -> Self {
        DeviceNodesConfig { enabled: false, host_dir: default_host_dir(), control: default_control() }
    }
}

/// A device node a container gets at `/dev/<name>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    /// Its path on the host.
    pub host_path: PathBuf,
    /// Its path in the container.
    pub container_path: PathBuf,
    /// A GPU's own node (always named); a control node is named only where the host has it.
    pub required: bool,
}

impl DeviceNode {
    /// Whether it is named to the runtime now: a GPU's node always (a missing one makes the
    /// runtime refuse the container, naming the path), a control node only where it exists.
    #[must_use]
    pub fn named(&self) -> bool {
        self.required || self.host_path.exists()
    }
}

impl DeviceNodesConfig {
    /// The nodes of a container holding the GPUs of device minor numbers `minors` (in the order
    /// of its `NVIDIA_VISIBLE_DEVICES`): none when disabled or without GPUs.
    #[must_use]
    pub fn nodes(&self, minors: &[u32]) -> Vec<DeviceNode> {
        if !self.enabled || minors.is_empty() {
            return Vec::new();
        }
        let node = |name: String, required: bool| DeviceNode {
            host_path: self.host_dir.path().join(&name),
            container_path: PathBuf::from("/dev").join(&name),
            required,
        };
        let mut nodes: Vec<DeviceNode> = Vec::with_capacity(minors.len() + self.control.len());
        for m in minors {
            let n = node(format!("nvidia{m}"), true);
            if !nodes.contains(&n) {
                nodes.push(n);
            }
        }
        nodes.extend(self.control.iter().map(|c| node(c.clone(), false)));
        nodes
    }
}

fn default_host_dir() -> AbsPath {
    abs("/dev")
}

fn default_control() -> Vec<String> {
    ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"].map(str::to_owned).to_vec()
}

fn node_names<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let names = Vec::<String>::deserialize(d)?;
    if let Some(bad) = names
        .iter()
        .find(|n| n.is_empty() || n.contains('/') || n.starts_with('.') || !n.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(serde::de::Error::custom(format!(
            "{bad:?} is not a device node name under host_dir; write a plain name such as \"nvidiactl\""
        )));
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::Config;

    #[test]
    fn off_by_default_and_each_gpu_then_the_control_nodes() {
        let c = Config::parse("", Path::new("t.toml")).unwrap();
        assert!(!c.device_nodes.enabled);
        assert!(c.device_nodes.nodes(&[0]).is_empty());
        let c =
            Config::parse("[device_nodes]\nenabled = true\nhost_dir = \"/host/dev\"\n", Path::new("t.toml")).unwrap();
        let nodes = c.device_nodes.nodes(&[3, 1, 3]);
        let paths: Vec<_> = nodes
            .iter()
            .map(|n| (n.host_path.to_str().unwrap(), n.container_path.to_str().unwrap(), n.required))
            .collect();
        assert_eq!(
            paths,
            [
                ("/host/dev/nvidia3", "/dev/nvidia3", true),
                ("/host/dev/nvidia1", "/dev/nvidia1", true),
                ("/host/dev/nvidiactl", "/dev/nvidiactl", false),
                ("/host/dev/nvidia-uvm", "/dev/nvidia-uvm", false),
                ("/host/dev/nvidia-uvm-tools", "/dev/nvidia-uvm-tools", false),
            ]
        );
        assert!(c.device_nodes.nodes(&[]).is_empty(), "a container without GPUs gets no node");
        assert!(nodes[0].named(), "a GPU's node is named even where the host lacks it");
        assert!(!nodes[2].named(), "a control node the host lacks is left out");
    }

    #[test]
    fn a_bad_setting_is_refused_with_what_to_write() {
        let e = Config::parse("[device_nodes]\ncontrol = [\"../sda\"]\n", Path::new("t.toml")).unwrap_err().to_string();
        assert!(e.contains("\"../sda\"") && e.contains("nvidiactl"), "{e}");
        let e = Config::parse("[device_nodes]\nhost_dir = \"dev\"\n", Path::new("t.toml")).unwrap_err().to_string();
        assert!(e.contains("relative"), "{e}");
        let e = Config::parse("[device_nodes]\nenable = true\n", Path::new("t.toml")).unwrap_err().to_string();
        assert!(e.contains("enable"), "{e}");
    }
}
