//! The API-server side: a watch of the pods bound to this node (field selector
//! `spec.nodeName`), with the node's own credentials, feeding the [`PodStore`]. The watch
//! relists after errors and keeps the store as last seen in between, so `Allocate` keeps
//! working through an API-server outage for pods already seen. A deleted or finished pod's
//! ledger rows are released, the history kept. Kubelet calls ask for consistent reads of the
//! node's pods not yet running ([`refresh_pods`]), or of the pods the kubelet says it may be
//! admitting ([`fetch_pods`]), so they never go by a lagging watch. A kubelet
//! reporting per-MiB device health is pointed out ([`DeviceHealthNotice`]).

use gpushare_core::retry::Backoff;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt as _;
use gpushare_core::codec::node::PodRef;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Api, Client, Config};
use thiserror::Error;

use crate::allocation::allocator::Allocator;
use crate::allocation::ledger::EventKind;
use crate::allocation::pods::{PodStore, PodView};
use crate::cluster::objects::PodObject;

/// The API server cannot be set up.
#[derive(Debug, Error)]
pub enum KubeError {
    /// The kubeconfig is missing or invalid.
    #[error("kubeconfig {path}: {reason}; point [kubernetes] kubeconfig at the kubelet's kubeconfig")]
    Kubeconfig {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

/// A client from the kubeconfig at `path`.
///
/// # Errors
/// [`KubeError::Kubeconfig`].
pub async fn client(path: &Path) -> Result<Client, KubeError> {
    let bad = |reason: String| KubeError::Kubeconfig { path: path.display().to_string(), reason };
    let kubeconfig = Kubeconfig::read_from(path).map_err(|e| bad(e.to_string()))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| bad(e.to_string()))?;
    Client::try_from(config).map_err(|e| bad(e.to_string()))
}

/// What the daemon keeps of a pod.
#[must_use]
pub fn view(pod: &PodObject) -> Option<PodView> {
    let meta = &pod.metadata;
    let phase = pod.status.phase.as_deref();
    Some(PodView {
        pod: PodRef {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone()?,
            uid: meta.uid.clone()?,
        },
        node: pod.spec.node_name.clone(),
        created: meta.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default(),
        version: meta.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0),
        terminal: meta.deletion_timestamp.is_some() || matches!(phase, Some("Succeeded" | "Failed")),
        spec: pod.spec.core(),
        annotations: meta.annotations.clone().unwrap_or_default().into_iter().collect::<BTreeMap<_, _>>(),
        container_ids: pod.status.container_ids(),
    })
}

/// Tells the operator, once per run, that the kubelet reports the health of each allocated
/// device in pod status (`allocatedResourcesStatus`, the `ResourceHealthStatus` feature gate, on
/// by default from Kubernetes 1.36) while gpushared serves memory in MiB: one device per MiB makes
/// that kubelet look devices up for minutes after a restart, admitting nothing meanwhile
/// (docs/install.md, section 3).
#[derive(Debug)]
pub struct DeviceHealthNotice {
    resource: String,
    armed: bool,
}

impl DeviceHealthNotice {
    /// A notice for the memory `resource`, armed only in MiB mode.
    #[must_use]
    pub fn new(resource: &str, unit: gpushare_core::MemoryUnit) -> Self {
        DeviceHealthNotice { resource: resource.to_owned(), armed: unit == gpushare_core::MemoryUnit::Mib }
    }

    /// Looks at a pod's status; warns (and returns true) the first time one shows the kubelet
    /// reporting device health for the memory resource.
    pub fn see(&mut self, pod: &PodObject) -> bool {
        if !self.armed {
            return false;
        }
        let entries = pod.status.device_health_entries(&self.resource);
        if entries == 0 {
            return false;
        }
        self.armed = false;
        let meta = &pod.metadata;
        tracing::warn!(
            pod = %format!("{}/{}", meta.namespace.as_deref().unwrap_or_default(), meta.name.as_deref().unwrap_or_default()),
            resource = %self.resource,
            entries,
            "the kubelet reports each allocated device's health in pod status (feature gate ResourceHealthStatus), one \
             entry per MiB here: kubelets 1.36 and later then stall for minutes after a restart; set the kubelet's \
             featureGates ResourceHealthStatus and ResourceHealthStatusMessage to false (docs/install.md, section 3)"
        );
        true
    }
}

