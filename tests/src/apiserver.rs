//! An API-server stand-in that speaks Kubernetes' HTTP/JSON, so that the real `kube` client (its
//! `Api`, its `watcher`, its discovery calls) works against it unchanged. It serves core/v1 Pods
//! and Nodes on `127.0.0.1`:
//!
//! - list with field selectors (`=`, `==`, `!=` on any dotted path) and label selectors
//!   (`k=v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`); paging with `limit` and
//!   `continue` (later pages read the current objects; the list keeps the first page's
//!   resourceVersion, so a watch from it replays what changed);
//! - watch from a resourceVersion over a bounded event history, with bookmarks, `sendInitialEvents`,
//!   `timeoutSeconds`, `DELETED`/`ADDED` when an update moves an object out of or into a watch's
//!   selector, and an `ERROR` event with a `410 Expired` Status once the history has moved on;
//! - get, create (uid, creationTimestamp, generateName, the usual pod defaults, and a client's new
//!   pod starts `Pending` whatever status it sent), update with
//!   optimistic concurrency, JSON merge patch, strategic merge patch, JSON patch, delete with
//!   preconditions, `dryRun=All`, the `status` subresources (a write to the main resource keeps
//!   the stored status; a write to `status` keeps the stored spec), and `pods/binding`, which sets
//!   `spec.nodeName` and copies the Binding's annotations in one write (`409` if already bound);
//! - discovery (`/api`, `/api/v1`, `/apis`), `/version`, and the part of core/v1's `OpenAPI` v3
//!   document (`/openapi/v3`) that tells `kubectl` the server validates fields itself, so the real
//!   `kubectl` gets, creates, applies and deletes against it (`tests/tests/kubectl.rs`), and
//!   server-side printing (`as=Table`) with the real server's Pod and Node columns;
//! - every error as a Kubernetes `Status`.
//!
//! One global resourceVersion counts every write. [`ApiServer::set_unavailable`] simulates an
//! outage (every request gets `503` and open watches end); [`ApiServer::restart`] a restart on the
//! same port (the objects stay, the watch history does not, as with a real server's watch cache);
//! [`ApiServer::set_pod_gets_forbidden`] the Node authorizer's `403` for a pod it has not yet seen
//! bound to the node reading it; [`ApiServer::hold_watch_events`] a watch that lags behind.
//!
//! Not supported: other kinds and API groups, server-side apply (`415`), protobuf, graceful
//! deletion and finalizers (a delete removes the object at once), pagination, admission and most
//! validation (names, label and annotation maps and the shape of `metadata` are checked; of a
//! pod's spec only that an update cannot change `spec.nodeName`).

mod patch;
mod routes;
mod selectors;
mod status;
mod store;
mod tables;
mod watch;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::Value;
use tokio::task::JoinHandle;

use store::{Key, Origin, Store};

/// Options for [`ApiServer::start_with`]; build with `Options { history: 2, ..Options::default() }`.
#[derive(Debug, Clone)]
pub struct Options {
    /// Watch events kept for replay (at least 1); a watch from an older resourceVersion gets
    /// `410 Expired`.
    pub history: usize,
    /// How often a watch that asked for bookmarks (`allowWatchBookmarks=true`) gets one.
    pub bookmark_every: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options { history: 1000, bookmark_every: Duration::from_secs(1) }
    }
}

/// The kinds served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// core/v1 Pod, namespaced.
    Pod,
    /// core/v1 Node, cluster-scoped.
    Node,
}

impl Kind {
    /// Every kind served.
    pub const ALL: [Kind; 2] = [Kind::Pod, Kind::Node];

    /// The kind's name: `Pod`, `Node`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
        }
    }

    /// The resource's name in URLs: `pods`, `nodes`.
    #[must_use]
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::Node => "nodes",
        }
    }

    /// Whether objects of this kind live in a namespace.
    #[must_use]
    pub fn is_namespaced(self) -> bool {
        self == Kind::Pod
    }

    /// The kind named by `name`: the kind (`Pod`), the plural (`pods`) or the singular (`pod`),
    /// in any case.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| name.eq_ignore_ascii_case(k.name()) || name.eq_ignore_ascii_case(k.plural()))
    }

    fn list_kind(self) -> &'static str {
        match self {
            Kind::Pod => "PodList",
            Kind::Node => "NodeList",
        }
    }
}

