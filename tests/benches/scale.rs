//! Scale, side by side in one run: the real kube-scheduler placing pods on many API-only nodes
//! (Node objects with their daemon's published state and allocatable, no kubelet), (a) through
//! gpushare's extender with `gpushare.io/gpu-mem`, (b) with the same scheduler and a plain
//! extended resource, no extender. Reports pods/s for both, the ratio (a)/(b), and the
//! extender's filter latency under that load.
//!
//! ```text
//! cargo build --release --bins && cargo bench -p gpushare-testkit --bench scale
//! ```
//!
//! `GPUSHARE_SCALE_NODES` (default 1000) nodes of 8 × 80 GiB, `GPUSHARE_SCALE_PODS` (default
//! 5000) pods of 1–8 GiB created by 16 clients at once; pods/s runs from the first create to the
//! list (polled every 250 ms) that first shows every pod bound. Both runs use the same
//! kube-scheduler build with client rate limits raised (`clientConnection` qps and burst 5000):
//! kube-scheduler's defaults (50/100) would cap the plain run's binds at 50/s, and the extender
//! binds with its own client. (a) loads the shipped configuration; (b) a configuration with no
//! extender. The extender's filter p50/p99 come from its own histogram (upper bucket bounds).
//! (c) Where `GPUSHARE_PEERS_SRC` gives Alibaba's source (`tests/peers/build`): Alibaba's
//! gpushare-scheduler-extender with its own settings (filter and bind, `aliyun.com/gpu-mem`),
//! the nodes' capacity as its device plugin would set it, the same pods asking
//! `aliyun.com/gpu-mem`; its pods/s as a ratio to (a), and each extender's resident memory once
//! every pod is bound.
//! (d) Where it gives HAMi's source: HAMi's scheduler (extender and webhook) with its chart's
//! kube-scheduler configuration, the nodes' devices in the annotation its device plugin writes
//! (`hami.io/node-nvidia-register`, 10 shares per GPU) and `nvidia.com/gpu` allocatable, the same
//! pods asking `nvidia.com/gpu: 1` and `nvidia.com/gpumem`; its node policy `spread`, not its
//! chart's `binpack`: it binds under a lock on the node that only its device plugin releases,
//! and these nodes have none, so each node takes one pod (pods no more than nodes). Its API
//! client's rate limits are raised as kube-scheduler's are (`--kube-qps`, `--kube-burst` 5000):
//! at client-go's defaults it reads about one node every two seconds. It reads the nodes'
//! devices at a pace of its own: the pass reports how long that took, and places pods only once
//! every node is read, within `GPUSHARE_SCALE_HAMI_WAIT` seconds (default 600).
//! Where a peer runs, kube-scheduler calls every extender, ours included, through a timing relay
//! (`gpushare_testkit::call_timer`), which gives each one's filter and bind p50/p99 measured the
//! same way, from outside (Alibaba's and HAMi's keep no latency histogram). The relay is one more
//! hop on each scheduling cycle, so without peers ours is called directly and (a)/(b) compares
//! the two paths alone; ours is always also read from its own histogram.
//! Needs the real components (`tests/kube/build`, or `GPUSHARE_KUBE_BIN`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stderr, clippy::cast_precision_loss)]

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
use gpushare_testkit::call_timer::CallTimer;
use gpushare_testkit::cluster::http_get;
use gpushare_testkit::peers::{self, ALIYUN_GPU_MEM, HAMI_GPU, HAMI_GPUMEM, HAMI_SPLIT};
use gpushare_testkit::realbox;
use gpushare_testkit::realkube::{self, ControlPlane, EXTENDER_URL};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const GPUS: u32 = 8;
const GPU_MIB: u64 = 81_920;
/// The plain run's extended resource: the same quantity, no extender.
const PLAIN: &str = "example.com/gpu-mem";
const RATE: &str = "  qps: 5000\n  burst: 5000\n";

