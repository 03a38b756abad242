//! Publishes this node's state (GPUs, health, cordon, unit, daemon version, and per GPU the
//! memory held and by whom) as the `gpushare.io/node-state` annotation of its own Node, through
//! the core codec, for the extender and `kubectl-inspect-gpushare`.
//!
//! - A change (allocation, release, repair, health) starts a debounce window (100 ms); a burst
//!   of changes becomes one publication, and publications are at least 500 ms apart, so a node
//!   in heavy churn writes its Node at most twice a second.
//! - A publication waits while the kubelet admits a container through the shared-memory
//!   resource (from its `GetPreferredAllocation` until its `Allocate` is answered) and 3 ms
//!   after, at most 250 ms: the patch is work that can wait, the kubelet's admission is not.
//! - Each publication carries a generation one above the last: the first continues from the
//!   value already on the Node, so generations grow across daemon restarts.
//! - Only this node's annotation is written, with a JSON merge patch (nothing else on the Node
//!   is touched).
//! - API errors are retried with backoff (200 ms doubling to 10 s), publishing the state as it
//!   is at each attempt; the state is also republished every 10 minutes.
//! - Kubernetes limits the total of all annotations of an object (every key and value) to
//!   256 KiB. The publisher learns the size of the Node's other annotations from the Node it
//!   reads at start and the Node each patch returns (and reads it again after any failure). A
//!   value that would take the total over the limit drops the per-GPU holder and claim lists
//!   (the memory figures stay) and says so in the log; if even that would not fit, nothing is
//!   written, an error names the sizes and the fix, and the publisher checks again every 10 s
//!   (the longest backoff).

use std::time::Duration;

use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::codec::{CodecError, MAX_ANNOTATION_BYTES};
use kube::Api;
use kube::api::{Patch, PatchParams};
use thiserror::Error;
use tokio::sync::watch;

use crate::DAEMON_VERSION;
use crate::allocation::allocator::Allocator;
use crate::cluster::objects::NodeObject;

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
    /// Even without the holder lists, the state would take the Node's annotations over
    /// Kubernetes' limit: the other annotations leave too little room.
    #[error(
        "node {node}: {NODE_STATE_KEY} would take {own} bytes (key and value, without the holder lists) beside {others} \
         bytes of the Node's other annotations, {} bytes over Kubernetes' limit of {limit} bytes for all annotations of \
         an object; remove or shorten the Node's other annotations (kubectl annotate node {node} KEY-)",
        excess(*.own, *.others, *.limit)
    )]
    DoesNotFit {
        /// This node.
        node: String,
        /// The smallest value with its key, in bytes.
        own: usize,
        /// The Node's other annotations (keys and values), in bytes.
        others: usize,
        /// Kubernetes' limit.
        limit: usize,
    },
}

/// How many bytes `own` and `others` are over `limit`.
fn excess(own: usize, others: usize, limit: usize) -> usize {
    own.saturating_add(others).saturating_sub(limit)
}

/// Kubernetes' limit on the total size of all annotations of an object: every key and value
/// (the API server refuses a write that would exceed it).
pub const MAX_TOTAL_ANNOTATION_BYTES: usize = MAX_ANNOTATION_BYTES;

/// What the publisher reads of its Node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    /// The generation published on the Node, if any (a missing or unreadable annotation is
    /// `None`).
    pub generation: Option<u64>,
    /// The bytes of the Node's other annotations (keys and values; all but
    /// [`NODE_STATE_KEY`]), which count against the same limit.
    pub other_annotation_bytes: usize,
}

impl NodeView {
    /// What the publisher reads of `node`.
    #[must_use]
    pub fn of(node: &NodeObject) -> Self {
        let annotations = node.metadata.annotations.as_ref();
        NodeView {
            generation: annotations
                .and_then(|a| a.get(NODE_STATE_KEY))
                .and_then(|v| NodeState::decode(v).ok())
                .map(|s| s.generation),
            other_annotation_bytes: annotations.map_or(0, |a| {
                a.iter().filter(|(k, _)| k.as_str() != NODE_STATE_KEY).map(|(k, v)| k.len() + v.len()).sum()
            }),
        }
    }
}