/// What the HTTP side and the test hooks share.
#[derive(Debug, Clone)]
struct Shared {
    store: Arc<Mutex<Store>>,
    available: Arc<AtomicBool>,
    /// Bumped to end every open watch (an outage, a shutdown).
    closer: Arc<tokio::sync::watch::Sender<u64>>,
    requests: Arc<Mutex<Vec<(String, String)>>>,
    /// Whether a `GET` of one pod answers `403` ([`ApiServer::set_pod_gets_forbidden`]).
    pod_gets_forbidden: Arc<AtomicBool>,
    /// Whether watches hold back their live events ([`ApiServer::hold_watch_events`]).
    watches_held: Arc<tokio::sync::watch::Sender<bool>>,
    bookmark_every: Duration,
    /// Set in the copy each HTTP instance serves with: true (or its sender gone) once it stops.
    stopping: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Shared {
    fn new(options: &Options) -> Shared {
        Shared {
            store: Arc::new(Mutex::new(Store::new(options.history))),
            available: Arc::new(AtomicBool::new(true)),
            closer: Arc::new(tokio::sync::watch::channel(0).0),
            requests: Arc::new(Mutex::new(Vec::new())),
            pod_gets_forbidden: Arc::new(AtomicBool::new(false)),
            watches_held: Arc::new(tokio::sync::watch::channel(false).0),
            bookmark_every: options.bookmark_every.max(Duration::from_millis(10)),
            stopping: None,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn requests(&self) -> MutexGuard<'_, Vec<(String, String)>> {
        self.requests.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn is_available(&self) -> bool {
        self.available.load(Ordering::SeqCst)
    }

    fn pod_gets_forbidden(&self) -> bool {
        self.pod_gets_forbidden.load(Ordering::SeqCst)
    }

    fn close_watches(&self) {
        self.closer.send_modify(|epoch| *epoch += 1);
    }

    /// Whether the HTTP instance serving with this copy is stopping.
    fn is_stopping(&self) -> bool {
        self.stopping.as_ref().is_some_and(|s| *s.borrow() || s.has_changed().is_err())
    }

    /// Resolves once the HTTP instance serving with this copy stops.
    async fn stopped(&self) {
        match self.stopping.clone() {
            Some(mut stopping) => {
                let _ = stopping.wait_for(|s| *s).await;
            }
            None => std::future::pending().await,
        }
    }
}

/// The HTTP side while it runs.
#[derive(Debug)]
struct Running {
    /// Sending `true` (or dropping it) stops accepting, refuses further requests on open
    /// connections, ends this instance's watches and closes its connections.
    stop: tokio::sync::watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// A running API-server stand-in. Dropping it stops the HTTP side.
#[derive(Debug)]
pub struct ApiServer {
    addr: SocketAddr,
    shared: Shared,
    running: Mutex<Option<Running>>,
}

async fn serve(addr: SocketAddr, shared: &Shared) -> anyhow::Result<(SocketAddr, Running)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the API server stand-in to {addr}"))?;
    let addr = listener.local_addr()?;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let instance = Shared { stopping: Some(stopping), ..shared.clone() };
    let app = routes::router(instance.clone());
    let task = tokio::spawn(async move {
        let signal = async move { instance.stopped().await };
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(signal).await {
            tracing::warn!(error = %e, "the API server stand-in stopped serving");
        }
    });
    tracing::debug!(%addr, "API server stand-in listening");
    Ok((addr, Running { stop, task }))
}

impl ApiServer {
    /// Starts on 127.0.0.1 with a random port and default [`Options`], on the current tokio runtime.
    ///
    /// # Errors
    /// If no port can be bound.
    pub async fn start() -> anyhow::Result<ApiServer> {
        Self::start_with(Options::default()).await
    }

    /// Starts on 127.0.0.1 with a random port and `options`.
    ///
    /// # Errors
    /// If no port can be bound.
    pub async fn start_with(options: Options) -> anyhow::Result<ApiServer> {
        Self::start_at(SocketAddr::from(([127, 0, 0, 1], 0)), options).await
    }

    /// Starts, empty, on `addr` (for example the address of a server that was dropped).
    ///
    /// # Errors
    /// If `addr` cannot be bound.
    pub async fn start_at(addr: SocketAddr, options: Options) -> anyhow::Result<ApiServer> {
        let shared = Shared::new(&options);
        let (addr, running) = serve(addr, &shared).await?;
        Ok(ApiServer { addr, shared, running: Mutex::new(Some(running)) })
    }

    /// The address it listens on.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for this server: plain HTTP, a user with a dummy token.
    #[must_use]
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: {}\n\
             users:\n- name: standin\n  user:\n    token: standin-token\ncontexts:\n- name: standin\n  context:\n    \
             cluster: standin\n    user: standin\n    namespace: default\ncurrent-context: standin\n",
            self.url()
        )
    }

    /// Writes [`ApiServer::kubeconfig`] to `path`.
    ///
    /// # Errors
    /// If the file cannot be written.
    pub fn write_kubeconfig(&self, path: &std::path::Path) -> anyhow::Result<()> {
        std::fs::write(path, self.kubeconfig()).with_context(|| format!("writing {}", path.display()))
    }

    /// Stores `object`, creating it (as [`ApiServer::create`]) or replacing what is stored (an
    /// `ADDED` or `MODIFIED` event). Its `kind` (`Pod` or `Node`) says where it goes; a pod
    /// without a namespace goes to `default`. Replacing keeps the stored uid and
    /// creationTimestamp; spec and status are the ones given (no subresource rules apply to the
    /// hooks). Returns the object as stored.
    ///
    /// # Errors
    /// If the kind is missing or not served, or the object is malformed.
    pub fn insert(&self, object: Value) -> anyhow::Result<Value> {
        let Some(kind) = object.get("kind").and_then(Value::as_str).and_then(Kind::from_name) else {
            anyhow::bail!("insert needs an object whose kind is Pod or Node");
        };
        let namespace = object.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or("default").to_owned();
        self.shared.lock().upsert(kind, &namespace, object).map_err(anyhow::Error::from)
    }

    /// Creates an object as a client would (it must not exist, it gets a uid, a
    /// creationTimestamp and a pod the defaults), except that the status given is kept (a pod's
    /// phase defaults to `Pending`); returns it as stored.
    ///
    /// # Errors
    /// The API error, for example that it exists.
    pub fn create(&self, kind: Kind, namespace: &str, object: Value) -> anyhow::Result<Value> {
        self.shared.lock().create(kind, namespace, object, Origin::Hook, false).map_err(anyhow::Error::from)
    }

    /// Creates a pod in `namespace`; returns it as stored.
    ///
    /// # Errors
    /// The API error, for example that it exists.
    pub fn create_pod(&self, namespace: &str, pod: Value) -> anyhow::Result<Value> {
        self.create(Kind::Pod, namespace, pod)
    }

    /// Creates a node; returns it as stored.
    ///
    /// # Errors
    /// The API error, for example that it exists.
    pub fn create_node(&self, node: Value) -> anyhow::Result<Value> {
        self.create(Kind::Node, "", node)
    }

    /// An object as stored (`namespace` is ignored for nodes).
    #[must_use]
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        self.shared.lock().get(&Key::new(kind, namespace, name)).cloned()
    }

