//! The harness for driving the real `gpushared` binary: a temporary directory standing in for
//! the host (device-plugin directory, ledger, config, kubeconfig), the daemon as its own
//! process, and helpers to wait on it.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::{ContainerRole, GpuUuid, MemoryUnit, Mib};
use gpushare_testkit::apiserver::ApiServer;
use serde_json::{Value, json};

/// A host: a temporary directory with the daemon's paths.
pub struct Host {
    pub dir: tempfile::TempDir,
}

impl Host {
    pub fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("device-plugins")).unwrap();
        Host { dir }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn plugin_dir(&self) -> PathBuf {
        self.path("device-plugins")
    }

    /// Where the kubelet stand-in serves PodResources.
    pub fn pod_resources_socket(&self) -> PathBuf {
        self.path("pod-resources/kubelet.sock")
    }

    pub fn ledger(&self) -> PathBuf {
        self.path("state/ledger.db")
    }

    /// Writes a kubeconfig pointing at `server`.
    pub fn kubeconfig(&self, server: &str) -> PathBuf {
        let path = self.path("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n\
                 users:\n- name: u\n  user:\n    token: test\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\n\
                 current-context: x\n"
            ),
        )
        .unwrap();
        path
    }

    /// Writes a configuration: the host's paths, then `extra` TOML (which may add sections).
    pub fn config(&self, kubeconfig: &Path, top: &str, extra: &str) -> PathBuf {
        self.config_kubelet(kubeconfig, top, "", extra)
    }

    /// [`Host::config`] with `kubelet` (lines) added to its `[kubelet]` table.
    pub fn config_kubelet(&self, kubeconfig: &Path, top: &str, kubelet: &str, extra: &str) -> PathBuf {
        let path = self.path("gpushared.toml");
        std::fs::write(
            &path,
            format!(
                "node_name = \"node-a\"\n{top}\n[kubelet]\ndevice_plugin_dir = \"{}\"\npod_resources_socket = \"{}\"\n{kubelet}\n\
                 [ledger]\npath = \"{}\"\n[kubernetes]\nkubeconfig = \"{}\"\n{extra}\n",
                self.plugin_dir().display(),
                self.pod_resources_socket().display(),
                self.ledger().display(),
                kubeconfig.display()
            ),
        )
        .unwrap();
        path
    }
}

/// A static GPU list for `[[gpus]]`: (MiB, NUMA node) per GPU.
pub fn static_gpus(gpus: &[(u64, Option<u32>)]) -> String {
    let mut out = String::new();
    for (i, (mib, numa)) in gpus.iter().enumerate() {
        out.push_str(&format!(
            "[[gpus]]\nindex = {i}\nuuid = \"GPU-static-{i}\"\nmodel = \"Tesla T4\"\nmemory_mib = {mib}\nminor = {i}\n"
        ));
        if let Some(n) = numa {
            out.push_str(&format!("numa_node = {n}\n"));
        }
    }
    out
}

/// The daemon as a child process; killed when dropped.
pub struct Daemon {
    pub child: Child,
    pub log: PathBuf,
}

impl Daemon {
    pub fn start(config: &Path, log: PathBuf) -> Daemon {
        Self::start_with_env(config, log, &[])
    }

    pub fn start_with_env(config: &Path, log: PathBuf, env: &[(&str, &str)]) -> Daemon {
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpushared"));
        cmd.arg("--config").arg(config).stdin(Stdio::null()).stdout(out.try_clone().unwrap()).stderr(out);
        cmd.env("RUST_LOG", "info,gpushared=debug");
        for (k, v) in env {
            cmd.env(k, v);
        }
        Daemon { child: cmd.spawn().unwrap(), log }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Sends SIGTERM (or SIGKILL) to the daemon.
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill").arg(format!("-{sig}")).arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success());
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A kubeconfig server nobody listens on: the daemon serves the kubelet regardless.
pub const NO_API_SERVER: &str = "http://127.0.0.1:9";

pub const WAIT: Duration = Duration::from_secs(15);

/// A device list of `n` devices, every one healthy: one the plugin sent on its current stream,
/// since the kubelet (and its stand-in) keeps an ended stream's list with every device unhealthy.
pub fn healthy_list(n: usize) -> impl Fn(&[gpushare_proto::deviceplugin::Device]) -> bool {
    move |d| d.len() == n && d.iter().all(|x| x.health == gpushare_proto::HEALTHY)
}

/// A container of a test pod: name, role, and its (GPU index, MiB) shares.
pub type Spec<'a> = (&'a str, ContainerRole, &'a [(u32, u64)]);

pub fn uuid(i: u32) -> GpuUuid {
    GpuUuid::new(format!("GPU-static-{i}")).unwrap()
}

/// Creates a pod bound to node-a whose containers ask for their shares, with the assignment
/// the extender would have written.
pub fn bound_pod(api: &ApiServer, name: &str, containers: &[Spec<'_>]) {
    bound_pod_on(api, name, containers, uuid);
}

/// [`bound_pod`] on GPUs whose UUIDs `uuid` gives by index.
pub fn bound_pod_on(api: &ApiServer, name: &str, containers: &[Spec<'_>], uuid: impl Fn(u32) -> GpuUuid) {
    assigned_pod(api, name, Some("node-a"), containers, uuid);
}

/// A pod assigned to node-a's GPUs as [`bound_pod_on`] makes it, bound to `node` (`None`: not
/// bound yet; `spec.nodeName` patched later binds it).
#[allow(dead_code)] // Not every test file binds pods late.
pub fn assigned_pod(
    api: &ApiServer,
    name: &str,
    node: Option<&str>,
    containers: &[Spec<'_>],
    uuid: impl Fn(u32) -> GpuUuid,
) {
    let assignment = Assignment {
        node: "node-a".into(),
        unit: MemoryUnit::Mib,
        containers: containers
            .iter()
            .map(|(n, role, gpus)| ContainerAssignment {
                name: (*n).into(),
                role: *role,
                gpus: gpus.iter().map(|(i, m)| GpuShare { index: *i, uuid: uuid(*i), mib: Mib::new(*m) }).collect(),
            })
            .collect(),
    };
    let k8s = |(n, role, gpus): &Spec<'_>| {
        let mib: u64 = gpus.iter().map(|(_, m)| m).sum();
        let mut c = json!({"name": n, "image": "x", "resources": {"limits": {
            "gpushare.io/gpu-mem": mib.to_string(), "gpushare.io/gpu-count": gpus.len().to_string()}}});
        if *role == ContainerRole::Sidecar {
            c["restartPolicy"] = json!("Always");
        }
        c
    };
    // Sidecars are init containers with restartPolicy Always, in init order.
    let init: Vec<Value> = containers.iter().filter(|c| c.1 != ContainerRole::App).map(k8s).collect();
    let app: Vec<Value> = containers.iter().filter(|c| c.1 == ContainerRole::App).map(k8s).collect();
    api.create_pod(
        "default",
        json!({"metadata": {"name": name, "annotations": {ASSIGNMENT_KEY: assignment.encode().unwrap()}},
               "spec": {"nodeName": node, "initContainers": init, "containers": app}}),
    )
    .unwrap();
}