/// Watches the pods bound to `node` forever, keeping `store` current and releasing the ledger
/// rows of pods that are deleted or finished.
pub async fn watch_pods(client: Client, node: String, store: PodStore, alloc: Arc<Allocator>) {
    let api: Api<PodObject> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut stream = watcher(api, config).boxed();
    let mut relist: Vec<PodView> = Vec::new();
    let mut backoff = Backoff::per_node();
    let mut notice = DeviceHealthNotice::new(alloc.resource(), alloc.inventory().unit());
    while let Some(event) = stream.next().await {
        if event.is_ok() && backoff.failures() > 0 {
            tracing::info!(failures = backoff.succeeded(), "pod watch back");
        }
        match event {
            Ok(watcher::Event::Apply(pod)) => {
                notice.see(&pod);
                let Some(v) = view(&pod) else { continue };
                if v.terminal {
                    release(&alloc, &v, "pod finished or deleted");
                }
                store.upsert(v);
            }
            // A relist: the store keeps serving what it had until the list is complete.
            Ok(watcher::Event::InitApply(pod)) => {
                notice.see(&pod);
                let Some(v) = view(&pod) else { continue };
                if v.terminal {
                    release(&alloc, &v, "pod finished or deleted");
                }
                relist.push(v);
            }
            Ok(watcher::Event::Delete(pod)) => {
                if let Some(v) = view(&pod) {
                    release(&alloc, &v, "pod deleted");
                    store.remove(&v.pod.uid, v.version);
                }
            }
            Ok(watcher::Event::Init) => relist.clear(),
            Ok(watcher::Event::InitDone) => {
                // The relist is the truth: pods gone meanwhile are released.
                let seen: std::collections::BTreeSet<String> = relist.iter().map(|v| v.pod.uid.clone()).collect();
                for gone in store.snapshot().into_iter().filter(|p| !seen.contains(&p.view.pod.uid)) {
                    release(&alloc, &gone.view, "pod no longer bound to this node");
                }
                store.replace_all(std::mem::take(&mut relist));
            }
            Err(e) => {
                let wait = backoff.failed(jitter_permille());
                if backoff.failures() == 1 {
                    tracing::warn!(error = %e, retry_in = ?wait,
                        "pod watch failed; serving pods as last seen and retrying with backoff (until it is back, further failures are logged at debug)");
                } else {
                    tracing::debug!(error = %e, retry_in = ?wait, failures = backoff.failures(), "pod watch still failing");
                }
                // A kubelet call waiting for a pod this node has not seen cuts the wait short:
                // the kubelet got the pod from the API server, so it is back.
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = store.wanted() => tracing::info!("a kubelet call waits for a pod not seen yet; retrying the pod watch now"),
                }
            }
        }
    }
}

/// The pods a consistent read returns: those bound to `node` that are not running or finished,
/// the only ones a kubelet call can be for.
#[must_use]
pub fn not_running(node: &str) -> String {
    format!("spec.nodeName={node},status.phase!=Running,status.phase!=Succeeded,status.phase!=Failed")
}

/// How long one consistent read may take before the calls waiting on it hear that it failed.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Serves the consistent reads kubelet calls ask for ([`PodStore::confirm`]): a list of the pods
/// bound to `node` not yet running, with no resource version (so the API server answers as of
/// now, not from a possibly older cache), merged into `store`. Calls that ask while a read is
/// under way wait for the next one, which begins after them; calls that ask together share it.
/// `requested` comes from [`PodStore::serve_reads`], taken before the plugin serves.
pub async fn refresh_pods(
    client: Client,
    node: String,
    store: PodStore,
    mut requested: tokio::sync::watch::Receiver<u64>,
    alloc: Arc<Allocator>,
) {
    let api: Api<PodObject> = Api::all(client);
    let params = kube::api::ListParams::default().fields(&not_running(&node));
    let mut served = 0;
    loop {
        if requested.wait_for(|n| *n > served).await.is_err() {
            return;
        }
        served = *requested.borrow_and_update();
        let started = std::time::Instant::now();
        let error = match tokio::time::timeout(READ_TIMEOUT, api.list(&params)).await {
            Ok(Ok(list)) => {
                let views: Vec<PodView> = list.items.iter().filter_map(view).collect();
                for v in views.iter().filter(|v| v.terminal) {
                    release(&alloc, v, "pod finished or deleted");
                }
                tracing::debug!(pods = views.len(), took = ?started.elapsed(), "read the node's pods not running yet");
                if store.merge_read(views) {
                    tracing::debug!("the read found pods the watch had not delivered");
                }
                None
            }
            Ok(Err(e)) => Some(format!("listing the pods of node {node}: {e}")),
            Err(_) => Some(format!("listing the pods of node {node}: no answer within {READ_TIMEOUT:?}")),
        };
        if let Some(e) = &error {
            tracing::warn!(error = %e, "a consistent read of this node's pods failed");
        }
        store.read_done(served, error);
    }
}

