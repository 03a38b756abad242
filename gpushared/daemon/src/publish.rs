//! Publishes this node's state (GPUs, health, cordon, unit, daemon version, and per GPU the
//! memory held and by whom) as the `gpushare.io/node-state` annotation of its own Node, through
//! the core codec, for the extender and `kubectl-inspect-gpushare`.
//!
//! - A change (allocation, release, repair, health) starts a debounce window (100 ms); a burst
//!   of changes becomes one publication, and publications are at least 500 ms apart, so a node
//!   in heavy churn writes its Node at most twice a second.
//! - Each publication carries a generation one above the last: the first continues from the
//!   value already on the Node, so generations grow across daemon restarts.
//! - Only this node's annotation is written, with a JSON merge patch (nothing else on the Node
//!   is touched).
//! - API errors are retried with backoff (200 ms doubling to 10 s), publishing the state as it
//!   is at each attempt; the state is also republished every 10 minutes.
//! - A value over Kubernetes' annotation limit drops the per-GPU holder lists (the memory
//!   figures stay) and says so in the log.

use std::time::Duration;

use gpushare_core::codec::CodecError;
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use kube::Api;
use kube::api::{Patch, PatchParams};
use thiserror::Error;
use tokio::sync::watch;

use crate::allocator::Allocator;
use crate::objects::NodeObject;

/// The daemon's version, as published.
pub const DAEMON_VERSION: &str = env!("CARGO_PKG_VERSION");

/// How publication failed.
#[derive(Debug, Error)]
pub enum PublishError {
    /// The API server refused or could not be reached.
    #[error("node {node}: {what}: {source}")]
    Api {
        /// This node.
        node: String,
        /// What was being done.
        what: &'static str,
        /// The client's error.
        source: kube::Error,
    },
    /// The state cannot be encoded.
    #[error("node {node}: {source}")]
    Encode {
        /// This node.
        node: String,
        /// The codec's error.
        source: CodecError,
    },
}

/// Where the annotation goes: this node's Node object.
pub trait NodeApi: Send + Sync {
    /// The generation currently published on the Node, if any (a missing or unreadable
    /// annotation is `None`).
    fn published_generation(&self) -> impl Future<Output = Result<Option<u64>, PublishError>> + Send;
    /// Merge-patches the annotation.
    fn patch(&self, value: &str) -> impl Future<Output = Result<(), PublishError>> + Send;
}

/// The Node through the API server.
#[derive(Clone, Debug)]
pub struct KubeNode {
    api: Api<NodeObject>,
    node: String,
}

impl KubeNode {
    /// This node's Node object through `client`.
    #[must_use]
    pub fn new(client: kube::Client, node: String) -> Self {
        KubeNode { api: Api::all(client), node }
    }
}

impl NodeApi for KubeNode {
    async fn published_generation(&self) -> Result<Option<u64>, PublishError> {
        let node = self.api.get(&self.node).await.map_err(|source| PublishError::Api {
            node: self.node.clone(),
            what: "reading the Node",
            source,
        })?;
        Ok(node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_STATE_KEY))
            .and_then(|v| NodeState::decode(v).ok())
            .map(|s| s.generation))
    }

    async fn patch(&self, value: &str) -> Result<(), PublishError> {
        let body = serde_json::json!({ "metadata": { "annotations": { NODE_STATE_KEY: value } } });
        self.api
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map(|_| ())
            .map_err(|source| PublishError::Api { node: self.node.clone(), what: "patching its annotation", source })
    }
}

/// The annotation value for `state`: complete if it fits, else without the holder lists.
///
/// # Errors
/// [`CodecError`] if even the reduced value cannot be encoded.
pub fn encode(state: &NodeState) -> Result<(String, bool), CodecError> {
    match state.encode() {
        Ok(v) => Ok((v, false)),
        Err(CodecError::TooLarge { .. }) => {
            let reduced = NodeState { allocations: Vec::new(), ..state.clone() };
            reduced.encode().map(|v| (v, true))
        }
        Err(e) => Err(e),
    }
}

/// Publishing timings.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// How long a burst of changes is collected before publishing.
    pub debounce: Duration,
    /// The least time between two publications.
    pub min_interval: Duration,
    /// The first retry delay; doubles up to `max_backoff`.
    pub backoff: Duration,
    /// The longest retry delay.
    pub max_backoff: Duration,
    /// Republish this often even without changes.
    pub resync: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            debounce: Duration::from_millis(100),
            min_interval: Duration::from_millis(500),
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
            resync: Duration::from_secs(600),
        }
    }
}

