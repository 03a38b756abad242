//! The status API on a real `dbus-daemon`, started by the test on a private socket with a
//! hand-written system-bus configuration (see [`Bus`]: most of the default policy of Debian's
//! `system.conf`, not the whole file) that includes the project's policy file. The steps, in
//! order, on one daemon and then a restarted one:
//!
//! - without a bus the daemon serves the kubelet, and `gpusharectl` says it cannot reach it;
//! - once the bus is there the daemon owns the name as root, and root reads everything
//!   (`Version`, the GPU model, `gpusharectl status` and `gpus --json` included);
//! - an allocation through the kubelet stand-in and a cordon are signalled (`PropertiesChanged`
//!   with the new `AllocationCount` and `Gpus`);
//! - an unprivileged user (`runuser -u nobody`) reads but is refused cordon and the name;
//! - while the bus is away the daemon still answers the kubelet, a real `Allocate` included,
//!   then comes back on the bus and lists that allocation;
//! - a restarted daemon keeps its cordons; killed, with the bus still up, `gpusharectl` says it
//!   is not running.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Host, WAIT, bound_pod, static_gpus};
use futures::StreamExt as _;
use gpushare_core::ContainerRole;
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_testkit::apiserver::ApiServer;
use gpushare_testkit::kubelet::{Admitted, Kubelet};
use gpushared::dbus::{BUS_NAME, GpuRecord, Gpushare1Proxy, INTERFACE, OBJECT_PATH, OverBudgetRecord};
use serde_json::{Value, json};

const POLICY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../etc/dbus-1/system.d/io.gpushare.GpuShare1.conf");

/// How long one command the test runs may take (`gpusharectl`'s own call timeout is 30 s).
const COMMAND_WAIT: Duration = Duration::from_secs(45);

/// A private bus with a hand-written system-bus configuration (not Debian's `system.conf`
/// itself): `<type>system</type>`, EXTERNAL authentication, a socket in the test's directory,
/// and as default policy the `<policy context="default">` of Debian's `system.conf` (dbus 1.14)
/// less four rules (the allow for the driver's `Containers1`; the denials of
/// `UpdateActivationEnvironment`, `Debug.Stats` and the systemd `Activator`): anyone connects,
/// nobody owns a name or calls a method unless a policy file allows it, signals and requested
/// replies pass, anyone calls the bus driver. The rest of Debian's file (its user, fork, pid
/// file, syslog, root-only policies and `system.d` directories) is left out; the only policy
/// file included is the project's. `docs/dbus.md` says the same.
struct Bus {
    child: Child,
    address: String,
    socket: PathBuf,
}

/// The default policy of [`Bus::start`]: Debian's system bus, less four rules.
const SYSTEM_POLICY: &str = r#"<policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
  </policy>"#;

/// A bus of an operator's own with no policy to speak of: anyone owns any name and calls any
/// method (the project's policy file is not included).
const OPEN_POLICY: &str = r#"<policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
  </policy>"#;

impl Bus {
    fn start(dir: &Path) -> Bus {
        Self::start_with(dir, &format!("{SYSTEM_POLICY}\n  <include>{POLICY}</include>"))
    }