/// `config`, a kube-scheduler configuration, with its client's rate limits raised to [`RATE`].
fn with_rate(config: &str) -> String {
    let raised = config.replacen("clientConnection:\n", &format!("clientConnection:\n{RATE}"), 1);
    assert_ne!(raised, config, "a kube-scheduler configuration with no clientConnection section");
    raised
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn node_object(name: &str, hami: bool) -> Value {
    let gpus: Vec<Gpu> = (0..GPUS)
        .map(|i| {
            Gpu::new(i, GpuUuid::new(format!("GPU-{name}-{i}")).unwrap(), "NVIDIA A100-SXM4-80GB", Mib::new(GPU_MIB))
        })
        .collect();
    let state = NodeState {
        generation: 1,
        daemon_version: "0.1.0".into(),
        inventory: NodeInventory::new(MemoryUnit::Mib, gpus).unwrap(),
        used: vec![Mib::ZERO; GPUS as usize],
        allocations: vec![],
        claims: vec![],
        over_budget: vec![],
        tells_lookalikes_apart: false,
    };
    let mut node = json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "annotations": {NODE_STATE_KEY: state.encode().unwrap()}}});
    if hami {
        // What HAMi's device plugin writes: each GPU, its shares, memory and cores.
        let devices: Vec<Value> = (0..GPUS)
            .map(|i| {
                json!({"id": format!("GPU-{name}-{i}"), "index": i, "count": HAMI_SPLIT, "devmem": GPU_MIB,
                       "devcore": 100, "type": "NVIDIA A100-SXM4-80GB", "health": true})
            })
            .collect();
        node["metadata"]["annotations"]["hami.io/node-nvidia-register"] = json!(Value::Array(devices).to_string());
    }
    node
}

fn node_status() -> Value {
    let total = (GPU_MIB * u64::from(GPUS)).to_string();
    let resources = json!({"cpu": "128", "memory": "1Ti", "pods": "110", "gpushare.io/gpu-mem": total, PLAIN: total,
                           ALIYUN_GPU_MEM: total, "aliyun.com/gpu-count": GPUS.to_string(),
                           HAMI_GPU: (GPUS * HAMI_SPLIT).to_string()});
    json!({"status": {"capacity": resources, "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet ready",
                        "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
}

fn pod_object(name: &str, resource: &str, mib: u64) -> Pod {
    let mut limits = json!({resource: mib.to_string()});
    if resource == HAMI_GPUMEM {
        // HAMi's users ask for a GPU and the MiB on it.
        limits[HAMI_GPU] = json!("1");
    }
    serde_json::from_value(
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false,
                 "containers": [{"name": "main", "image": "registry.example/app:1",
                                 "resources": {"limits": limits}}]}}),
    )
    .unwrap()
}

/// Creates `nodes` API-only nodes: the object, its Ready status, and no `not-ready` taint.
async fn add_nodes(client: &kube::Client, nodes: usize, hami: bool) {
    let api: Api<Node> = Api::all(client.clone());
    let t = Instant::now();
    futures::stream::iter(0..nodes)
        .map(|i| {
            let api = api.clone();
            async move {
                let name = format!("node-{i:05}");
                let node: Node = serde_json::from_value(node_object(&name, hami)).unwrap();
                api.create(&PostParams::default(), &node).await.unwrap();
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(node_status())).await.unwrap();
                // The API server taints a new node not-ready; the node lifecycle controller would
                // lift it for a Ready node.
                api.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"taints": null}})))
                    .await
                    .unwrap();
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
    eprintln!("{nodes} API-only nodes in {:.1} s", t.elapsed().as_secs_f64());
}

