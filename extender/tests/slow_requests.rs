//! One slow or huge request does not hold up the others, and none is answered later than
//! `request_timeout_seconds`: the verbs run off the async workers, large bodies one at a time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;
use common::{http, node_object, pod_object, start_with_timeout, until};

/// One test at a time: the huge bodies of one would take the CPU the other's timing needs
/// (two cores).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_stuck_behind_the_view_gets_503_at_the_timeout_and_health_still_answers() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let h = start_with_timeout(false, 64 << 20, Duration::from_secs(1)).await;
    h.api.create_node(node_object("gpu-a", 1, 15_360)).unwrap();
    let pod = h.api.create_pod("default", pod_object("p", 1000)).unwrap();
    // The node and the pod both in the view: the filter that waits below asks about them.
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts().0 == 1 && v.counts().1 == 1)).await;
    // Something holds the cluster view for 3 s (as a huge request would).
    // The requests start only once it holds the view: on a loaded machine a fixed pause could
    // let the filter take the view first.
    let ext = h.ext.clone();
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        ext.with_view(|_| {
            held_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_secs(3));
        });
    });
    tokio::task::spawn_blocking(move || held_rx.recv().unwrap()).await.unwrap();
    let (addr, observe) = (h.addr, h.observe);
    let body = json!({"Pod": pod, "Nodes": null, "NodeNames": ["gpu-a"]}).to_string();
    let start = Instant::now();
    let filter = tokio::spawn(async move { http(addr, "POST", "/gpushare-scheduler/filter", &body).await });
    // Two more verbs wait for the view too; health answers meanwhile.
    let more: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { http(observe, "GET", "/gpushare-scheduler/inspect", "").await }))
        .collect();
    let (status, _) = tokio::time::timeout(Duration::from_millis(500), http(addr, "GET", "/healthz", ""))
        .await
        .expect("/healthz held up by requests waiting for the view");
    assert_eq!(status, 200);
    let (status, body) = filter.await.unwrap();
    let took = start.elapsed();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not answered within 1 s"), "{body}");
    assert!(took < Duration::from_millis(2500), "answered after {took:?}, the view was held for 3 s");
    for m in more {
        assert_eq!(m.await.unwrap().0, 503);
    }
    holder.join().unwrap();
    // Once the view is free, the same request is answered.
    let body = json!({"Pod": h.api.pod("default", "p").unwrap(), "Nodes": null, "NodeNames": ["gpu-a"]}).to_string();
    let (status, body) = http(addr, "POST", "/gpushare-scheduler/filter", &body).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_requests_pass_while_huge_ones_are_decoded_one_at_a_time() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let h = start_with_timeout(false, 64 << 20, Duration::from_secs(30)).await;
    h.api.create_node(node_object("gpu-a", 2, 15_360)).unwrap();
    let pod = h.api.create_pod("default", pod_object("p", 1000)).unwrap();
    until("ready", async || h.ext.is_ready() && h.ext.with_view(|v| v.counts().1 == 1)).await;
    // Two filters of 400,000 node names each (about 15 MB), and small filters in between.
    let names: Vec<String> = (0..400_000).map(|i| format!("cpu-node-{i:07}-rack-a-zone-b-long")).collect();
    let huge = json!({"Pod": pod, "Nodes": null, "NodeNames": names}).to_string();
    assert!(huge.len() > 14 << 20, "{}", huge.len());
    let small_body = json!({"Pod": pod, "Nodes": null, "NodeNames": ["gpu-a"]}).to_string();
    let addr = h.addr;
    let big: Vec<_> = (0..2)
        .map(|_| {
            let body = huge.clone();
            tokio::spawn(async move {
                let (status, body) = http(addr, "POST", "/gpushare-scheduler/filter", &body).await;
                (status, body.len(), Instant::now())
            })
        })
        .collect();
    let started = Instant::now();
    // Small filters, one after another, for as long as the huge ones run.
    let mut slowest_small = Duration::ZERO;
    let mut small = 0;
    while !big.iter().all(tokio::task::JoinHandle::is_finished) {
        let start = Instant::now();
        let (status, body) = http(addr, "POST", "/gpushare-scheduler/filter", &small_body).await;
        slowest_small = slowest_small.max(start.elapsed());
        small += 1;
        assert_eq!(status, 200, "{body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["NodeNames"], json!(["gpu-a"]), "{body}");
    }
    let mut big_done = Vec::new();
    for b in big {
        let (status, len, at) = b.await.unwrap();
        assert_eq!(status, 200);
        assert!(len > 1000);
        big_done.push(at);
    }
    // The small ones did not queue behind the huge ones: each took a fraction of the time the
    // first huge one did (a ratio, so that the machine's speed does not matter).
    let first_big = *big_done.iter().min().unwrap() - started;
    assert!(small > 5, "only {small} small filters while the huge ones ran");
    assert!(slowest_small * 4 < first_big, "a small filter took {slowest_small:?}; the first huge one {first_big:?}");
}
