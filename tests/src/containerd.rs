//! containerd 2 with runc as one node's real container runtime (`tests/runtime/build`), and
//! what the processes it ran reported about themselves.
//!
//! Each node gets a containerd of its own: its root, state, sockets and runc state under the
//! node's `cri/` folder, CDI on with the node's CDI folder (where gpushared writes a claim's
//! spec, the folder the recording runtime reads too), the box's images imported (no registry is
//! reachable), and a pod network of its own: containerd runs in a network namespace of its own
//! (`unshare --net`) where the CNI bridge plugin makes the node's bridge, so nodes side by side
//! neither collide nor touch the machine's network. NRI is on, its socket in the node's folder
//! ([`NRI_SOCKET`]), where gpushared's NRI plugin dials it; it launches no plugins of its own.
//! A node may require NRI plugins: NRI's default validator then refuses every container created
//! while one of them is not registered (`required_plugins`), as docs/gpushared.md has a counted
//! node's containerd configured.
//! The build machines' containers lack `CAP_SYS_RESOURCE`, so no process may lower its OOM score
//! below its parent's: containerd keeps each container's at or above its own
//! (`restrict_oom_score_adj`, as for a containerd that runs in a user namespace).
//!
//! Every container runs the probe, whose report of what it sees [`crate::probe`] reads back from
//! the kubelet's pod logs.
//!
//! The shims and containers outlive a killed containerd, as on a host. [`Containerd`] kills them
//! when it is dropped or halted: every container in its runc state (`runc delete --force`),
//! every shim that serves its socket, and every mount under its folder.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::cluster::Proc;
use crate::cri::api;
use crate::realkube::{ControlPlane, built_by};

/// The directory holding containerd, runc, the CNI plugins and `images.tar`:
/// `$GPUSHARE_RUNTIME_BIN`, or what `tests/runtime/build` builds (cached).
///
/// # Errors
/// If the build fails.
pub fn binaries() -> anyhow::Result<PathBuf> {
    built_by("GPUSHARE_RUNTIME_BIN", &Path::new(env!("CARGO_MANIFEST_DIR")).join("runtime").join("build"))
}

/// The image every suite's pod on containerd names (`tests/runtime/build` makes it): its
/// entrypoint is the probe, and `/bin/sleep` and `/bin/true` are the probe too.
pub const PROBE_IMAGE: &str = "registry.example/probe:1";

/// The containerd namespace of the CRI plugin.
const NAMESPACE: &str = "k8s.io";

/// containerd's NRI socket, in the folder given to [`Containerd::start`].
pub const NRI_SOCKET: &str = "nri.sock";

/// One node's containerd, serving while this lives.
#[derive(Debug)]
pub struct Containerd {
    /// Its folder: configuration, root, state, sockets.
    dir: PathBuf,
    /// The binaries ([`binaries`]).
    bin: PathBuf,
    proc: Proc,
}

impl Containerd {
    /// Starts node `node`'s containerd under `dir`, reading CDI specs from `cdi`, requiring the
    /// NRI plugins `required` (none: NRI's default validator stays off), imports the box's
    /// images and waits until it serves.
    ///
    /// # Errors
    /// If it cannot be built or started, or does not serve within 30 s (with its log).
    pub fn start(
        plane: &ControlPlane,
        node: &str,
        dir: &Path,
        cdi: &Path,
        required: &[String],
    ) -> anyhow::Result<Containerd> {
        let bin = binaries()?;
        for d in [dir, cdi, &dir.join("net.d")] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        std::fs::write(dir.join("config.toml"), config(dir, &bin, cdi, required))?;
        std::fs::write(dir.join("net.d").join("10-box.conflist"), network(dir))?;
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
        let proc = plane.spawn(
            &format!("containerd-{node}"),
            Path::new("unshare"),
            vec![
                "--net".into(),
                "--".into(),
                bin.join("containerd").display().to_string(),
                format!("--config={}", dir.join("config.toml").display()),
            ],
            vec![("PATH".into(), path)],
        )?;
        let mut containerd = Containerd { dir: dir.to_owned(), bin, proc };
        containerd.wait_serving()?;
        containerd.ctr(&["images", "import", &containerd.bin.join("images.tar").display().to_string()])?;
        Ok(containerd)
    }

