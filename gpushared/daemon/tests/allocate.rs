//! Allocate end to end: the daemon binary, the API-server stand-in holding pods bound to the
//! node with their `gpushare.io/assignment`, and the kubelet stand-in admitting them through
//! the device plugin socket. Every request shape, repeats, an API-server outage, a pod watch
//! lagging behind the kubelet, look-alikes in the kubelet's order, refusals, releases, and
//! SIGKILL in the middle of an admission burst.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{Daemon, Host, WAIT, assigned_pod, bound_pod, static_gpus};
use gpushare_core::ContainerRole;
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_testkit::apiserver::ApiServer;
use gpushare_testkit::kubelet::Kubelet;
use gpushared::allocation::ledger::{Ledger, request_key};
use serde_json::json;

/// Pods in the SIGKILL burst.
const PODS: usize = 40;

struct Cluster {
    host: Host,
    api: ApiServer,
    kubelet: Kubelet,
    config: std::path::PathBuf,
    /// The relay the daemon's API connection goes through, when it lags.
    _lag: Option<gpushare_testkit::lag::Lag>,
}

/// A node with `gpus` (MiB each) served by a daemon, with the stand-ins around it.
async fn cluster(gpus: &[u64]) -> (Cluster, Daemon) {
    cluster_with(gpus, "").await
}

/// The same with `extra` configuration after the GPU list.
async fn cluster_with(gpus: &[u64], extra: &str) -> (Cluster, Daemon) {
    cluster_lagging(gpus, extra, None).await
}

/// The same with the daemon's API answers held back by `lag`: its pod watch lags behind the
/// kubelet (the test), which admits pods as soon as they are bound.
async fn cluster_lagging(gpus: &[u64], extra: &str, lag: Option<Duration>) -> (Cluster, Daemon) {
    cluster_of(gpus, extra, lag, false, "").await
}

