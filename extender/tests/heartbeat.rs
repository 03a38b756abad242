//! A node whose daemon stops renewing its heartbeat: the extender stops placing pods by its
//! published state after three periods, says so in filter's reason, inspect and the metrics,
//! and trusts it again at the next renewal. The view's clock is moved by hand: the test waits
//! for the watch, never for a heartbeat period.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use gpushare_core::codec::heartbeat::{HEARTBEAT_KEY, Heartbeat};
use serde_json::{Value, json};

mod common;
use common::{http, node_object, pod_object, start_with_clock, until};
use gpushare_extender::clock::ManualClock;

fn beat(at_ms: i64) -> Value {
    json!({"metadata": {"annotations": {HEARTBEAT_KEY: Heartbeat { at_ms, every_seconds: 1 }.encode().unwrap()}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_daemon_stopped_renewing_its_heartbeat_takes_no_new_pod() {
    let clock = Arc::new(ManualClock::new());
    let h = start_with_clock(clock.clone()).await;
    let node = |name: &str| {
        let mut n = node_object(name, 1, 15_360);
        n["metadata"]["annotations"][HEARTBEAT_KEY] = beat(1)["metadata"]["annotations"][HEARTBEAT_KEY].clone();
        n
    };
    h.api.create_node(node("alive")).unwrap();
    h.api.create_node(node("dead")).unwrap();
    // A node whose daemon publishes no heartbeat (an older gpushared) is judged as before.
    h.api.create_node(node_object("old", 1, 15_360)).unwrap();
    let pod = h.api.create_pod("default", pod_object("p", 1000)).unwrap();
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts() == (3, 1, 0))).await;
    let filter = async || {
        let body = json!({"Pod": pod, "Nodes": null, "NodeNames": ["alive", "dead", "old"]}).to_string();
        serde_json::from_str::<Value>(&http(h.addr, "POST", "/gpushare-scheduler/filter", &body).await.1).unwrap()
    };
    assert_eq!(filter().await["NodeNames"], json!(["alive", "dead", "old"]));

    // "alive" renews every 500 ms of the view's clock; "dead" does not, and is stale after 3 s
    // (three periods): still placed at 3 s, no longer once past it.
    for at in 2..=7 {
        clock.advance(Duration::from_millis(500));
        h.api.patch(gpushare_testkit::apiserver::Kind::Node, "", "alive", &beat(at)).unwrap();
        until("alive's renewal in the view", async || {
            h.ext.with_view(|v| v.freshness("alive").is_some_and(|f| f.age.is_zero()))
        })
        .await;
        let r = filter().await;
        let by = Duration::from_millis(500) * u32::try_from(at - 1).unwrap();
        assert_eq!(r["NodeNames"], json!(["alive", "dead", "old"]), "{by:?} after dead's last beat: {r}");
    }
    clock.advance(Duration::from_millis(1));
    let result = filter().await;
    assert_eq!(result["NodeNames"], json!(["alive", "old"]), "{result}");
    let why = result["FailedAndUnresolvableNodes"]["dead"].as_str().unwrap();
    assert!(
        why.contains("node's gpushared has not renewed its gpushare.io/heartbeat for ")
            && why.contains("(stale after 3 s)"),
        "{why}"
    );
    let (_, inspect) = http(h.observe, "GET", "/gpushare-scheduler/inspect/dead", "").await;
    let inspect: Value = serde_json::from_str(&inspect).unwrap();
    assert_eq!(inspect["nodes"][0]["stale"], true, "{inspect}");
    let (_, metrics) = http(h.observe, "GET", "/metrics", "").await;
    assert!(metrics.contains("gpushare_node_stale{node=\"dead\"} 1\n"), "{metrics}");
    assert!(metrics.contains("gpushare_node_stale{node=\"alive\"} 0\n"), "{metrics}");
    assert!(metrics.contains("gpushare_gpu_schedulable{node=\"dead\",gpu=\"0\",uuid=\"GPU-dead-0\"} 0\n"), "{metrics}");
    // A bind there is refused for the same reason.
    let bind = json!({"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "dead"});
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind.to_string()).await;
    assert!(body.contains("has not renewed its gpushare.io/heartbeat"), "{body}");

    // The daemon comes back: its next renewal makes the node usable again.
    h.api.patch(gpushare_testkit::apiserver::Kind::Node, "", "dead", &beat(99)).unwrap();
    until("the renewal in the view", async || h.ext.report().nodes.iter().all(|n| !n.stale)).await;
    assert_eq!(filter().await["NodeNames"], json!(["alive", "dead", "old"]));
}
