//! The API server: the client from a kubeconfig, the Node and Pod watches that feed the cluster
//! view, and the [`Cluster`] calls the verbs make (read a pod, create a `pods/binding`).

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt as _;
use kube::api::PostParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Api, Client, Config};
use serde_json::json;
use thiserror::Error;

use gpushare_core::retry::Backoff;

use crate::objects::{NodeObject, PodObject};
use crate::service::{Binding, Cluster, ClusterError, Extender};
use crate::view::{ClusterView, NodeReading};

/// The API server cannot be set up.
#[derive(Debug, Error)]
pub enum KubeError {
    /// The kubeconfig is missing or invalid.
    #[error("kubeconfig {path}: {reason}")]
    Kubeconfig {
        /// The file, or where it was looked for.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

/// A client from the kubeconfig at `path`, or, without one, from `$KUBECONFIG`,
/// `~/.kube/config` or the in-cluster service account.
///
/// # Errors
/// [`KubeError::Kubeconfig`] naming the file and the problem.
pub async fn client(path: Option<&Path>) -> Result<Client, KubeError> {
    let config = match path {
        Some(path) => {
            let bad = |reason: String| KubeError::Kubeconfig { path: path.display().to_string(), reason };
            let kubeconfig = Kubeconfig::read_from(path).map_err(|e| bad(e.to_string()))?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|e| bad(e.to_string()))?
        }
        None => Config::infer().await.map_err(|e| KubeError::Kubeconfig {
            path: std::env::var("KUBECONFIG").unwrap_or_else(|_| "~/.kube/config".to_owned()),
            reason: e.to_string(),
        })?,
    };
    Client::try_from(config).map_err(|e| KubeError::Kubeconfig { path: "(inferred)".to_owned(), reason: e.to_string() })
}

/// [`Cluster`] over a real API server.
#[derive(Clone)]
pub struct KubeCluster {
    client: Client,
}

impl std::fmt::Debug for KubeCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeCluster")
    }
}

impl KubeCluster {
    /// Calls through `client`.
    #[must_use]
    pub fn new(client: Client) -> Self {
        KubeCluster { client }
    }
}

fn classify(e: kube::Error) -> ClusterError {
    match e {
        kube::Error::Api(status) if status.code == 409 => ClusterError::Conflict(status.message),
        kube::Error::Api(status) if status.code == 404 => ClusterError::NotFound(status.message),
        kube::Error::Api(status) => ClusterError::Failed(format!("API server: {} ({})", status.message, status.code)),
        e => ClusterError::Failed(e.to_string()),
    }
}

impl Cluster for KubeCluster {
    async fn get_pod(&self, namespace: &str, name: &str) -> Result<PodObject, ClusterError> {
        Api::<PodObject>::namespaced(self.client.clone(), namespace).get(name).await.map_err(classify)
    }

    async fn bind(&self, b: &Binding) -> Result<(), ClusterError> {
        let body = json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": b.name, "namespace": b.namespace, "uid": b.uid, "annotations": b.annotations},
            "target": {"apiVersion": "v1", "kind": "Node", "name": b.node},
        });
        Api::<PodObject>::namespaced(self.client.clone(), &b.namespace)
            .create_subresource::<_, serde_json::Value>("binding", &b.name, &PostParams::default(), &body)
            .await
            .map(drop)
            .map_err(classify)
    }
}

/// Disagreement lines logged per change, at most: a node reporting thousands of pods the view
/// does not know must not flood the log at every publication (the metric counts them all).
const DISAGREEMENTS_LOGGED: usize = 10;

fn log_disagreements(found: Vec<String>) {
    let more = found.len().saturating_sub(DISAGREEMENTS_LOGGED);
    for d in found.into_iter().take(DISAGREEMENTS_LOGGED) {
        tracing::warn!(disagreement = %d, "a daemon's report differs from the extender's view");
    }
    if more > 0 {
        tracing::warn!(
            more,
            "and more disagreements like these (gpushare_extender_view_disagreements_total counts them all)"
        );
    }
}

