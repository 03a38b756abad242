//! Nodes still served by Alibaba's device plugin, during a move off Alibaba's gpushare: no
//! gpushared publishes for them, so, with Alibaba compatibility on, their GPUs are read as
//! Alibaba's own `kubectl-inspect-gpushare` reads them — `aliyun.com/gpu-count` GPUs sharing
//! the node's `aliyun.com/gpu-mem` capacity equally — and what each holds from the pods
//! Alibaba's extender placed there (`ALIYUN_COM_GPU_MEM_IDX`, `ALIYUN_COM_GPU_MEM_POD`). This
//! is for inspect alone: nothing is ever placed on such a node (its refusal stays "gpushared is
//! not running there").

use super::*;

/// A node's capacity as Alibaba's device plugin sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlibabaNode {
    /// `aliyun.com/gpu-count`.
    pub gpus: u32,
    /// `aliyun.com/gpu-mem`, in the cluster unit.
    pub units: u64,
}

/// One GPU of such a node: its total and the pods placed on it, in the cluster unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlibabaGpu {
    /// Its index, the `ALIYUN_COM_GPU_MEM_IDX` of its pods.
    pub index: u32,
    /// Its share of the node's memory.
    pub total: u64,
    /// Each pod placed on it: `namespace/name`, UID and its `ALIYUN_COM_GPU_MEM_POD`.
    pub pods: Vec<(String, String, u64)>,
}

impl AlibabaNode {
    /// From a Node's capacity: `None` unless both resources (`names`) are whole numbers above 0.
    #[must_use]
    pub fn of(node: &NodeObject, names: &ResourceNames) -> Option<Self> {
        let gpus = u32::try_from(node.capacity(names.count.as_str())?).ok().filter(|g| *g > 0)?;
        let units = node.capacity(names.memory.as_str()).filter(|u| *u > 0)?;
        Some(AlibabaNode { gpus, units })
    }
}

impl ClusterView {
    /// The GPUs of `node` if Alibaba's device plugin serves it (see the module), in index
    /// order, each with the non-terminal pods Alibaba's extender placed on it; `None` for any
    /// other node. A pod whose index is past the node's GPUs is left out, as Alibaba's inspect
    /// leaves it out.
    #[must_use]
    pub fn alibaba_gpus(&self, node: &str) -> Option<Vec<AlibabaGpu>> {
        let capacity = self.nodes.get(node)?.alibaba?;
        let total = capacity.units / u64::from(capacity.gpus);
        let mut gpus: Vec<AlibabaGpu> =
            (0..capacity.gpus).map(|index| AlibabaGpu { index, total, pods: Vec::new() }).collect();
        for uid in self.bound.get(node).into_iter().flatten() {
            let Some(pod) = self.pods.get(uid).filter(|p| !p.terminal) else { continue };
            if let Holding::Alibaba(a) = &pod.holding
                && let Some(gpu) = gpus.get_mut(a.idx as usize)
            {
                gpu.pods.push((pod.key(), pod.uid.clone(), a.pod));
            }
        }
        Some(gpus)
    }
}
