//! The API-server side: a watch of the pods bound to this node (field selector
//! `spec.nodeName`), with the node's own credentials, feeding the [`PodStore`]. The watch
//! relists after errors and keeps the store as last seen in between, so `Allocate` keeps
//! working through an API-server outage for pods already seen. A deleted or finished pod's
//! ledger rows are released, the history kept.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt as _;
use gpushare_core::codec::node::PodRef;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Api, Client, Config};
use thiserror::Error;

use crate::allocator::Allocator;
use crate::objects::PodObject;
use crate::pods::{PodStore, PodView};

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
        terminal: meta.deletion_timestamp.is_some() || matches!(phase, Some("Succeeded" | "Failed")),
        spec: pod.spec.core(),
        annotations: meta.annotations.clone().unwrap_or_default().into_iter().collect::<BTreeMap<_, _>>(),
    })
}

/// Watches the pods bound to `node` forever, keeping `store` current and releasing the ledger
/// rows of pods that are deleted or finished.
pub async fn watch_pods(client: Client, node: String, store: PodStore, alloc: Arc<Allocator>) {
    let api: Api<PodObject> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut stream = watcher(api, config).boxed();
    let mut relist: Vec<PodView> = Vec::new();
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Apply(pod)) => {
                let Some(v) = view(&pod) else { continue };
                if v.terminal {
                    release(&alloc, &v, "pod finished or deleted");
                }
                store.upsert(v);
            }
            // A relist: the store keeps serving what it had until the list is complete.
            Ok(watcher::Event::InitApply(pod)) => {
                let Some(v) = view(&pod) else { continue };
                if v.terminal {
                    release(&alloc, &v, "pod finished or deleted");
                }
                relist.push(v);
            }
            Ok(watcher::Event::Delete(pod)) => {
                if let Some(v) = view(&pod) {
                    release(&alloc, &v, "pod deleted");
                    store.remove(&v.pod.uid);
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
                tracing::warn!(error = %e, "pod watch failed; serving pods as last seen and retrying");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
}

fn release(alloc: &Allocator, v: &PodView, reason: &str) {
    match alloc.release_pod(&v.pod.uid, reason) {
        Ok(0) => {}
        Ok(n) => tracing::info!(pod = %format!("{}/{}", v.pod.namespace, v.pod.name), rows = n, reason, "released"),
        Err(e) => tracing::error!(error = %e, "cannot release a pod's allocations"),
    }
}