/// Where the annotation goes: this node's Node object.
pub trait NodeApi: Send + Sync {
    /// Reads the Node.
    fn read(&self) -> impl Future<Output = Result<NodeView, PublishError>> + Send;
    /// Merge-patches the annotation; returns the Node as the API server stored it.
    fn patch(&self, value: &str) -> impl Future<Output = Result<NodeView, PublishError>> + Send;
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
    async fn read(&self) -> Result<NodeView, PublishError> {
        let node = self.api.get(&self.node).await.map_err(|source| PublishError::Api {
            node: self.node.clone(),
            what: "reading the Node",
            source,
        })?;
        Ok(NodeView::of(&node))
    }

    async fn patch(&self, value: &str) -> Result<NodeView, PublishError> {
        let body = serde_json::json!({ "metadata": { "annotations": { NODE_STATE_KEY: value } } });
        self.api
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map(|node| NodeView::of(&node))
            .map_err(|source| PublishError::Api { node: self.node.clone(), what: "patching its annotation", source })
    }
}

/// What [`encode`] makes of a node state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Encoded {
    /// The complete value.
    Complete(String),
    /// The value without the holder lists (the memory figures stay): the complete one would
    /// not fit.
    WithoutHolders(String),
    /// Not even the value without the holder lists fits: with its key it takes `own` bytes.
    DoesNotFit {
        /// The smallest value's bytes with its key.
        own: usize,
    },
}

/// The annotation value for `state` beside `others` bytes of the Node's other annotations (keys
/// and values): complete if all the Node's annotations then fit Kubernetes' limit
/// ([`MAX_TOTAL_ANNOTATION_BYTES`]), else without the holder lists, else nothing.
///
/// # Errors
/// [`CodecError`] if the state cannot be encoded for another reason than its size.
pub fn encode(state: &NodeState, others: usize) -> Result<Encoded, CodecError> {
    let with_key = |value: &str| NODE_STATE_KEY.len() + value.len();
    let fits = |value: &str| with_key(value).saturating_add(others) <= MAX_TOTAL_ANNOTATION_BYTES;
    match state.encode() {
        Ok(v) if fits(&v) => return Ok(Encoded::Complete(v)),
        Ok(_) | Err(CodecError::TooLarge { .. }) => {}
        Err(e) => return Err(e),
    }
    match (NodeState { allocations: Vec::new(), claims: Vec::new(), ..state.clone() }).encode() {
        Ok(v) if fits(&v) => Ok(Encoded::WithoutHolders(v)),
        Ok(v) => Ok(Encoded::DoesNotFit { own: with_key(&v) }),
        Err(CodecError::TooLarge { len, .. }) => Ok(Encoded::DoesNotFit { own: NODE_STATE_KEY.len() + len }),
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
    /// A publication waits until the kubelet has admitted no container for this long (the
    /// answer to its `Allocate` on its way), so that a publication does not start while an
    /// admission is under way (one already running, or released by `max_hold`, still does).
    pub quiet: Duration,
    /// ... but never holds back longer than this, however busy the kubelet.
    pub max_hold: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            debounce: Duration::from_millis(100),
            min_interval: Duration::from_millis(500),
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
            resync: Duration::from_secs(600),
            quiet: Duration::from_millis(3),
            max_hold: Duration::from_millis(250),
        }
    }
}

/// Returns once the kubelet has been admitting no container for `timing.quiet` (see
/// [`Allocator::admission_started`]), or after `timing.max_hold`. Returns how long it held back.
pub(crate) async fn kubelet_quiet(admission: &mut watch::Receiver<bool>, timing: Timing) -> Duration {
    let start = tokio::time::Instant::now();
    let until = start + timing.max_hold;
    loop {
        match tokio::time::timeout_at(until, async { admission.wait_for(|busy| !busy).await.map(|_| ()) }).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) | Err(_) => break,
        }
        tokio::time::sleep(timing.quiet.min(until.saturating_duration_since(tokio::time::Instant::now()))).await;
        // Quiet throughout: no admission started (or ended) meanwhile.
        if !admission.has_changed().unwrap_or(false) || tokio::time::Instant::now() >= until {
            break;
        }
    }
    start.elapsed()
}