/// Keeps the extender's view current from the API server, forever: Nodes and Pods are
/// watched; each watch (re)start's complete list replaces what the view had. The extender is
/// ready once both first lists are in.
pub async fn watch<C: Cluster>(client: Client, extender: Arc<Extender<C>>) {
    let nodes_synced = Arc::new(AtomicBool::new(false));
    let pods_synced = Arc::new(AtomicBool::new(false));
    extender.with_view(ClusterView::await_initial_lists);
    let ready = {
        let (n, p, e) = (nodes_synced.clone(), pods_synced.clone(), extender.clone());
        move || {
            if n.load(Ordering::SeqCst) && p.load(Ordering::SeqCst) && !e.is_ready() {
                e.set_ready(true);
                let (nodes, pods, _) = e.with_view(|v| v.counts());
                tracing::info!(nodes, gpu_pods = pods, "cluster view synced; ready");
            }
        }
    };
    let nodes = {
        let (ext, ready) = (extender.clone(), ready.clone());
        let api: Api<NodeObject> = Api::all(client.clone());
        async move {
            let mut stream = watcher(api, watcher::Config::default()).boxed();
            let mut relist: Vec<NodeObject> = Vec::new();
            let mut backoff = Backoff::cluster_wide();
            while let Some(event) = stream.next().await {
                back_again(&mut backoff, event.is_ok(), "node");
                let found = match event {
                    Ok(watcher::Event::Apply(n)) => {
                        let read = read_states(&ext, [&n]);
                        ext.with_view(|v| read.into_iter().flat_map(|(n, r)| v.apply_reading(n, r)).collect())
                    }
                    Ok(watcher::Event::InitApply(n)) => {
                        relist.push(n);
                        Vec::new()
                    }
                    Ok(watcher::Event::Delete(n)) => {
                        ext.with_view(|v| v.delete_node(n.name()));
                        Vec::new()
                    }
                    Ok(watcher::Event::Init) => {
                        relist.clear();
                        Vec::new()
                    }
                    Ok(watcher::Event::InitDone) => {
                        let read = read_states(&ext, &relist);
                        let found = ext.with_view(|v| v.replace_read_nodes(read));
                        relist = Vec::new();
                        crate::memory::release_free_memory();
                        nodes_synced.store(true, Ordering::SeqCst);
                        ready();
                        found
                    }
                    Err(e) => {
                        tokio::time::sleep(failed(&mut backoff, &e, "node")).await;
                        Vec::new()
                    }
                };
                log_disagreements(found);
            }
        }
    };
    let pods = {
        let ext = extender.clone();
        let api: Api<PodObject> = Api::all(client);
        async move {
            let mut stream = watcher(api, watcher::Config::default()).boxed();
            // A (re)list is applied as it arrives, remembering only the UIDs seen: holding
            // 51,000 listed pods beside the view they become would double the peak.
            let mut seen: HashSet<String> = HashSet::new();
            let mut backoff = Backoff::cluster_wide();
            while let Some(event) = stream.next().await {
                back_again(&mut backoff, event.is_ok(), "pod");
                match event {
                    Ok(watcher::Event::Apply(p)) => ext.with_view(|v| v.apply_pod(&p)),
                    Ok(watcher::Event::InitApply(p)) => {
                        // Only GPU pods are kept: a big cluster's view stays small.
                        ext.with_view_batched(|v| {
                            if v.keeps(&p) {
                                v.apply_pod(&p);
                                seen.insert(p.uid().to_owned());
                            }
                        });
                    }
                    Ok(watcher::Event::Delete(p)) => ext.with_view(|v| v.delete_pod(p.uid())),
                    Ok(watcher::Event::Init) => seen.clear(),
                    Ok(watcher::Event::InitDone) => {
                        log_disagreements(ext.with_view_batched(|v| v.retain_pods(&seen)));
                        seen = HashSet::new();
                        // The pages of the list go back first, so the caches computed next
                        // (one per node, in one sweep) lie close together.
                        crate::memory::release_free_memory();
                        ext.with_view(|_| ());
                        crate::memory::release_free_memory();
                        pods_synced.store(true, Ordering::SeqCst);
                        ready();
                    }
                    Err(e) => tokio::time::sleep(failed(&mut backoff, &e, "pod")).await,
                }
            }
        }
    };
    tokio::join!(nodes, pods);
}

/// `nodes` with their published states read before the view's lock is taken (see
/// [`NodeReading`]): hashed, and decoded where the view does not hold that state already.
fn read_states<'a, C: Cluster>(
    ext: &Extender<C>,
    nodes: impl IntoIterator<Item = &'a NodeObject>,
) -> Vec<(&'a NodeObject, NodeReading)> {
    let mut read: Vec<_> = nodes.into_iter().map(|n| (n, NodeReading::hashed(n))).collect();
    let held: Vec<bool> = ext.with_view(|v| read.iter().map(|(n, r)| v.holds_state(n, r)).collect());
    for ((n, reading), held) in read.iter_mut().zip(held) {
        if !held {
            reading.decode(n);
        }
    }
    read
}

/// A watch of `what` failed: the wait before it retries. The first failure of an outage is a
/// warning, the next ones debug lines, so a long outage does not flood the log.
fn failed(backoff: &mut Backoff, error: &watcher::Error, what: &str) -> Duration {
    let jitter =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos() % 1001);
    let wait = backoff.failed(jitter);
    if backoff.failures() == 1 {
        tracing::warn!(%error, retry_in = ?wait, "{what} watch failed; keeping the last view and retrying with backoff \
            (until it is back, further failures are logged at debug)");
    } else {
        tracing::debug!(%error, retry_in = ?wait, failures = backoff.failures(), "{what} watch still failing");
    }
    wait
}

/// An event from a watch: says so once when it ends an outage.
fn back_again(backoff: &mut Backoff, ok: bool, what: &str) {
    if ok && backoff.failures() > 0 {
        tracing::info!(failures = backoff.succeeded(), "{what} watch back");
    }
}
