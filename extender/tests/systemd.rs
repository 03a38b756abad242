//! The extender binary under systemd's protocol (`Type=notify`), driven as the packaged unit
//! runs it: `READY=1` once it listens (healthz answers at once), a `STATUS=` line that follows
//! the view's sync, `WATCHDOG=1` every half of `$WATCHDOG_USEC`, and `STOPPING=1` with a clean
//! exit on SIGTERM. The test binds the `NOTIFY_SOCKET` datagram socket itself. And the network
//! confinement the package's generator writes from `--unit-drop-in`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{http, node_object};
use gpushare_testkit::apiserver::ApiServer;
use gpushare_testkit::notify::Notes;

const WAIT: Duration = Duration::from_secs(10);

fn free_port() -> u16 {
    gpushare_testkit::ports::free_port().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_once_listening_status_follows_the_view_watchdog_and_stopping() {
    let api = ApiServer::start().await.unwrap();
    api.create_node(node_object("gpu-1", 2, 16_384)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let config = dir.path().join("extender.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"{addr}\"\nobserve_listen = \"127.0.0.1:{}\"\n[kubernetes]\nkubeconfig = \"{}\"\n",
            free_port(),
            kubeconfig.display()
        ),
    )
    .unwrap();
    let notify = dir.path().join("notify.sock");
    let notes = Notes::listen(&notify);
    let log = std::fs::File::create(dir.path().join("extender.log")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpushare-extender"))
        .arg("--config")
        .arg(&config)
        .env("NOTIFY_SOCKET", &notify)
        .env("WATCHDOG_USEC", "400000")
        .env_remove("WATCHDOG_PID")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(dir.path().join("extender.log")).unwrap_or_default();

    // READY=1 comes once the listener is bound: healthz answers right after it, no retry.
    let ready = tokio::task::block_in_place(|| notes.wait_for("READY", WAIT, |m| m.starts_with("READY=1")));
    assert!(ready.contains(&format!("STATUS=serving kube-scheduler on {addr}")), "{ready}");
    assert_eq!(http(addr, "GET", "/healthz", "").await.0, 200, "{}", log());

    // The status line says so once the view has synced (readyz agrees).
    tokio::task::block_in_place(|| {
        notes.wait_for("the synced status", WAIT, |m| m.starts_with("STATUS=") && m.ends_with("is synced"))
    });
    assert_eq!(http(addr, "GET", "/readyz", "").await.0, 200);

    // The watchdog: a ping every half of WATCHDOG_USEC (200 ms) while the view answers.
    let from = Instant::now();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let pings = notes.pings_between(from, Instant::now());
    assert!((4..=7).contains(&pings), "{pings} pings in 1.1 s at a 200 ms period");

    // SIGTERM: STOPPING=1 and a clean exit.
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        assert!(Instant::now() < deadline, "still running after SIGTERM: {}", log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(code, Some(0), "{}", log());
    tokio::task::block_in_place(|| notes.wait_for("STOPPING", WAIT, |m| m.starts_with("STOPPING=1\nSTATUS=stopping")));
}

/// `[kubernetes] confine_network`: `--unit-drop-in` prints what the package's generator writes
/// (the API server, loopback, the callers), and a confinement that cannot be made (a server
/// named by host name) is refused by the generator's call, by `--check-config` and by the
/// extender's start alike, never served without.
#[test]
fn a_confinement_asked_for_is_printed_for_the_generator_or_refused_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let run =
        |args: &[&std::ffi::OsStr]| Command::new(env!("CARGO_BIN_EXE_gpushare-extender")).args(args).output().unwrap();
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let kubeconfig = |name: &str, server: &str| {
        write(
            name,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: x\ncontexts:\n- name: x\n  context:\n    cluster: c\n    \
                 user: x\nclusters:\n- name: c\n  cluster:\n    server: {server}\nusers:\n- name: x\n  user:\n    token: t\n"
            ),
        )
    };
    let listen =
        format!("[server]\nlisten = \"127.0.0.1:{}\"\nobserve_listen = \"127.0.0.1:{}\"\n", free_port(), free_port());
    // `server` adds to [server], `kubernetes` to [kubernetes].
    let config = |name: &str, kubeconfig: &std::path::Path, server: &str, kubernetes: &str| {
        let kubeconfig = kubeconfig.display().to_string();
        write(name, format!("{listen}{server}[kubernetes]\nkubeconfig = {kubeconfig:?}\n{kubernetes}"))
    };
    let confined = "confine_network = true\n";
    let by_address = kubeconfig("by-address", "https://10.9.0.1:6443");
    let on = config("on.toml", &by_address, "callers = [\"10.0.0.0/24\"]\n", confined);
    let out = run(&["--config".as_ref(), on.as_os_str(), "--unit-drop-in".as_ref()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8_lossy(&out.stdout);
    let settings: Vec<&str> = printed.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        settings,
        ["[Service]", "IPAddressDeny=any", "IPAddressAllow=10.9.0.1 localhost 10.0.0.0/24"],
        "{printed}"
    );
    assert!(run(&["--check-config".as_ref(), on.as_os_str()]).status.success());
    // Off: the generator gets nothing to write.
    let off = config("off.toml", &by_address, "", "");
    let out = run(&["--config".as_ref(), off.as_os_str(), "--unit-drop-in".as_ref()]);
    assert!(out.status.success() && out.stdout.is_empty(), "{out:?}");

    let by_name = kubeconfig("by-name", "https://api.cluster.example:6443");
    let refused = config("refused.toml", &by_name, "", confined);
    for args in [
        vec!["--config".as_ref(), refused.as_os_str(), "--unit-drop-in".as_ref()],
        vec!["--check-config".as_ref(), refused.as_os_str()],
        vec!["--config".as_ref(), refused.as_os_str()],
    ] {
        let out = run(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("https://api.cluster.example:6443/, which is named by host name"), "{args:?}: {err}");
        assert!(err.contains("confine_network = false"), "{args:?}: {err}");
    }
}
