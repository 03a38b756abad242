//! At start, the restored ledger is checked against the node's own last publication (the
//! `gpushare.io/node-state` on its Node): every container published as holding memory must
//! have a row in the ledger, live or released. A ledger without them lost data (its `-wal`
//! deleted after a clean stop, the file truncated or replaced): it is reported loudly, a copy
//! of what is left is kept, no kubelet call is served, and once the pod watch has listed the
//! pods bound here the lost rows of those still running are booked again
//! ([`crate::allocation::allocator::Allocator::finish_rebuild`]).

use std::sync::Arc;
use std::time::Duration;

use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use kube::Api;

use crate::allocation::allocator::Allocator;
use crate::allocation::pods::PodStore;
use crate::cluster::objects::NodeObject;

/// Checks the ledger against the Node's published state and starts a rebuild when it lacks
/// allocations. Returns how many were missing. When the Node cannot be read (the API server
/// is down), the check is skipped and said so: the ledger is trusted as it is.
pub async fn check_ledger(client: kube::Client, node: &str, alloc: &Allocator) -> usize {
    let api: Api<NodeObject> = Api::all(client);
    let published = match tokio::time::timeout(Duration::from_secs(10), api.get(node)).await {
        Ok(Ok(n)) => n.metadata.annotations.as_ref().and_then(|a| a.get(NODE_STATE_KEY)).cloned(),
        Ok(Err(e)) => {
            tracing::warn!(node, error = %e, "cannot read this Node: the ledger is not checked against its last publication");
            return 0;
        }
        Err(_) => {
            tracing::warn!(
                node,
                "the API server did not answer within 10 s: the ledger is not checked against the Node's last publication"
            );
            return 0;
        }
    };
    let Some(state) = published.and_then(|v| NodeState::decode(&v).ok()) else { return 0 };
    let missing = match alloc.missing_from_ledger(&state.allocations) {
        Ok(m) => m,
        Err(e) => {
            tracing::error!(error = %e, "cannot check the ledger against the Node's last publication");
            return 0;
        }
    };
    if missing.is_empty() {
        return 0;
    }
    let mib: u64 = missing.iter().map(|a| a.mib.get()).sum();
    let pods: std::collections::BTreeSet<&str> = missing.iter().map(|a| a.pod.uid.as_str()).collect();
    let kept = match alloc.keep_ledger_copy("incomplete") {
        Ok(path) => path.display().to_string(),
        Err(e) => format!("no copy could be kept ({e})"),
    };
    tracing::error!(
        missing_allocations = missing.len(),
        pods = pods.len(),
        mib,
        generation = state.generation,
        kept_at = %kept,
        "THE ALLOCATION LEDGER LACKS ALLOCATIONS THIS NODE PUBLISHED (its write-ahead log lost, or the file truncated \
         or replaced): no kubelet call is served until they are booked again from the pods bound to this node"
    );
    let detail = format!(
        "the ledger lacked {} allocation(s) of {} pod(s), {mib} MiB, that the node had published (generation {}); \
         what was left was kept at {kept}; rebuilding",
        missing.len(),
        pods.len(),
        state.generation
    );
    if let Err(e) = alloc.record_event(crate::allocation::ledger::EventKind::LedgerIncomplete, &detail) {
        tracing::error!(error = %e, "cannot record the incomplete ledger in its history");
    }
    let n = missing.len();
    alloc.begin_rebuild(missing);
    n
}

/// Finishes a rebuild once the pod watch has listed the pods bound here; retries every second
/// while the ledger cannot be written.
pub async fn finish_rebuild(alloc: Arc<Allocator>, pods: PodStore) {
    while !pods.is_synced() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    loop {
        let a = Arc::clone(&alloc);
        match tokio::task::spawn_blocking(move || a.finish_rebuild()).await {
            Ok(Ok(done)) => {
                tracing::warn!(
                    rebooked = done.rows,
                    gone = done.gone,
                    "the ledger is rebuilt; serving the kubelet again"
                );
                return;
            }
            Ok(Err(e)) => tracing::error!(error = %e, "cannot rebuild the ledger; retrying in 1 s"),
            Err(e) => tracing::error!(error = %e, "the rebuild task failed; retrying in 1 s"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
