//! What the extender's HTTP tests share: objects for the API-server stand-in, a bare HTTP/1.1
//! client, and an extender served in-process over a stand-in.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory, ResourceNames};
use gpushare_extender::clock::{Clock, SystemClock};
use gpushare_extender::kube::{KubeCluster, client, watch};
use gpushare_extender::server::{ServerOptions, observe_router, router, serve};
use gpushare_extender::service::Extender;
use gpushare_extender::view::{ClusterView, ViewConfig};
use gpushare_testkit::apiserver::ApiServer;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A node whose daemon publishes `gpus` GPUs of `mib` MiB.
pub fn node_object(name: &str, gpus: u32, mib: u64) -> Value {
    let list = (0..gpus)
        .map(|i| {
            let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{name}-{i}")).unwrap(), "Tesla T4", Mib::new(mib));
            g.minor = Some(i);
            g
        })
        .collect();
    let inventory = NodeInventory::new(MemoryUnit::Mib, list).unwrap();
    let state = NodeState {
        generation: 1,
        daemon_version: "0.1.0".into(),
        used: vec![Mib::ZERO; gpus as usize],
        inventory,
        allocations: vec![],
        claims: vec![],
        over_budget: vec![],
        tells_lookalikes_apart: false,
    };
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {NODE_STATE_KEY: state.encode().unwrap()}},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.7"}]}
    })
}

pub fn pod_object(name: &str, mib: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "main", "image": "cuda",
                                 "resources": {"limits": {"gpushare.io/gpu-mem": mib.to_string()}}}]}
    })
}

/// One HTTP/1.1 request; returns the status and the body.
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    split_response(&raw)
}

pub fn split_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    // Chunked bodies (axum streams some): join the chunks.
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        body.to_owned()
    };
    (status, body)
}

pub struct Harness {
    pub api: ApiServer,
    /// kube-scheduler's verbs.
    pub addr: SocketAddr,
    /// `/metrics` and `/inspect` (`[server] observe_listen`).
    pub observe: SocketAddr,
    pub ext: Arc<Extender<KubeCluster>>,
    pub dir: tempfile::TempDir,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Harness {
    /// Stops the extender (its server and watches); the API server stays.
    pub fn stop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }

    /// Starts another extender over the same API server.
    pub async fn restart(&mut self, alibaba: bool) {
        self.stop();
        let kubeconfig = self.dir.path().join("kubeconfig");
        let ((addr, observe), ext, tasks) =
            serve_extender(&kubeconfig, alibaba, 1 << 20, Duration::from_secs(5), Arc::new(SystemClock)).await;
        (self.addr, self.observe, self.ext, self.tasks) = (addr, observe, ext, tasks);
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn view_config(alibaba: bool) -> ViewConfig {
    ViewConfig {
        unit: MemoryUnit::Mib,
        names: if alibaba { ResourceNames::alibaba() } else { ResourceNames::gpushare() },
        alibaba,
        assume_ttl: Duration::from_secs(300),
        heartbeat_by_wall_clock: false,
    }
}

async fn serve_extender(
    kubeconfig: &std::path::Path,
    alibaba: bool,
    max_body_bytes: usize,
    timeout: Duration,
    clock: Arc<dyn Clock>,
) -> ((SocketAddr, SocketAddr), Arc<Extender<KubeCluster>>, Vec<tokio::task::JoinHandle<()>>) {
    let client = client(Some(kubeconfig)).await.unwrap();
    let view = ClusterView::new(view_config(alibaba)).with_clock(clock);
    let ext = Arc::new(Extender::new(view, KubeCluster::new(client.clone()), Default::default()));
    let options = ServerOptions { prefix: "/gpushare-scheduler".into(), max_body_bytes, timeout };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(ext.clone(), &options);
    let server = tokio::spawn(async move {
        let _ = serve(listener, app, None, std::future::pending()).await;
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let observe = listener.local_addr().unwrap();
    let app = observe_router(ext.clone(), &options);
    let observer = tokio::spawn(async move {
        let _ = serve(listener, app, None, std::future::pending()).await;
    });
    let watcher = tokio::spawn(watch(client, ext.clone()));
    ((addr, observe), ext, vec![server, observer, watcher])
}

pub async fn start(max_body_bytes: usize) -> Harness {
    start_with(false, max_body_bytes).await
}

pub async fn start_with(alibaba: bool, max_body_bytes: usize) -> Harness {
    start_with_timeout(alibaba, max_body_bytes, Duration::from_secs(5)).await
}

/// [`start_with`], the requests answered within `timeout`.
pub async fn start_with_timeout(alibaba: bool, max_body_bytes: usize, timeout: Duration) -> Harness {
    start_full(alibaba, max_body_bytes, timeout, Arc::new(SystemClock)).await
}

/// [`start`], the view reading the time from `clock`.
#[allow(dead_code)] // not every test binary moves the clock
pub async fn start_with_clock(clock: Arc<dyn Clock>) -> Harness {
    start_full(false, 1 << 20, Duration::from_secs(5), clock).await
}

async fn start_full(alibaba: bool, max_body_bytes: usize, timeout: Duration, clock: Arc<dyn Clock>) -> Harness {
    let api = ApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let ((addr, observe), ext, tasks) = serve_extender(&kubeconfig, alibaba, max_body_bytes, timeout, clock).await;
    Harness { api, addr, observe, ext, dir, tasks }
}

pub async fn until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
