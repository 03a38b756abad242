//! The daemon's memory and its `Allocate` latency as the kubelet sees it: the `gpushared`
//! process serving 8 GPUs (MiB mode: 16 384 MiB each, 131 072 devices; `RSS_UNIT=GiB`: 80 GiB
//! each, 640 devices), 500 containers admitted through the kubelet stand-in, their pods in the
//! API-server stand-in.
//!
//! Run: `cargo bench -p gpushared --bench rss`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::cast_precision_loss)]

use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::{ContainerRole, GpuUuid, MemoryUnit, Mib};
use gpushare_testkit::apiserver::ApiServer;
use gpushare_testkit::kubelet::Kubelet;
use serde_json::json;

const GPUS: u32 = 8;
const PODS: usize = 500;

/// The CPU time `pid` has used, user and system (`/proc/PID/stat`, in clock ticks of 10 ms).
fn cpu_ms(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses: utime and stime are the
    // 12th and 13th of them.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let ticks: u64 = after.split_whitespace().skip(11).take(2).map(|v| v.parse::<u64>().unwrap()).sum();
    ticks * 10
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let base = std::env::var("BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let dir = tempfile::tempdir_in(base).unwrap();
    let api = ApiServer::start().await.unwrap();
    api.write_kubeconfig(&dir.path().join("kubeconfig")).unwrap();
    // The daemon publishes its state on its Node, as in a cluster.
    api.create_node(json!({"metadata": {"name": "node-a"}})).unwrap();
    // RSS_UNIT=GiB measures GiB mode (8 x 80 GiB, pods of 1 GiB); RSS_GPU_MIB and RSS_POD_UNITS
    // change the sizes (RSS_GPU_MIB=1024 RSS_POD_UNITS=10: the baseline of a small device list).
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let unit = if std::env::var("RSS_UNIT").is_ok_and(|u| u == "GiB") { MemoryUnit::Gib } else { MemoryUnit::Mib };
    let gib = unit == MemoryUnit::Gib;
    let gpu_mib = env("RSS_GPU_MIB", if gib { 81_920 } else { 16_384 });
    let pod_units = usize::try_from(env("RSS_POD_UNITS", if gib { 1 } else { 200 })).unwrap();
    let pod_mib = pod_units as u64 * unit.mib_per_unit();
    let devices = u64::from(GPUS) * (gpu_mib / unit.mib_per_unit());
    let mut gpus = String::new();
    for i in 0..GPUS {
        let _ = write!(
            gpus,
            "[[gpus]]\nindex = {i}\nuuid = \"GPU-rss-{i}\"\nmodel = \"Tesla T4\"\nmemory_mib = {gpu_mib}\n"
        );
    }
    let config = dir.path().join("gpushared.toml");
    std::fs::write(
        &config,
        format!(
            "node_name = \"node-a\"\n[kubelet]\ndevice_plugin_dir = \"{0}/dp\"\n[ledger]\npath = \"{0}/ledger.db\"\n\
             [kubernetes]\nkubeconfig = \"{0}/kubeconfig\"\n[resources]\nunit = \"{unit}\"\n{gpus}",
            dir.path().display()
        ),
    )
    .unwrap();
    // Each pod is bound just before the kubelet admits it, as gpushare-extender binds pods that
    // look alike to the kubelet (same size, other GPUs): the next only once the node reports the
    // previous allocated. Bound all at once, every call would be ambiguous, and the daemon waits
    // out its 5 s for the pod watch before serving the oldest.
    let bind_pod = |p: usize| {
        let gpu = u32::try_from(p).unwrap() % GPUS;
        let a = Assignment {
            node: "node-a".into(),
            unit,
            containers: vec![ContainerAssignment {
                name: "main".into(),
                role: ContainerRole::App,
                gpus: vec![GpuShare {
                    index: gpu,
                    uuid: GpuUuid::new(format!("GPU-rss-{gpu}")).unwrap(),
                    mib: Mib::new(pod_mib),
                }],
            }],
        };
        api.create_pod(
            "bench",
            json!({"metadata": {"name": format!("pod-{p:04}"), "annotations": {ASSIGNMENT_KEY: a.encode().unwrap()}},
                   "spec": {"nodeName": "node-a", "containers": [{"name": "main", "image": "x",
                   "resources": {"limits": {"gpushare.io/gpu-mem": pod_units.to_string()}}}]}}),
        )
        .unwrap();
    };
    std::fs::create_dir_all(dir.path().join("dp")).unwrap();
    let kubelet = Kubelet::start(&dir.path().join("dp")).await.unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpushared"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .envs(std::env::var("RSS_DAEMON_ENV").ok().iter().flat_map(|v| {
            v.split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect::<Vec<_>>()
        }))
        .stdout(Stdio::null())
        // RSS_DAEMON_LOG=FILE keeps the daemon's log (with RSS_DAEMON_ENV=RUST_LOG=debug, say).
        .stderr(
            std::env::var_os("RSS_DAEMON_LOG").map_or_else(Stdio::null, |f| std::fs::File::create(f).unwrap().into()),
        )
        .spawn()
        .unwrap();
    kubelet.wait_registered(1, Duration::from_secs(20)).await.unwrap();
    kubelet.wait_devices(Duration::from_secs(20), |d| !d.is_empty()).await.unwrap();
    // Steady state: the daemon hands the device list's pages back within 10 s of sending it.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let idle = status_kib(child.id(), "VmRSS:");
    let cpu_before = cpu_ms(child.id());
    let burst = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut admitted = 0;
    let mut latencies = Vec::with_capacity(PODS);
    let mut bound = 0;
    // RSS_GAP_MS=N waits between the two calls, which the kubelet makes back to back: it tells
    // the cost of Allocate itself from the after-effects of the large call before it.
    let gap = std::env::var("RSS_GAP_MS").ok().and_then(|v| v.parse().ok()).map(Duration::from_millis);
    // RSS_SLOW=MS prints each Allocate slower than that, with the wall clock, to match with the
    // daemon's log (RSS_DAEMON_LOG).
    let slow = std::env::var("RSS_SLOW").ok().and_then(|v| v.parse().ok()).map(Duration::from_millis);
    while admitted < PODS {
        if bound == admitted {
            bind_pod(admitted);
            bound += 1;
        }
        let ids = match kubelet.preferred(pod_units).await {
            Ok(ids) => ids,
            Err(e) if Instant::now() < deadline && e.to_string().contains("no pod bound") => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        if let Some(gap) = gap {
            tokio::time::sleep(gap).await;
        }
        // The call alone, without the stand-in's bookkeeping after it.
        match kubelet.allocate_timed(&ids).await {
            Ok((_, took)) => {
                latencies.push(took);
                admitted += 1;
                if let Some(slow) = slow
                    && took > slow
                {
                    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
                    println!(
                        "slow Allocate #{}: {took:.3?} ending at {}.{:06}",
                        admitted - 1,
                        now.as_secs() % 86_400,
                        now.subsec_micros()
                    );
                }
            }
            Err(e) if Instant::now() < deadline && e.to_string().contains("no pod bound") => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let cpu = cpu_ms(child.id()) - cpu_before;
    let burst = burst.elapsed();
    // The round trip alone, with the cheapest call.
    let mut trips = Vec::with_capacity(PODS);
    for _ in 0..PODS {
        let t = Instant::now();
        kubelet.ask_options().await.unwrap();
        trips.push(t.elapsed());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let busy = status_kib(child.id(), "VmRSS:");
    // Settled: the daemon returns a burst's freed pages once it has been quiet for 1 s.
    tokio::time::sleep(gpushared::memory::QUIET + Duration::from_millis(500)).await;
    let rss = status_kib(child.id(), "VmRSS:");
    let peak = status_kib(child.id(), "VmHWM:");
    let anon = status_kib(child.id(), "RssAnon:");
    let file = status_kib(child.id(), "RssFile:");
    if std::env::var("RSS_SMAPS").is_ok() {
        // The largest resident mappings, for finding where memory goes.
        let smaps = std::fs::read_to_string(format!("/proc/{}/smaps", child.id())).unwrap();
        let mut maps: Vec<(u64, String)> = Vec::new();
        let mut current = String::new();
        for line in smaps.lines() {
            if line.split_whitespace().next().is_some_and(|f| f.contains('-') && !f.ends_with(':')) {
                current = line.to_owned();
            } else if let Some(kb) = line.strip_prefix("Rss:") {
                maps.push((kb.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0), current.clone()));
            }
        }
        maps.sort_by_key(|m| std::cmp::Reverse(m.0));
        for (kb, map) in maps.iter().take(12) {
            println!("  {kb:>6} kB  {map}");
        }
    }
    if let Some(s) = std::env::var("RSS_HOLD").ok().and_then(|v| v.parse().ok()) {
        println!("holding pid {} for {s} s", child.id());
        std::thread::sleep(Duration::from_secs(s));
    }
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    let _ = child.wait();
    latencies.sort();
    trips.sort();
    let at = |per_mille: usize| latencies[(latencies.len() - 1) * per_mille / 1000];
    let trip = |per_mille: usize| trips[(trips.len() - 1) * per_mille / 1000];
    println!(
        "gpushared RSS: {unit} mode, 8 GPUs x {gpu_mib} MiB ({devices} devices), {PODS} pods of {pod_units} {unit} \
         in the API server"
    );
    println!("serving, idle, no allocation yet  {:>6.1} MiB", idle as f64 / 1024.0);
    println!(
        "after {PODS} allocations           {:>6.1} MiB settled, {:.1} MiB right after the burst (peak {:.1} MiB)",
        rss as f64 / 1024.0,
        busy as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    println!(
        "  of which heap and stacks        {:>6.1} MiB, mapped binary and libraries {:.1} MiB",
        anon as f64 / 1024.0,
        file as f64 / 1024.0
    );
    println!(
        "Allocate to the daemon process    p50 {:.3?}  p90 {:.3?}  p99 {:.3?}  max {:.3?}",
        at(500),
        at(900),
        at(990),
        at(1000)
    );
    println!(
        "daemon CPU during the {PODS} admissions {cpu} ms in {:.1} s: {:.1} ms an admission (both calls)",
        burst.as_secs_f64(),
        cpu as f64 / PODS as f64
    );
    println!("GetDevicePluginOptions round trip p50 {:.3?}  p90 {:.3?}  p99 {:.3?}", trip(500), trip(900), trip(990));
}
