//! Renews this node's `gpushare.io/heartbeat` annotation every `[kubernetes]
//! heartbeat_seconds`, a small merge patch of that key alone, so that the extender can tell a
//! live daemon's published state from a dead one's ([`gpushare_core::codec::heartbeat`]). A
//! failed renewal is logged and tried again at the next period: missing one is harmless, the
//! extender waits three.

use std::time::Duration;

use gpushare_core::codec::heartbeat::{HEARTBEAT_KEY, Heartbeat};
use kube::Api;
use kube::api::{Patch, PatchParams};

use crate::cluster::objects::NodeObject;

/// Renews the heartbeat of Node `node` every `every`, forever.
pub async fn run(client: kube::Client, node: String, every: Duration) {
    let api: Api<NodeObject> = Api::all(client);
    let every_seconds = u32::try_from(every.as_secs().max(1)).unwrap_or(u32::MAX);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        let value = match (Heartbeat { at_ms: crate::allocation::ledger::now_ms(), every_seconds }).encode() {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode the heartbeat");
                continue;
            }
        };
        let body = serde_json::json!({ "metadata": { "annotations": { HEARTBEAT_KEY: value } } });
        match api.patch(&node, &PatchParams::default(), &Patch::Merge(&body)).await {
            Ok(_) if failing => {
                tracing::info!(node = %node, "the heartbeat is renewed again");
                failing = false;
            }
            Ok(_) => tracing::trace!(node = %node, "heartbeat renewed"),
            Err(e) => {
                tracing::warn!(node = %node, error = %e, retry_in = ?every, "cannot renew the heartbeat on the Node");
                failing = true;
            }
        }
    }
}