    /// The socket, as the kubelet's `containerRuntimeEndpoint` names it.
    #[must_use]
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket().display())
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// Loses what a host keeps in tmpfs, as a power cut does: containerd, every shim and
    /// container are killed, and its state folder (`/run/containerd` on a host) is emptied; its
    /// root (images, snapshots, its metadata) is kept. [`Self::boot`] starts it again.
    ///
    /// # Errors
    /// If the state folder cannot be emptied.
    pub fn halt(&mut self) -> anyhow::Result<()> {
        self.proc.kill();
        self.kill_containers();
        let state = self.dir.join("state");
        match std::fs::remove_dir_all(&state) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("emptying {}", state.display())),
        }
    }

    /// Starts containerd halted by [`Self::halt`] with the same configuration, as a boot does.
    ///
    /// # Errors
    /// If it does not serve within 30 s.
    pub fn boot(&mut self) -> anyhow::Result<()> {
        self.proc.start()?;
        self.wait_serving()
    }

    /// Kills containerd alone (SIGKILL) and starts it again, as `systemctl restart containerd`
    /// after a crash would: the shims and containers keep running.
    ///
    /// # Errors
    /// If it does not serve again within 30 s.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.proc.kill();
        self.proc.start()?;
        self.wait_serving()
    }

    /// The containers running now, as containerd's CRI service lists them: (pod UID, container
    /// name, attempt) of each, pod sandboxes aside.
    ///
    /// # Errors
    /// If containerd does not answer.
    pub fn running(&self) -> anyhow::Result<Vec<(String, String, u32)>> {
        cri(&self.socket(), |mut client| async move {
            let state = api::ContainerStateValue { state: api::ContainerState::ContainerRunning.into() };
            let filter = api::ContainerFilter { state: Some(state), ..Default::default() };
            let list = client.list_containers(api::ListContainersRequest { filter: Some(filter) }).await?;
            Ok(list
                .into_inner()
                .containers
                .into_iter()
                .map(|c| {
                    let attempt = c.metadata.as_ref().map_or(0, |m| m.attempt);
                    (label(&c.labels, POD_UID), label(&c.labels, CONTAINER_NAME), attempt)
                })
                .collect())
        })
    }

    /// Its log.
    #[must_use]
    pub fn log_tail(&self, lines: usize) -> String {
        self.proc.log_tail(lines)
    }

    fn wait_serving(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.ctr(&["version"]).is_ok() {
                return Ok(());
            }
            if let Some(status) = self.proc.exited() {
                bail!("containerd exited ({status}):\n{}", self.proc.log_tail(30));
            }
            if Instant::now() > deadline {
                bail!("containerd does not serve {} after 30 s:\n{}", self.socket().display(), self.proc.log_tail(30));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs `ctr` against this containerd in the CRI plugin's namespace.
    fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(self.bin.join("ctr"))
            .arg(format!("--address={}", self.socket().display()))
            .arg(format!("--namespace={NAMESPACE}"))
            .args(args)
            .output()
            .context("running ctr")?;
        if !out.status.success() {
            bail!("ctr {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Kills every container of this containerd, its shims, and unmounts what they mounted.
    fn kill_containers(&self) {
        let runc_root = self.dir.join("runc").join(NAMESPACE);
        let runc = |args: &[&str]| {
            Command::new(self.bin.join("runc")).arg(format!("--root={}", runc_root.display())).args(args).output()
        };
        if let Ok(out) = runc(&["list", "--quiet"]) {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = runc(&["delete", "--force", id]);
            }
        }
        let address = self.socket().display().to_string();
        for pid in processes_with_args(&["-address", &address]) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
        unmount_under(&self.dir);
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.proc.kill();
        self.kill_containers();
    }
}

/// The label the kubelet puts on each container: its pod's UID.
const POD_UID: &str = "io.kubernetes.pod.uid";

/// The label the kubelet puts on each container: its name in the pod.
const CONTAINER_NAME: &str = "io.kubernetes.container.name";

/// How long one call of containerd's CRI service may take.
const CRI_TIMEOUT: Duration = Duration::from_secs(10);

fn label(labels: &std::collections::HashMap<String, String>, key: &str) -> String {
    labels.get(key).cloned().unwrap_or_default()
}

type Client = api::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>;

/// Makes one call of containerd's CRI service at `socket`, on a runtime of its own: the suites
/// call from synchronous code inside theirs.
fn cri<T: Send, F: std::future::Future<Output = anyhow::Result<T>>>(
    socket: &Path,
    call: impl FnOnce(Client) -> F + Send,
) -> anyhow::Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(async {
                    let answer = tokio::time::timeout(CRI_TIMEOUT, async {
                        let channel = gpushare_proto::uds::connect(socket).await?;
                        call(Client::new(channel)).await
                    });
                    answer.await.unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {CRI_TIMEOUT:?}")))
                })
            })
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the call panicked")))
    })
    .with_context(|| format!("calling containerd's CRI service at {}", socket.display()))
}

