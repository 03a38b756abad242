//! The pods the admission benchmarks (`allocate`, `nri`) bind to their node: GPU UUIDs, one
//! single-container pod per index spread over the GPUs, and the quantile of unsorted samples.

use std::collections::BTreeMap;
use std::time::Duration;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::PodRef;
use gpushare_core::{ContainerRole, GpuUuid, MemoryUnit, Mib};
use gpushared::allocation::pods::PodView;

use crate::common::percentile;

/// GPU `i`'s UUID.
pub(crate) fn uuid(i: u32) -> GpuUuid {
    GpuUuid::new(format!("GPU-bench-{i}")).unwrap()
}

/// Pod `p` bound to `bench-node`: one container `main` granted `mib` MiB on GPU `p % gpus`,
/// asking for as much `gpushare.io/gpu-mem` in `unit`.
pub(crate) fn pod(p: usize, gpus: u32, unit: MemoryUnit, mib: u64) -> PodView {
    let gpu = u32::try_from(p).unwrap() % gpus;
    let assignment = Assignment {
        node: "bench-node".into(),
        unit,
        containers: vec![ContainerAssignment {
            name: "main".into(),
            role: ContainerRole::App,
            gpus: vec![GpuShare { index: gpu, uuid: uuid(gpu), mib: Mib::new(mib) }],
        }],
    };
    let units = mib / unit.mib_per_unit();
    PodView {
        pod: PodRef { namespace: "bench".into(), name: format!("pod-{p:04}"), uid: format!("uid-{p:04}") },
        node: Some("bench-node".into()),
        created: format!("2026-01-01T00:{:02}:{:02}Z", p / 60, p % 60),
        version: 0,
        terminal: false,
        spec: serde_json::from_value(serde_json::json!({"containers": [{"name": "main",
            "resources": {"limits": {"gpushare.io/gpu-mem": units.to_string()}}}]}))
        .unwrap(),
        annotations: BTreeMap::from([(ASSIGNMENT_KEY.to_owned(), assignment.encode().unwrap())]),
        container_ids: Vec::new(),
    }
}

/// The `per_mille`-th of `samples` (nearest rank).
pub(crate) fn quantile(samples: &[Duration], per_mille: usize) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    percentile(&sorted, per_mille)
}
