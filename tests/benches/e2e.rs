//! The end-to-end benchmark: pods placed and admitted per second across the box, and the
//! latency from bind to the container's environment.
//!
//! ```text
//! cargo build --release --bins && cargo bench -p gpushare-testkit --bench e2e
//! ```
//!
//! The box (`gpushare_testkit::cluster`) runs every piece as its own process: the API-server
//! stand-in, per node a kubelet stand-in and `gpushared` on the fake NVML library, the extender,
//! the kube-scheduler stand-in. `GPUSHARE_BENCH_NODES` (default 20) nodes of 4 × 32 GiB,
//! `GPUSHARE_BENCH_PODS` (default 1000) pods of 1–3 GiB (2,000 GiB of the box's 2,560) created
//! by 4 clients at once,
//! `GPUSHARE_BENCH_UNIT` (default `GiB`; `MiB` for one device per MiB). Reported: pods per
//! second from the first create to the list (polled every 20 ms) that first shows the last
//! pod Running; per pod, bind (the scheduler's watch sees `spec.nodeName`) to admission (the
//! kubelet stand-in records the `Allocate` answer), p50/p99/max.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt as _;
use gpushare_core::MemoryUnit;
use gpushare_testkit::cluster::{Cluster, Options, uniform_cluster};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::json;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn now_ms() -> u64 {
    u64::try_from(SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let nodes = usize::try_from(env("GPUSHARE_BENCH_NODES", 20)).unwrap();
    let pods = env("GPUSHARE_BENCH_PODS", 1000);
    let unit = match std::env::var("GPUSHARE_BENCH_UNIT").as_deref() {
        Ok("MiB") => MemoryUnit::Mib,
        _ => MemoryUnit::Gib,
    };
    let per_gib = if unit == MemoryUnit::Mib { 1024 } else { 1 };
    let mut spec = uniform_cluster(nodes, 4, 32_768, unit);
    for n in &mut spec.nodes {
        n.gpus[0].model = "NVIDIA A100".into();
    }
    let options =
        Options { dir: gpushare_testkit::box_dir(), dbus: false, log_filter: "warn".into(), ..Options::default() };
    let started = Instant::now();
    let box_ = Cluster::up(&spec, &options).await.unwrap();
    eprintln!("box up: {nodes} nodes of 4 x 32 GiB ({unit}) in {:.1} s", started.elapsed().as_secs_f64());
    // The clock starts with the first create.

    // When each pod is first seen bound, from a watch like the scheduler's.
    let bound_at: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let seen = Arc::clone(&bound_at);
    let api: Api<Pod> = Api::all(box_.client());
    let watch = tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default()).default_backoff().applied_objects().boxed();
        while let Some(Ok(pod)) = stream.next().await {
            if pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                seen.lock().unwrap().entry(uid).or_insert_with(now_ms);
            }
        }
    });

    let t0 = Instant::now();
    let clients = 4;
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let client = box_.client();
            tokio::spawn(async move {
                let api: Api<Pod> = Api::namespaced(client, "bench");
                let mut i = c;
                while i < pods {
                    let gib = 1 + (i * 7) % 3;
                    let pod: Pod = serde_json::from_value(json!({
                        "metadata": {"name": format!("b{i:05}"), "namespace": "bench"},
                        "spec": {"containers": [{"name": "main", "image": "x", "resources": {"limits": {
                            "gpushare.io/gpu-mem": (gib * per_gib).to_string()}}}]}
                    }))
                    .unwrap();
                    api.create(&kube::api::PostParams::default(), &pod).await.unwrap();
                    i += clients;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let created = t0.elapsed();
    let deadline = Instant::now() + Duration::from_secs(300);
    // The clock stops when the last pod is seen Running: the list that shows it is the
    // observation, the loop's exit (all done, timeout, no progress) only when it is noticed.
    let mut last_running = (0, t0);
    let mut last_progress = (0, Instant::now());
    let running = loop {
        let list = box_.pods().await.unwrap();
        let observed = Instant::now();
        let running =
            list.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")).count();
        let failed =
            list.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")).count();
        if running > last_running.0 {
            last_running = (running, observed);
        }
        if running + failed >= usize::try_from(pods).unwrap() || observed > deadline {
            break running;
        }
        if running + failed != last_progress.0 {
            last_progress = (running + failed, observed);
        } else if last_progress.1.elapsed() > Duration::from_secs(10) {
            eprintln!("no progress for 10 s: {running} running, {failed} failed of {pods}");
            break running;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(running > 0, "no pod runs: nothing to measure");
    assert_eq!(last_running.0, running, "the running count never falls");
    let elapsed = last_running.1.duration_since(t0);
    watch.abort();

    let bound_at = bound_at.lock().unwrap().clone();
    let mut latencies: Vec<u64> = box_
        .nodes
        .iter()
        .flat_map(|n| n.admissions().into_values())
        .filter_map(|r| bound_at.get(&r.uid).map(|b| r.at_ms.saturating_sub(*b)))
        .collect();
    latencies.sort_unstable();
    let report = box_.check_settled(Duration::from_secs(10)).await.unwrap();
    eprintln!(
        "{pods} pods created in {:.2} s; {running} running after {:.2} s: {:.0} pods/s placed and admitted",
        created.as_secs_f64(),
        elapsed.as_secs_f64(),
        running as f64 / elapsed.as_secs_f64()
    );
    eprintln!(
        "bind to container env: p50 {} ms, p99 {} ms, max {} ms ({} pods); invariant violations: {}",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or(0),
        latencies.len(),
        report.violations.len() + report.settled_violations.len()
    );
}
