//! Filter + prioritize one pod against 5,000 nodes × 8 GPUs, then place it on the best node:
//! what the extender does for every pod. Usage is realistic and deterministic: mixed GPU
//! models, GPUs from empty to full in pod-sized steps, about 3% unhealthy or cordoned.
//!
//! Run: `cargo bench -p gpushare-core --bench placement`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use gpushare_core::placement::{GpuPolicy, NodeView, Placer};
use gpushare_core::request::{ContainerRequest, ContainerRole, PodRequest};
use gpushare_core::schedule::{Policies, best, evaluate};
use gpushare_core::{Gpu, GpuUuid, Health, MemoryUnit, Mib, NodeInventory};

const NODES: usize = 5000;
const GPUS: u32 = 8;

/// A small deterministic generator (xorshift), so every run measures the same cluster.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn cluster() -> Vec<(NodeInventory, Vec<Mib>)> {
    let models =
        [("Tesla T4", 15_360u64), ("NVIDIA A10", 23_028), ("A100-SXM4-40GB", 40_960), ("A100-SXM4-80GB", 81_920)];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    (0..NODES)
        .map(|n| {
            let (model, total) = models[n % models.len()];
            let mut used = Vec::new();
            let gpus = (0..GPUS)
                .map(|i| {
                    let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{n:05}-{i}")).unwrap(), model, Mib::new(total));
                    match rng.below(64) {
                        0 => g.health = Health::Unhealthy { reason: "Xid 79".into() },
                        1 => g.cordoned = true,
                        _ => {}
                    }
                    // Pods of 1-8 GiB; a GPU holds up to what fits.
                    let mut u = 0;
                    for _ in 0..rng.below(8) {
                        let pod = (1 + rng.below(8)) * 1024;
                        if u + pod <= total {
                            u += pod;
                        }
                    }
                    used.push(Mib::new(u));
                    g
                })
                .collect();
            (NodeInventory::new(MemoryUnit::Mib, gpus).unwrap(), used)
        })
        .collect()
}

fn pod(containers: &[(&str, ContainerRole, u64, u32)]) -> PodRequest {
    PodRequest::new(
        MemoryUnit::Mib,
        containers
            .iter()
            .map(|(n, r, m, k)| ContainerRequest::new(*n, *r, Mib::new(*m), *k, MemoryUnit::Mib).unwrap())
            .collect(),
    )
}

fn bench(c: &mut Criterion) {
    let nodes = cluster();
    let views: Vec<NodeView<'_>> = nodes.iter().map(|(inv, used)| NodeView::new(inv, used).unwrap()).collect();
    let pods = [
        ("one container 3500 MiB", pod(&[("main", ContainerRole::App, 3500, 1)])),
        ("two GPUs x 12000 MiB", pod(&[("train", ContainerRole::App, 24_000, 2)])),
        (
            "init + sidecar + two apps",
            pod(&[
                ("fetch", ContainerRole::Init, 2000, 1),
                ("proxy", ContainerRole::Sidecar, 512, 1),
                ("model", ContainerRole::App, 6000, 1),
                ("tokenizer", ContainerRole::App, 1500, 1),
            ]),
        ),
    ];
    let mut group = c.benchmark_group("5000 nodes x 8 GPUs: filter+score all, place on best");
    for (name, p) in &pods {
        let mut placer = Placer::new();
        let verdicts = evaluate(&mut placer, views.iter().copied(), p, Policies::default());
        let fits = verdicts.iter().filter(|v| v.is_ok()).count();
        eprintln!("{name}: {fits} of {NODES} nodes fit");
        group.bench_function(*name, |b| {
            b.iter(|| {
                let verdicts = evaluate(&mut placer, views.iter().copied(), black_box(p), Policies::default());
                let chosen = best(&verdicts).unwrap();
                black_box(placer.place(views[chosen], p, GpuPolicy::Binpack).unwrap())
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
