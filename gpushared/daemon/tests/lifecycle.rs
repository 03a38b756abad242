//! gpushared over time, driven as a process through the stand-ins: systemd notification
//! (`READY`, `STATUS`, the watchdog, `STOPPING`) on a datagram socket the test binds as
//! `NOTIFY_SOCKET`, and the node-state annotation it publishes on its Node.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Daemon, Host, WAIT, bound_pod, static_gpus};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{ContainerRole, Mib};
use gpushare_testkit::apiserver::ApiServer;
use gpushare_testkit::kubelet::Kubelet;
use serde_json::json;

/// What the daemon told "systemd", in order, with when.
#[derive(Clone, Default)]
struct Notes(Arc<Mutex<Vec<(Instant, String)>>>);

impl Notes {
    /// Binds `path` and records every datagram.
    fn listen(path: &std::path::Path) -> Notes {
        let sock = UnixDatagram::bind(path).unwrap();
        let notes = Notes::default();
        let out = notes.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = sock.recv(&mut buf) {
                out.0.lock().unwrap().push((Instant::now(), String::from_utf8_lossy(&buf[..n]).into_owned()));
            }
        });
        notes
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().iter().map(|(_, m)| m.clone()).collect()
    }

    fn wait_for(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if let Some(m) = self.all().into_iter().find(|m| pred(m)) {
                return m;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("no {what} notification; got {:#?}", self.all());
    }

    fn pings_between(&self, from: Instant, to: Instant) -> usize {
        self.0.lock().unwrap().iter().filter(|(at, m)| *at >= from && *at < to && m == "WATCHDOG=1").count()
    }
}

