//! The extender's request bodies, as kube-scheduler (or anything else) may send them: any
//! bytes are a 400 or an answer, never a panic, and filter, prioritize and preempt answer
//! whatever parses, over a small cluster view with GPUs, bound pods and an in-flight bind.
#![no_main]

use std::sync::OnceLock;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::schedule::Policies;
use gpushare_core::{ContainerRole, Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory, ResourceNames};
use gpushare_extender::service::Extender;
use gpushare_extender::service::fake::FakeCluster;
use gpushare_extender::view::{ClusterView, ViewConfig};
use gpushare_extender::wire::{BindingArgs, ExtenderArgs, PreemptionArgs};
use libfuzzer_sys::fuzz_target;
use serde_json::json;

fn extender() -> &'static Extender<FakeCluster> {
    static EXT: OnceLock<Extender<FakeCluster>> = OnceLock::new();
    EXT.get_or_init(|| {
        let mut view = ClusterView::new(ViewConfig {
            unit: MemoryUnit::Mib,
            names: ResourceNames::gpushare(),
            alibaba: false,
            assume_ttl: std::time::Duration::from_secs(300),
            heartbeat_by_wall_clock: false,
        });
        for (node, gpus) in [("n1", 2u32), ("n2", 4)] {
            let list = (0..gpus)
                .map(|i| Gpu::new(i, GpuUuid::new(format!("GPU-{node}-{i}")).unwrap(), "T4", Mib::new(15_360)))
                .collect();
            let state = NodeState {
                generation: 1,
                daemon_version: "fuzz".into(),
                inventory: NodeInventory::new(MemoryUnit::Mib, list).unwrap(),
                used: vec![Mib::ZERO; gpus as usize],
                allocations: vec![],
                claims: vec![],
                over_budget: vec![],
                // n2's daemon tells look-alikes apart: binds there skip the look-alike rule.
                tells_lookalikes_apart: node == "n2",
            };
            let object = json!({"metadata": {"name": node, "annotations": {NODE_STATE_KEY: state.encode().unwrap()}}});
            view.apply_node(&serde_json::from_value(object).unwrap());
        }
        for (i, mib) in [(0, 3000u64), (1, 9000)] {
            let a = Assignment {
                node: "n1".into(),
                unit: MemoryUnit::Mib,
                containers: vec![ContainerAssignment {
                    name: "main".into(),
                    role: ContainerRole::App,
                    gpus: vec![GpuShare {
                        index: i,
                        uuid: GpuUuid::new(format!("GPU-n1-{i}")).unwrap(),
                        mib: Mib::new(mib),
                    }],
                }],
            };
            let pod = json!({"metadata": {"name": format!("p{i}"), "namespace": "default", "uid": format!("uid-p{i}"),
                                          "annotations": {ASSIGNMENT_KEY: a.encode().unwrap()}},
                             "spec": {"nodeName": "n1", "priority": i, "containers": [{"name": "main",
                                      "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]},
                             "status": {"phase": "Running"}});
            view.apply_pod(&serde_json::from_value(pod).unwrap());
        }
        let ext = Extender::new(view, FakeCluster::default(), Policies::default());
        ext.set_ready(true);
        ext
    })
}

fuzz_target!(|data: &[u8]| {
    let ext = extender();
    if let Ok(args) = serde_json::from_slice::<ExtenderArgs<'_>>(data) {
        let _ = serde_json::to_vec(&ext.filter(&args)).expect("a filter answer encodes");
        let _ = serde_json::to_vec(&ext.prioritize(&args)).expect("a prioritize answer encodes");
    }
    if let Ok(args) = serde_json::from_slice::<PreemptionArgs>(data) {
        let answer = ext.preempt(&args);
        for (node, victims) in &answer.node_name_to_meta_victims {
            assert!(!victims.pods.is_empty(), "an empty victim list for {node}");
            assert!(victims.num_pdb_violations >= 0);
        }
    }
    let _ = serde_json::from_slice::<BindingArgs>(data);
});
