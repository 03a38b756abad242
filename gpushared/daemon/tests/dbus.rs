//! The status API on a real `dbus-daemon`, started by the test with a system-bus configuration
//! (the default policy of Debian's system.conf) that includes the project's policy file: the
//! daemon owns the name as root, root reads and cordons, an unprivileged user (`runuser -u
//! nobody`) reads but is refused cordon, signals follow changes, and the daemon keeps serving
//! the kubelet while the bus is away, then comes back on it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Host, WAIT, bound_pod, static_gpus};
use futures::StreamExt as _;
use gpushare_core::ContainerRole;
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_testkit::apiserver::ApiServer;
use gpushare_testkit::kubelet::Kubelet;
use gpushared::dbus::Gpushare1Proxy;
use serde_json::json;

const POLICY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../etc/dbus-1/system.d/io.gpushare.GpuShare1.conf");

/// A private bus configured like the system bus.
struct Bus {
    child: Child,
    address: String,
    socket: PathBuf,
}

impl Bus {
    fn start(dir: &Path) -> Bus {
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
  <policy context="default">
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
  </policy>
  <include>{POLICY}</include>
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

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
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

/// `gpusharectl ARGS` as `user` (None: this process's user): exit code and output. For another
/// user the binary is run from a copy beside the bus (the build directory may not be readable by
/// `nobody`, under /root say).
fn ctl(user: Option<&str>, address: &str, args: &[&str]) -> (i32, String) {
    let built = env!("CARGO_BIN_EXE_gpusharectl");
    let copy = address.strip_prefix("unix:path=").and_then(|s| Path::new(s).parent()).map(|d| d.join("gpusharectl"));
    let bin = match (user, copy) {
        (Some(_), Some(copy)) => {
            if !copy.exists() {
                std::fs::copy(built, &copy).unwrap();
                std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            copy
        }
        _ => PathBuf::from(built),
    };
    let mut cmd = match user {
        Some(u) => {
            let mut c = Command::new("runuser");
            c.args(["-u", u, "--"]).arg(&bin);
            c
        }
        None => Command::new(bin),
    };
    let out = cmd.arg("--address").arg(address).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// A client without a property cache: every read asks the daemon.
async fn proxy(address: &str) -> Gpushare1Proxy<'static> {
    let conn = zbus::connection::Builder::address(address).build().await.unwrap();
    Gpushare1Proxy::builder(&conn).cache_properties(zbus::proxy::CacheProperties::No).build().await.unwrap()
}

/// Waits until the daemon owns its name on the bus.
async fn wait_for_name(address: &str, daemon: &Daemon, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(conn) = zbus::connection::Builder::address(address).build().await
            && let Ok(dbus) = zbus::fdo::DBusProxy::new(&conn).await
            && dbus.name_has_owner(gpushared::dbus::BUS_NAME.try_into().unwrap()).await.unwrap_or(false)
        {
            return;
        }
        assert!(Instant::now() < deadline, "gpushared did not take its bus name\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_api_reads_for_everyone_and_cordons_for_root_only() {
    if !is_root() {
        eprintln!("skipped: the D-Bus policy test runs as root (to own the name and use runuser), as CI does");
        return;
    }
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

    // The bus is not there yet: the daemon serves the kubelet regardless.
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    bound_pod(&api, "infer-1", &[("main", ContainerRole::App, &[(1, 300)])]);
    let deadline = Instant::now() + WAIT;
    while let Err(e) = kubelet.admit(&[300]).await {
        assert!(Instant::now() < deadline, "{e}\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, out) = ctl(None, &address, &["status"]);
    assert_eq!(code, 69, "no bus: a distinct exit code\n{out}");
    assert_eq!(out.lines().count(), 1, "one clear line: {out}");

    // The bus comes: the daemon takes its name (retrying every 1 s, then backing off).
    let mut bus = Bus::start(&bus_dir);
    wait_for_name(&address, &daemon, Duration::from_secs(20)).await;

    // Root reads everything.
    let p = proxy(&bus.address).await;
    assert_eq!(p.node_name().await.unwrap(), "node-a");
    assert_eq!(p.unit().await.unwrap(), "MiB");
    assert_eq!(p.allocation_count().await.unwrap(), 1);
    let gpus = p.gpus().await.unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!((gpus[1].0, gpus[1].3, gpus[1].4, gpus[1].5.as_str(), gpus[1].7), (1, 1000, 300, "Healthy", false));
    let rows = p.list_allocations("default/infer-1").await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].3.as_str(), rows[0].6, rows[0].7), ("main", 1, 300));
    assert!(p.list_allocations("default/nobody").await.unwrap().is_empty());
    let err = p.list_allocations("no-slash").await.unwrap_err().to_string();
    assert!(err.contains("is not NAMESPACE/NAME"), "{err}");
    let why = p.explain("default/infer-1").await.unwrap();
    assert!(why.contains("container \"main\": assigned GPU1 300 MiB; allocated"), "{why}");
    assert!(p.explain("default/ghost").await.unwrap().contains("not bound to node node-a"));
    let history = p.history(0).await.unwrap();
    assert!(
        history.iter().any(|(_, kind, detail)| kind == "allocated" && detail.contains("default/infer-1")),
        "{history:?}"
    );

    // Signals: a cordon changes the Gpus property.
    let watcher = {
        let conn = zbus::connection::Builder::address(bus.address.as_str()).build().await.unwrap();
        Gpushare1Proxy::new(&conn).await.unwrap()
    };
    let mut gpu_changes = watcher.receive_gpus_changed().await;
    assert!(p.cordon("GPU-static-0").await.unwrap());
    assert!(!p.cordon("0").await.unwrap(), "already cordoned");
    let err = p.cordon("7").await.unwrap_err().to_string();
    assert!(err.contains("no GPU \"7\" on this node"), "{err}");
    let changed = tokio::time::timeout(WAIT, async {
        loop {
            let c = gpu_changes.next().await.unwrap();
            if c.get().await.unwrap()[0].7 {
                return;
            }
        }
    })
    .await;
    assert!(changed.is_ok(), "no PropertiesChanged for Gpus after the cordon");
    // Published for the extender, and kept across a restart (below).
    let deadline = Instant::now() + WAIT;
    loop {
        let state =
            api.node("node-a").and_then(|n| n["metadata"]["annotations"][NODE_STATE_KEY].as_str().map(str::to_owned));
        if state.is_some_and(|s| NodeState::decode(&s).unwrap().inventory.gpus()[0].cordoned) {
            break;
        }
        assert!(Instant::now() < deadline, "the cordon is not in the node annotation");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // An unprivileged user reads, and is refused cordon and uncordon.
    let (code, out) = ctl(Some("nobody"), &address, &["gpus"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("GPU-static-1") && out.contains("300"), "{out}");
    let (code, out) = ctl(Some("nobody"), &address, &["--json", "allocations", "--pod", "default/infer-1"]);
    assert_eq!(code, 0, "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 1);
    let (code, out) = ctl(Some("nobody"), &address, &["explain", "default/infer-1"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = ctl(Some("nobody"), &address, &["history", "--since", "1h"]);
    assert_eq!(code, 0, "{out}");
    for verb in ["cordon", "uncordon"] {
        let (code, out) = ctl(Some("nobody"), &address, &[verb, "0"]);
        assert_eq!(code, 77, "{verb} as nobody: {out}");
        assert!(out.contains("permission denied"), "{out}");
    }
    let gpus = p.gpus().await.unwrap();
    assert!(gpus[0].7, "still cordoned after the refused uncordon");
    // Nobody may take the name either.
    let taken = Command::new("runuser")
        .args([
            "-u",
            "nobody",
            "--",
            "dbus-send",
            &format!("--bus={address}"),
            "--print-reply",
            "--dest=org.freedesktop.DBus",
        ])
        .args(["/org/freedesktop/DBus", "org.freedesktop.DBus.RequestName", "string:io.gpushare.GpuShare1", "uint32:4"])
        .output();
    if let Ok(out) = taken {
        assert!(!out.status.success(), "nobody must not own the name: {}", String::from_utf8_lossy(&out.stdout));
    }

    // Root uncordons through gpusharectl.
    let (code, out) = ctl(None, &address, &["uncordon", "GPU-static-0"]);
    assert_eq!(code, 0, "{out}");
    assert!(!p.gpus().await.unwrap()[0].7);
    let (code, out) = ctl(None, &address, &["cordon", "1"]);
    assert_eq!(code, 0, "{out}");

    // The bus goes away and comes back: the daemon serves the kubelet meanwhile and returns.
    bus.stop();
    kubelet.ask_options().await.unwrap();
    let mut bus = Bus::start(&bus_dir);
    wait_for_name(&address, &daemon, Duration::from_secs(30)).await;
    let p = proxy(&bus.address).await;
    assert!(p.gpus().await.unwrap()[1].7, "the cordon of GPU1 is kept");
    drop(daemon);

    // A restarted daemon keeps the cordon (it is in the ledger).
    let daemon = Daemon::start(&config, host.path("daemon-2.log"));
    wait_for_name(&address, &daemon, WAIT).await;
    let p = proxy(&bus.address).await;
    let gpus = p.gpus().await.unwrap();
    assert!(!gpus[0].7 && gpus[1].7, "{gpus:?}");
    bus.stop();
}