/// Serves the reads of named pods kubelet calls ask for ([`PodStore::confirm_named`]): each pod
/// read with a `GET` (a quorum read, as of now), those found merged into `store`. A pod the API
/// server does not have (404) is left as the store has it. A pod it will not show the node (403)
/// proves nothing: the Node authorizer answers so for a pod bound elsewhere, but also for one
/// bound here moments ago, before its graph (fed by the API server's own watch) has the binding;
/// the read is then reported as not settling the pods, and the caller reads the node's pods by
/// list. `fetches` comes from [`PodStore::serve_fetches`], taken before the plugin serves.
pub async fn fetch_pods(
    client: Client,
    store: PodStore,
    mut fetches: tokio::sync::mpsc::UnboundedReceiver<crate::allocation::pods::Fetch>,
    alloc: Arc<Allocator>,
) {
    while let Some(fetch) = fetches.recv().await {
        let started = std::time::Instant::now();
        let gets = fetch.pods.iter().map(|(namespace, name)| {
            let api: Api<PodObject> = Api::namespaced(client.clone(), namespace);
            async move {
                match tokio::time::timeout(READ_TIMEOUT, api.get(name)).await {
                    Ok(Ok(pod)) => Ok(view(&pod).map_or(Read::Absent, |v| Read::Found(Box::new(v)))),
                    Ok(Err(kube::Error::Api(e))) if e.code == 404 => Ok(Read::Absent),
                    Ok(Err(kube::Error::Api(e))) if e.code == 403 => Ok(Read::Hidden),
                    Ok(Err(e)) => Err(format!("reading pod {namespace}/{name}: {e}")),
                    Err(_) => Err(format!("reading pod {namespace}/{name}: no answer within {READ_TIMEOUT:?}")),
                }
            }
        });
        let outcome = futures::future::join_all(gets).await.into_iter().collect::<Result<Vec<_>, String>>();
        let got = started.elapsed();
        let outcome = outcome.map(|reads| {
            let settled = !reads.iter().any(|r| matches!(r, Read::Hidden));
            let views: Vec<PodView> =
                reads.into_iter().filter_map(|r| if let Read::Found(v) = r { Some(*v) } else { None }).collect();
            for v in views.iter().filter(|v| v.terminal) {
                release(&alloc, v, "pod finished or deleted");
            }
            tracing::debug!(
                pods = views.len(),
                settled,
                queued_us = started.duration_since(fetch.asked).as_micros(),
                get_us = got.as_micros(),
                took_us = started.elapsed().as_micros(),
                "read the pods the kubelet may admit"
            );
            store.merge_read(views);
            settled
        });
        if let Err(e) = &outcome {
            tracing::warn!(error = %e, "a consistent read of the pods the kubelet may admit failed");
        }
        let _ = fetch.done.send(outcome);
    }
}

/// What a `GET` of one named pod showed.
enum Read {
    /// The pod.
    Found(Box<PodView>),
    /// The API server does not have it (404), or sent an object without a name or UID.
    Absent,
    /// The API server will not show it to this node (403), which proves nothing.
    Hidden,
}

/// Thousandths of a backoff wait to add, from the clock's nanoseconds: enough to spread the
/// daemons of a cluster that failed together.
fn jitter_permille() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos() % 1001)
}

