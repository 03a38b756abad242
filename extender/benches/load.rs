//! The extender under kube-scheduler's load, measured from a second process on loopback: the
//! `gpushare-extender` binary watches an API-server stand-in holding 5,000 nodes × 8 GPUs and
//! 50,000 bound pods; this process sends filter and prioritize requests naming 500 and all
//! 5,000 nodes (one connection for latency, several for throughput), filter again while one
//! node re-publishes a 200 KiB state, then binds pods into one node, and reads the extender's
//! resident memory.
//!
//! Run: `cargo bench -p gpushare-extender --bench load`. Results: BENCHMARKS.md.
//! `LOAD_NODES`, `LOAD_PODS_PER_NODE`, `LOAD_SECONDS`, `LOAD_CONNECTIONS` and `LOAD_CHURN_HZ` change the sizes;
//! `LOAD_EXTENDER_ENV=K=V,K=V` sets the extender's environment.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::cast_precision_loss)]

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{ContainerRole, Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};
use gpushare_testkit::apiserver::ApiServer;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;

const GPUS: u32 = 8;
const GPU_MIB: u64 = 81_920;

fn env(key: &str, default: u64) -> u64 {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn uuid(node: usize, gpu: u32) -> GpuUuid {
    GpuUuid::new(format!("GPU-{node:05}-{gpu}")).unwrap()
}

fn node(i: usize) -> Value {
    let gpus = (0..GPUS)
        .map(|g| {
            let mut gpu = Gpu::new(g, uuid(i, g), "NVIDIA A100-SXM4-80GB", Mib::new(GPU_MIB));
            gpu.minor = Some(g);
            gpu
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
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": format!("node-{i:05}"), "annotations": {NODE_STATE_KEY: state.encode().unwrap()}},
           "status": {"addresses": [{"type": "InternalIP", "address": format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256)}]}})
}

fn pod(name: &str, mib: u64, bound: Option<(usize, u32)>) -> Value {
    let mut p = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "bench", "labels": {"app": "inference"}},
        "spec": {"containers": [{"name": "main", "image": "registry.example/inference:1.0",
                 "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string(), "cpu": "2", "memory": "8Gi"}}}]}});
    if let Some((n, g)) = bound {
        let a = Assignment {
            node: format!("node-{n:05}"),
            unit: MemoryUnit::Mib,
            containers: vec![ContainerAssignment {
                name: "main".into(),
                role: ContainerRole::App,
                gpus: vec![GpuShare { index: g, uuid: uuid(n, g), mib: Mib::new(mib) }],
            }],
        };
        p["metadata"]["annotations"] = json!({ASSIGNMENT_KEY: a.encode().unwrap()});
        p["spec"]["nodeName"] = json!(format!("node-{n:05}"));
        p["status"] = json!({"phase": "Running"});
    }
    p
}

/// Plays `node`'s daemon after pod `name` was bound there: its assignment is reported
/// allocated in the node state, as the daemon does once the kubelet admitted the pod.
fn report_allocated(api: &ApiServer, daemon: &std::sync::Mutex<NodeState>, node: &str, name: &str) {
    let pod = api.pod("bench", name).unwrap();
    let a = Assignment::decode(pod["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    let pod_ref = gpushare_core::codec::node::PodRef {
        namespace: "bench".into(),
        name: name.to_owned(),
        uid: pod["metadata"]["uid"].as_str().unwrap().to_owned(),
    };
    let mut state = daemon.lock().unwrap();
    for c in a.containers {
        for g in c.gpus {
            state.allocations.push(gpushare_core::codec::node::NodeAllocation {
                pod: pod_ref.clone(),
                container: c.name.clone(),
                role: c.role,
                gpu: g.index,
                mib: g.mib,
            });
        }
    }
    state.used = gpushare_core::codec::node::used_per_gpu(&state.inventory, &state.allocations, &state.claims);
    state.generation += 1;
    let value = state.encode().unwrap();
    api.patch(
        gpushare_testkit::apiserver::Kind::Node,
        "",
        node,
        &json!({"metadata": {"annotations": {NODE_STATE_KEY: value}}}),
    )
    .unwrap();
}

/// A keep-alive HTTP/1.1 connection.
struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Conn {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Conn { reader: BufReader::new(stream) }
    }

    async fn request(&mut self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let stream = self.reader.get_mut();
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body).await.unwrap();
        let mut line = String::new();
        self.reader.read_line(&mut line).await.unwrap();
        let status: u16 = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let mut length = 0usize;
        loop {
            line.clear();
            self.reader.read_line(&mut line).await.unwrap();
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap();
            }
        }
        let mut out = vec![0; length];
        self.reader.read_exact(&mut out).await.unwrap();
        (status, out)
    }
}

