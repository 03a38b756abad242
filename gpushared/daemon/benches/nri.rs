//! What joining the runtime's NRI costs each container: `CreateContainer` through the NRI
//! socket, the daemon's own plugin ([`gpushared::nri::serve`]) in this process and a stand-in
//! runtime speaking NRI's framing over the unix socket, a real SQLite ledger in a temporary
//! directory.
//!
//! 8 GPUs of 80 GiB in GiB mode, 500 single-container pods of 1 GiB, each admitted first
//! (GetPreferredAllocation and a durable Allocate, the allocation service called directly,
//! answering the lean set). Then the runtime creates each pod's container, its environment the
//! lean answer: the plugin completes it from the ledger. Then as many containers that hold
//! nothing of gpushare's, which the runtime passes to every plugin all the same. Prints
//! p50/p90/p99/max of each, and the NRI round trips against the durable `allocate()`.
//!
//! Run: `cargo bench -p gpushared --bench nri`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_core::{Gpu, MemoryUnit, Mib, NodeInventory, ResourceNames};
use gpushare_proto::nri as api;
use gpushare_proto::ttrpc;
use gpushare_testkit::nri::Runtime;
use gpushared::allocation::allocator::Allocator;
use gpushared::allocation::ledger::Ledger;
use gpushared::allocation::pods::PodStore;
use gpushared::config::{Compatibility, ContainerEnvironment, NriConfig};
use prost::Message as _;
use tokio::net::UnixListener;

mod common;
mod workload;
use common::report;
use workload::{pod, quantile, uuid};

const GPUS: u32 = 8;
const GPU_GIB: u64 = 80;
const PODS: usize = 500;

/// Admits every pod, one at a time, the allocation service called directly; returns the
/// allocator, each container's lean environment (`KEY=value`), and each durable `allocate()`.
fn admit_all(dir: &std::path::Path) -> (Arc<Allocator>, Vec<Vec<String>>, Vec<Duration>) {
    let gpus = (0..GPUS).map(|i| Gpu::new(i, uuid(i), "A100-SXM4-80GB", Mib::new(GPU_GIB * 1024))).collect();
    let inventory = NodeInventory::new(MemoryUnit::Gib, gpus).unwrap();
    let pods = PodStore::new();
    let ledger = Ledger::open(&dir.join("ledger.db")).unwrap().ledger;
    let alloc = Allocator::new(
        "bench-node".into(),
        ResourceNames::gpushare(),
        Compatibility::Gpushare,
        inventory,
        pods.clone(),
        ledger,
    )
    .unwrap()
    .with_environment(ContainerEnvironment::Lean);
    let all: Vec<String> =
        (0..usize::try_from(GPUS).unwrap()).flat_map(|g| alloc.devices().ids(g).collect::<Vec<_>>()).collect();
    let mut in_use = std::collections::HashSet::new();
    let (mut envs, mut took) = (Vec::with_capacity(PODS), Vec::with_capacity(PODS));
    for p in 0..PODS {
        pods.upsert(pod(p, GPUS, MemoryUnit::Gib, 1024));
        let available: Vec<&str> = all.iter().filter(|d| !in_use.contains(*d)).map(String::as_str).collect();
        let ids = alloc.preferred(available, &[], 1).unwrap();
        let t = Instant::now();
        let answer = alloc.allocate(&ids).unwrap();
        took.push(t.elapsed());
        envs.push(answer.envs.iter().map(|(k, v)| format!("{k}={v}")).collect());
        in_use.extend(ids);
    }
    (Arc::new(alloc), envs, took)
}

/// The payload of a call the plugin answered with success.
fn answered(response: ttrpc::Response) -> Vec<u8> {
    assert_eq!(response.status.map_or(0, |s| s.code), 0);
    response.payload
}

fn create(p: usize, env: Vec<String>) -> Vec<u8> {
    api::CreateContainerRequest {
        pod: Some(api::PodSandbox {
            id: format!("sandbox-{p}"),
            name: format!("pod-{p:04}"),
            uid: format!("uid-{p:04}"),
            namespace: "bench".into(),
        }),
        container: Some(api::Container {
            id: format!("c-{p}"),
            pod_sandbox_id: format!("sandbox-{p}"),
            name: "main".into(),
            env,
        }),
    }
    .encode_to_vec()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let base = std::env::var("BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let dir = tempfile::tempdir_in(&base).unwrap();
    let (alloc, envs, allocate) = tokio::task::block_in_place(|| admit_all(dir.path()));

    let path = dir.path().join("nri.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let config: NriConfig = toml::from_str(&format!("enabled = true\nsocket = {path:?}")).unwrap();
    let plugin = tokio::spawn(async move { gpushared::nri::serve(&alloc, &config).await });
    let (socket, _) = listener.accept().await.unwrap();
    let mut runtime = Runtime::new(socket);
    runtime.registration(None).await;
    answered(runtime.call("Configure", api::ConfigureRequest::default().encode_to_vec()).await);

    let mut ours = Vec::with_capacity(PODS);
    for (p, env) in envs.into_iter().enumerate() {
        let request = create(p, env);
        let t = Instant::now();
        let response = runtime.call("CreateContainer", request).await;
        ours.push(t.elapsed());
        let adjust = api::CreateContainerResponse::decode(answered(response).as_slice()).unwrap().adjust.unwrap();
        assert!(adjust.env.iter().any(|kv| kv.key == "GPUSHARE_MEMORY_MIB"), "{adjust:?}");
    }
    let mut others = Vec::with_capacity(PODS);
    for p in PODS..2 * PODS {
        let request = create(p, vec!["PATH=/usr/bin".into(), "HOSTNAME=web".into()]);
        let t = Instant::now();
        let response = runtime.call("CreateContainer", request).await;
        others.push(t.elapsed());
        assert!(api::CreateContainerResponse::decode(answered(response).as_slice()).unwrap().adjust.is_none());
    }
    answered(runtime.call("Shutdown", api::Empty {}.encode_to_vec()).await);
    plugin.await.unwrap().unwrap();

    let p50 = |v: &[Duration]| quantile(v, 500);
    println!("NRI CreateContainer through the socket: {GPUS} GPUs x {GPU_GIB} GiB, {PODS} pods x 1 GiB, lean answers");
    report("allocate() (durable)", allocate.clone());
    report("CreateContainer, ours", ours.clone());
    report("CreateContainer, not ours", others.clone());
    println!(
        "p50 against allocate(): ours {:.3}, not ours {:.3}",
        p50(&ours).as_secs_f64() / p50(&allocate).as_secs_f64(),
        p50(&others).as_secs_f64() / p50(&allocate).as_secs_f64(),
    );
}