fn release(alloc: &Allocator, v: &PodView, reason: &str) {
    match alloc.release_pod(&v.pod.uid, reason) {
        Ok(0) => {}
        Ok(n) => tracing::info!(pod = %v.pod, rows = n, reason, "released"),
        Err(e) => tracing::error!(error = %e, "cannot release a pod's allocations"),
    }
}

/// How often an eviction the API server turned away for now (a disruption budget: 429; the
/// server: 5xx; the network) is asked again, and how many times.
const EVICTION_RETRY: std::time::Duration = std::time::Duration::from_secs(30);
const EVICTION_ATTEMPTS: u32 = 10;

/// Evicts the pods the over-use detector names, through the Eviction API (`policy/v1`, the
/// pod's UID as precondition, so a re-created pod of the same name is never hit), each in a
/// task of its own. Every outcome is logged and recorded in the ledger history.
pub async fn evict_pods(
    client: Client,
    mut requests: tokio::sync::mpsc::UnboundedReceiver<crate::gpus::overuse::Eviction>,
    alloc: Arc<Allocator>,
) {
    while let Some(request) = requests.recv().await {
        tokio::spawn(evict(client.clone(), request, Arc::clone(&alloc)));
    }
}

async fn evict(client: Client, request: crate::gpus::overuse::Eviction, alloc: Arc<Allocator>) {
    let PodRef { namespace, name, uid } = &request.pod;
    let who = format!("{namespace}/{name}");
    let body = serde_json::json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
        "deleteOptions": {"preconditions": {"uid": uid}},
    });
    let record = |kind: EventKind, detail: String| {
        if let Err(e) = alloc.record_event(kind, &detail) {
            tracing::error!(error = %e, "the eviction could not be recorded in the ledger history");
        }
    };
    for attempt in 1..=EVICTION_ATTEMPTS {
        let http_request = http::Request::post(format!("/api/v1/namespaces/{namespace}/pods/{name}/eviction"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body.to_string().into_bytes());
        let http_request = match http_request {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(pod = %who, error = %e, "cannot build the eviction request");
                return;
            }
        };
        match client.request::<serde_json::Value>(http_request).await {
            Ok(_) => {
                tracing::warn!(pod = %who, reason = %request.reason, "evicted: over its GPU memory budget");
                record(EventKind::Evicted, format!("{who}: {}", request.reason));
                return;
            }
            Err(kube::Error::Api(status)) if status.code != 429 && status.code < 500 => {
                // 403: the node's credentials may not evict; 404/409: the pod is gone or replaced.
                tracing::error!(pod = %who, code = status.code, message = %status.message,
                    "the API server refused the eviction; the pod stays over budget (see docs/gpushared.md, Over-use)");
                record(EventKind::EvictionRefused, format!("{who}: HTTP {}: {}", status.code, status.message));
                return;
            }
            Err(e) => {
                tracing::warn!(pod = %who, attempt, error = %e, "eviction not done yet; asking again in 30 s");
                tokio::time::sleep(EVICTION_RETRY).await;
            }
        }
    }
    record(EventKind::EvictionRefused, format!("{who}: still turned away after {EVICTION_ATTEMPTS} attempts"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_core::MemoryUnit;

    fn pod_reporting(entries: usize) -> PodObject {
        let resources: Vec<serde_json::Value> =
            (0..entries).map(|i| serde_json::json!({"resourceID": format!("Q0-{i}"), "health": "Healthy"})).collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "status": {"containerStatuses": [{"name": "main", "allocatedResourcesStatus": [
                {"name": "gpushare.io/gpu-mem", "resources": resources}]}]}
        }))
        .unwrap()
    }

    #[test]
    fn device_health_in_pod_status_is_pointed_out_once_in_mib_mode() {
        let mut mib = DeviceHealthNotice::new("gpushare.io/gpu-mem", MemoryUnit::Mib);
        assert!(!mib.see(&pod_reporting(0)));
        assert!(mib.see(&pod_reporting(3000)));
        assert!(!mib.see(&pod_reporting(3000)), "warned twice");
        let mut gib = DeviceHealthNotice::new("gpushare.io/gpu-mem", MemoryUnit::Gib);
        assert!(!gib.see(&pod_reporting(3)));
        let mut other = DeviceHealthNotice::new("aliyun.com/gpu-mem", MemoryUnit::Mib);
        assert!(!other.see(&pod_reporting(3000)));
    }
}
