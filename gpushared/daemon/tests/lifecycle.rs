//! gpushared over time, driven as a process through the stand-ins: systemd notification
//! (`READY`, `STATUS`, the watchdog, `STOPPING`, a stop while starting) on a datagram socket the
//! test binds as `NOTIFY_SOCKET`; the node-state annotation it publishes on its Node (and a Node
//! whose other annotations leave it no room); kubelet restarts; reconciliation with the
//! kubelet's PodResources API; GPU health from NVML events injected into the fake NVML library,
//! and automatic recovery.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, Host, NO_API_SERVER, WAIT, bound_pod, healthy_list, static_gpus};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{ContainerRole, Mib};
use gpushare_testkit::apiserver::ApiServer;
use gpushare_testkit::kubelet::{ContainerSpec, Kubelet};
use gpushare_testkit::notify::Notes;
use gpushared::allocation::ledger::Ledger;
use serde_json::json;

/// A host whose daemon reaches the API-server stand-in, with two 1000 MiB GPUs.
async fn host_with_api() -> (Host, ApiServer, std::path::PathBuf) {
    host_with(&static_gpus(&[(1000, None), (1000, None)])).await
}

/// A host whose daemon reaches the API-server stand-in, with `extra` configuration.
async fn host_with(extra: &str) -> (Host, ApiServer, std::path::PathBuf) {
    let host = Host::new();
    let api = ApiServer::start().await.unwrap();
    api.create_node(json!({"metadata": {"name": "node-a", "annotations": {"team": "ml"}}})).unwrap();
    let kubeconfig = host.path("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let config = host.config(&kubeconfig, "", extra);
    (host, api, config)
}

/// The node state on the Node, if published.
fn node_state(api: &ApiServer) -> Option<NodeState> {
    let node = api.node("node-a")?;
    let value = node["metadata"]["annotations"][NODE_STATE_KEY].as_str()?.to_owned();
    Some(NodeState::decode(&value).unwrap())
}

/// Waits until `ok` holds, polling every 20 ms.
async fn eventually<T>(what: &str, mut ok: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = ok() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Admits a named pod through the kubelet stand-in once the daemon has seen it bound.
async fn admit_named(kubelet: &Kubelet, name: &str, containers: &[ContainerSpec]) {
    let deadline = Instant::now() + WAIT;
    loop {
        match kubelet.admit_pod("default", name, containers).await {
            Ok(_) => return,
            Err(e) if Instant::now() < deadline && format!("{e:#}").contains("no pod bound") => {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            Err(e) => panic!("{e:#}"),
        }
    }
}

/// What PodResources reports for pod `default/<name>` whose container `main` holds `device_ids`.
fn held_by(name: &str, device_ids: Vec<String>) -> gpushare_proto::podresources::PodResources {
    gpushare_proto::podresources::PodResources {
        name: name.into(),
        namespace: "default".into(),
        containers: vec![gpushare_proto::podresources::ContainerResources {
            name: "main".into(),
            devices: vec![gpushare_proto::podresources::ContainerDevices {
                resource_name: "gpushare.io/gpu-mem".into(),
                device_ids: device_ids.into(),
                topology: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn ledger(host: &Host) -> Ledger {
    Ledger::open(&host.ledger()).unwrap().ledger
}

/// Admits a one-container pod of `mib` on GPU `gpu`, once the daemon has seen it; returns
/// the devices it received.
async fn place(api: &ApiServer, kubelet: &Kubelet, name: &str, gpu: u32, mib: u64) -> Vec<String> {
    place_on(api, kubelet, name, gpu, mib, common::uuid).await
}

/// [`place`] on GPUs whose UUIDs `uuid` gives by index.
async fn place_on(
    api: &ApiServer,
    kubelet: &Kubelet,
    name: &str,
    gpu: u32,
    mib: u64,
    uuid: impl Fn(u32) -> gpushare_core::GpuUuid,
) -> Vec<String> {
    common::bound_pod_on(api, name, &[("main", ContainerRole::App, &[(gpu, mib)])], uuid);
    let deadline = Instant::now() + WAIT;
    loop {
        match kubelet.admit(&[usize::try_from(mib).unwrap()]).await {
            Ok(mut admitted) => return admitted.remove(0).devices,
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
    let kept = {
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        let daemon = Daemon::start(&config, host.path("first.log"));
        kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
        let devices = place(&api, &kubelet, "kept", 0, 300).await;
        daemon.signal("TERM");
        kubelet.stop();
        devices
    };

    let notify = host.path("notify.sock");
    let notes = Notes::listen(&notify);
    let socket = host.plugin_dir().join("gpushared.sock");
    let mut daemon = Daemon::start_with_env(
        &config,
        host.path("second.log"),
        &[("NOTIFY_SOCKET", notify.to_str().unwrap()), ("WATCHDOG_USEC", "400000")],
    );
    // READY=1 comes once the ledger is restored and the socket serves; no kubelet is up yet.
    let ready = notes.wait_for("READY", WAIT, |m| m.starts_with("READY=1"));
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
    // It holds the first run's devices, as a kubelet restored from its checkpoint does.
    kubelet.inject_pod_resources(held_by("kept", kept));
    kubelet.wait_registered(1, WAIT).await.unwrap();
    notes.wait_for("serving status", WAIT, |m| m == "STATUS=serving 2 GPUs, 1 allocation");
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    place(&api, &kubelet, "more", 1, 200).await;
    notes.wait_for("status after an allocation", WAIT, |m| m == "STATUS=serving 2 GPUs, 2 allocations");

    // SIGTERM: STOPPING=1, the socket removed, exit 0.
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(WAIT), Some(0), "{}", daemon.log());
    notes.wait_for("STOPPING", WAIT, |m| m.starts_with("STOPPING=1\nSTATUS=stopping"));
    assert!(!socket.exists());
    // A clean stop logs no error (a reconciliation cut short by the stop is no failure).
    assert!(!daemon.log().contains(" ERROR "), "{}", daemon.log());
    let all = notes.all();
    assert_eq!(all.iter().filter(|m| m.starts_with("READY=1")).count(), 1, "{all:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_signal_while_starting_stops_it_cleanly() {
    // A "bus" that takes connections and never answers holds the start in its D-Bus wait (2 s),
    // after the plugin socket is bound and before READY.
    let host = Host::new();
    let silent = host.path("silent-bus");
    let _bus = std::os::unix::net::UnixListener::bind(&silent).unwrap();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    let extra = format!("{}\n[dbus]\naddress = \"unix:path={}\"\n", static_gpus(&[(1000, None)]), silent.display());
    let config = host.config(&kubeconfig, "", &extra);
    let socket = host.plugin_dir().join("gpushared.sock");
    let start = |name: &str| {
        let notify = host.path(&format!("{name}.sock"));
        let notes = Notes::listen(&notify);
        let env = [("NOTIFY_SOCKET", notify.to_str().unwrap())];
        (Daemon::start_with_env(&config, host.path(&format!("{name}.log")), &env), notes)
    };
    let stopped_cleanly = |daemon: &mut Daemon, notes: &Notes| {
        assert_eq!(daemon.wait_exit(WAIT), Some(0), "{}", daemon.log());
        notes.wait_for("STOPPING", WAIT, |m| m.starts_with("STOPPING=1\nSTATUS=stopping"));
        let all = notes.all();
        assert!(!all.iter().any(|m| m.starts_with("READY=1")), "never ready: {all:#?}");
        assert!(!socket.exists(), "the plugin socket is removed");
    };

    // SIGTERM in the D-Bus wait: the wait ends at once.
    let (mut daemon, notes) = start("in-the-wait");
    notes.wait_for("restoring the ledger", WAIT, |m| m == "STATUS=starting: restoring the ledger");
    eventually("the plugin socket", || socket.exists().then_some(())).await;
    daemon.signal("TERM");
    stopped_cleanly(&mut daemon, &notes);
    assert!(daemon.log().contains("a stop signal arrived while starting"), "{}", daemon.log());
    assert!(!daemon.log().contains("not up after 2 s"), "the wait was cut short: {}", daemon.log());

    // SIGTERM as soon as it starts (discovery, the ledger): caught, and the same clean stop.
    let (mut daemon, notes) = start("at-once");
    notes.wait_for("discovering GPUs", WAIT, |m| m == "STATUS=starting: discovering GPUs");
    daemon.signal("TERM");
    stopped_cleanly(&mut daemon, &notes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_other_annotations_leave_no_room_gets_nothing_until_they_shrink() {
    let host = Host::new();
    let api = ApiServer::start().await.unwrap();
    // Kubernetes limits all annotations of an object together (keys and values) to 256 KiB;
    // these leave 50 bytes, less than the node state needs even without holder lists.
    let blob = "x".repeat(262_144 - "team".len() - "ml".len() - "example.com/blob".len() - 50);
    api.create_node(json!({"metadata": {"name": "node-a", "annotations": {"team": "ml", "example.com/blob": blob}}}))
        .unwrap();
    let kubeconfig = host.path("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    // One heartbeat at start (refused too: no room), then none for an hour.
    let config = host.config(
        &kubeconfig,
        "",
        &format!("heartbeat_seconds = 3600\n{}", static_gpus(&[(1000, None), (1000, None)])),
    );
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    let log = eventually("the error", || {
        let log = daemon.log();
        log.contains("the node state does not fit beside the Node's other annotations").then_some(log)
    })
    .await;
    for part in ["262094 bytes of the Node's other annotations", "262144 bytes", "kubectl annotate node node-a KEY-"] {
        assert!(log.contains(part), "{part:?} in {log}");
    }
    // Nothing is written (the one PATCH is the heartbeat's), and the Node is read again only at
    // the longest backoff (10 s): one GET to check the ledger at start, one by the publisher.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let to_node =
        |method: &str| api.requests().iter().filter(|(m, p)| m == method && p.contains("/nodes/node-a")).count();
    assert_eq!(to_node("PATCH"), 1);
    assert_eq!(to_node("GET"), 2);
    assert!(node_state(&api).is_none());
    assert_eq!(daemon.log().matches("does not fit beside").count(), 1, "logged once: {}", daemon.log());

    // With room made, the next attempt publishes generation 1 beside the rest.
    api.patch(
        gpushare_testkit::apiserver::Kind::Node,
        "",
        "node-a",
        &json!({"metadata": {"annotations": {"example.com/blob": null}}}),
    )
    .unwrap();
    let state = eventually("the publication once there is room", || node_state(&api)).await;
    assert_eq!(state.generation, 1);
    assert_eq!(state.inventory.gpus().len(), 2);
    assert_eq!(api.node("node-a").unwrap()["metadata"]["annotations"]["team"], "ml");
    // Logged once the API server's answer is in (just after the Node has it).
    eventually("the log line", || daemon.log().contains("the node state fits again and is published").then_some(()))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_its_gpus_and_allocations_on_its_own_node() {
    let (host, api, config) = host_with_api().await;
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();

    let state = node_state;
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

    // API errors are retried with backoff: with its Node gone (404), the daemon keeps trying,
    // and publishes the current state once the Node is back.
    bound_pod(&api, "while-away", &[("main", ContainerRole::App, &[(1, 50)])]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    api.delete(gpushare_testkit::apiserver::Kind::Node, "", "node-a").unwrap();
    kubelet.admit(&[50]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(daemon.log().contains("cannot publish the node state; retrying"), "{}", daemon.log());
    api.create_node(json!({"metadata": {"name": "node-a"}})).unwrap();
    wait_state(&api, "the publication after the Node came back", &|s| s.allocations.len() == 12);
    api.delete_pod("default", "while-away").unwrap();
    wait_state(&api, "while-away released", &|s| s.allocations.len() == 11);

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_restart_is_followed_by_a_new_registration_within_a_second() {
    let (host, api, config) = host_with_api().await;
    let kubelet = Kubelet::start_with_pod_resources(&host.plugin_dir(), &host.pod_resources_socket()).await.unwrap();
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    bound_pod(&api, "before", &[("main", ContainerRole::App, &[(0, 300)])]);
    admit_named(&kubelet, "before", &[ContainerSpec::app("main", 300)]).await;

    for round in 1..=3 {
        let started = Instant::now();
        kubelet.restart().await.unwrap();
        kubelet
            .wait_registered_since_restart(1, Duration::from_secs(1))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}\n{}", daemon.log()));
        let took = started.elapsed();
        eprintln!("round {round}: registered again {took:?} after the kubelet restarted");
        assert!(took < Duration::from_secs(1), "round {round}: registered again after {took:?}");
        // ListAndWatch resumes with the full list; the kubelet kept the old one, unhealthy.
        kubelet
            .wait_devices(WAIT, healthy_list(2000))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}\n{}", daemon.log()));
    }
    // Nothing was lost, and admission works on the new connection.
    bound_pod(&api, "after", &[("main", ContainerRole::App, &[(1, 200)])]);
    admit_named(&kubelet, "after", &[ContainerSpec::app("main", 200)]).await;
    let live = ledger(&host).live().unwrap();
    let pods: Vec<&str> = live.iter().map(|r| r.pod.name.as_str()).collect();
    assert_eq!(pods, vec!["before", "after"]);
    assert!(daemon.log().contains("the plugin socket was removed (a kubelet restart?); serving on a new one"));
}

/// A kubelet that drops the plugin's stream and stays up (1.29's registration race after a
/// plugin restart) gets a new registration within a second, and the devices back; a kubelet
/// holding its stream gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_that_dropped_the_plugin_without_restarting_gets_a_new_registration() {
    let (host, api, config) = host_with_api().await;
    let kubelet = Kubelet::start_with_pod_resources(&host.plugin_dir(), &host.pod_resources_socket()).await.unwrap();
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| d.len() == 2000).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(kubelet.registrations().len(), 1, "a held stream needs no registration\n{}", daemon.log());

    for round in 1..=2 {
        let started = Instant::now();
        kubelet.disconnect_plugin();
        kubelet
            .wait_registered(1 + round, Duration::from_secs(2))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}\n{}", daemon.log()));
        eprintln!("round {round}: registered again {:?} after the kubelet dropped the plugin", started.elapsed());
        kubelet.wait_devices(WAIT, healthy_list(2000)).await.unwrap();
    }
    assert_eq!(kubelet.restarts(), 0);
    assert!(
        daemon.log().contains("the kubelet holds no device-list stream of this plugin; registering again"),
        "{}",
        daemon.log()
    );
    // Admission works on the new client.
    bound_pod(&api, "after", &[("main", ContainerRole::App, &[(1, 200)])]);
    admit_named(&kubelet, "after", &[ContainerSpec::app("main", 200)]).await;
    assert_eq!(kubelet.registrations().len(), 3, "{}", daemon.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciles_the_ledger_with_what_the_kubelet_holds() {
    let (host, api, config) = host_with(&format!(
        "{}\n[reconcile]\ninterval_seconds = 1\ngrace_seconds = 1\n",
        static_gpus(&[(1000, None), (1000, None)])
    ))
    .await;
    let kubelet = Kubelet::start_with_pod_resources(&host.plugin_dir(), &host.pod_resources_socket()).await.unwrap();
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    bound_pod(&api, "stays", &[("main", ContainerRole::App, &[(0, 300)])]);
    admit_named(&kubelet, "stays", &[ContainerSpec::app("main", 300)]).await;
    bound_pod(&api, "forgotten", &[("main", ContainerRole::App, &[(0, 200)])]);
    admit_named(&kubelet, "forgotten", &[ContainerSpec::app("main", 200)]).await;
    bound_pod(&api, "unlisted", &[("main", ContainerRole::App, &[(1, 150)])]);
    admit_named(&kubelet, "unlisted", &[ContainerSpec::app("main", 150)]).await;

    // "forgotten" is deleted while the daemon is down: its watch never sees the deletion.
    drop(daemon);
    api.delete_pod("default", "forgotten").unwrap();
    assert!(kubelet.remove_pod("default", "forgotten"));
    // The kubelet does not list "unlisted", which the API server still has running on this
    // node (as a restarting kubelet lists nothing at first): it is kept.
    assert!(kubelet.remove_pod("default", "unlisted"));
    let daemon = Daemon::start(&config, host.path("daemon-2.log"));
    // The kubelet holds devices on GPU1 for "adopted", which the ledger never saw.
    bound_pod(&api, "adopted", &[("main", ContainerRole::App, &[(1, 100)])]);
    let inventory = gpushare_core::NodeInventory::new(
        gpushare_core::MemoryUnit::Mib,
        (0..2).map(|i| gpushare_core::Gpu::new(i, common::uuid(i), "Tesla T4", Mib::new(1000))).collect(),
    )
    .unwrap();
    let ids: Vec<String> = gpushare_core::devices::DeviceMap::new(&inventory).ids(1).skip(500).take(100).collect();
    kubelet.inject_pod_resources(held_by("adopted", ids));

    let live = eventually("the repairs", || {
        let live = ledger(&host).live().unwrap();
        let names: Vec<String> = live.iter().map(|r| r.pod.name.clone()).collect();
        (names == ["stays", "unlisted", "adopted"]).then_some(live)
    })
    .await;
    assert_eq!((live[2].gpu_index, live[2].mib), (1, Mib::new(100)));
    let history = ledger(&host).all_since(0).unwrap();
    let forgotten = history.iter().find(|r| r.pod.name == "forgotten").unwrap();
    assert_eq!(
        forgotten.release_reason.as_deref(),
        Some("reconcile: the kubelet no longer runs this pod, and it is not running on this node")
    );
    let events: Vec<String> = ledger(&host)
        .events_since(0)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "reconcile")
        .map(|e| e.detail)
        .collect();
    assert!(events.iter().any(|e| e.starts_with("released default/forgotten container \"main\"")), "{events:?}");
    assert!(
        events.iter().any(|e| e.starts_with("adopted GPU1 100 MiB for default/adopted container \"main\"")),
        "{events:?}"
    );
    // The published state follows the repairs (the state before them also held three
    // allocations: wait for the repaired figures, not the count).
    let repaired = vec![Mib::new(300), Mib::new(250)];
    let state = eventually("the repaired annotation", || {
        node_state(&api).filter(|s| s.allocations.len() == 3 && s.used == repaired)
    })
    .await;
    assert_eq!(state.used, repaired);

    // "stays" finishes. The kubelet lists a finished pod until it is removed: its rows are
    // released, and reconciliation rounds after that do not book it again.
    api.patch_pod("default", "stays", &serde_json::json!({"status": {"phase": "Succeeded"}})).unwrap();
    eventually("the finished pod released", || {
        ledger(&host).live().unwrap().iter().all(|r| r.pod.name != "stays").then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(3500)).await; // three rounds of interval_seconds = 1
    let live: Vec<String> = ledger(&host).live().unwrap().into_iter().map(|r| r.pod.name).collect();
    assert_eq!(live, ["unlisted", "adopted"], "{}", daemon.log());
    drop(daemon);
}

/// A clean stop leaves everything in `ledger.db` (a lost `-wal` then loses nothing). A ledger
/// that lost what the node had published (the file truncated, with PodResources unreachable)
/// is reported, kept, rebuilt from the pods bound here before any call is served, and a pod
/// that would overcommit the GPU is then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_lost_allocations_is_rebuilt_before_serving() {
    let (host, api, config) = host_with(&static_gpus(&[(16_384, None), (16_384, None)])).await;
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let mut daemon = Daemon::start(&config, host.path("daemon-1.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    place(&api, &kubelet, "big", 0, 15_003).await;
    eventually("big published", || node_state(&api).filter(|s| s.used == [Mib::new(15_003), Mib::ZERO])).await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(WAIT), Some(0), "{}", daemon.log());
    let wal = std::path::PathBuf::from(format!("{}-wal", host.ledger().display()));
    assert!(std::fs::metadata(&wal).map_or(0, |m| m.len()) == 0, "the log was not emptied at stop");
    assert!(daemon.log().contains("ledger checkpointed into its file"), "{}", daemon.log());

    // The -wal and -shm files lost: nothing is, after a clean stop.
    let _ = std::fs::remove_file(&wal);
    let _ = std::fs::remove_file(format!("{}-shm", host.ledger().display()));
    assert_eq!(ledger(&host).live().unwrap().len(), 1);

    // The file truncated to 0 bytes: the daemon finds the ledger lacks what it published.
    std::fs::write(host.ledger(), b"").unwrap();
    let daemon = Daemon::start(&config, host.path("daemon-2.log"));
    // Opened here only once the daemon has migrated the empty file (two migrations of one
    // empty file at once would collide).
    eventually("the rebuild", || daemon.log().contains("the ledger is rebuilt").then_some(())).await;
    let live = eventually("the rebuilt ledger", || {
        let live = ledger(&host).live().unwrap();
        (!live.is_empty()).then_some(live)
    })
    .await;
    assert_eq!(
        live.iter().map(|r| (r.pod.name.as_str(), r.gpu_index, r.mib.get())).collect::<Vec<_>>(),
        [("big", 0, 15_003)]
    );
    let log = daemon.log();
    assert!(log.contains("THE ALLOCATION LEDGER LACKS ALLOCATIONS THIS NODE PUBLISHED"), "{log}");
    let dir = host.ledger().parent().unwrap().to_owned();
    let kept = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("ledger.db.incomplete-") && !name.ends_with("-wal"));
    assert_eq!(kept.count(), 1, "a copy of what was left is kept");
    let kinds: Vec<String> = ledger(&host).events_since(0).unwrap().into_iter().map(|e| e.kind).collect();
    assert!(
        kinds.contains(&"ledger-incomplete".to_owned()) && kinds.contains(&"ledger-rebuilt".to_owned()),
        "{kinds:?}"
    );
    // A 10 000 MiB pod assigned to the same GPU (the kubelet counts devices of both GPUs) is
    // refused: 15 003 of 16 384 are booked. The kubelet took the first daemon's devices as
    // unhealthy when its stream ended; they are back once the rebuilt daemon registers.
    kubelet.wait_registered(2, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| d.iter().any(|d| d.health == "Healthy")).await.unwrap();
    bound_pod(&api, "more", &[("main", ContainerRole::App, &[(0, 10_000)])]);
    let err = loop {
        let err = kubelet.admit(&[10_000]).await.unwrap_err().to_string();
        if !err.contains("no pod bound") {
            break err;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    };
    assert!(err.contains("ResourceExhausted") && err.contains("GPU0 has 1381 MiB free in the ledger"), "{err}");
    drop(daemon);
}

/// The daemon renews its heartbeat on its Node every `heartbeat_seconds`, beside the node
/// state, and nothing else on the Node is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_is_renewed_every_period() {
    use gpushare_core::codec::heartbeat::{HEARTBEAT_KEY, Heartbeat};
    let (host, api, config) = host_with(&format!("heartbeat_seconds = 1\n{}", static_gpus(&[(1000, None)]))).await;
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    let heartbeat = || {
        let node = api.node("node-a")?;
        Some(Heartbeat::decode(node["metadata"]["annotations"][HEARTBEAT_KEY].as_str()?).unwrap())
    };
    let first = eventually("the first heartbeat", heartbeat).await;
    assert_eq!(first.every_seconds, 1);
    let next = eventually("a renewal", || heartbeat().filter(|h| h.at_ms > first.at_ms)).await;
    assert!(next.at_ms - first.at_ms >= 900, "renewed after {} ms, every 1 s", next.at_ms - first.at_ms);
    assert_eq!(api.node("node-a").unwrap()["metadata"]["annotations"]["team"], "ml", "{}", daemon.log());
    drop(daemon);
}

mod health {
    //! GPU health through the fake NVML library's injected events.

    use super::*;
    use gpushare_testkit::nvml::{FakeGpu, build, events_directive, inject, write_config};

    /// A host on the fake NVML library with `gpus` and an event file, probed every second and
    /// recovering after 2 s quiet, its daemon reaching the API-server stand-in.
    struct NvmlHost {
        host: Host,
        api: ApiServer,
        config: std::path::PathBuf,
        nvml_config: std::path::PathBuf,
        events: std::path::PathBuf,
    }

    async fn nvml_host(gpus: &[FakeGpu]) -> NvmlHost {
        let host = Host::new();
        let lib = build(host.dir.path()).unwrap();
        let events = host.path("nvml-events");
        std::fs::write(&events, "").unwrap();
        let nvml_config = host.path("fake-nvml.conf");
        write_config(&nvml_config, gpus, &events_directive(&events)).unwrap();
        let api = ApiServer::start().await.unwrap();
        api.create_node(json!({"metadata": {"name": "node-a"}})).unwrap();
        let kubeconfig = host.path("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let extra = format!(
            "[nvml]\nlibrary = \"{}\"\n[health]\nprobe_interval_seconds = 1\nrecovery_seconds = 2\n",
            lib.display()
        );
        let config = host.config(&kubeconfig, "", &extra);
        NvmlHost { host, api, config, nvml_config, events }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn faults_withdraw_a_gpu_within_a_second_and_it_recovers_on_its_own() {
        let gpus = [FakeGpu::new("h", 0, 500, "Tesla T4"), FakeGpu::new("h", 1, 500, "Tesla T4")];
        let NvmlHost { host, api, config, nvml_config, events } = nvml_host(&gpus).await;
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        let daemon = Daemon::start_with_env(
            &config,
            host.path("daemon.log"),
            &[("FAKE_NVML_CONFIG", nvml_config.to_str().unwrap())],
        );
        kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        kubelet.wait_devices(WAIT, |d| d.len() == 1000).await.unwrap();
        let unhealthy = |d: &[gpushare_proto::deviceplugin::Device]| {
            d.iter().filter(|x| x.health == gpushare_proto::UNHEALTHY).count()
        };
        let gpu_health = |api: &ApiServer, i: usize| node_state(api).map(|s| s.inventory.gpus()[i].health.clone());

        // What a GPU is doing is sampled at each probe (1 s here) and published when it changes
        // meaningfully: 10 utilisation points, or 256 MiB (or 5 %) of memory in use.
        inject(&events, "util 0 55").unwrap();
        inject(&events, "used 0 300").unwrap();
        let activity = |api: &ApiServer| node_state(api).and_then(|s| s.inventory.gpus()[0].activity);
        let seen =
            eventually("GPU0's activity in the annotation", || activity(&api).filter(|a| a.in_use.get() == 300)).await;
        assert_eq!(seen.utilization, Some(55));
        inject(&events, "util 0 60").unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(activity(&api).and_then(|a| a.utilization), Some(55), "5 points is not news");
        inject(&events, "util 0 90").unwrap();
        eventually("the new utilisation", || (activity(&api)?.utilization == Some(90)).then_some(())).await;

        // An application Xid changes nothing.
        inject(&events, "xid 0 13").unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(unhealthy(&kubelet.devices()), 0);
        assert!(daemon.log().contains("application Xid error"), "{}", daemon.log());

        // Xid 79 (fallen off the bus): GPU1's 500 devices turn Unhealthy within a second.
        let started = Instant::now();
        inject(&events, "xid 1 79").unwrap();
        kubelet.wait_devices(Duration::from_secs(1), |d| unhealthy(d) == 500).await.unwrap_or_else(|e| {
            panic!("{e}\n{}", daemon.log());
        });
        let took = started.elapsed();
        let reason = eventually("the annotation", || match gpu_health(&api, 1) {
            Some(gpushare_core::Health::Unhealthy { reason }) => Some(reason),
            _ => None,
        })
        .await;
        assert_eq!(reason, "Xid 79");
        eprintln!("Xid 79: devices Unhealthy after {took:?}, annotation after {:?}", started.elapsed());
        assert!(started.elapsed() < Duration::from_secs(1), "annotation after {:?}", started.elapsed());
        assert!(took < Duration::from_secs(1));

        // Recovery: quiet for 2 s and answering a probe.
        kubelet.wait_devices(WAIT, |d| unhealthy(d) == 0).await.unwrap();
        assert!(started.elapsed() >= Duration::from_secs(2), "recovered after {:?}", started.elapsed());
        eventually("the healthy annotation", || (gpu_health(&api, 1)? == gpushare_core::Health::Healthy).then_some(()))
            .await;

        // A GPU that stops answering is found by the probe; it recovers once it answers again.
        inject(&events, "lost 0").unwrap();
        kubelet.wait_devices(Duration::from_secs(3), |d| unhealthy(d) == 500).await.unwrap();
        inject(&events, "recover 0").unwrap();
        kubelet.wait_devices(WAIT, |d| unhealthy(d) == 0).await.unwrap();

        // An uncorrectable ECC error, and every change is in the history.
        inject(&events, "ecc_dbe 1").unwrap();
        kubelet.wait_devices(Duration::from_secs(1), |d| unhealthy(d) == 500).await.unwrap();
        let history: Vec<String> = ledger(&host)
            .events_since(0)
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "health")
            .map(|e| e.detail)
            .collect();
        assert_eq!(history.len(), 5, "{history:#?}");
        assert!(history[0].starts_with("GPU1 (GPU-fake-h-1) is unhealthy: Xid 79"), "{history:#?}");
        assert!(history[1].starts_with("GPU1 (GPU-fake-h-1) is healthy again"), "{history:#?}");
        assert!(history[2].starts_with("GPU0 (GPU-fake-h-0) is unhealthy: does not answer"), "{history:#?}");
        assert!(history[4].ends_with("is unhealthy: uncorrectable ECC error"), "{history:#?}");
    }

    /// A GPU that does not answer when gpushared starts (fallen off the bus) does not stop the
    /// node: the others are served, and it is served unhealthy under the identity the ledger
    /// remembers, with its allocation kept, an event in the history, and its devices offered
    /// again once it answers (its Xid events watched again too).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gpu_lost_at_start_is_served_unhealthy_and_taken_back_when_it_answers() {
        let gpus = [FakeGpu::new("h", 0, 500, "Tesla T4"), FakeGpu::new("h", 1, 500, "NVIDIA A10")];
        let NvmlHost { host, api, config, nvml_config, events } = nvml_host(&gpus).await;
        let env = [("FAKE_NVML_CONFIG", nvml_config.to_str().unwrap())];
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        let unhealthy = |d: &[gpushare_proto::deviceplugin::Device]| {
            d.iter().filter(|x| x.health == gpushare_proto::UNHEALTHY).count()
        };

        // First start: both answer and are remembered; a pod holds 200 MiB of GPU1.
        let mut daemon = Daemon::start_with_env(&config, host.path("daemon-1.log"), &env);
        kubelet.wait_devices(WAIT, |d| d.len() == 1000).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        let fake_uuid = |i: u32| gpushare_core::GpuUuid::new(format!("GPU-fake-h-{i}")).unwrap();
        place_on(&api, &kubelet, "on-gpu1", 1, 200, fake_uuid).await;
        daemon.signal("TERM");
        assert_eq!(daemon.wait_exit(WAIT), Some(0), "{}", daemon.log());

        // GPU1 falls off the bus; the daemon starts again.
        inject(&events, "lost 1").unwrap();
        let daemon = Daemon::start_with_env(&config, host.path("daemon-2.log"), &env);
        kubelet
            .wait_devices(WAIT, |d| d.len() == 1000 && unhealthy(d) == 500)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        let state = eventually("GPU1 unhealthy in the annotation", || {
            node_state(&api).filter(|s| !s.inventory.gpus()[1].health.is_healthy())
        })
        .await;
        let gpu1 = &state.inventory.gpus()[1];
        assert_eq!((gpu1.uuid.as_str(), gpu1.model.as_str(), gpu1.total.get()), ("GPU-fake-h-1", "NVIDIA A10", 500));
        assert!(
            matches!(&gpu1.health, gpushare_core::Health::Unhealthy { reason } if reason.contains("does not answer")),
            "{:?}",
            gpu1.health
        );
        assert!(state.allocations.iter().any(|a| a.pod.name == "on-gpu1" && a.gpu == 1), "{state:?}");
        let lost: Vec<String> = ledger(&host)
            .events_since(0)
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "gpu-lost")
            .map(|e| e.detail)
            .collect();
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert!(lost[0].starts_with("GPU1 (GPU-fake-h-1, NVIDIA A10, 500 MiB) does not answer"), "{lost:?}");

        // Back on the bus: healthy once quiet for 2 s, and its Xid events are watched again.
        inject(&events, "recover 1").unwrap();
        kubelet.wait_devices(WAIT, |d| unhealthy(d) == 0).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        eventually("GPU1's events watched again", || daemon.log().contains("GPU answers again").then_some(())).await;
        inject(&events, "xid 1 79").unwrap();
        kubelet.wait_devices(Duration::from_secs(2), |d| unhealthy(d) == 500).await.unwrap_or_else(|e| {
            panic!("{e}\n{}", daemon.log());
        });
    }
}

mod overuse {
    //! Over-use detection: processes injected into the fake NVML library, their cgroups in a
    //! stand-in `/proc`, the budgets from the ledger, evictions through the API-server stand-in.

    use super::*;
    use gpushare_testkit::nvml::{FakeGpu, build, events_directive, inject, write_config};

    const CID: &str = "4f2a9c0d1e2b3a4f5e6d7c8b9a0f1e2d3c4b5a69788796a5b4c3d2e1f0a1b2c3";

    /// `<proc>/<pid>/cgroup` for a process of pod `uid` (systemd driver, containerd).
    fn cgroup(proc: &std::path::Path, pid: u32, uid: &str, container_id: &str) {
        let dir = proc.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let slice = format!("kubepods-burstable-pod{}.slice", uid.replace('-', "_"));
        let text = format!("0::/kubepods.slice/kubepods-burstable.slice/{slice}/cri-containerd-{container_id}.scope\n");
        std::fs::write(dir.join("cgroup"), text).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_container_over_budget_is_recorded_published_and_evicted() {
        let host = Host::new();
        let lib = build(host.dir.path()).unwrap();
        let events = host.path("nvml-events");
        std::fs::write(&events, "").unwrap();
        let nvml_config = host.path("fake-nvml.conf");
        // GPU2 is served through DRA: its claims' memory has no container budget to check.
        let gpus: Vec<FakeGpu> = (0..3)
            .map(|i| FakeGpu { uuid: common::uuid(i).to_string(), ..FakeGpu::new("h", i, 1000, "Tesla T4") })
            .collect();
        write_config(&nvml_config, &gpus, &events_directive(&events)).unwrap();
        let proc = host.path("proc");
        let api = ApiServer::start().await.unwrap();
        api.create_node(json!({"metadata": {"name": "node-a"}})).unwrap();
        let kubeconfig = host.path("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let extra = format!(
            "[nvml]\nlibrary = \"{}\"\n[overuse]\ninterval_seconds = 1\ntolerance_mib = 50\naction = \"evict\"\n\
             evict_after_seconds = 3\nproc_directory = \"{}\"\n[sharing]\ndra = [2]\n\
             [dra]\nregistry_dir = \"{}\"\nplugin_dir = \"{}\"\ncdi_dir = \"{}\"\n",
            lib.display(),
            proc.display(),
            host.path("plugins_registry").display(),
            host.path("dra-plugin").display(),
            host.path("cdi").display()
        );
        let config = host.config(&kubeconfig, "", &extra);
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        let daemon = Daemon::start_with_env(
            &config,
            host.path("daemon.log"),
            &[("FAKE_NVML_CONFIG", nvml_config.to_str().unwrap())],
        );
        kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        kubelet.wait_devices(WAIT, |d| d.len() == 2000).await.unwrap();

        // "train" holds 300 MiB of GPU0; its container's runtime ID reaches the daemon through
        // the pod's status, as the kubelet writes it.
        place(&api, &kubelet, "train", 0, 300).await;
        let train_uid = api.pod("default", "train").unwrap()["metadata"]["uid"].as_str().unwrap().to_owned();
        api.patch_pod(
            "default",
            "train",
            &json!({"status": {"phase": "Running",
                    "containerStatuses": [{"name": "main", "containerID": format!("containerd://{CID}")}]}}),
        )
        .unwrap();
        // "rogue" asks for no GPU memory, yet runs on GPU1 (it set NVIDIA_VISIBLE_DEVICES itself).
        api.create_pod(
            "default",
            json!({"metadata": {"name": "rogue"}, "spec": {"nodeName": "node-a",
            "containers": [{"name": "app", "image": "x"}]}}),
        )
        .unwrap();
        let rogue_uid = api.pod("default", "rogue").unwrap()["metadata"]["uid"].as_str().unwrap().to_owned();
        cgroup(&proc, 4242, &train_uid, CID);
        cgroup(&proc, 4243, &train_uid, CID);
        cgroup(&proc, 5151, &rogue_uid, "aaaabbbbccccddddeeeeffff000011112222333344445555666677778888999a");
        // A host process (the MPS server, a monitoring agent) is nobody's.
        std::fs::create_dir_all(proc.join("77")).unwrap();
        std::fs::write(proc.join("77/cgroup"), "0::/system.slice/nvidia-persistenced.service\n").unwrap();

        // Within budget (300 + 50 of tolerance): nothing.
        inject(&events, "proc 0 4242 200").unwrap();
        inject(&events, "proc 0 4243 140").unwrap();
        inject(&events, "proc 0 77 600").unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let over = |api: &ApiServer| node_state(api).map(|s| s.over_budget).unwrap_or_default();
        assert!(over(&api).is_empty(), "{:?}\n{}", over(&api), daemon.log());

        // 200 + 250 = 450 MiB of a 300 MiB budget; and the rogue pod on GPU1. A DRA claim's
        // container on GPU2 (here the rogue pod's cgroup) is not reported.
        inject(&events, "proc 0 4243 250").unwrap();
        inject(&events, "proc 1 5151 100").unwrap();
        inject(&events, "proc 2 5151 700").unwrap();
        let seen = eventually("both in the node annotation", || {
            let o = over(&api);
            (o.len() == 2).then_some(o)
        })
        .await;
        let train = seen.iter().find(|o| o.pod.name == "train").unwrap();
        assert_eq!(
            (train.container.as_str(), train.gpu, train.in_use, train.budget),
            ("main", 0, Mib::new(450), Mib::new(300))
        );
        let rogue = seen.iter().find(|o| o.pod.name == "rogue").unwrap();
        assert_eq!(
            (rogue.container.as_str(), rogue.gpu, rogue.in_use, rogue.budget),
            ("", 1, Mib::new(100), Mib::ZERO)
        );

        // Over for 3 s: "train" is evicted through the API; "rogue", with no budget, is not.
        eventually("train evicted", || api.pod("default", "train").is_none().then_some(())).await;
        let evictions: Vec<(String, String)> =
            api.requests().into_iter().filter(|(_, path)| path.ends_with("/eviction")).collect();
        assert_eq!(evictions, vec![("POST".to_owned(), "/api/v1/namespaces/default/pods/train/eviction".to_owned())]);
        let history = |kind: &str| -> Vec<String> {
            ledger(&host).events_since(0).unwrap().into_iter().filter(|e| e.kind == kind).map(|e| e.detail).collect()
        };
        let evicted = eventually("the eviction in the history", || {
            let h = history("evicted");
            (!h.is_empty()).then_some(h)
        })
        .await;
        assert!(
            evicted[0].starts_with(
                "default/train: default/train container \"main\" uses 450 MiB on GPU0, over its budget of 300 MiB, for "
            ),
            "{evicted:?}"
        );
        let began = history("over-budget");
        assert_eq!(began.len(), 2, "{began:?}");
        assert!(began.contains(&"default/rogue uses 100 MiB on GPU1 without a budget there".to_owned()), "{began:?}");

        // The evicted pod's processes end; it leaves the list, and the history says so.
        inject(&events, "proc_end 0 4242").unwrap();
        inject(&events, "proc_end 0 4243").unwrap();
        eventually("train gone from the list", || (over(&api).len() == 1).then_some(())).await;
        let ended = history("within-budget");
        assert_eq!(ended.len(), 1, "{ended:?}");
        assert!(ended[0].starts_with("default/train container \"main\""), "{ended:?}");
        assert!(api.pod("default", "rogue").is_some(), "a pod without a budget is never evicted");
        assert!(daemon.log().contains("container over its GPU memory budget"), "{}", daemon.log());
        drop(daemon);
    }
}

mod whole {
    //! Whole GPUs beside the shares: `[sharing] whole` GPUs as a second resource, through the
    //! kubelet stand-in serving both resources.

    use super::*;
    use gpushare_core::SharingMode;

    const WHOLE: &str = "gpushare.io/gpu";

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_whole_gpu_is_a_second_resource_and_never_a_share() {
        let gpus = static_gpus(&[(1000, None), (1000, Some(1)), (1000, None)]);
        let (host, api, config) = host_with(&format!("[sharing]\nwhole = [1, \"GPU-static-2\"]\n{gpus}")).await;
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        kubelet.also_serve(WHOLE);
        let daemon = Daemon::start(&config, host.path("daemon.log"));
        kubelet.wait_registered(2, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        let registrations = kubelet.registrations();
        let whole = registrations.iter().find(|r| r.resource_name == WHOLE).unwrap();
        assert_eq!(whole.endpoint, "gpushared-whole.sock");
        assert!(!whole.options.unwrap().get_preferred_allocation_available);
        assert!(
            registrations.iter().any(|r| r.resource_name == "gpushare.io/gpu-mem" && r.endpoint == "gpushared.sock")
        );

        // The memory resource offers GPU0 only; the whole resource GPU1 and GPU2, by UUID.
        kubelet.wait_devices(WAIT, |d| d.len() == 1000).await.unwrap();
        let list = kubelet.wait_devices_of(WHOLE, WAIT, |d| d.len() == 2).await.unwrap();
        let ids: Vec<(&str, &str)> = list.iter().map(|d| (d.id.as_str(), d.health.as_str())).collect();
        assert_eq!(ids, vec![("GPU-static-1", "Healthy"), ("GPU-static-2", "Healthy")]);
        assert_eq!(list[0].topology.as_ref().unwrap().nodes[0].id, 1, "NUMA node published");

        // Allocate: the GPUs' UUIDs, and a line in the history.
        let envs = kubelet.allocate_of(WHOLE, &["GPU-static-1".into(), "GPU-static-2".into()]).await.unwrap();
        assert_eq!(envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-static-1,GPU-static-2"));
        let err = kubelet.allocate_of(WHOLE, &["GPU-static-0".into()]).await.unwrap_err().to_string();
        assert!(err.contains("InvalidArgument") && err.contains("is shared, not handed out whole"), "{err}");
        let err = kubelet.allocate_of(WHOLE, &["GPU-nope".into()]).await.unwrap_err().to_string();
        assert!(err.contains("\"GPU-nope\" is not a GPU of this node"), "{err}");
        let history: Vec<String> = ledger(&host)
            .events_since(0)
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "whole-allocated")
            .map(|e| e.detail)
            .collect();
        assert_eq!(history, vec!["GPU1 (GPU-static-1), GPU2 (GPU-static-2) handed out whole".to_owned()]);

        // A ledger the daemon cannot write (another writer holds it past the busy timeout): the
        // hand-out is refused as UNAVAILABLE, so the kubelet retries, and answered once it can.
        let blocker = rusqlite::Connection::open(host.ledger()).unwrap();
        blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
        let err = kubelet.allocate_of(WHOLE, &["GPU-static-1".into()]).await.unwrap_err().to_string();
        assert!(err.contains("Unavailable") && err.contains("the ledger cannot record it"), "{err}");
        blocker.execute_batch("ROLLBACK").unwrap();
        drop(blocker);
        let envs = kubelet.allocate_of(WHOLE, &["GPU-static-1".into()]).await.unwrap();
        assert_eq!(envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-static-1"));

        // The node annotation says so: the extender places no share there.
        let state = eventually("the node state", || node_state(&api)).await;
        let modes: Vec<SharingMode> = state.inventory.gpus().iter().map(|g| g.mode).collect();
        assert_eq!(modes, vec![SharingMode::Shared, SharingMode::Whole, SharingMode::Whole]);
        assert_eq!(state.inventory.schedulable_capacity(), Mib::new(1000));

        // A kubelet restart: both resources register again.
        kubelet.restart().await.unwrap();
        kubelet.wait_registered_since_restart(2, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        kubelet.wait_devices_of(WHOLE, WAIT, healthy_list(2)).await.unwrap();
        kubelet.wait_devices(WAIT, healthy_list(1000)).await.unwrap();

        // A kubelet that drops both clients and stays up: both resources register again.
        let before = kubelet.registrations().len();
        kubelet.disconnect_plugin();
        kubelet.wait_registered(before + 2, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        kubelet.wait_devices_of(WHOLE, WAIT, healthy_list(2)).await.unwrap();
        kubelet.wait_devices(WAIT, healthy_list(1000)).await.unwrap();
        assert!(daemon.log().contains("the kubelet holds no whole-GPU device-list stream; registering again"));

        // Stopping removes both sockets.
        let mut daemon = daemon;
        daemon.signal("TERM");
        assert_eq!(daemon.wait_exit(WAIT), Some(0), "{}", daemon.log());
        assert!(!host.plugin_dir().join("gpushared-whole.sock").exists());
        assert!(!host.plugin_dir().join("gpushared.sock").exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gpu_cannot_be_both_mps_and_whole() {
        let gpus = static_gpus(&[(1000, None), (1000, None)]);
        let (host, _api, config) =
            host_with(&format!("[sharing]\nwhole = [1]\nmps = [\"GPU-static-1\"]\n{gpus}")).await;
        let mut daemon = Daemon::start(&config, host.path("daemon.log"));
        let code = daemon.wait_exit(WAIT);
        assert!(code.is_some_and(|c| c != 0), "{code:?}");
        assert!(daemon.log().contains("names GPU 1 (GPU-static-1) in mps and whole"), "{}", daemon.log());
    }
}