    /// A pod as stored.
    #[must_use]
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.get(Kind::Pod, namespace, name)
    }

    /// A node as stored.
    #[must_use]
    pub fn node(&self, name: &str) -> Option<Value> {
        self.get(Kind::Node, "", name)
    }

    /// Every stored object of `kind`, ordered by namespace and name.
    #[must_use]
    pub fn list(&self, kind: Kind) -> Vec<Value> {
        self.shared.lock().all(kind)
    }

    /// Applies a JSON merge patch to any part of an object, status included (a kubelet writing a
    /// pod's status, say). A patch that changes nothing writes nothing.
    ///
    /// # Errors
    /// If the object does not exist or the result is malformed.
    pub fn patch(&self, kind: Kind, namespace: &str, name: &str, merge_patch: &Value) -> anyhow::Result<Value> {
        self.shared.lock().patch_unchecked(&Key::new(kind, namespace, name), merge_patch).map_err(anyhow::Error::from)
    }

    /// [`ApiServer::patch`] for a pod.
    ///
    /// # Errors
    /// If the pod does not exist or the result is malformed.
    pub fn patch_pod(&self, namespace: &str, name: &str, merge_patch: &Value) -> anyhow::Result<Value> {
        self.patch(Kind::Pod, namespace, name, merge_patch)
    }

    /// Deletes an object (a `DELETED` event); returns its last state.
    ///
    /// # Errors
    /// If it does not exist.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> anyhow::Result<Value> {
        self.shared.lock().delete(&Key::new(kind, namespace, name), false, |_| Ok(())).map_err(anyhow::Error::from)
    }

    /// Deletes a pod.
    ///
    /// # Errors
    /// If it does not exist.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> anyhow::Result<Value> {
        self.delete(Kind::Pod, namespace, name)
    }

    /// The current resourceVersion (that of the last write).
    #[must_use]
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().resource_version()
    }

    /// Every request seen, as (method, path and query), oldest first.
    #[must_use]
    pub fn requests(&self) -> Vec<(String, String)> {
        self.shared.requests().clone()
    }

    /// How many requests were seen.
    #[must_use]
    pub fn request_count(&self) -> usize {
        self.shared.requests().len()
    }

    /// Forgets the requests seen so far.
    pub fn clear_requests(&self) {
        self.shared.requests().clear();
    }

    /// Simulates an outage (`true`): every request gets `503` and open watches end, until it is
    /// called with `false`. Note that a kube client retries a `503` (by default 15 times, with
    /// exponential backoff), so a call made during the outage may only return after it.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.shared.available.store(!unavailable, Ordering::SeqCst);
        if unavailable {
            self.shared.close_watches();
        }
        tracing::debug!(unavailable, "API server stand-in availability");
    }

    /// Answers every `GET` of one pod with `403 Forbidden` (`true`) until called with `false`,
    /// as the real API server's Node authorizer answers a node that reads a pod bound to it
    /// before the authorizer's graph has the binding. Lists and watches are served as before.
    pub fn set_pod_gets_forbidden(&self, forbidden: bool) {
        self.shared.pod_gets_forbidden.store(forbidden, Ordering::SeqCst);
    }

    /// Holds back (`true`) the live events of every watch, open or new, until called with
    /// `false`, then sends them in order: a client whose watch lags behind the others' while its
    /// other requests are answered at once.
    pub fn hold_watch_events(&self, held: bool) {
        self.shared.watches_held.send_replace(held);
    }

    /// The opposite of [`ApiServer::set_unavailable`].
    pub fn set_available(&self, available: bool) {
        self.set_unavailable(!available);
    }

    /// Stops the HTTP side: the port is released, open watches end and connections close. The
    /// objects stay, for [`ApiServer::restart`] and the hooks.
    pub async fn shutdown(&self) {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(Running { stop, mut task }) = running else {
            return;
        };
        stop.send_replace(true);
        if tokio::time::timeout(Duration::from_secs(5), &mut task).await.is_err() {
            task.abort();
            let _ = task.await;
        }
        tracing::debug!(addr = %self.addr, "API server stand-in shut down");
    }

    /// Restarts on the same port, as an API server restart: the objects and the resourceVersion
    /// stay, open watches end, and the watch history is lost, so a watch resuming from before the
    /// restart gets `410 Expired` and relists.
    ///
    /// # Errors
    /// If the port cannot be bound again.
    pub async fn restart(&self) -> anyhow::Result<()> {
        self.shutdown().await;
        self.shared.lock().forget_history();
        let (_, running) = serve(self.addr, &self.shared).await?;
        *self.running.lock().unwrap_or_else(PoisonError::into_inner) = Some(running);
        Ok(())
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // Dropping `running`'s sender stops the HTTP side.
        let running = self.running.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(running) = running {
            running.stop.send_replace(true);
        }
    }
}
