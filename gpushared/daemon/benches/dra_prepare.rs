//! NodePrepareResources and NodeUnprepareResources through the DRA socket, as the kubelet calls
//! them: the daemon's own DRA server in this process, a gRPC client over the unix socket, a real
//! SQLite ledger and the CDI directory in a temporary directory (on the build machine's disk).
//! Each prepare reads the claim (from memory here: the API server's GET is not measured), checks
//! the GPU's room, commits the claim's row and writes its CDI spec (fsynced, renamed) before the
//! answer.
//!
//! 8 GPUs of 81 920 MiB, 1000 claims of 600 MiB spread over them, prepared one at a time, then
//! unprepared. Prints p50/p90/p99/max latency of each call and the prepares per second.
//!
//! Run: `cargo bench -p gpushared --bench dra_prepare`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory, ResourceNames, SharingMode};
use gpushare_proto::dra::dra_plugin_client::DraPluginClient;
use gpushare_proto::dra::{Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest};
use gpushared::allocation::allocator::Allocator;
use gpushared::allocation::ledger::Ledger;
use gpushared::allocation::pods::PodStore;
use gpushared::config::Compatibility;
use gpushared::dra::grpc::{RegistrationService, serve};
use gpushared::dra::service::{ClaimSource, Driver};
use k8s_openapi::api::resource::v1::ResourceClaim;

mod common;
use common::report;

const GPUS: u32 = 8;
const GPU_MIB: u64 = 81_920;
const CLAIMS: usize = 1000;
const CLAIM_MIB: u64 = 600;
const DRIVER: &str = "gpu.gpushare.io";
const NODE: &str = "bench-node";

/// The claims as kube-scheduler left them, by name.
struct Claims(HashMap<String, ResourceClaim>);

impl ClaimSource for Claims {
    async fn get(&self, _: &str, name: &str) -> Result<ResourceClaim, String> {
        self.0.get(name).cloned().ok_or_else(|| format!("no claim {name}"))
    }
}

fn claim(i: usize) -> ResourceClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("c-{i:04}"), "namespace": "bench", "uid": format!("uid-{i:04}")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpushare-memory"}}]}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": DRIVER, "pool": NODE, "device": format!("gpu-{}", i % GPUS as usize),
            "shareID": format!("00000000-0000-0000-0000-{i:012}"),
            "consumedCapacity": {"memory": format!("{CLAIM_MIB}Mi")},
        }]}}},
    }))
    .unwrap()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let base = std::env::var("BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let dir = tempfile::tempdir_in(&base).unwrap();
    let gpus = (0..GPUS)
        .map(|i| {
            let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-bench-{i}")).unwrap(), "A100", Mib::new(GPU_MIB));
            g.mode = SharingMode::Dra;
            g
        })
        .collect();
    let inventory = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
    let ledger = Ledger::open(&dir.path().join("ledger.db")).unwrap().ledger;
    let alloc = Arc::new(
        Allocator::new(
            NODE.into(),
            ResourceNames::gpushare(),
            Compatibility::Gpushare,
            inventory,
            PodStore::new(),
            ledger,
        )
        .unwrap(),
    );
    let claims = Claims((0..CLAIMS).map(|i| (format!("c-{i:04}"), claim(i))).collect());
    let driver = Arc::new(Driver {
        alloc: Arc::clone(&alloc),
        claims,
        driver: DRIVER.into(),
        node: NODE.into(),
        cdi_dir: dir.path().join("cdi"),
    });
    let socket = dir.path().join("dra.sock");
    let plugin = gpushared::kubelet::plugin::bind(&socket).unwrap();
    let reg = gpushared::kubelet::plugin::bind(&dir.path().join("reg.sock")).unwrap();
    let registration = RegistrationService { driver: DRIVER.into(), endpoint: socket.display().to_string() };
    let shutdown = futures::FutureExt::shared(Box::pin(std::future::pending::<()>()));
    tokio::spawn(serve(driver, registration, (plugin, reg), shutdown));
    let mut client = DraPluginClient::new(gpushare_proto::uds::connect(&socket).await.unwrap());
    let named = |i: usize| Claim { namespace: "bench".into(), uid: format!("uid-{i:04}"), name: format!("c-{i:04}") };

    let mut prepare = Vec::with_capacity(CLAIMS);
    let started = Instant::now();
    for i in 0..CLAIMS {
        let t = Instant::now();
        let answer =
            client.node_prepare_resources(NodePrepareResourcesRequest { claims: vec![named(i)] }).await.unwrap();
        prepare.push(t.elapsed());
        let one = &answer.get_ref().claims[&format!("uid-{i:04}")];
        assert!(one.error.is_empty(), "{}", one.error);
    }
    let elapsed = started.elapsed();
    let mut repeat = Vec::with_capacity(CLAIMS);
    for i in 0..CLAIMS {
        let t = Instant::now();
        client.node_prepare_resources(NodePrepareResourcesRequest { claims: vec![named(i)] }).await.unwrap();
        repeat.push(t.elapsed());
    }
    let mut unprepare = Vec::with_capacity(CLAIMS);
    for i in 0..CLAIMS {
        let t = Instant::now();
        client.node_unprepare_resources(NodeUnprepareResourcesRequest { claims: vec![named(i)] }).await.unwrap();
        unprepare.push(t.elapsed());
    }
    println!(
        "DRA through the socket: {GPUS} GPUs x {GPU_MIB} MiB, {CLAIMS} claims x {CLAIM_MIB} MiB, durable ledger and CDI spec"
    );
    report("NodePrepareResources", prepare);
    report("NodePrepareResources again", repeat);
    report("NodeUnprepareResources", unprepare);
    println!("prepares per second          {:.0} (one claim each)", CLAIMS as f64 / elapsed.as_secs_f64());
    assert!(alloc.live_claims().is_empty());
}
