//! Start to serving: from spawning the `gpushared` binary to the kubelet stand-in holding its
//! registration and its complete device list, for 8 GPUs x 16 384 MiB (131 072 devices) from
//! the static GPU list, the ledger as left by the previous run. Ten runs; prints the median and
//! the slowest.
//!
//! Run: `cargo bench -p gpushared --bench startup`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpushare_testkit::kubelet::Kubelet;

const RUNS: usize = 10;

fn config(dir: &std::path::Path) -> std::path::PathBuf {
    let mut gpus = String::new();
    for i in 0..8 {
        let _ = write!(
            gpus,
            "[[gpus]]\nindex = {i}\nuuid = \"GPU-start-{i}\"\nmodel = \"Tesla T4\"\nmemory_mib = 16384\nnuma_node = {}\n",
            i / 4
        );
    }
    std::fs::write(dir.join("kubeconfig"), "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:9\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n").unwrap();
    let path = dir.join("gpushared.toml");
    std::fs::write(
        &path,
        format!(
            "node_name = \"bench\"\n[kubelet]\ndevice_plugin_dir = \"{0}/dp\"\n[ledger]\npath = \"{0}/ledger.db\"\n\
             [kubernetes]\nkubeconfig = \"{0}/kubeconfig\"\n{gpus}",
            dir.display()
        ),
    )
    .unwrap();
    path
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let base = std::env::var("BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let dir = tempfile::tempdir_in(base).unwrap();
    std::fs::create_dir_all(dir.path().join("dp")).unwrap();
    let config = config(dir.path());
    let mut registered = Vec::new();
    let mut listed = Vec::new();
    for _ in 0..RUNS {
        let kubelet = Kubelet::start(&dir.path().join("dp")).await.unwrap();
        let t = Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpushared"))
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        kubelet.wait_registered(1, Duration::from_secs(20)).await.unwrap();
        registered.push(t.elapsed());
        kubelet.wait_devices(Duration::from_secs(20), |d| d.len() == 8 * 16_384).await.unwrap();
        listed.push(t.elapsed());
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
        let _ = child.wait();
        kubelet.stop();
    }
    registered.sort();
    listed.sort();
    println!("Start to serving: 8 GPUs x 16384 MiB (131072 devices), static GPU list, {RUNS} runs");
    println!(
        "registered with the kubelet   median {:>8.1?}  slowest {:>8.1?}",
        registered[RUNS / 2],
        registered[RUNS - 1]
    );
    println!("full device list received     median {:>8.1?}  slowest {:>8.1?}", listed[RUNS / 2], listed[RUNS - 1]);
}