    /// A bus whose configuration holds `policy` as its policy section.
    fn start_with(dir: &Path, policy: &str) -> Bus {
        let socket = dir.join("system_bus_socket");
        let _ = std::fs::remove_file(&socket);
        let config = dir.join("system.conf");
        std::fs::write(
            &config,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "https://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <auth>EXTERNAL</auth>
  <listen>unix:path={}</listen>
  {policy}
</busconfig>
"#,
                socket.display()
            ),
        )
        .unwrap();
        let child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .arg("--nofork")
            .arg("--nopidfile")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("dbus-daemon must be installed (Debian package dbus-daemon); .ci/run installs it");
        let deadline = Instant::now() + WAIT;
        while !socket.exists() {
            assert!(Instant::now() < deadline, "dbus-daemon did not create {}", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        Bus { child, address: format!("unix:path={}", socket.display()), socket }
    }

    /// Kills the bus and removes its socket; once only, so that dropping a stopped bus leaves
    /// alone the socket of the bus started after it at the same path.
    fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        self.stop();
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

/// The node around the daemon: the API-server and kubelet stand-ins, the daemon's
/// configuration (two 1000 MiB GPUs, the bus at `address`), and the directory of the bus. The
/// temporary directory goes last, after the stand-ins serving from it.
struct Node {
    api: ApiServer,
    kubelet: Kubelet,
    config: PathBuf,
    bus_dir: PathBuf,
    address: String,
    host: Host,
}

impl Node {
    async fn start() -> Node {
        let host = Host::new();
        std::fs::set_permissions(host.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let bus_dir = host.path("bus");
        std::fs::create_dir_all(&bus_dir).unwrap();
        std::fs::set_permissions(&bus_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let api = ApiServer::start().await.unwrap();
        api.create_node(json!({"metadata": {"name": "node-a"}})).unwrap();
        let kubeconfig = host.path("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let address = format!("unix:path={}", bus_dir.join("system_bus_socket").display());
        let extra = format!("{}\n[dbus]\naddress = \"{address}\"\n", static_gpus(&[(1000, None), (1000, None)]));
        let config = host.config(&kubeconfig, "", &extra);
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        Node { api, kubelet, config, bus_dir, address, host }
    }

    /// Binds the pod `default/NAME` with one app container `main` assigned `mib` on GPU `gpu`,
    /// and admits it through the kubelet stand-in (`GetPreferredAllocation`, then `Allocate`),
    /// retrying while the daemon has not seen the pod yet. Checks the answer names the pod and
    /// the GPU.
    async fn admit(&self, daemon: &Daemon, name: &str, gpu: u32, mib: u64) -> Admitted {
        bound_pod(&self.api, name, &[("main", ContainerRole::App, &[(gpu, mib)])]);
        let units = usize::try_from(mib).unwrap();
        let deadline = Instant::now() + WAIT;
        let admitted = loop {
            match self.kubelet.admit(&[units]).await {
                Ok(mut answers) => break answers.remove(0),
                Err(e) if Instant::now() < deadline && e.to_string().contains("no pod bound") => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("admitting {name}: {e}\n{}", daemon.log()),
            }
        };
        assert_eq!(admitted.envs["GPUSHARE_POD"], format!("default/{name}"), "{admitted:?}");
        assert_eq!(admitted.envs["NVIDIA_VISIBLE_DEVICES"], format!("GPU-static-{gpu}"), "{admitted:?}");
        admitted
    }
}

/// Runs `cmd` to completion within [`COMMAND_WAIT`]: its exit code (-1 when killed by a signal)
/// and its stdout followed by its stderr. A command that cannot start or does not finish fails
/// the test: nothing is skipped for a missing tool.
async fn run(mut cmd: tokio::process::Command) -> (i32, String) {
    let what = format!("{:?}", cmd.as_std());
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let out = tokio::time::timeout(COMMAND_WAIT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {COMMAND_WAIT:?}"))
        .unwrap_or_else(|e| panic!("{what} could not run: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// The `gpusharectl` binary of this build (its own crate, built beside this test by
/// `cargo test --workspace`).
fn gpusharectl_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let mut dir = exe.parent().unwrap().to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    let bin = dir.join("gpusharectl");
    assert!(bin.is_file(), "{} is missing: build it first (cargo build -p gpusharectl)", bin.display());
    bin
}

/// `gpusharectl ARGS` as `user` (None: this process's user): exit code and output. For another
/// user the binary is run from a copy beside the bus (the build directory may not be readable by
/// `nobody`, under /root say).
async fn ctl(user: Option<&str>, address: &str, args: &[&str]) -> (i32, String) {
    let built = gpusharectl_binary();
    let copy = address.strip_prefix("unix:path=").and_then(|s| Path::new(s).parent()).map(|d| d.join("gpusharectl"));
    let bin = match (user, copy) {
        (Some(_), Some(copy)) => {
            if !copy.exists() {
                std::fs::copy(&built, &copy).unwrap();
                std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            copy
        }
        _ => built,
    };
    let mut cmd = match user {
        Some(u) => {
            let mut c = tokio::process::Command::new("runuser");
            c.args(["-u", u, "--"]).arg(&bin);
            c
        }
        None => tokio::process::Command::new(bin),
    };
    cmd.arg("--address").arg(address).args(args);
    run(cmd).await
}

/// A call to the bus driver (`org.freedesktop.DBus.MEMBER ARGS`) with `dbus-send --print-reply`
/// as `user`, through `runuser`: exit code and output.
async fn bus_driver_call_as(user: &str, address: &str, member: &str, args: &[&str]) -> (i32, String) {
    let mut cmd = tokio::process::Command::new("runuser");
    cmd.args(["-u", user, "--", "dbus-send"])
        .arg(format!("--bus={address}"))
        .args(["--print-reply", "--dest=org.freedesktop.DBus", "/org/freedesktop/DBus"])
        .arg(format!("org.freedesktop.DBus.{member}"))
        .args(args);
    run(cmd).await
}

/// `key: value` lines (what `gpusharectl status` prints) as a map.
fn key_values(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap_or_else(|| panic!("not a key: value line: {l:?}"));
            (k.to_owned(), v.trim().to_owned())
        })
        .collect()
}

/// One GPU of the test's configuration as `gpusharectl gpus --json` shows it, healthy.
fn gpu_json(index: u32, used: u64, cordoned: bool) -> Value {
    json!({
        "index": index,
        "uuid": format!("GPU-static-{index}"),
        "model": "Tesla T4",
        "totalMiB": 1000,
        "usedMiB": used,
        "freeMiB": 1000 - used,
        "health": "Healthy",
        "healthReason": null,
        "cordoned": cordoned,
        "mode": "shared",
        "utilPercent": null,
        "inUseMiB": null,
    })
}

/// A client without a property cache: every read asks the daemon.
async fn proxy(address: &str) -> Gpushare1Proxy<'static> {
    let conn = zbus::connection::Builder::address(address).build().await.unwrap();
    Gpushare1Proxy::builder(&conn).cache_properties(zbus::proxy::CacheProperties::No).build().await.unwrap()
}

/// Whether [`BUS_NAME`] has an owner on the bus at `address`; None when the bus does not answer
/// (within 5 s).
async fn name_owned(address: &str) -> Option<bool> {
    let ask = async {
        let conn = zbus::connection::Builder::address(address).build().await.ok()?;
        let dbus = zbus::fdo::DBusProxy::new(&conn).await.ok()?;
        dbus.name_has_owner(BUS_NAME.try_into().ok()?).await.ok()
    };
    tokio::time::timeout(Duration::from_secs(5), ask).await.ok().flatten()
}

/// Waits until the bus at `address` answers that [`BUS_NAME`] is `owned` (or not); fails with
/// `why()` after `timeout`.
async fn wait_for_owner(address: &str, owned: bool, timeout: Duration, why: impl Fn() -> String) {
    let deadline = Instant::now() + timeout;
    while name_owned(address).await != Some(owned) {
        assert!(Instant::now() < deadline, "{}", why());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the daemon owns its name on the bus.
async fn wait_for_name(address: &str, daemon: &Daemon, timeout: Duration) {
    wait_for_owner(address, true, timeout, || format!("gpushared did not take its bus name\n{}", daemon.log())).await;
}

/// The `PropertiesChanged` signals of gpushared's object, read straight off the bus (not through
/// a property cache) and decoded: the values they carried, in arrival order.
struct Signals {
    stream: zbus::fdo::PropertiesChangedStream,
    /// `AllocationCount` values.
    counts: Vec<u32>,
    /// `Gpus` values.
    gpus: Vec<Vec<GpuRecord>>,
    /// Both, from signals that carried both, with the `OverBudget` they carried too (if any).
    together: Vec<(u32, Vec<GpuRecord>, Option<Vec<OverBudgetRecord>>)>,
}

impl Signals {
    /// Subscribes; every signal sent after this returns is seen.
    async fn subscribe(address: &str) -> Signals {
        let conn = zbus::connection::Builder::address(address).build().await.unwrap();
        let props =
            zbus::fdo::PropertiesProxy::builder(&conn).destination(BUS_NAME).path(OBJECT_PATH).build().await.unwrap();
        let stream = props.receive_properties_changed().await.unwrap();
        Signals { stream, counts: Vec::new(), gpus: Vec::new(), together: Vec::new() }
    }

    /// Reads signals until `done` holds of what came; fails after [`WAIT`], naming `what` and
    /// what came instead.
    async fn wait_for(&mut self, what: &str, done: impl Fn(&Signals) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !done(self) {
            let Ok(Some(signal)) = tokio::time::timeout_at(deadline, self.stream.next()).await else {
                panic!(
                    "no PropertiesChanged with {what}; came AllocationCount {:?}, Gpus {:?}",
                    self.counts, self.gpus
                );
            };
            let args = signal.args().unwrap();
            if args.interface_name().as_str() != INTERFACE {
                continue;
            }
            let (mut count, mut gpus, mut over) = (None, None, None);
            for (name, value) in args.changed_properties() {
                match *name {
                    "AllocationCount" => count = Some(u32::try_from(value.try_to_owned().unwrap()).unwrap()),
                    "Gpus" => {
                        gpus = Some(zbus::as_variant::deserialize_for_property::<Vec<GpuRecord>>(value).unwrap());
                    }
                    "OverBudget" => {
                        over =
                            Some(zbus::as_variant::deserialize_for_property::<Vec<OverBudgetRecord>>(value).unwrap());
                    }
                    _ => {}
                }
            }
            self.counts.extend(count);
            self.gpus.extend(gpus.clone());
            if let (Some(c), Some(g)) = (count, gpus) {
                self.together.push((c, g, over));
            }
        }
    }
}

/// No bus yet: the daemon serves the kubelet regardless (the pod `default/infer-1` gets 300 MiB
/// on GPU1), and `gpusharectl` says in one line that it cannot reach gpushared.
async fn serves_the_kubelet_without_a_bus(node: &Node, daemon: &Daemon) {
    node.kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    node.kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    node.admit(daemon, "infer-1", 1, 300).await;
    let (code, out) = ctl(None, &node.address, &["status"]).await;
    assert_eq!(code, 69, "no bus: a distinct exit code\n{out}");
    assert_eq!(out.lines().count(), 1, "one clear line: {out}");
    assert!(out.contains("cannot reach gpushared") && !out.contains("not running"), "{out}");
}

/// Root reads every property and the read-only methods, and `gpusharectl status` and `gpus
/// --json` show the same.
async fn root_reads_everything(node: &Node, p: &Gpushare1Proxy<'_>) {
    assert_eq!(p.node_name().await.unwrap(), "node-a");
    assert_eq!(p.version().await.unwrap(), env!("CARGO_PKG_VERSION"));
    assert_eq!(p.unit().await.unwrap(), "MiB");
    assert_eq!(p.allocation_count().await.unwrap(), 1);
    let gpus = p.gpus().await.unwrap();
    assert_eq!(gpus.len(), 2);
    for (index, g) in (0u32..).zip(&gpus) {
        assert_eq!(
            (g.index, g.uuid.as_str(), g.model.as_str(), g.total_mib),
            (index, format!("GPU-static-{index}").as_str(), "Tesla T4", 1000)
        );
    }
    assert_eq!(
        (gpus[1].index, gpus[1].total_mib, gpus[1].used_mib, gpus[1].health.as_str(), gpus[1].cordoned),
        (1, 1000, 300, "Healthy", false)
    );
    let rows = p.list_allocations("default/infer-1").await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].container.as_str(), rows[0].gpu_index, rows[0].mib), ("main", 1, 300));
    assert!(p.list_allocations("default/nobody").await.unwrap().is_empty());
    let err = p.list_allocations("no-slash").await.unwrap_err().to_string();
    assert!(err.contains("is not NAMESPACE/NAME"), "{err}");
    let why = p.explain("default/infer-1").await.unwrap();
    assert!(why.contains("container \"main\": assigned GPU1 300 MiB; allocated"), "{why}");
    assert!(p.explain("default/ghost").await.unwrap().contains("not bound to node node-a"));
    let history = p.history(0).await.unwrap();
    assert!(history.iter().any(|h| h.kind == "allocated" && h.detail.contains("default/infer-1")), "{history:?}");
    // Page by page, a line at a time, the same lines; a cursor the daemon did not hand out is refused.
    let (mut paged, mut cursor) = (Vec::new(), String::new());
    loop {
        let (page, next) = p.history_page(0, &cursor, 1).await.unwrap();
        assert!(page.len() <= 1, "{page:?}");
        paged.extend(page);
        if next.is_empty() {
            break;
        }
        cursor = next;
    }
    assert_eq!(paged, history);
    let err = p.history_page(0, "not-a-cursor", 10).await.unwrap_err().to_string();
    assert!(err.contains("InvalidArgs") && err.contains("not one gpushared handed out"), "{err}");

    let (code, out) = ctl(None, &node.address, &["status"]).await;
    assert_eq!(code, 0, "{out}");
    let expected = [
        ("node", "node-a"),
        ("version", env!("CARGO_PKG_VERSION")),
        ("unit", "MiB"),
        ("gpus", "2 (2 healthy, 0 unhealthy, 0 cordoned)"),
        ("memory", "300 MiB used of 2000 MiB (1700 MiB free)"),
        ("allocations", "1"),
        ("over budget", "0 containers"),
    ];
    assert_eq!(key_values(&out), BTreeMap::from(expected.map(|(k, v)| (k.to_owned(), v.to_owned()))), "{out}");
    let (code, out) = ctl(None, &node.address, &["gpus", "--json"]).await;
    assert_eq!(code, 0, "{out}");
    let json: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(json, json!([gpu_json(0, 0, false), gpu_json(1, 300, false)]));
}

/// An allocation through the kubelet stand-in (`default/infer-2`, 200 MiB on GPU0) is
/// signalled: `PropertiesChanged` carries the new `AllocationCount` and `Gpus`.
async fn allocations_are_signalled(node: &Node, daemon: &Daemon) {
    let mut signals = Signals::subscribe(&node.address).await;
    node.admit(daemon, "infer-2", 0, 200).await;
    // One signal carries both: a client never sees the new GPUs beside the old count.
    signals
        .wait_for("AllocationCount 2 and Gpus with 200 MiB used on GPU0 and 300 on GPU1, in one signal", |s| {
            s.together.iter().any(|(c, g, _)| *c == 2 && g.iter().map(|g| g.used_mib).eq([200, 300]))
        })
        .await;
    // The same signal carries the containers over budget: none (no NVML here, no processes).
    let (_, _, over) = signals.together.iter().find(|(c, _, _)| *c == 2).unwrap();
    assert_eq!(over.as_deref(), Some(&[][..]), "OverBudget in the same signal");
    let (code, out) = ctl(None, &node.address, &["over-budget"]).await;
    assert_eq!((code, out.as_str()), (0, "no container is over its budget\n"));
    let (code, out) = ctl(None, &node.address, &["over-budget", "--json"]).await;
    assert_eq!((code, out.as_str()), (0, "[]\n"));
}

/// Root cordons GPU0 (by UUID; again by index, unchanged; an unknown GPU is refused): the
/// change is signalled and published in the node annotation for the extender.
async fn cordons_are_signalled_and_published(node: &Node, p: &Gpushare1Proxy<'_>) {
    let mut signals = Signals::subscribe(&node.address).await;
    assert!(p.cordon("GPU-static-0").await.unwrap());
    assert!(!p.cordon("0").await.unwrap(), "already cordoned");
    let err = p.cordon("7").await.unwrap_err().to_string();
    assert!(err.contains("no GPU \"7\" on this node"), "{err}");
    signals.wait_for("Gpus with GPU0 cordoned", |s| s.gpus.iter().any(|g| g[0].cordoned && !g[1].cordoned)).await;
    let deadline = Instant::now() + WAIT;
    loop {
        let state = node
            .api
            .node("node-a")
            .and_then(|n| n["metadata"]["annotations"][NODE_STATE_KEY].as_str().map(str::to_owned));
        if state.is_some_and(|s| NodeState::decode(&s).unwrap().inventory.gpus()[0].cordoned) {
            break;
        }
        assert!(Instant::now() < deadline, "the cordon is not in the node annotation");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An unprivileged user reads through `gpusharectl`, and is refused cordon, uncordon and the
/// bus name.
async fn nobody_reads_but_changes_nothing(node: &Node, p: &Gpushare1Proxy<'_>) {
    let address = node.address.as_str();
    let (code, out) = ctl(Some("nobody"), address, &["gpus"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("GPU-static-1") && out.contains("300"), "{out}");
    let (code, out) = ctl(Some("nobody"), address, &["--json", "allocations", "--pod", "default/infer-1"]).await;
    assert_eq!(code, 0, "{out}");
    let json: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 1);
    let (code, out) = ctl(Some("nobody"), address, &["--json", "claims"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.trim(), "[]", "this node serves no GPU through DRA");
    let (code, out) = ctl(Some("nobody"), address, &["explain", "default/infer-1"]).await;
    assert_eq!(code, 0, "{out}");
    let (code, out) = ctl(Some("nobody"), address, &["history", "--since", "1h"]).await;
    assert_eq!(code, 0, "{out}");
    for verb in ["cordon", "uncordon"] {
        let (code, out) = ctl(Some("nobody"), address, &[verb, "0"]).await;
        assert_eq!(code, 77, "{verb} as nobody: {out}");
        assert!(out.contains("permission denied"), "{out}");
    }
    let gpus = p.gpus().await.unwrap();
    assert!(gpus[0].cordoned, "still cordoned after the refused uncordon");

    // Nobody may not take the name either. The same tool as the same user first makes a call
    // the policy allows, so the refusal below is the policy's, not a tool that did not run.
    let (code, out) = bus_driver_call_as("nobody", address, "NameHasOwner", &["string:io.gpushare.GpuShare1"]).await;
    assert_eq!(code, 0, "dbus-send as nobody must work: {out}");
    assert!(out.contains("boolean true"), "{out}");
    let (code, out) =
        bus_driver_call_as("nobody", address, "RequestName", &["string:io.gpushare.GpuShare1", "uint32:4"]).await;
    assert_ne!(code, 0, "nobody must not own the name: {out}");
    assert!(
        out.contains("org.freedesktop.DBus.Error.AccessDenied") && out.contains("io.gpushare.GpuShare1"),
        "the bus must refuse nobody the name: {out}"
    );
    assert_eq!(name_owned(address).await, Some(true), "gpushared still owns its name");
}

/// Root uncordons GPU0 and cordons GPU1 through `gpusharectl`.
async fn root_cordons_with_gpusharectl(node: &Node, p: &Gpushare1Proxy<'_>) {
    let (code, out) = ctl(None, &node.address, &["uncordon", "GPU-static-0"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(!p.gpus().await.unwrap()[0].cordoned);
    let (code, out) = ctl(None, &node.address, &["cordon", "1"]).await;
    assert_eq!(code, 0, "{out}");
}

/// The bus goes away: the daemon still answers the kubelet, a real allocation included
/// (`default/infer-3`, 100 MiB on GPU0). The bus comes back: the daemon takes its name again,
/// keeps the cordon of GPU1, and lists the allocation made meanwhile.
async fn bus_goes_away_and_comes_back(node: &Node, daemon: &Daemon, bus: &mut Bus) {
    bus.stop();
    let away = gpushared::allocation::ledger::now_ms();
    node.kubelet.ask_options().await.unwrap();
    node.admit(daemon, "infer-3", 0, 100).await;
    let back = gpushared::allocation::ledger::now_ms();
    *bus = Bus::start(&node.bus_dir);
    wait_for_name(&node.address, daemon, Duration::from_secs(30)).await;
    let p = proxy(&bus.address).await;
    assert!(p.gpus().await.unwrap()[1].cordoned, "the cordon of GPU1 is kept");
    assert_eq!(p.allocation_count().await.unwrap(), 3);

    let (code, out) = ctl(None, &node.address, &["allocations", "--json"]).await;
    assert_eq!(code, 0, "{out}");
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let pods: Vec<&str> = rows.iter().filter_map(|r| r["pod"].as_str()).collect();
    assert_eq!(pods, ["infer-1", "infer-2", "infer-3"], "{out}");
    let row = &rows[2];
    let at = row["allocatedAtMs"].as_i64().unwrap();
    assert!((away..=back).contains(&at), "allocated at {at}, while the bus was away ({away}..={back}): {out}");
    let fields = ["namespace", "container", "role", "gpuIndex", "gpuUuid", "mib"].map(|k| row[k].clone());
    assert_eq!(fields, [json!("default"), json!("main"), json!("app"), json!(0), json!("GPU-static-0"), json!(100)]);
}

/// The bus is up but gpushared is not (killed): `gpusharectl` says so in one line and exits 69,
/// for root and for an unprivileged user.
async fn bus_up_daemon_down(node: &Node, daemon: Daemon) {
    drop(daemon);
    wait_for_owner(&node.address, false, WAIT, || "the bus still names an owner after gpushared was killed".into())
        .await;
    for user in [None, Some("nobody")] {
        let (code, out) = ctl(user, &node.address, &["status"]).await;
        assert_eq!(code, 69, "bus up, gpushared down, as {user:?}: EX_UNAVAILABLE\n{out}");
        assert_eq!(out.lines().count(), 1, "one clear line: {out}");
        assert!(
            out.contains("gpushared is not running")
                && out.contains(&format!("no {BUS_NAME} on the bus at {}", node.address)),
            "{out}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_api_reads_for_everyone_and_cordons_for_root_only() {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the D-Bus policy test runs as root (to own the name and use runuser)");
        return;
    }
    let node = Node::start().await;
    let daemon = Daemon::start(&node.config, node.host.path("daemon.log"));
    serves_the_kubelet_without_a_bus(&node, &daemon).await;

    // The bus comes: the daemon takes its name (retrying every 1 s, then backing off).
    let mut bus = Bus::start(&node.bus_dir);
    wait_for_name(&node.address, &daemon, Duration::from_secs(20)).await;
    let p = proxy(&bus.address).await;
    root_reads_everything(&node, &p).await;
    allocations_are_signalled(&node, &daemon).await;
    cordons_are_signalled_and_published(&node, &p).await;
    nobody_reads_but_changes_nothing(&node, &p).await;
    root_cordons_with_gpusharectl(&node, &p).await;
    bus_goes_away_and_comes_back(&node, &daemon, &mut bus).await;
    drop(daemon);

    // A restarted daemon keeps the cordon (it is in the ledger).
    let daemon = Daemon::start(&node.config, node.host.path("daemon-2.log"));
    wait_for_name(&node.address, &daemon, WAIT).await;
    let p = proxy(&bus.address).await;
    let gpus = p.gpus().await.unwrap();
    assert!(!gpus[0].cordoned && gpus[1].cordoned, "{gpus:?}");

    bus_up_daemon_down(&node, daemon).await;
    bus.stop();
}

/// On a bus of the operator's own (`[dbus] address`) with no policy file, the daemon itself
/// still lets only root cordon: nobody's `gpusharectl cordon` reaches it and is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_bus_without_the_policy_the_daemon_still_cordons_for_root_only() {
    if !is_root() {
        gpushare_testkit::skip_unless_ci("the D-Bus policy test runs as root (to own the name and use runuser)");
        return;
    }
    let node = Node::start().await;
    let mut bus = Bus::start_with(&node.bus_dir, OPEN_POLICY);
    let daemon = Daemon::start(&node.config, node.host.path("daemon.log"));
    wait_for_name(&node.address, &daemon, Duration::from_secs(20)).await;
    for verb in ["cordon", "uncordon"] {
        let (code, out) = ctl(Some("nobody"), &node.address, &[verb, "0"]).await;
        assert_eq!(code, 77, "{verb} as nobody: {out}");
        assert!(out.contains("permission denied") && out.contains("needs root"), "{out}");
    }
    let p = proxy(&bus.address).await;
    assert!(!p.gpus().await.unwrap()[0].cordoned, "nobody's cordon changed nothing");
    let (code, out) = ctl(None, &node.address, &["cordon", "0"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(p.gpus().await.unwrap()[0].cordoned);
    drop(daemon);
    bus.stop();
}
