//! Filter and prioritize over many nodes: one pod against a cluster's worth of [`NodeView`]s,
//! each node either scored 0–10 or rejected with its reason, and the best node picked.
//! The extender answers kube-scheduler from this; the simulator and benchmarks use it too.

use serde::{Deserialize, Serialize};

use crate::placement::{GpuPolicy, NodePolicy, NodeView, Placer, Rejection};
use crate::request::PodRequest;

/// The two placement policies together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policies {
    /// How GPUs are chosen within a node.
    pub gpu: GpuPolicy,
    /// How nodes are ranked.
    pub node: NodePolicy,
}

/// Each node's verdict for `pod`, in the order given: a score, or why it was rejected.
pub fn evaluate<'a>(
    placer: &mut Placer,
    nodes: impl IntoIterator<Item = NodeView<'a>>,
    pod: &PodRequest,
    policies: Policies,
) -> Vec<Result<u8, Rejection>> {
    nodes.into_iter().map(|node| placer.score(node, pod, policies.gpu, policies.node)).collect()
}

/// The position of the highest-scoring node; the first one among equals.
#[must_use]
pub fn best(verdicts: &[Result<u8, Rejection>]) -> Option<usize> {
    let mut best: Option<(usize, u8)> = None;
    for (i, v) in verdicts.iter().enumerate() {
        if let Ok(score) = v
            && best.is_none_or(|(_, b)| *score > b)
        {
            best = Some((i, *score));
        }
    }
    best.map(|(i, _)| i)
}