/// Publishes `alloc`'s state to `node` now and after every change, forever.
pub async fn run<N: NodeApi>(node: N, alloc: std::sync::Arc<Allocator>, timing: Timing) {
    let mut changes: watch::Receiver<u64> = alloc.subscribe();
    let mut activity: watch::Receiver<u64> = alloc.subscribe_activity();
    let mut admission = alloc.subscribe_admission();
    let mut publisher = Publisher::default();
    loop {
        changes.borrow_and_update();
        activity.borrow_and_update();
        let mut delay = timing.backoff;
        loop {
            let held = kubelet_quiet(&mut admission, timing).await;
            match publisher.publish_once(&node, &alloc, held).await {
                Ok(()) => break,
                Err(e @ PublishError::DoesNotFit { .. }) => {
                    // Retrying sooner would not help: the other annotations must change first.
                    if publisher.unfit_logged {
                        tracing::debug!(error = %e, retry_in = ?timing.max_backoff, "the node state still does not fit");
                    } else if let PublishError::DoesNotFit { own, others, limit, .. } = &e {
                        tracing::error!(
                            error = %e,
                            annotation_bytes = own,
                            other_annotation_bytes = others,
                            limit_bytes = limit,
                            retry_in = ?timing.max_backoff,
                            "the node state does not fit beside the Node's other annotations; nothing is published until it does"
                        );
                        publisher.unfit_logged = true;
                    }
                    tokio::time::sleep(timing.max_backoff).await;
                    delay = timing.max_backoff;
                }
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

/// What the publisher knows between publications.
#[derive(Debug, Default)]
struct Publisher {
    /// The generation last published.
    last: Option<u64>,
    /// The bytes of the Node's other annotations as last seen; `None`: read the Node first.
    others: Option<usize>,
    /// The last publication left out the holder lists.
    reduced: bool,
    /// The state does not fit, and the error is logged.
    unfit_logged: bool,
}

impl Publisher {
    /// Publishes the state now; `held` is how long it waited for the kubelet (for the log).
    async fn publish_once<N: NodeApi>(
        &mut self,
        node: &N,
        alloc: &Allocator,
        held: Duration,
    ) -> Result<(), PublishError> {
        let start = tokio::time::Instant::now();
        let (previous, others) = match (self.last, self.others) {
            (Some(last), Some(others)) => (last, others),
            (last, _) => {
                let view = node.read().await?;
                self.others = Some(view.other_annotation_bytes);
                (last.or(view.generation).unwrap_or(0), view.other_annotation_bytes)
            }
        };
        let generation = previous.saturating_add(1);
        let state = alloc.node_state(generation, DAEMON_VERSION);
        let encoded =
            encode(&state, others).map_err(|source| PublishError::Encode { node: alloc.node().to_owned(), source })?;
        let (value, reduced) = match encoded {
            Encoded::Complete(v) => (v, false),
            Encoded::WithoutHolders(v) => (v, true),
            Encoded::DoesNotFit { own } => {
                // Read the Node again next time: its other annotations must shrink first.
                self.others = None;
                return Err(PublishError::DoesNotFit {
                    node: alloc.node().to_owned(),
                    own,
                    others,
                    limit: MAX_TOTAL_ANNOTATION_BYTES,
                });
            }
        };
        if reduced && !self.reduced {
            tracing::warn!(
                holders = state.allocations.len(),
                claims = state.claims.len(),
                other_annotation_bytes = others,
                limit_bytes = MAX_TOTAL_ANNOTATION_BYTES,
                "the node state with every holder would take the Node's annotations over Kubernetes' limit; publishing the memory figures without the holder lists"
            );
        }
        match node.patch(&value).await {
            Ok(view) => self.others = Some(view.other_annotation_bytes),
            Err(e) => {
                // The Node may have changed (deleted and created again, other annotations
                // grown until the API server refused the patch): read it again.
                self.others = None;
                return Err(e);
            }
        }
        if !reduced && self.reduced {
            tracing::info!("the node state fits with every holder again");
        }
        if self.unfit_logged {
            tracing::info!(bytes = NODE_STATE_KEY.len() + value.len(), "the node state fits again and is published");
            self.unfit_logged = false;
        }
        self.reduced = reduced;
        self.last = Some(generation);
        tracing::debug!(generation, bytes = value.len(), reduced, held = ?held, took = ?start.elapsed(), "published the node state");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use gpushare_core::codec::node::{NodeAllocation, NodeClaim, PodRef};
    use gpushare_core::dra::ClaimRef;
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
                role: gpushare_core::ContainerRole::App,
                gpu: u32::try_from(p % 8).unwrap(),
                mib: Mib::new(1024),
            })
            .collect();
        let mut used = vec![Mib::ZERO; 8];
        for a in &allocations {
            used[a.gpu as usize] = used[a.gpu as usize].saturating_add(a.mib);
        }
        NodeState {
            generation: 1,
            daemon_version: DAEMON_VERSION.into(),
            inventory,
            used,
            allocations,
            claims: Vec::new(),
            over_budget: Vec::new(),
            tells_lookalikes_apart: false,
        }
    }

    /// The value without the holder lists.
    fn reduced(state: &NodeState) -> String {
        NodeState { allocations: Vec::new(), claims: Vec::new(), ..state.clone() }.encode().unwrap()
    }

    #[test]
    fn hundreds_of_pods_fit_the_annotation_limit() {
        // Measured: 110 pods (the kubelet's default max-pods) 20,159 bytes, 250 pods 43,539,
        // 500 pods 85,289, against Kubernetes' 262,144 for all annotations of an object.
        for (pods, most) in [(110, 25_000), (250, 55_000), (500, 110_000)] {
            let Encoded::Complete(value) = encode(&state(pods), 0).unwrap() else { panic!("{pods} pods: reduced") };
            assert!(value.len() < most, "{pods} pods: {} bytes", value.len());
            // BENCHMARKS.md records these (`-- --nocapture`).
            println!("node-state annotation, 8 GPUs, {pods} pods: {} bytes", value.len());
            assert_eq!(NodeState::decode(&value).unwrap().allocations.len(), pods);
        }
    }

    #[test]
    fn hundreds_of_dra_claims_fit_the_annotation_limit() {
        // Claims from ResourceClaimTemplates, named `<pod>-<request>-<suffix>`.
        for (claims, most) in [(110, 25_000), (500, 110_000)] {
            let mut state = state(0);
            state.claims = (0..claims)
                .map(|c| NodeClaim {
                    claim: ClaimRef {
                        uid: format!("9d0e4c7b-1a2b-4c3d-8e9f-{c:012}"),
                        namespace: "ml-inference-prod".into(),
                        name: format!("llama-serving-deployment-7d9f8b6c5-{c:05}-gpu-x7k2q"),
                    },
                    request: "gpu".into(),
                    gpu: u32::try_from(c % 8).unwrap(),
                    mib: Mib::new(1024),
                })
                .collect();
            let Encoded::Complete(value) = encode(&state, 0).unwrap() else { panic!("{claims} claims: reduced") };
            assert!(value.len() < most, "{claims} claims: {} bytes", value.len());
            // BENCHMARKS.md records these (`-- --nocapture`).
            println!("node-state annotation, 8 GPUs, {claims} claims: {} bytes", value.len());
            assert_eq!(NodeState::decode(&value).unwrap().claims.len(), claims);
        }
    }

    #[test]
    fn an_oversized_state_keeps_the_memory_figures_without_the_holders() {
        let mut big = state(3_000);
        big.claims.push(NodeClaim {
            claim: ClaimRef { uid: "u".into(), namespace: "ml".into(), name: "c".into() },
            request: "gpu".into(),
            gpu: 0,
            mib: Mib::new(1),
        });
        assert!(matches!(big.encode(), Err(CodecError::TooLarge { .. })));
        let Encoded::WithoutHolders(value) = encode(&big, 0).unwrap() else { panic!("not reduced") };
        let back = NodeState::decode(&value).unwrap();
        assert!(back.allocations.is_empty() && back.claims.is_empty());
        assert_eq!(back.used, big.used);
    }

    #[test]
    fn the_other_annotations_count_against_the_same_limit() {
        // Kubernetes counts every key and value of the object: with `others` bytes of other
        // annotations, the node state's key and value may take the rest, to the byte.
        let s = state(110);
        let complete = s.encode().unwrap();
        let room = |value: &str| MAX_TOTAL_ANNOTATION_BYTES - NODE_STATE_KEY.len() - value.len();
        assert_eq!(encode(&s, room(&complete)).unwrap(), Encoded::Complete(complete.clone()));
        // One byte less room: the holder lists go, the memory figures stay.
        let without = reduced(&s);
        assert_eq!(encode(&s, room(&complete) + 1).unwrap(), Encoded::WithoutHolders(without.clone()));
        assert_eq!(encode(&s, room(&without)).unwrap(), Encoded::WithoutHolders(without.clone()));
        // No room even for that: nothing, with the size it needs.
        let own = NODE_STATE_KEY.len() + without.len();
        // Measured: 1,819 bytes for these 8 GPUs.
        assert!(own < 2_000, "8 GPUs without the holder lists: {own} bytes");
        assert_eq!(encode(&s, room(&without) + 1).unwrap(), Encoded::DoesNotFit { own });
        assert_eq!(encode(&s, MAX_TOTAL_ANNOTATION_BYTES).unwrap(), Encoded::DoesNotFit { own });
        assert_eq!(encode(&s, usize::MAX).unwrap(), Encoded::DoesNotFit { own });
        // What the error says.
        let e = PublishError::DoesNotFit { node: "node-a".into(), own: 2_000, others: 261_000, limit: 262_144 };
        let text = e.to_string();
        for part in ["2000 bytes", "261000 bytes", "856 bytes over", "262144 bytes", "kubectl annotate node node-a"] {
            assert!(text.contains(part), "{part:?} in {text}");
        }
    }

    #[test]
    fn the_publisher_counts_every_other_annotation_of_its_node() {
        let node: NodeObject =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "node-a", "annotations": {
                "team": "ml",
                NODE_STATE_KEY: reduced(&state(0)),
            }}}))
            .unwrap();
        assert_eq!(NodeView::of(&node), NodeView { generation: Some(1), other_annotation_bytes: 6 });
        assert_eq!(NodeView::of(&NodeObject::default()), NodeView::default());
    }

    /// A Node in memory that counts reads and patches and refuses, as the API server does, a
    /// patch that would take its annotations over the limit.
    #[derive(Clone, Default)]
    struct FakeNode(Arc<Mutex<Fake>>);

    #[derive(Default)]
    struct Fake {
        /// The other annotations' bytes (the test changes them).
        others: usize,
        reads: usize,
        /// Every patch attempted.
        attempts: usize,
        /// The values stored.
        stored: Vec<String>,
    }

    impl FakeNode {
        fn with(&self, f: impl FnOnce(&mut Fake)) {
            f(&mut self.0.lock().unwrap());
        }
        fn get<T>(&self, f: impl FnOnce(&Fake) -> T) -> T {
            f(&self.0.lock().unwrap())
        }
        fn view(f: &Fake) -> NodeView {
            NodeView {
                generation: f.stored.last().map(|v| NodeState::decode(v).unwrap().generation),
                other_annotation_bytes: f.others,
            }
        }
    }

    impl NodeApi for FakeNode {
        async fn read(&self) -> Result<NodeView, PublishError> {
            let mut f = self.0.lock().unwrap();
            f.reads += 1;
            Ok(Self::view(&f))
        }

        async fn patch(&self, value: &str) -> Result<NodeView, PublishError> {
            let mut f = self.0.lock().unwrap();
            f.attempts += 1;
            if NODE_STATE_KEY.len() + value.len() + f.others > MAX_TOTAL_ANNOTATION_BYTES {
                return Err(PublishError::Api {
                    node: "node-a".into(),
                    what: "patching its annotation",
                    source: kube::Error::Service("metadata.annotations: Too long".into()),
                });
            }
            f.stored.push(value.to_owned());
            Ok(Self::view(&f))
        }
    }

    /// An allocator for node-a with one 1000 MiB GPU.
    fn allocator(dir: &std::path::Path) -> Arc<Allocator> {
        let ledger = crate::allocation::ledger::Ledger::open(&dir.join("ledger.db")).unwrap().ledger;
        let gpu = Gpu::new(0, GpuUuid::new("GPU-0").unwrap(), "Tesla T4", Mib::new(1000));
        let inventory = NodeInventory::new(MemoryUnit::Mib, vec![gpu]).unwrap();
        let names = gpushare_core::ResourceNames::gpushare();
        let compat = crate::config::Compatibility::Gpushare;
        Arc::new(
            Allocator::new("node-a".into(), names, compat, inventory, crate::allocation::pods::PodStore::new(), ledger)
                .unwrap(),
        )
    }

    /// Quick timings: the first retry after 1 ms, doubling to 300 ms.
    const QUICK: Timing = Timing {
        debounce: Duration::from_millis(10),
        min_interval: Duration::from_millis(20),
        backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(300),
        resync: Duration::from_secs(600),
        quiet: Duration::from_millis(5),
        max_hold: Duration::from_millis(400),
    };

    async fn eventually(what: &str, ok: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !ok() {
            assert!(std::time::Instant::now() < deadline, "{what}: not within 5 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A publisher with `timing` on a Node with room, once its first publication is stored.
    async fn publishing(timing: Timing) -> (tempfile::TempDir, Arc<Allocator>, FakeNode, tokio::task::JoinHandle<()>) {
        let dir = tempfile::tempdir().unwrap();
        let alloc = allocator(dir.path());
        let node = FakeNode::default();
        node.with(|f| f.others = 100);
        let task = tokio::spawn(run(node.clone(), Arc::clone(&alloc), timing));
        eventually("the first publication", || node.get(|f| f.stored.len() == 1)).await;
        (dir, alloc, node, task)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_without_room_gets_nothing_and_is_read_again_at_the_longest_backoff() {
        let dir = tempfile::tempdir().unwrap();
        let node = FakeNode::default();
        node.with(|f| f.others = MAX_TOTAL_ANNOTATION_BYTES - 10);
        let task = tokio::spawn(run(node.clone(), allocator(dir.path()), QUICK));
        // Doubling from 1 ms would read the Node about ten times in 700 ms; at the longest
        // backoff it is read at 0, 300 and 600 ms.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let (reads, attempts) = node.get(|f| (f.reads, f.attempts));
        assert!((1..=3).contains(&reads), "{reads} reads in 700 ms");
        assert_eq!(attempts, 0, "nothing is written that would not fit");
        // Room is made: the next read sees it, and the first publication is generation 1 (none
        // was used up while nothing fitted).
        node.with(|f| f.others = 100);
        eventually("the publication", || node.get(|f| !f.stored.is_empty())).await;
        let published = node.get(|f| NodeState::decode(&f.stored[0]).unwrap());
        assert_eq!(published.generation, 1);
        task.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_patch_reads_the_node_again_and_learns_it_has_no_room() {
        let (_dir, alloc, node, task) = publishing(QUICK).await;
        assert_eq!(node.get(|f| f.reads), 1, "the patch's answer says how big the rest is");
        // Someone else annotates the Node; the publisher learns of it when its patch is refused.
        node.with(|f| f.others = MAX_TOTAL_ANNOTATION_BYTES - 10);
        alloc.set_health(0, gpushare_core::Health::Unhealthy { reason: "Xid 79".into() }).unwrap();
        eventually("the refused patch and a new read", || node.get(|f| f.attempts == 2 && f.reads == 2)).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        let (attempts, reads, stored) = node.get(|f| (f.attempts, f.reads, f.stored.len()));
        assert_eq!((attempts, stored), (2, 1), "no patch that cannot fit");
        assert!((2..=4).contains(&reads), "read again at the longest backoff: {reads} reads");
        node.with(|f| f.others = 100);
        eventually("the publication once there is room", || node.get(|f| f.stored.len() == 2)).await;
        let published = node.get(|f| NodeState::decode(&f.stored[1]).unwrap());
        assert_eq!(published.generation, 2);
        assert!(matches!(published.inventory.gpus()[0].health, gpushare_core::Health::Unhealthy { .. }));
        task.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_publication_waits_for_the_kubelets_admission_to_end() {
        // Held back for as long as it takes: only the end of the admission releases it.
        let (_dir, alloc, node, task) = publishing(Timing { max_hold: Duration::from_secs(60), ..QUICK }).await;
        // The kubelet is admitting a container (its Allocate on its way) when the state changes.
        alloc.admission_started();
        alloc.set_health(0, gpushare_core::Health::Unhealthy { reason: "Xid 79".into() }).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(node.get(|f| f.stored.len()), 1, "held back while the kubelet admits");
        alloc.admission_ended();
        eventually("the publication once the Allocate is answered", || node.get(|f| f.stored.len() == 2)).await;
        task.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admission_that_never_ends_holds_a_publication_back_for_max_hold_only() {
        let (_dir, alloc, node, task) = publishing(QUICK).await;
        // The kubelet gone between its two calls: no Allocate ends the admission.
        alloc.admission_started();
        let changed = std::time::Instant::now();
        alloc.set_health(0, gpushare_core::Health::Unhealthy { reason: "Xid 79".into() }).unwrap();
        eventually("the publication despite the open admission", || node.get(|f| f.stored.len() == 2)).await;
        assert!(changed.elapsed() >= QUICK.max_hold, "published after {:?}", changed.elapsed());
        let published = node.get(|f| NodeState::decode(&f.stored[1]).unwrap());
        assert!(!published.inventory.gpus()[0].health.is_healthy());
        task.abort();
    }
}