/// The same, with the kubelet's PodResources served (`listing`) or not, and `kubelet` (lines)
/// in the configuration's `[kubelet]` table.
async fn cluster_of(
    gpus: &[u64],
    extra: &str,
    lag: Option<Duration>,
    listing: bool,
    kubelet: &str,
) -> (Cluster, Daemon) {
    let host = Host::new();
    let api = ApiServer::start().await.unwrap();
    api.create_node(json!({"metadata": {"name": "node-a"}})).unwrap();
    let (kubeconfig, lag) = match lag {
        Some(delay) => {
            let lag = gpushare_testkit::lag::Lag::start(api.addr(), delay).await.unwrap();
            (host.kubeconfig(&lag.url()), Some(lag))
        }
        None => {
            let kubeconfig = host.path("kubeconfig");
            api.write_kubeconfig(&kubeconfig).unwrap();
            (kubeconfig, None)
        }
    };
    let gpus: Vec<(u64, Option<u32>)> = gpus.iter().map(|m| (*m, None)).collect();
    let config = host.config_kubelet(&kubeconfig, "", kubelet, &format!("{}{extra}", static_gpus(&gpus)));
    let kubelet = if listing {
        Kubelet::start_with_pod_resources(&host.plugin_dir(), &host.pod_resources_socket()).await.unwrap()
    } else {
        Kubelet::start(&host.plugin_dir()).await.unwrap()
    };
    let daemon = Daemon::start(&config, host.path("daemon-1.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    (Cluster { host, api, kubelet, config, _lag: lag }, daemon)
}

/// Admits one pod's containers, retrying while the daemon has not yet seen the pod.
async fn admit(c: &Cluster, sizes: &[usize]) -> Vec<gpushare_testkit::kubelet::Admitted> {
    let deadline = Instant::now() + WAIT;
    loop {
        match c.kubelet.admit(sizes).await {
            Ok(a) => return a,
            Err(e) if Instant::now() < deadline && e.to_string().contains("no pod bound") => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

fn ledger_of(c: &Cluster) -> Ledger {
    Ledger::open(&c.host.ledger()).unwrap().ledger
}

/// `[kubelet] environment = "lean"`: the kubelet gets answers with only what places and
/// bounds the container, so each of its checkpoint rewrites carries less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lean_environment_answers_only_what_places_and_bounds_the_container() {
    let (c, _daemon) = cluster_of(&[1000, 1000], "", None, false, "environment = \"lean\"").await;
    bound_pod(&c.api, "lean", &[("main", ContainerRole::App, &[(1, 300)])]);
    let a = admit(&c, &[300]).await;
    let names: Vec<&str> = a[0].envs.keys().map(String::as_str).collect();
    assert_eq!(names, ["CUDA_DEVICE_MEMORY_LIMIT_0", "GPUSHARE_CONTAINER", "GPUSHARE_POD", "NVIDIA_VISIBLE_DEVICES"]);
    assert_eq!(a[0].envs["NVIDIA_VISIBLE_DEVICES"], "GPU-static-1");
    assert_eq!(a[0].envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "300m");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_shape_lands_on_its_assigned_gpu() {
    let (c, daemon) = cluster(&[1000, 1000, 1000]).await;
    bound_pod(&c.api, "single", &[("main", ContainerRole::App, &[(2, 350)])]);
    let a = admit(&c, &[350]).await;
    assert_eq!(a[0].envs["NVIDIA_VISIBLE_DEVICES"], "GPU-static-2");
    assert_eq!(a[0].envs["GPUSHARE_MEMORY_MIB"], "350");
    assert_eq!(a[0].envs["GPUSHARE_POD"], "default/single");

    // Two equal pods bound together, on different GPUs: each gets its own.
    bound_pod(&c.api, "twin-a", &[("main", ContainerRole::App, &[(0, 200)])]);
    tokio::time::sleep(Duration::from_millis(1100)).await; // a later creation second
    bound_pod(&c.api, "twin-b", &[("main", ContainerRole::App, &[(1, 200)])]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = admit(&c, &[200]).await;
    let second = admit(&c, &[200]).await;
    assert_eq!(
        (first[0].envs["GPUSHARE_POD"].as_str(), first[0].envs["NVIDIA_VISIBLE_DEVICES"].as_str()),
        ("default/twin-a", "GPU-static-0")
    );
    assert_eq!(
        (second[0].envs["GPUSHARE_POD"].as_str(), second[0].envs["NVIDIA_VISIBLE_DEVICES"].as_str()),
        ("default/twin-b", "GPU-static-1")
    );

    // Init container, then two app containers on different GPUs.
    bound_pod(
        &c.api,
        "multi",
        &[
            ("fetch", ContainerRole::Init, &[(0, 100)]),
            ("model", ContainerRole::App, &[(0, 300)]),
            ("tokenizer", ContainerRole::App, &[(1, 50)]),
        ],
    );
    let m = admit(&c, &[100, 300, 50]).await;
    let got: Vec<(&str, &str)> =
        m.iter().map(|a| (a.envs["GPUSHARE_CONTAINER"].as_str(), a.envs["NVIDIA_VISIBLE_DEVICES"].as_str())).collect();
    assert_eq!(got, [("fetch", "GPU-static-0"), ("model", "GPU-static-0"), ("tokenizer", "GPU-static-1")]);

    // One container over two GPUs.
    bound_pod(&c.api, "train", &[("trainer", ContainerRole::App, &[(1, 150), (2, 150)])]);
    let t = admit(&c, &[300]).await;
    assert_eq!(t[0].envs["NVIDIA_VISIBLE_DEVICES"], "GPU-static-1,GPU-static-2");
    assert_eq!(t[0].envs["GPUSHARE_MEMORY_MIB"], "150");

    // The same devices again: the same answer, nothing new in the ledger.
    let again = c.kubelet.allocate(&t[0].devices).await.unwrap();
    assert_eq!(again, t[0].envs);
    let live = ledger_of(&c).live().unwrap();
    assert_eq!(live.len(), 1 + 2 + 3 + 2, "{live:?}");
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_gpus_give_their_clients_pinned_memory_threads_and_the_pipe_directory() {
    let pipes = tempfile::tempdir().unwrap();
    let env_file = pipes.path().join("run/mps.env");
    let extra = format!(
        "[sharing]\nmps = [\"GPU-static-1\", 2]\n[mps]\npipe_directory = \"{}\"\nenvironment_file = \"{}\"\n",
        pipes.path().display(),
        env_file.display()
    );
    let (c, daemon) = cluster_with(&[1000, 1000, 1000], &extra).await;
    // Written before READY, for gpushared-mps.service: the MPS GPUs and the pipe directory.
    let env = std::fs::read_to_string(&env_file).unwrap();
    assert!(env.contains("\nCUDA_VISIBLE_DEVICES=GPU-static-1,GPU-static-2\n"), "{env}");
    assert!(env.contains(&format!("\nCUDA_MPS_PIPE_DIRECTORY={}\n", pipes.path().display())), "{env}");

    // A shared GPU: the budget as environment (gpushare's and HAMi-core's), no MPS, no mount.
    bound_pod(&c.api, "shared", &[("main", ContainerRole::App, &[(0, 300)])]);
    let s = admit(&c, &[300]).await;
    assert_eq!(s[0].envs["NVIDIA_VISIBLE_DEVICES"], "GPU-static-0");
    assert_eq!(s[0].envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "300m");
    assert!(!s[0].envs.keys().any(|k| k.starts_with("CUDA_MPS_")), "{:?}", s[0].envs);
    assert!(s[0].mounts.is_empty(), "{:?}", s[0].mounts);

    // An MPS GPU (named by UUID): pinned memory, a proportional thread share (300 of 1000 MiB),
    // the pipe directory mounted at the same path.
    bound_pod(&c.api, "mps", &[("main", ContainerRole::App, &[(1, 300)])]);
    let m = admit(&c, &[300]).await;
    let dir = pipes.path().display().to_string();
    assert_eq!(m[0].envs["NVIDIA_VISIBLE_DEVICES"], "GPU-static-1");
    assert_eq!(m[0].envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "300m");
    assert_eq!(m[0].envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=300M");
    assert_eq!(m[0].envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
    assert_eq!(m[0].envs["CUDA_MPS_PIPE_DIRECTORY"], dir);
    // Read-only: the client reaches the control daemon but cannot replace its sockets.
    assert_eq!(m[0].mounts, [format!("{dir}:{dir}:ro")]);

    // Two MPS GPUs (the second named by index): one limit per device ordinal.
    bound_pod(&c.api, "mps-two", &[("main", ContainerRole::App, &[(1, 100), (2, 100)])]);
    let t = admit(&c, &[200]).await;
    assert_eq!(t[0].envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=100M,1=100M");
    assert_eq!(t[0].envs["CUDA_DEVICE_MEMORY_LIMIT_1"], "100m");
    assert_eq!(t[0].mounts.len(), 1);

    // Spanning a shared and an MPS GPU: served as shared (no MPS client for part of a container).
    bound_pod(&c.api, "mixed", &[("main", ContainerRole::App, &[(0, 100), (1, 100)])]);
    let x = admit(&c, &[200]).await;
    assert!(!x[0].envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"), "{:?}", x[0].envs);
    assert!(x[0].mounts.is_empty());

    // The node annotation says which GPUs are MPS.
    let deadline = Instant::now() + WAIT;
    loop {
        let node = c.api.get(gpushare_testkit::apiserver::Kind::Node, "", "node-a").unwrap();
        let state = node["metadata"]["annotations"][NODE_STATE_KEY].as_str().map(NodeState::decode);
        if let Some(Ok(state)) = state {
            let modes: Vec<&str> = state.inventory.gpus().iter().map(|g| g.mode.as_str()).collect();
            assert_eq!(modes, ["shared", "mps", "mps"]);
            break;
        }
        assert!(Instant::now() < deadline, "no node state published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mps_gpu_the_host_lacks_stops_the_daemon_with_the_gpus_it_has() {
    let host = Host::new();
    let config = host.config(
        &host.path("kubeconfig"),
        "",
        &format!("{}[sharing]\nmps = [\"GPU-nope\"]\n", static_gpus(&[(1000, None)])),
    );
    let mut daemon = Daemon::start(&config, host.path("daemon.log"));
    assert_eq!(daemon.wait_exit(WAIT), Some(1), "{}", daemon.log());
    assert!(
        daemon
            .log()
            .contains("[sharing] mps names GPU GPU-nope, which this host does not have; its GPUs are 0 (GPU-static-0)"),
        "{}",
        daemon.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_during_an_api_server_outage_waits_for_a_read_of_the_nodes_pods() {
    let (c, daemon) = cluster(&[1000]).await;
    bound_pod(&c.api, "p1", &[("main", ContainerRole::App, &[(0, 100)])]);
    bound_pod(&c.api, "p2", &[("main", ContainerRole::App, &[(0, 120)])]);
    bound_pod(&c.api, "p3", &[("main", ContainerRole::App, &[(0, 130)])]);
    admit(&c, &[100]).await;
    // The watch has p2, but the kubelet's may have more: the call waits for the API server.
    c.api.set_available(false);
    let asked = Instant::now();
    let (answer, ()) = tokio::join!(c.kubelet.admit(&[120]), async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        c.api.set_available(true);
    });
    let a = answer.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    assert!(asked.elapsed() >= Duration::from_secs(1), "answered without reading the node's pods");
    assert_eq!(a[0].envs["GPUSHARE_POD"], "default/p2");
    // An outage that outlasts the wait fails the admission, saying why.
    c.api.set_available(false);
    let err = c.kubelet.admit(&[130]).await.unwrap_err().to_string();
    c.api.set_available(true);
    assert!(err.contains("Unavailable") && err.contains("cannot tell which pod the kubelet is admitting"), "{err}");
    admit(&c, &[130]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_watch_lagging_behind_the_kubelet_never_serves_the_wrong_pod() {
    const LAG: Duration = Duration::from_millis(1500);
    let (c, daemon) = cluster_lagging(&[1000, 1000], "", Some(LAG)).await;
    // x is created first and bound last; y waits, bound, seen by the daemon's watch. The
    // kubelet, handed both at once (after its own restart, say), admits the older first: x,
    // which the daemon's watch delivers only 1.5 s later.
    assigned_pod(&c.api, "x", None, &[("main", ContainerRole::App, &[(1, 200)])], common::uuid);
    tokio::time::sleep(Duration::from_millis(1100)).await; // a later creation second
    bound_pod(&c.api, "y", &[("main", ContainerRole::App, &[(0, 200)])]);
    tokio::time::sleep(LAG + Duration::from_secs(1)).await;
    c.api.patch_pod("default", "x", &json!({"spec": {"nodeName": "node-a"}})).unwrap();
    let first = c.kubelet.admit(&[200]).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    let second = c.kubelet.admit(&[200]).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    let got = |a: &[gpushare_testkit::kubelet::Admitted]| {
        (a[0].envs["GPUSHARE_POD"].clone(), a[0].envs["NVIDIA_VISIBLE_DEVICES"].clone())
    };
    assert_eq!(got(&first), ("default/x".into(), "GPU-static-1".into()), "{}", daemon.log());
    assert_eq!(got(&second), ("default/y".into(), "GPU-static-0".into()), "{}", daemon.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_watch_reads_the_pod_the_kubelet_names() {
    const LAG: Duration = Duration::from_millis(1500);
    let (c, daemon) = cluster_of(&[1000, 1000], "", Some(LAG), true, "").await;
    wait_telling_apart(&c, &daemon).await;
    // y is bound and seen; x, a look-alike on the other GPU, is bound as the kubelet admits it,
    // 1.5 s before the daemon's watch can deliver it. The kubelet names x; the daemon reads x.
    bound_pod(&c.api, "y", &[("main", ContainerRole::App, &[(0, 200)])]);
    tokio::time::sleep(LAG + Duration::from_secs(1)).await;
    bound_pod(&c.api, "x", &[("main", ContainerRole::App, &[(1, 200)])]);
    admit_named(&c, &daemon, &[("x", "GPU-static-1"), ("y", "GPU-static-0")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_the_node_authorizer_hides_yet_is_read_from_the_node_list() {
    let (c, daemon) = cluster_of(&[1000, 1000], "", None, true, "").await;
    wait_telling_apart(&c, &daemon).await;
    bound_pod(&c.api, "y", &[("main", ContainerRole::App, &[(0, 200)])]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // As with a burst's first pods on a real API server: x is bound as the kubelet admits it,
    // the daemon's watch has not delivered it yet, and the Node authorizer's graph has not
    // caught up with the binding, so a GET of x (or of y) is refused with 403. That proves
    // nothing about the pod: the daemon reads the node's pods by list instead, which the
    // authorizer allows.
    c.api.hold_watch_events(true);
    c.api.set_pod_gets_forbidden(true);
    bound_pod(&c.api, "x", &[("main", ContainerRole::App, &[(1, 200)])]);
    admit_named(&c, &daemon, &[("x", "GPU-static-1")]).await;
    c.api.hold_watch_events(false);
    c.api.set_pod_gets_forbidden(false);
    admit_named(&c, &daemon, &[("y", "GPU-static-0")]).await;
}

/// Has the kubelet admit each named pod (one container of 200 MiB) in turn, and checks that
/// the daemon served it, on the GPU given.
async fn admit_named(c: &Cluster, daemon: &Daemon, pods: &[(&str, &str)]) {
    use gpushare_testkit::kubelet::ContainerSpec;
    for &(name, gpu) in pods {
        let got = c
            .kubelet
            .admit_pod("default", name, &[ContainerSpec::app("main", 200)])
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", daemon.log()));
        assert_eq!(got[0].envs["GPUSHARE_POD"], format!("default/{name}"), "{}", daemon.log());
        assert_eq!(got[0].envs["NVIDIA_VISIBLE_DEVICES"], gpu, "{name}");
    }
}

/// Waits for the daemon to publish that it tells look-alikes apart (the kubelet's PodResources
/// answered it).
async fn wait_telling_apart(c: &Cluster, daemon: &Daemon) {
    let deadline = Instant::now() + WAIT;
    loop {
        let node = c.api.node("node-a").unwrap();
        let state = node["metadata"]["annotations"][NODE_STATE_KEY].as_str().map(NodeState::decode);
        if let Some(Ok(s)) = state
            && s.tells_lookalikes_apart
        {
            return;
        }
        assert!(Instant::now() < deadline, "never published telling look-alikes apart\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn look_alikes_created_in_one_second_are_served_in_the_order_they_were_bound() {
    let (c, daemon) = cluster(&[1000]).await;
    // Bound one after the other within a second, named against that order: the kubelet's
    // watch delivers tie-b first, and the kubelet admits it first.
    bound_pod(&c.api, "tie-b", &[("main", ContainerRole::App, &[(0, 200)])]);
    bound_pod(&c.api, "tie-a", &[("main", ContainerRole::App, &[(0, 200)])]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = admit(&c, &[200]).await;
    let second = admit(&c, &[200]).await;
    assert_eq!(first[0].envs["GPUSHARE_POD"], "default/tie-b", "{}", daemon.log());
    assert_eq!(second[0].envs["GPUSHARE_POD"], "default/tie-a", "{}", daemon.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_says_which_look_alike_it_admits() {
    let (c, daemon) = cluster_of(&[1000, 1000], "", None, true, "").await;
    // The daemon says on its node that it tells look-alikes apart once the kubelet's
    // PodResources answered it.
    wait_telling_apart(&c, &daemon).await;
    // Three look-alikes, oldest first: x on GPU1, y and z on GPU0. The kubelet admits z, then
    // y, then x: against every order the daemon could keep (it rejected x before its device
    // manager, say, then took x again; its watch delivered them otherwise).
    bound_pod(&c.api, "x", &[("main", ContainerRole::App, &[(1, 200)])]);
    tokio::time::sleep(Duration::from_millis(1100)).await; // a later creation second
    bound_pod(&c.api, "y", &[("main", ContainerRole::App, &[(0, 200)])]);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    bound_pod(&c.api, "z", &[("main", ContainerRole::App, &[(0, 200)])]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    admit_named(&c, &daemon, &[("z", "GPU-static-0"), ("y", "GPU-static-0"), ("x", "GPU-static-1")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_errors_with_reasons() {
    // Two GPUs: the kubelet counts 2000 devices, while the ledger knows GPU0 alone.
    let (c, _daemon) = cluster(&[1000, 1000]).await;
    // Nobody waits: the read of the node's pods says so, and the call is refused without
    // waiting out the 5 s a lagging pod watch would get.
    let asked = Instant::now();
    let err = c.kubelet.admit(&[64]).await.unwrap_err().to_string();
    assert!(asked.elapsed() < Duration::from_secs(3), "refused after {:?}", asked.elapsed());
    assert!(
        err.contains("FailedPrecondition") && err.contains("no pod bound to node node-a is waiting for 64 MiB"),
        "{err}"
    );
    // A pod that skipped the extender.
    c.api
        .create_pod(
            "ml",
            json!({"metadata": {"name": "raw"}, "spec": {"nodeName": "node-a", "containers": [
                {"name": "c", "image": "x", "resources": {"limits": {"gpushare.io/gpu-mem": "64"}}}]}}),
        )
        .unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let err = c.kubelet.admit(&[64]).await.unwrap_err().to_string();
        if err.contains("ml/raw has no gpushare.io/assignment annotation") {
            break;
        }
        assert!(Instant::now() < deadline, "{err}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Two assignments that overcommit the GPU: the second is refused by the ledger.
    bound_pod(&c.api, "big-1", &[("main", ContainerRole::App, &[(0, 700)])]);
    admit(&c, &[700]).await;
    bound_pod(&c.api, "big-2", &[("main", ContainerRole::App, &[(0, 700)])]);
    let deadline = Instant::now() + WAIT;
    let err = loop {
        let err = c.kubelet.admit(&[700]).await.unwrap_err().to_string();
        if !err.contains("no pod bound") || Instant::now() > deadline {
            break err;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        err.contains("ResourceExhausted") && err.contains("GPU0 has 300 MiB free in the ledger, needs 700 MiB"),
        "{err}"
    );
}

/// A pod with a sidecar (a restartable init container): the kubelet admits the init container,
/// then the sidecar, then the app container, and each gets its assigned GPU and budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_with_a_sidecar_is_served_in_the_kubelets_order() {
    let (c, daemon) = cluster(&[1000, 1000]).await;
    bound_pod(
        &c.api,
        "meshed",
        &[
            ("fetch", ContainerRole::Init, &[(0, 100)]),
            ("proxy", ContainerRole::Sidecar, &[(1, 50)]),
            ("model", ContainerRole::App, &[(0, 300)]),
        ],
    );
    let containers = [
        gpushare_testkit::kubelet::ContainerSpec::app("model", 300),
        gpushare_testkit::kubelet::ContainerSpec::init("fetch", 100),
        gpushare_testkit::kubelet::ContainerSpec::sidecar("proxy", 50),
    ];
    let deadline = Instant::now() + WAIT;
    let a = loop {
        match c.kubelet.admit_pod("default", "meshed", &containers).await {
            Ok(a) => break a,
            Err(e) if Instant::now() < deadline && format!("{e:#}").contains("no pod bound") => {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            Err(e) => panic!("{e:#}\n{}", daemon.log()),
        }
    };
    let got: Vec<(&str, &str, &str)> = a
        .iter()
        .map(|x| {
            (
                x.envs["GPUSHARE_CONTAINER"].as_str(),
                x.envs["NVIDIA_VISIBLE_DEVICES"].as_str(),
                x.envs["GPUSHARE_MEMORY_MIB"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [("model", "GPU-static-0", "300"), ("fetch", "GPU-static-0", "100"), ("proxy", "GPU-static-1", "50")]
    );
    let live = ledger_of(&c).live().unwrap();
    let rows: Vec<(&str, u32)> = live.iter().map(|r| (r.container.as_str(), r.gpu_index)).collect();
    assert_eq!(rows, [("fetch", 0), ("proxy", 1), ("model", 0)], "booked in the kubelet's order");
}

/// Calls that cannot be right are refused at once (`INVALID_ARGUMENT`), not after waiting for a
/// pod, and book nothing: no device, a device twice, an assignment that places a container the
/// pod does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loose_requests_are_refused_at_once_and_book_nothing() {
    let (c, daemon) = cluster(&[1000]).await;
    let quick = async |what: &str, call: std::pin::Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send + '_>>| {
        let start = Instant::now();
        let err = call.await.unwrap_err().to_string();
        // The daemon waits up to 5 s for a pod it has not seen yet; these are not worth waiting for.
        assert!(start.elapsed() < Duration::from_secs(3), "{what}: {err} after {:?}", start.elapsed());
        assert!(err.contains("InvalidArgument"), "{what}: {err}");
        err
    };
    let err = quick("no device", Box::pin(async { c.kubelet.allocate(&[]).await.map(drop) })).await;
    assert!(err.contains("asked for 0 devices"), "{err}");
    let err = quick("a preferred allocation of 0", Box::pin(async { c.kubelet.preferred(0).await.map(drop) })).await;
    assert!(err.contains("asked for 0 devices"), "{err}");
    let id = c.kubelet.devices()[0].id.clone();
    let err =
        quick("one device twice", Box::pin(async { c.kubelet.allocate(&[id.clone(), id.clone()]).await.map(drop) }))
            .await;
    assert!(err.contains("is listed twice in one Allocate"), "{err}");

    // The assignment places "ghost"; the pod's container is "main".
    let assignment = gpushare_core::codec::assignment::Assignment {
        node: "node-a".into(),
        unit: gpushare_core::MemoryUnit::Mib,
        containers: vec![gpushare_core::codec::assignment::ContainerAssignment {
            name: "ghost".into(),
            role: ContainerRole::App,
            gpus: vec![gpushare_core::codec::assignment::GpuShare {
                index: 0,
                uuid: common::uuid(0),
                mib: gpushare_core::Mib::new(300),
            }],
        }],
    };
    c.api
        .create_pod(
            "default",
            json!({"metadata": {"name": "haunted", "annotations": {
                       gpushare_core::codec::assignment::ASSIGNMENT_KEY: assignment.encode().unwrap()}},
                   "spec": {"nodeName": "node-a", "containers": [{"name": "main", "image": "x",
                       "resources": {"limits": {"gpushare.io/gpu-mem": "300"}}}]}}),
        )
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let err = loop {
        let start = Instant::now();
        let err = c.kubelet.admit(&[300]).await.unwrap_err().to_string();
        if !err.contains("no pod bound") {
            assert!(start.elapsed() < Duration::from_secs(3), "{err} after {:?}", start.elapsed());
            break err;
        }
        assert!(Instant::now() < deadline, "{err}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        err.contains("InvalidArgument")
            && err.contains(
                "pod default/haunted: the assignment places container \"ghost\", which the pod does not have"
            ),
        "{err}"
    );
    assert!(ledger_of(&c).live().unwrap().is_empty(), "{}", daemon.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_or_finished_pod_releases_its_rows_and_keeps_history() {
    let (c, daemon) = cluster(&[1000]).await;
    bound_pod(&c.api, "gone", &[("main", ContainerRole::App, &[(0, 100)])]);
    bound_pod(&c.api, "done", &[("main", ContainerRole::App, &[(0, 110)])]);
    admit(&c, &[100]).await;
    admit(&c, &[110]).await;
    c.api.delete_pod("default", "gone").unwrap();
    c.api.patch_pod("default", "done", &json!({"status": {"phase": "Succeeded"}})).unwrap();
    let deadline = Instant::now() + WAIT;
    while !ledger_of(&c).live().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all = ledger_of(&c).all_since(0).unwrap();
    let reasons: BTreeSet<String> = all.iter().filter_map(|r| r.release_reason.clone()).collect();
    assert_eq!(reasons, BTreeSet::from(["pod deleted".to_owned(), "pod finished or deleted".to_owned()]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_an_admission_burst_loses_no_answered_allocation() {
    let (c, mut daemon) = cluster(&[4000]).await;
    for i in 0..PODS {
        bound_pod(&c.api, &format!("burst-{i:02}"), &[("main", ContainerRole::App, &[(0, 10 + i as u64)])]);
    }
    // Admit as fast as possible; kill the daemon after the 15th answer, mid-burst.
    let mut answered = Vec::new();
    let mut killed = false;
    for i in 0..PODS {
        let size = 10 + i;
        let result = if killed { c.kubelet.admit(&[size]).await } else { Ok(admit(&c, &[size]).await) };
        match result {
            Ok(a) => answered.push((a[0].devices.clone(), a[0].envs.clone())),
            Err(_) => break,
        }
        if answered.len() == 15 {
            daemon.signal("KILL");
            killed = true;
        }
    }
    assert_eq!(daemon.wait_exit(WAIT), None, "killed by a signal, no exit code");
    assert!(answered.len() >= 15);

    // Every answered allocation is on disk, and none twice.
    {
        let ledger = ledger_of(&c);
        let live = ledger.live().unwrap();
        let mut containers = BTreeSet::new();
        for r in &live {
            assert!(containers.insert((r.pod.uid.clone(), r.container.clone())), "twice: {r:?}");
        }
        let keys: BTreeSet<String> = live.iter().map(|r| r.request_key.clone()).collect();
        for (devices, envs) in &answered {
            assert!(keys.contains(&request_key(devices)), "answered but not in the ledger: {envs:?}");
        }
        assert!(live.len() <= answered.len() + 1, "at most the one in flight beyond the answers");
    }

    // Restarted on the same ledger, it answers the same devices the same way and goes on.
    let daemon = Daemon::start(&c.config, c.host.path("daemon-2.log"));
    c.kubelet.wait_registered(2, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    // The kubelet took the killed daemon's devices as unhealthy; the new stream brings them back.
    c.kubelet.wait_devices(WAIT, |d| d.iter().any(|d| d.health == "Healthy")).await.unwrap();
    let (devices, envs) = &answered[3];
    let deadline = Instant::now() + WAIT;
    let again = loop {
        match c.kubelet.allocate(devices).await {
            Ok(a) => break a,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}\n{}", daemon.log()),
        }
    };
    assert_eq!(&again, envs);
    let next = 10 + ledger_of(&c).live().unwrap().len();
    let more = admit(&c, &[next]).await;
    assert_eq!(more[0].envs["GPUSHARE_MEMORY_MIB"], next.to_string());
}