/// Publishes `alloc`'s state to `node` now and after every change, forever.
pub async fn run<N: NodeApi>(node: N, alloc: std::sync::Arc<Allocator>, timing: Timing) {
    let mut changes: watch::Receiver<u64> = alloc.subscribe();
    let mut activity: watch::Receiver<u64> = alloc.subscribe_activity();
    let mut last: Option<u64> = None;
    loop {
        changes.borrow_and_update();
        activity.borrow_and_update();
        let mut delay = timing.backoff;
        loop {
            match publish_once(&node, &alloc, &mut last).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?delay, "cannot publish the node state; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(timing.max_backoff);
                }
            }
        }
        let published = tokio::time::Instant::now();
        let resync = tokio::time::sleep(timing.resync);
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
                tokio::time::sleep(timing.debounce).await;
                tokio::time::sleep_until(published + timing.min_interval).await;
            }
            Ok(()) = activity.changed() => {
                tokio::time::sleep_until(published + timing.min_interval).await;
            }
            () = resync => {}
        }
    }
}

async fn publish_once<N: NodeApi>(node: &N, alloc: &Allocator, last: &mut Option<u64>) -> Result<(), PublishError> {
    let previous = match *last {
        Some(g) => g,
        None => node.published_generation().await?.unwrap_or(0),
    };
    let generation = previous.saturating_add(1);
    let state = alloc.node_state(generation, DAEMON_VERSION);
    let (value, reduced) =
        encode(&state).map_err(|source| PublishError::Encode { node: alloc.node().to_owned(), source })?;
    if reduced {
        tracing::warn!(
            holders = state.allocations.len(),
            "the node state with every holder is over Kubernetes' annotation limit; publishing the memory figures without the holder lists"
        );
    }
    node.patch(&value).await?;
    *last = Some(generation);
    tracing::debug!(generation, bytes = value.len(), "published the node state");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_core::codec::node::{NodeAllocation, PodRef};
    use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory};

    /// A node of 8 x 80 GiB GPUs with `pods` single-container pods of realistic name lengths
    /// (a 253-character limit allows longer, but generated names are around these).
    fn state(pods: usize) -> NodeState {
        let gpus = (0..8u32)
            .map(|i| {
                let mut g = Gpu::new(
                    i,
                    GpuUuid::new(format!("GPU-8f6e2c1a-53b4-7f0e-9d2c-1a2b3c4d5e{i:02}")).unwrap(),
                    "NVIDIA H100 80GB HBM3",
                    Mib::new(81_559),
                );
                g.minor = Some(i);
                g.numa_node = Some(i / 4);
                g.pci_bus_id = Some(format!("00000000:{:02X}:00.0", 0x18 + i));
                g
            })
            .collect();
        let inventory = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
        let allocations: Vec<NodeAllocation> = (0..pods)
            .map(|p| NodeAllocation {
                pod: PodRef {
                    namespace: "ml-inference-prod".into(),
                    name: format!("llama-serving-deployment-7d9f8b6c5-{p:05}"),
                    uid: format!("3f1c2b4a-9e8d-4c7b-a6f5-{p:012}"),
                },
                container: "model-server".into(),
                gpu: u32::try_from(p % 8).unwrap(),
                mib: Mib::new(1024),
            })
            .collect();
        let mut used = vec![Mib::ZERO; 8];
        for a in &allocations {
            used[a.gpu as usize] = used[a.gpu as usize].saturating_add(a.mib);
        }
        NodeState { generation: 1, daemon_version: DAEMON_VERSION.into(), inventory, used, allocations }
    }

    #[test]
    fn hundreds_of_pods_fit_the_annotation_limit() {
        // Measured: 110 pods (the kubelet's default max-pods) 20,159 bytes, 250 pods 43,539,
        // 500 pods 85,289, against Kubernetes' 262,144 for all annotations of an object.
        for (pods, most) in [(110, 25_000), (250, 55_000), (500, 110_000)] {
            let (value, reduced) = encode(&state(pods)).unwrap();
            assert!(!reduced);
            assert!(value.len() < most, "{pods} pods: {} bytes", value.len());
            assert_eq!(NodeState::decode(&value).unwrap().allocations.len(), pods);
        }
    }

    #[test]
    fn an_oversized_state_keeps_the_memory_figures_without_the_holders() {
        let big = state(3_000);
        assert!(matches!(big.encode(), Err(CodecError::TooLarge { .. })));
        let (value, reduced) = encode(&big).unwrap();
        assert!(reduced);
        let back = NodeState::decode(&value).unwrap();
        assert!(back.allocations.is_empty());
        assert_eq!(back.used, big.used);
    }
}