/// containerd's configuration for a node under `dir`, requiring the NRI plugins `required`.
fn config(dir: &Path, bin: &Path, cdi: &Path, required: &[String]) -> String {
    let d = dir.display();
    let validator = if required.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = required.iter().map(|r| format!("'{r}'")).collect();
        format!(
            "[plugins.'io.containerd.nri.v1.nri'.default_validator]\n  enable = true\n  required_plugins = [{}]\n",
            names.join(", ")
        )
    };
    let mut text = format!(
        "version = 4\n\
         root = '{d}/root'\n\
         state = '{d}/state'\n\
         imports = []\n\
         [plugins.'io.containerd.server.v1.grpc']\n  address = '{d}/containerd.sock'\n\
         [plugins.'io.containerd.server.v1.ttrpc']\n  address = '{d}/containerd.sock.ttrpc'\n\
         [plugins.'io.containerd.internal.v1.opt']\n  path = '{d}/opt'\n\
         [plugins.'io.containerd.nri.v1.nri']\n  disable = false\n  socket_path = '{d}/{nri}'\n  \
         plugin_path = '{d}/nri-plugins'\n  plugin_config_path = '{d}/nri-conf.d'\n\
         [plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n\
         [plugins.'io.containerd.cri.v1.images'.pinned_images]\n  sandbox = 'registry.k8s.io/pause:3.10.2'\n\
         [plugins.'io.containerd.cri.v1.runtime']\n  enable_cdi = true\n  cdi_spec_dirs = ['{cdi}']\n  \
         netns_mounts_under_state_dir = true\n  restrict_oom_score_adj = true\n\
         [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]\n  \
         BinaryName = '{runc}'\n  Root = '{d}/runc'\n\
         [plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = ['{bin}']\n  conf_dir = '{d}/net.d'\n",
        nri = NRI_SOCKET,
        cdi = cdi.display(),
        runc = bin.join("runc").display(),
        bin = bin.display(),
    );
    text.push_str(&validator);
    text
}

/// The node's pod network: a bridge in containerd's own network namespace, addresses from
/// host-local.
fn network(dir: &Path) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "box",
        "plugins": [
            {"type": "bridge", "bridge": "box0", "isGateway": true,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]],
                      "dataDir": dir.join("ipam").display().to_string()}},
            {"type": "loopback"},
        ],
    })
    .to_string()
}

/// The pids of the processes whose arguments hold `args` in a row.
fn processes_with_args(args: &[&str]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let words: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                words.windows(args.len()).any(|w| w.iter().zip(args).all(|(a, b)| *a == b.as_bytes()))
            })
        })
        .collect()
}

/// Unmounts (lazily) every mount point under `dir`, deepest first.
fn unmount_under(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    let mut points: Vec<&str> =
        info.lines().filter_map(|l| l.split(' ').nth(4)).filter(|p| Path::new(p).starts_with(dir)).collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = Command::new("umount").args(["--lazy", p]).status();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_configuration_keeps_everything_under_the_nodes_folder() {
        let c = config(Path::new("/n/cri"), Path::new("/b"), Path::new("/n/cri/cdi"), &[]);
        for line in [
            "root = '/n/cri/root'",
            "state = '/n/cri/state'",
            "address = '/n/cri/containerd.sock'",
            "cdi_spec_dirs = ['/n/cri/cdi']",
            "Root = '/n/cri/runc'",
            "BinaryName = '/b/runc'",
            "socket_path = '/n/cri/nri.sock'",
            "plugin_path = '/n/cri/nri-plugins'",
            "plugin_config_path = '/n/cri/nri-conf.d'",
        ] {
            assert!(c.contains(line), "{line} missing from\n{c}");
        }
        assert!(!c.contains("default_validator"), "{c}");
        let required = config(Path::new("/n/cri"), Path::new("/b"), Path::new("/n/cri/cdi"), &["gpushare".into()]);
        let parsed: toml::Table = toml::from_str(&required).unwrap();
        let validator = &parsed["plugins"]["io.containerd.nri.v1.nri"]["default_validator"];
        assert_eq!(validator["enable"].as_bool(), Some(true), "{required}");
        assert_eq!(validator["required_plugins"].as_array().unwrap()[0].as_str(), Some("gpushare"), "{required}");
        let net: serde_json::Value = serde_json::from_str(&network(Path::new("/n/cri"))).unwrap();
        assert_eq!(net["plugins"][0]["ipam"]["dataDir"], "/n/cri/ipam");
    }
}