/// Creates `count` pods asking `resource` (prefix `prefix`), waits until all are bound; pods/s.
async fn place(client: &kube::Client, prefix: &str, resource: &str, count: usize) -> f64 {
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let t = Instant::now();
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            let pod = pod_object(&format!("{prefix}-{i:05}"), resource, 1024 * (1 + (i as u64 % 8)));
            async move {
                api.create(&PostParams::default(), &pod).await.unwrap();
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    let created = t.elapsed();
    loop {
        let pods = api.list(&ListParams::default()).await.unwrap();
        let bound = pods
            .items
            .iter()
            .filter(|p| {
                p.metadata.name.as_deref().is_some_and(|n| n.starts_with(prefix))
                    && p.spec.as_ref().is_some_and(|s| s.node_name.is_some())
            })
            .count();
        if bound == count {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(1800), "{bound} of {count} pods bound after 30 minutes");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    eprintln!("{prefix}: {count} pods created in {:.1} s, all bound in {secs:.1} s", created.as_secs_f64());
    count as f64 / secs
}

/// The upper bound of the bucket holding quantile `q` of the extender's `verb` histogram, in ms.
fn quantile_ms(metrics: &str, verb: &str, q: f64) -> Option<f64> {
    let prefix = format!("gpushare_extender_request_duration_seconds_bucket{{verb=\"{verb}\",le=\"");
    let buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, count.trim().parse().ok()?))
        })
        .collect();
    let total = buckets.last()?.1;
    buckets.iter().find(|(_, c)| *c >= q * total).map(|(le, _)| le * 1e3)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let nodes = env("GPUSHARE_SCALE_NODES", 1000);
    let pods = env("GPUSHARE_SCALE_PODS", 5000);
    let temp = tempfile::Builder::new().prefix("gpushare-scale.").tempdir().unwrap();
    let dir = gpushare_testkit::box_dir().unwrap_or_else(|| temp.path().to_owned());
    let repo = realbox::repo();
    let mut plane = ControlPlane::start(&dir, &realkube::binaries().unwrap()).unwrap();
    plane.apply(&repo.join("etc/kubernetes/gpushare-extender-rbac.yaml")).unwrap();
    let client = plane.admin_client().await.unwrap();
    let hami_built = peers::hami().map_err(|why| eprintln!("{why}")).is_ok();
    let alibaba_built = peers::alibaba().map_err(|why| eprintln!("{why}")).is_ok();
    // Every extender is timed through the relay, or none (the module header says why).
    let timed = hami_built || alibaba_built;
    add_nodes(&client, nodes, hami_built).await;

    // (a) The extender, under its shipped RBAC, and the shipped scheduler configuration.
    let (mut extender, addr, observe) = realbox::start_extender(&plane, "", "warn").unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while http_get(addr, "/readyz").await.is_none_or(|(s, _)| s != 200) {
        assert!(extender.exited().is_none(), "the extender exited:\n{}", extender.log_tail(20));
        assert!(Instant::now() < deadline, "the extender is not ready:\n{}", extender.log_tail(20));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let shipped = std::fs::read_to_string(repo.join("etc/kube-scheduler/gpushare-scheduler-config.yaml")).unwrap();
    let ours_url = format!("http://{addr}/gpushare-scheduler");
    let ours_timer = timed.then(|| CallTimer::start(&ours_url, None).unwrap());
    let url = ours_timer.as_ref().map_or(ours_url.as_str(), CallTimer::url_prefix);
    plane.start_scheduler_config(&with_rate(&shipped).replace(EXTENDER_URL, url)).unwrap();
    let with_extender = place(&client, "ext", "gpushare.io/gpu-mem", pods).await;
    let (_, metrics) = http_get(observe, "/metrics").await.unwrap();
    let (p50, p99) = (quantile_ms(&metrics, "filter", 0.5), quantile_ms(&metrics, "filter", 0.99));
    let ours_rss = extender.pid().map(rss_mib);
    drop(extender);

    // (b) The same scheduler, no extender, a plain extended resource.
    let plain_config = format!(
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\nclientConnection:\n{RATE}  {}\n",
        realkube::SCHEDULER_KUBECONFIG
    );
    plane.start_scheduler_config(&plain_config).unwrap();
    let plain = place(&client, "plain", PLAIN, pods).await;

    // (c) Alibaba's extender with its own settings (kube-scheduler's rate raised the same way).
    let alibaba = if alibaba_built {
        // Logging as ours does here (`warn`): at `info` it writes a line per node per filter.
        let (extender, url) = peers::spawn_alibaba_extender(&plane, "warn").unwrap();
        let timer = CallTimer::start(&url, None).unwrap();
        plane.start_scheduler_config(&with_rate(&peers::alibaba_scheduler_config(timer.url_prefix()))).unwrap();
        let rate = place(&client, "alibaba", ALIYUN_GPU_MEM, pods).await;
        Some((rate, extender.pid().map(rss_mib), timer))
    } else {
        None
    };

    // (d) HAMi's scheduler, spreading pods over the nodes (the module header says why).
    let hami = if hami_built && pods <= nodes {
        let (scheduler, url, metrics) = peers::spawn_hami_scheduler(&plane, HAMI_SPLIT, "spread", Some(5000)).unwrap();
        // It places nothing on a node until it has read the node's devices, which it does at its
        // own pace: the time that takes is a figure of its own.
        let t = Instant::now();
        let wait = Duration::from_secs(env("GPUSHARE_SCALE_HAMI_WAIT", 600) as u64);
        let mut registered = 0;
        while registered < nodes && t.elapsed() < wait {
            tokio::time::sleep(Duration::from_millis(500)).await;
            // The nodes its metrics name, each in several lines: the body may come in chunks,
            // and a chunk's boundary may split one of them, never all.
            let (_, m) = http_get(metrics, "/metrics").await.unwrap_or_default();
            registered = (0..nodes).filter(|i| m.contains(&format!("node=\"node-{i:05}\""))).count();
        }
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "hami: {registered} of {nodes} nodes registered in {secs:.1} s ({:.2} nodes/s)",
            registered as f64 / secs
        );
        if registered < nodes {
            eprintln!("hami: not placed: its scheduler had not read every node's devices (GPUSHARE_SCALE_HAMI_WAIT)");
            None
        } else {
            let timer = CallTimer::start(&url, Some(&plane.pki.ca())).unwrap();
            plane.start_scheduler_config(&with_rate(&peers::hami_scheduler_config(timer.url_prefix()))).unwrap();
            let rate = place(&client, "hami", HAMI_GPUMEM, pods).await;
            Some((rate, scheduler.pid().map(rss_mib), timer))
        }
    } else {
        if hami_built {
            eprintln!("HAMi's pass needs no more pods than nodes (each node takes one pod)");
        }
        None
    };

    println!("real kube-scheduler, {nodes} API-only nodes x {GPUS} GPUs, {pods} pods each run");
    println!("| run | pods/s |");
    println!("|---|---|");
    println!("| (a) extender, gpushare.io/gpu-mem | {with_extender:.1} |");
    println!("| (b) no extender, {PLAIN} | {plain:.1} |");
    if let Some((rate, _, _)) = &alibaba {
        println!("| (c) Alibaba's extender, {ALIYUN_GPU_MEM} | {rate:.1} |");
    }
    if let Some((rate, _, _)) = &hami {
        println!("| (d) HAMi's scheduler, {HAMI_GPUMEM} | {rate:.1} |");
    }
    println!("ratio (a)/(b): {:.2}", with_extender / plain);
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v}"));
    println!("extender filter under load: p50 <= {} ms, p99 <= {} ms (histogram bucket bounds)", ms(p50), ms(p99));
    let mib = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0} MiB"));
    println!("gpushare-extender resident memory, every pod bound: {}", mib(ours_rss));
    if let Some((rate, rss, _)) = &alibaba {
        println!("ratio (c)/(a): {:.3}; Alibaba's extender resident memory: {}", rate / with_extender, mib(*rss));
    }
    if let Some((rate, rss, _)) = &hami {
        println!("ratio (d)/(a): {:.3}; HAMi's scheduler resident memory: {}", rate / with_extender, mib(*rss));
    }
    if timed {
        println!("each extender's answers as kube-scheduler's calls saw them (the call timer):");
        println!("| extender | filter calls | filter p50 | filter p99 | bind calls | bind p99 |");
        println!("|---|---|---|---|---|---|");
    }
    let timers = [
        ("(a) gpushare-extender", ours_timer.as_ref()),
        ("(c) Alibaba's extender", alibaba.as_ref().map(|a| &a.2)),
        ("(d) HAMi's scheduler", hami.as_ref().map(|h| &h.2)),
    ];
    let q = |t: &CallTimer, verb: &str, q: f64| {
        t.quantile(verb, q).map_or_else(|| "-".to_owned(), |d| format!("{:.2} ms", d.as_secs_f64() * 1e3))
    };
    for (name, timer) in timers {
        if let Some(t) = timer {
            println!(
                "| {name} | {} | {} | {} | {} | {} |",
                t.calls("filter"),
                q(t, "filter", 0.5),
                q(t, "filter", 0.99),
                t.calls("bind"),
                q(t, "bind", 0.99)
            );
        }
    }
}

/// A process's resident memory (`VmRSS`), MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(f64::NAN);
    kib / 1024.0
}