fn percentile(sorted: &[Duration], p: usize) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = (sorted.len() - 1) * p / 100;
    sorted[i].as_secs_f64() * 1e3
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Latency with one connection, then throughput with `connections`, for `seconds` each.
async fn measure(addr: SocketAddr, verb: &str, body: &[u8], seconds: u64, connections: u64) -> (f64, f64, f64, f64) {
    let path = format!("/gpushare-scheduler/{verb}");
    let mut conn = Conn::open(addr).await;
    for _ in 0..50 {
        assert_eq!(conn.request("POST", &path, body).await.0, 200);
    }
    let mut lat = Vec::new();
    let end = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < end {
        let t = Instant::now();
        let (status, _) = conn.request("POST", &path, body).await;
        lat.push(t.elapsed());
        assert_eq!(status, 200);
    }
    lat.sort_unstable();
    let single = lat.len() as f64 / seconds as f64;
    let end = Instant::now() + Duration::from_secs(seconds);
    let tasks: Vec<_> = (0..connections)
        .map(|_| {
            let (body, path) = (body.to_vec(), path.clone());
            tokio::spawn(async move {
                let mut conn = Conn::open(addr).await;
                let mut n = 0u64;
                while Instant::now() < end {
                    assert_eq!(conn.request("POST", &path, &body).await.0, 200);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    (percentile(&lat, 50), percentile(&lat, 99), single, total as f64 / seconds as f64)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let nodes = usize::try_from(env("LOAD_NODES", 5000)).unwrap();
    let per_node = usize::try_from(env("LOAD_PODS_PER_NODE", 10)).unwrap();
    let seconds = env("LOAD_SECONDS", 5);
    let connections = env("LOAD_CONNECTIONS", 4);
    let dir = tempfile::tempdir().unwrap();
    let api = std::sync::Arc::new(ApiServer::start().await.unwrap());
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let t = Instant::now();
    for i in 0..nodes {
        api.insert(node(i)).unwrap();
        for j in 0..per_node {
            // 10 pods of 4 GiB to 16 GiB on each node, spread over its GPUs.
            let mib = 4096 * (1 + (j as u64 % 4));
            api.insert(pod(&format!("run-{i:05}-{j:02}"), mib, Some((i, u32::try_from(j).unwrap() % GPUS)))).unwrap();
        }
    }
    // The node the binds go to: empty.
    let target = nodes;
    api.insert(node(target)).unwrap();
    let binds = 1000;
    for b in 0..binds {
        // Sizes vary: pods the kubelet cannot tell apart are bound to a node one at a time.
        api.insert(pod(&format!("new-{b:04}"), 256 + (b as u64 % 500), None)).unwrap();
    }
    eprintln!(
        "stand-in filled: {} nodes, {} pods in {:.1} s",
        nodes + 1,
        nodes * per_node + binds,
        t.elapsed().as_secs_f64()
    );

    let port = gpushare_testkit::ports::free_port().unwrap();
    let config = dir.path().join("extender.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nobserve_listen = \"127.0.0.1:{}\"\n[kubernetes]\nkubeconfig = \"{}\"\n",
            gpushare_testkit::ports::free_port().unwrap(),
            kubeconfig.display()
        ),
    )
    .unwrap();
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpushare-extender"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .envs(std::env::var("LOAD_EXTENDER_ENV").ok().iter().flat_map(|v| {
            v.split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect::<Vec<_>>()
        }))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    loop {
        if let Ok(mut c) = TcpStream::connect(addr).await.map(|s| Conn { reader: BufReader::new(s) })
            && c.request("GET", "/readyz", b"").await.0 == 200
        {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "the extender did not become ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let synced = started.elapsed();
    let pid = child.id();
    let rss_synced = status_kib(pid, "VmRSS:");

    let names: Vec<String> = (0..nodes).map(|i| format!("node-{i:05}")).collect();
    let candidate = pod("candidate", 6000, None);
    let candidate = api.create_pod("bench", candidate).unwrap();
    let body = |n: usize| {
        serde_json::to_vec(&json!({"Pod": candidate, "Nodes": null, "NodeNames": names[..n.min(nodes)]})).unwrap()
    };
    println!(
        "gpushare-extender, {nodes} nodes x {GPUS} GPUs, {} pods in the view; synced in {:.1} s",
        nodes * per_node + binds,
        synced.as_secs_f64()
    );
    println!("| request | nodes named | p50 ms | p99 ms | req/s (1 conn) | req/s ({connections} conns) |");
    println!("|---|---|---|---|---|---|");
    for verb in ["filter", "prioritize"] {
        for n in [500, 5000] {
            let (p50, p99, single, many) = measure(addr, verb, &body(n), seconds, connections).await;
            println!("| {verb} | {} | {p50:.3} | {p99:.3} | {single:.0} | {many:.0} |", n.min(nodes));
        }
    }

    // One node churning a large published state (some 200 KiB, re-published `LOAD_CHURN_HZ`
    // times a second, 20 by default) while filter is measured again: the other nodes' answers
    // should stay fast (BENCHMARKS.md records how much they slow).
    let churn_name = "node-00000";
    let mut big =
        NodeState::decode(api.node(churn_name).unwrap()["metadata"]["annotations"][NODE_STATE_KEY].as_str().unwrap())
            .unwrap();
    while big.encode().unwrap().len() < 200 * 1024 {
        let i = big.allocations.len();
        big.allocations.push(gpushare_core::codec::node::NodeAllocation {
            pod: gpushare_core::codec::node::PodRef {
                namespace: "churn".into(),
                name: format!("churning-pod-with-a-long-name-{i:06}"),
                uid: format!("00000000-0000-4000-8000-{i:012}"),
            },
            container: "main".into(),
            role: ContainerRole::App,
            gpu: u32::try_from(i).unwrap() % GPUS,
            mib: Mib::new(1),
        });
    }
    big.used = gpushare_core::codec::node::used_per_gpu(&big.inventory, &big.allocations, &big.claims);
    let churn_kib = big.encode().unwrap().len() / 1024;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churner = {
        let (api, stop) = (api.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            let every = Duration::from_secs(1) / u32::try_from(env("LOAD_CHURN_HZ", 20).max(1)).unwrap_or(20);
            let mut next = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                next += every;
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                big.generation += 1;
                let value = big.encode().unwrap();
                let patch = json!({"metadata": {"annotations": {NODE_STATE_KEY: value}}});
                api.patch(gpushare_testkit::apiserver::Kind::Node, "", churn_name, &patch).unwrap();
                n += 1;
            }
            n
        })
    };
    let t = Instant::now();
    let (p50, p99, single, many) = measure(addr, "filter", &body(500), seconds, connections).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let churned = churner.join().unwrap();
    println!(
        "| filter, {churn_name} re-publishing a {churn_kib} KiB state {:.0} times/s | {} | {p50:.3} | {p99:.3} | {single:.0} | {many:.0} |",
        churned as f64 / t.elapsed().as_secs_f64(),
        500.min(nodes)
    );

    // Binds into one node, 8 at a time, as kube-scheduler's parallel binding would. The bench
    // plays that node's daemon: each bound pod is reported allocated right after its bind (a
    // real kubelet admits it within tens of ms), so a later pod of the same size is not held
    // back as its look-alike in admission.
    let target_name = format!("node-{target:05}");
    let pods = api.list(gpushare_testkit::apiserver::Kind::Pod);
    let mut bodies: Vec<(String, Vec<u8>)> = pods
        .iter()
        .filter(|p| p["metadata"]["name"].as_str().is_some_and(|n| n.starts_with("new-")))
        .map(|p| {
            let body = serde_json::to_vec(&json!({"PodName": p["metadata"]["name"], "PodNamespace": "bench",
                                                  "PodUID": p["metadata"]["uid"], "Node": target_name}))
            .unwrap();
            (p["metadata"]["name"].as_str().unwrap().to_owned(), body)
        })
        .collect();
    let daemon = std::sync::Arc::new(std::sync::Mutex::new(
        NodeState::decode(api.node(&target_name).unwrap()["metadata"]["annotations"][NODE_STATE_KEY].as_str().unwrap())
            .unwrap(),
    ));
    let t = Instant::now();
    let chunk = bodies.len().div_ceil(8);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let mine: Vec<(String, Vec<u8>)> = bodies.drain(..chunk.min(bodies.len())).collect();
            let (api, daemon, target_name) = (api.clone(), daemon.clone(), target_name.clone());
            tokio::spawn(async move {
                let mut conn = Conn::open(addr).await;
                let mut ok = 0;
                for (name, b) in mine {
                    let (status, reply) = conn.request("POST", "/gpushare-scheduler/bind", &b).await;
                    assert_eq!(status, 200);
                    if reply == br#"{"Error":""}"# {
                        ok += 1;
                        report_allocated(&api, &daemon, &target_name, &name);
                    }
                }
                ok
            })
        })
        .collect();
    let mut ok = 0;
    for task in tasks {
        ok += task.await.unwrap();
    }
    let bind_secs = t.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss = status_kib(pid, "VmRSS:");
    let peak = status_kib(pid, "VmHWM:");
    println!("\nbinds into one node: {ok} of {binds} in {bind_secs:.2} s = {:.0} binds/s", f64::from(ok) / bind_secs);
    println!(
        "RSS: {:.1} MiB after sync, {:.1} MiB at the end, peak {:.1} MiB",
        rss_synced as f64 / 1024.0,
        rss as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    let _ = child.kill();
    let _ = child.wait();
}