/// A host whose daemon reaches the API-server stand-in, with two 1000 MiB GPUs.
async fn host_with_api() -> (Host, ApiServer, std::path::PathBuf) {
    let host = Host::new();
    let api = ApiServer::start().await.unwrap();
    api.create_node(json!({"metadata": {"name": "node-a", "annotations": {"team": "ml"}}})).unwrap();
    let kubeconfig = host.path("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let config = host.config(&kubeconfig, "", &static_gpus(&[(1000, None), (1000, None)]));
    (host, api, config)
}

/// Admits a one-container pod of `mib` on GPU `gpu`, once the daemon has seen it.
async fn place(api: &ApiServer, kubelet: &Kubelet, name: &str, gpu: u32, mib: u64) {
    bound_pod(api, name, &[("main", ContainerRole::App, &[(gpu, mib)])]);
    let deadline = Instant::now() + WAIT;
    loop {
        match kubelet.admit(&[usize::try_from(mib).unwrap()]).await {
            Ok(_) => return,
            Err(e) if Instant::now() < deadline && e.to_string().contains("no pod bound") => {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tells_systemd_when_ready_what_it_does_and_that_it_lives() {
    let (host, api, config) = host_with_api().await;
    // A first run leaves an allocation in the ledger.
    {
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        let daemon = Daemon::start(&config, host.path("first.log"));
        kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
        place(&api, &kubelet, "kept", 0, 300).await;
        daemon.signal("TERM");
        kubelet.stop();
    }

    let notify = host.path("notify.sock");
    let notes = Notes::listen(&notify);
    let socket = host.plugin_dir().join("gpushared.sock");
    let mut daemon = Daemon::start_with_env(
        &config,
        host.path("second.log"),
        &[("NOTIFY_SOCKET", notify.to_str().unwrap()), ("WATCHDOG_USEC", "400000")],
    );
    // READY=1 comes once the ledger is restored and the socket serves; no kubelet is up yet.
    let ready = notes.wait_for("READY", |m| m.starts_with("READY=1"));
    assert!(socket.exists(), "READY before the plugin socket exists");
    let before_ready: Vec<String> = notes.all().into_iter().take_while(|m| !m.starts_with("READY=1")).collect();
    assert!(before_ready.iter().any(|m| m == "STATUS=starting: restoring the ledger"), "{before_ready:?}");
    assert!(ready.contains("STATUS=waiting for the kubelet at "), "{ready}");
    assert!(ready.ends_with("; 2 GPUs, 1 allocation"), "the restored ledger is counted: {ready}");

    // The watchdog: a ping every half of WATCHDOG_USEC (200 ms) while the daemon answers.
    let from = Instant::now();
    std::thread::sleep(Duration::from_millis(1100));
    let pings = notes.pings_between(from, Instant::now());
    assert!((4..=7).contains(&pings), "{pings} pings in 1.1 s at a 200 ms period");

    // Serving once the kubelet accepted the registration.
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    kubelet.wait_registered(1, WAIT).await.unwrap();
    notes.wait_for("serving status", |m| m == "STATUS=serving 2 GPUs, 1 allocation");
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    place(&api, &kubelet, "more", 1, 200).await;
    notes.wait_for("status after an allocation", |m| m == "STATUS=serving 2 GPUs, 2 allocations");

    // SIGTERM: STOPPING=1, the socket removed, exit 0.
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(WAIT), Some(0), "{}", daemon.log());
    notes.wait_for("STOPPING", |m| m.starts_with("STOPPING=1\nSTATUS=stopping"));
    assert!(!socket.exists());
    let all = notes.all();
    assert_eq!(all.iter().filter(|m| m.starts_with("READY=1")).count(), 1, "{all:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_its_gpus_and_allocations_on_its_own_node() {
    let (host, api, config) = host_with_api().await;
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();

    let state = |api: &ApiServer| -> Option<NodeState> {
        let node = api.node("node-a")?;
        let value = node["metadata"]["annotations"][NODE_STATE_KEY].as_str()?.to_owned();
        Some(NodeState::decode(&value).unwrap())
    };
    let wait_state = |api: &ApiServer, what: &str, ok: &dyn Fn(&NodeState) -> bool| -> NodeState {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(s) = state(api).filter(|s| ok(s)) {
                return s;
            }
            assert!(Instant::now() < deadline, "{what}: last {:?}", state(api));
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let first = wait_state(&api, "the first publication", &|_| true);
    assert_eq!(first.inventory.gpus().len(), 2);
    assert_eq!(first.daemon_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(first.used, vec![Mib::ZERO, Mib::ZERO]);
    // Only its own annotation changed.
    assert_eq!(api.node("node-a").unwrap()["metadata"]["annotations"]["team"], "ml");

    place(&api, &kubelet, "a", 0, 300).await;
    place(&api, &kubelet, "b", 0, 200).await;
    place(&api, &kubelet, "c", 1, 100).await;
    let s = wait_state(&api, "three allocations", &|s| s.allocations.len() == 3);
    assert_eq!(s.used, vec![Mib::new(500), Mib::new(100)]);
    assert!(s.generation > first.generation);
    let holders: Vec<(String, u32, u64)> =
        s.allocations.iter().map(|a| (a.pod.name.clone(), a.gpu, a.mib.get())).collect();
    assert_eq!(holders, vec![("a".into(), 0, 300), ("b".into(), 0, 200), ("c".into(), 1, 100)]);

    // A burst of changes is debounced into fewer publications.
    api.clear_requests();
    for i in 0..8 {
        bound_pod(&api, &format!("burst-{i}"), &[("main", ContainerRole::App, &[(1, 10)])]);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..8 {
        kubelet.admit(&[10]).await.unwrap();
    }
    wait_state(&api, "the burst", &|s| s.allocations.len() == 11);
    let patches = api.requests().iter().filter(|(m, p)| m == "PATCH" && p.contains("/nodes/node-a")).count();
    assert!((1..8).contains(&patches), "{patches} publications for 8 allocations");

    // A deleted pod's memory returns, and the annotation says so.
    api.delete_pod("default", "a").unwrap();
    let after = wait_state(&api, "the release", &|s| s.allocations.len() == 10);
    assert_eq!(after.used[0], Mib::new(200));

    // A restarted daemon continues the generation.
    drop(daemon);
    let before = state(&api).unwrap().generation;
    let _daemon = Daemon::start(&config, host.path("daemon-2.log"));
    let again = wait_state(&api, "the restarted daemon's publication", &|s| s.generation > before);
    assert_eq!(again.allocations.len(), 10);
}
