//! An API-server stand-in speaking Kubernetes' HTTP/JSON so that the real `kube` client works
//! against it unchanged: core/v1 Pods and Nodes with list (field and label selectors), watch
//! (from a resourceVersion, bookmarks, `410 Gone` once history is trimmed), get, create,
//! delete, JSON merge patch, and `pods/binding` (sets `spec.nodeName` and copies the Binding's
//! annotations in one write, `409` if already bound). Every write bumps one global
//! resourceVersion. [`ApiServer::set_unavailable`] simulates an outage: every request gets
//! `503` and open watches end.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

/// Options for [`ApiServer::start_with`].
#[derive(Debug, Clone)]
pub struct Options {
    /// Watch events kept for replay; a watch from an older resourceVersion gets `410 Gone`.
    pub history: usize,
    /// How often watches that asked for bookmarks get one.
    pub bookmark_every: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options { history: 1000, bookmark_every: Duration::from_secs(1) }
    }
}

/// `pods` or `nodes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Pod,
    Node,
}

impl Kind {
    fn list_kind(self) -> &'static str {
        match self {
            Kind::Pod => "PodList",
            Kind::Node => "NodeList",
        }
    }
    fn kind(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
        }
    }
}

type Key = (Kind, String, String);

#[derive(Debug, Clone)]
struct Event {
    rv: u64,
    kind: Kind,
    kind_of_event: &'static str,
    object: Value,
}

#[derive(Debug)]
struct Store {
    rv: u64,
    uid: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Event>,
    history_limit: usize,
    requests: Vec<(String, String)>,
}

#[derive(Debug, Clone)]
struct Shared {
    store: Arc<Mutex<Store>>,
    events: broadcast::Sender<Event>,
    available: watch::Sender<bool>,
    options: Options,
}

/// A running stand-in.
#[derive(Debug)]
pub struct ApiServer {
    addr: SocketAddr,
    shared: Shared,
    task: tokio::task::JoinHandle<()>,
}

/// A failed request, answered as a Kubernetes `Status`.
#[derive(Debug, Clone)]
struct ApiError {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code.as_u16(),
        });
        (self.code, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    }
}

fn status(code: StatusCode, reason: &'static str, message: impl Into<String>) -> ApiError {
    ApiError { code, reason, message: message.into() }
}

/// The response to a write: the object, or the error.
fn reply(code: StatusCode, result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(v) => ok_json(code, &v),
        Err(e) => e.into_response(),
    }
}

fn ok_json(code: StatusCode, v: &Value) -> Response {
    (code, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// RFC 3339 UTC time of now, second precision (Kubernetes' `metav1.Time`).
fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm), for dates after 1970.
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Does `object` satisfy a field selector such as `spec.nodeName=a,metadata.name!=b`?
fn fields_match(object: &Value, selector: &str) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (path, want, equal) = if let Some((p, v)) = term.split_once("!=") {
            (p, v, false)
        } else if let Some((p, v)) = term.split_once("==") {
            (p, v, true)
        } else if let Some((p, v)) = term.split_once('=') {
            (p, v, true)
        } else {
            return false;
        };
        let mut cur = object;
        let mut found = true;
        for part in path.split('.') {
            match cur.get(part) {
                Some(next) => cur = next,
                None => {
                    found = false;
                    break;
                }
            }
        }
        let value = if found { cur.as_str().map_or_else(|| cur.to_string(), str::to_owned) } else { String::new() };
        (value == want) == equal
    })
}

/// Does `object` satisfy a label selector (`k=v`, `k!=v`, `k`, comma-separated)?
fn labels_match(object: &Value, selector: &str) -> bool {
    let labels = object.pointer("/metadata/labels");
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        if let Some((k, v)) = term.split_once("!=") {
            get(k) != Some(v)
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            get(k) == Some(v)
        } else {
            get(term).is_some()
        }
    })
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Value::Object(t) = target {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a write: bumps the resourceVersion, stamps the object, keeps the event.
    fn write(&self, store: &mut Store, kind: Kind, kind_of_event: &'static str, mut object: Value) -> Value {
        store.rv += 1;
        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), Value::String(store.rv.to_string()));
        }
        let event = Event { rv: store.rv, kind, kind_of_event, object: object.clone() };
        store.history.push_back(event.clone());
        while store.history.len() > store.history_limit {
            store.history.pop_front();
        }
        let _ = self.events.send(event);
        object
    }

    fn create(&self, kind: Kind, ns: &str, mut object: Value) -> Result<Value, ApiError> {
        let mut store = self.lock();
        if !object.is_object() {
            return Err(status(StatusCode::BAD_REQUEST, "BadRequest", "the body is not a JSON object"));
        }
        if let Some(obj) = object.as_object_mut() {
            obj.insert("kind".into(), Value::String(kind.kind().into()));
            obj.insert("apiVersion".into(), Value::String("v1".into()));
        }
        let meta = object.get("metadata").cloned().unwrap_or_else(|| json!({}));
        let name = match (meta.get("name").and_then(Value::as_str), meta.get("generateName").and_then(Value::as_str)) {
            (Some(n), _) if !n.is_empty() => n.to_owned(),
            (_, Some(prefix)) => format!("{prefix}{:05x}", store.uid + 1),
            _ => return Err(status(StatusCode::BAD_REQUEST, "BadRequest", "metadata.name is required")),
        };
        let key = (kind, if kind == Kind::Pod { ns.to_owned() } else { String::new() }, name.clone());
        if store.objects.contains_key(&key) {
            return Err(status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", kind.kind()),
            ));
        }
        store.uid += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", store.uid);
        let m = object.as_object_mut().and_then(|o| {
            o.entry("metadata").or_insert_with(|| json!({}));
            o.get_mut("metadata").and_then(Value::as_object_mut)
        });
        if let Some(m) = m {
            m.insert("name".into(), Value::String(name));
            m.insert("uid".into(), Value::String(uid));
            m.insert("creationTimestamp".into(), Value::String(now_rfc3339()));
            if kind == Kind::Pod {
                m.insert("namespace".into(), Value::String(ns.to_owned()));
            }
        }
        if kind == Kind::Pod && object.pointer("/status/phase").is_none() {
            merge_patch(&mut object, &json!({"status": {"phase": "Pending"}}));
        }
        let stored = self.write(&mut store, kind, "ADDED", object);
        store.objects.insert(key, stored.clone());
        Ok(stored)
    }

    fn update(&self, key: &Key, change: impl FnOnce(&mut Value) -> Result<(), ApiError>) -> Result<Value, ApiError> {
        let mut store = self.lock();
        let Some(mut object) = store.objects.get(key).cloned() else {
            return Err(not_found(key));
        };
        change(&mut object)?;
        let stored = self.write(&mut store, key.0, "MODIFIED", object);
        store.objects.insert(key.clone(), stored.clone());
        Ok(stored)
    }

    fn delete(&self, key: &Key) -> Result<Value, ApiError> {
        let mut store = self.lock();
        let Some(object) = store.objects.remove(key) else {
            return Err(not_found(key));
        };
        Ok(self.write(&mut store, key.0, "DELETED", object))
    }
}

fn not_found(key: &Key) -> ApiError {
    status(StatusCode::NOT_FOUND, "NotFound", format!("{} \"{}\" not found", key.0.kind().to_lowercase(), key.2))
}

fn pod_key(ns: &str, name: &str) -> Key {
    (Kind::Pod, ns.to_owned(), name.to_owned())
}

fn node_key(name: &str) -> Key {
    (Kind::Node, String::new(), name.to_owned())
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| status(StatusCode::BAD_REQUEST, "BadRequest", format!("the request body is not valid JSON: {e}")))
}

/// List, or watch when `watch=true`.
async fn list_or_watch(shared: Shared, kind: Kind, ns: Option<String>, q: BTreeMap<String, String>) -> Response {
    let fields = q.get("fieldSelector").cloned().unwrap_or_default();
    let labels = q.get("labelSelector").cloned().unwrap_or_default();
    let matches = {
        let ns = ns.clone();
        move |k: Kind, o: &Value| {
            k == kind
                && ns.as_deref().is_none_or(|n| o.pointer("/metadata/namespace").and_then(Value::as_str) == Some(n))
                && fields_match(o, &fields)
                && labels_match(o, &labels)
        }
    };
    let watching = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    if !watching {
        let store = shared.lock();
        let items: Vec<Value> =
            store.objects.iter().filter(|((k, _, _), o)| matches(*k, o)).map(|(_, o)| o.clone()).collect();
        let list = json!({"kind": kind.list_kind(), "apiVersion": "v1",
                          "metadata": {"resourceVersion": store.rv.to_string()}, "items": items});
        return ok_json(StatusCode::OK, &list);
    }
    let since: Option<u64> = q.get("resourceVersion").and_then(|v| v.parse().ok()).filter(|v| *v > 0);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let timeout =
        q.get("timeoutSeconds").and_then(|v| v.parse().ok()).map_or(Duration::from_secs(1800), Duration::from_secs);
    // Subscribe before reading the history so no event falls between the two.
    let mut live = shared.events.subscribe();
    let (replay, current_rv) = {
        let store = shared.lock();
        let mut replay = Vec::new();
        match since {
            Some(rv) => {
                let oldest = store.history.front().map_or(store.rv + 1, |e| e.rv);
                if rv + 1 < oldest && rv < store.rv {
                    let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "message": format!("too old resource version: {rv} ({})", oldest - 1),
                        "reason": "Expired", "code": 410}});
                    let body = format!("{gone}\n");
                    return (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body).into_response();
                }
                replay.extend(store.history.iter().filter(|e| e.rv > rv).cloned());
            }
            None => replay.extend(store.objects.iter().map(|((k, _, _), o)| Event {
                rv: store.rv,
                kind: *k,
                kind_of_event: "ADDED",
                object: o.clone(),
            })),
        }
        (replay, store.rv)
    };
    let mut available = shared.available.subscribe();
    let every = shared.options.bookmark_every;
    let stream = async_stream(move |tx| async move {
        let send = |e: &Event| -> Option<Bytes> {
            if !matches(e.kind, &e.object) {
                return None;
            }
            Some(Bytes::from(format!("{}\n", json!({"type": e.kind_of_event, "object": e.object}))))
        };
        let mut last = current_rv;
        for e in &replay {
            last = last.max(e.rv);
            if let Some(b) = send(e)
                && tx.send(b).await.is_err()
            {
                return;
            }
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => return,
                changed = available.changed() => {
                    if changed.is_err() || !*available.borrow() { return; }
                }
                _ = tick.tick(), if bookmarks => {
                    let b = json!({"type": "BOOKMARK", "object": {"kind": kind.kind(), "apiVersion": "v1",
                                   "metadata": {"resourceVersion": last.to_string()}}});
                    if tx.send(Bytes::from(format!("{b}\n"))).await.is_err() { return; }
                }
                e = live.recv() => match e {
                    Ok(e) if e.rv > last => {
                        last = e.rv;
                        if let Some(b) = send(&e) && tx.send(b).await.is_err() { return; }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| {
            status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", "building the response").into_response()
        })
}

/// A stream fed by a task: the task gets a sender and ends the stream by returning.
fn async_stream<F, Fut>(f: F) -> impl futures::Stream<Item = Result<Bytes, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(f(tx));
    futures::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), Ok)
}

async fn outage(State(shared): State<Shared>, request: Request, next: Next) -> Response {
    shared.lock().requests.push((request.method().to_string(), request.uri().to_string()));
    if *shared.available.borrow() {
        next.run(request).await
    } else {
        status(StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable", "the API server stand-in is down (test outage)")
            .into_response()
    }
}

fn router(shared: Shared) -> Router {
    Router::new()
        .route(
            "/api/v1/pods",
            get(|State(s): State<Shared>, Query(q): Query<BTreeMap<String, String>>| {
                list_or_watch(s, Kind::Pod, None, q)
            }),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(|State(s): State<Shared>, Path(ns): Path<String>, Query(q): Query<BTreeMap<String, String>>| {
                list_or_watch(s, Kind::Pod, Some(ns), q)
            })
            .post(|State(s): State<Shared>, Path(ns): Path<String>, body: Bytes| async move {
                reply(StatusCode::CREATED, parse_body(&body).and_then(|v| s.create(Kind::Pod, &ns, v)))
            }),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(|State(s): State<Shared>, Path((ns, name)): Path<(String, String)>| async move {
                let key = pod_key(&ns, &name);
                let found = s.lock().objects.get(&key).cloned();
                reply(StatusCode::OK, found.ok_or_else(|| not_found(&key)))
            })
            .delete(|State(s): State<Shared>, Path((ns, name)): Path<(String, String)>| async move {
                reply(StatusCode::OK, s.delete(&pod_key(&ns, &name)))
            })
            .patch(patch_pod),
        )
        .route("/api/v1/namespaces/{ns}/pods/{name}/status", axum::routing::patch(patch_pod))
        .route("/api/v1/namespaces/{ns}/pods/{name}/binding", post(bind))
        .route(
            "/api/v1/nodes",
            get(|State(s): State<Shared>, Query(q): Query<BTreeMap<String, String>>| {
                list_or_watch(s, Kind::Node, None, q)
            })
            .post(|State(s): State<Shared>, body: Bytes| async move {
                reply(StatusCode::CREATED, parse_body(&body).and_then(|v| s.create(Kind::Node, "", v)))
            }),
        )
        .route(
            "/api/v1/nodes/{name}",
            get(|State(s): State<Shared>, Path(name): Path<String>| async move {
                let key = node_key(&name);
                let found = s.lock().objects.get(&key).cloned();
                reply(StatusCode::OK, found.ok_or_else(|| not_found(&key)))
            })
            .patch(
                |State(s): State<Shared>, Path(name): Path<String>, headers: HeaderMap, body: Bytes| async move {
                    patch(&s, &node_key(&name), &headers, &body)
                },
            ),
        )
        .layer(middleware::from_fn_with_state(shared.clone(), outage))
        .with_state(shared)
}

async fn patch_pod(
    State(s): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    patch(&s, &pod_key(&ns, &name), &headers, &body)
}

fn patch(s: &Shared, key: &Key, headers: &HeaderMap, body: &Bytes) -> Response {
    let kind = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if !matches!(kind, "application/merge-patch+json" | "application/strategic-merge-patch+json") {
        let e = status(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", format!("patch type {kind:?}"));
        return e.into_response();
    }
    let p = match parse_body(body) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let result = s.update(key, |o| {
        let want = p.pointer("/metadata/resourceVersion").and_then(Value::as_str);
        if let Some(want) = want
            && o.pointer("/metadata/resourceVersion").and_then(Value::as_str) != Some(want)
        {
            return Err(status(StatusCode::CONFLICT, "Conflict", "the object has been modified"));
        }
        merge_patch(o, &p);
        Ok(())
    });
    reply(StatusCode::OK, result)
}

async fn bind(State(s): State<Shared>, Path((ns, name)): Path<(String, String)>, body: Bytes) -> Response {
    let binding = match parse_body(&body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let Some(node) = binding.pointer("/target/name").and_then(Value::as_str).map(str::to_owned) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "the Binding has no target.name").into_response();
    };
    let annotations = binding.pointer("/metadata/annotations").cloned().unwrap_or_else(|| json!({}));
    let result = s.update(&pod_key(&ns, &name), |pod| {
        if let Some(bound) = pod.pointer("/spec/nodeName").and_then(Value::as_str).filter(|n| !n.is_empty()) {
            return Err(status(
                StatusCode::CONFLICT,
                "Conflict",
                format!("Operation cannot be fulfilled on pods/binding \"{name}\": pod {name} is already assigned to node \"{bound}\""),
            ));
        }
        merge_patch(pod, &json!({"spec": {"nodeName": node}, "metadata": {"annotations": annotations}}));
        Ok(())
    });
    let success = json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201});
    reply(StatusCode::CREATED, result.map(|_| success))
}

impl ApiServer {
    /// Starts on 127.0.0.1 with a random port, with default options.
    ///
    /// # Errors
    /// If the port cannot be bound.
    pub async fn start() -> anyhow::Result<ApiServer> {
        Self::start_with(Options::default()).await
    }

    /// Starts with `options`.
    ///
    /// # Errors
    /// If the port cannot be bound.
    pub async fn start_with(options: Options) -> anyhow::Result<ApiServer> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Shared {
            store: Arc::new(Mutex::new(Store {
                rv: 1,
                uid: 0,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
                history_limit: options.history.max(1),
                requests: Vec::new(),
            })),
            events: broadcast::channel(4096).0,
            available: watch::channel(true).0,
            options,
        };
        let app = router(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(ApiServer { addr, shared, task })
    }

    /// `http://127.0.0.1:<port>`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig for this server (plain HTTP, a dummy token) to `path`.
    ///
    /// # Errors
    /// If the file cannot be written.
    pub fn write_kubeconfig(&self, path: &std::path::Path) -> anyhow::Result<()> {
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: {}\n\
                 users:\n- name: node\n  user:\n    token: standin\ncontexts:\n- name: standin\n  context:\n    \
                 cluster: standin\n    user: node\ncurrent-context: standin\n",
                self.url()
            ),
        )?;
        Ok(())
    }

    /// Creates a pod in `namespace` (as `kubectl create` would); returns it as stored.
    ///
    /// # Errors
    /// The API error (for example, it exists).
    pub fn create_pod(&self, namespace: &str, pod: Value) -> anyhow::Result<Value> {
        self.shared.create(Kind::Pod, namespace, pod).map_err(|e| anyhow::anyhow!("create failed: {}", e.message))
    }

    /// Creates a node.
    ///
    /// # Errors
    /// The API error.
    pub fn create_node(&self, node: Value) -> anyhow::Result<Value> {
        self.shared.create(Kind::Node, "", node).map_err(|e| anyhow::anyhow!("create failed: {}", e.message))
    }

    /// Applies a merge patch to a pod (e.g. a status change).
    ///
    /// # Errors
    /// If the pod does not exist.
    pub fn patch_pod(&self, namespace: &str, name: &str, patch: &Value) -> anyhow::Result<Value> {
        self.shared
            .update(&pod_key(namespace, name), |o| {
                merge_patch(o, patch);
                Ok(())
            })
            .map_err(|e| anyhow::anyhow!("patch failed: {}", e.message))
    }

    /// Deletes a pod.
    ///
    /// # Errors
    /// If the pod does not exist.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> anyhow::Result<Value> {
        self.shared.delete(&pod_key(namespace, name)).map_err(|e| anyhow::anyhow!("delete failed: {}", e.message))
    }

    /// A pod as stored.
    #[must_use]
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.shared.lock().objects.get(&pod_key(namespace, name)).cloned()
    }

    /// A node as stored.
    #[must_use]
    pub fn node(&self, name: &str) -> Option<Value> {
        self.shared.lock().objects.get(&node_key(name)).cloned()
    }

    /// Every request seen, as (method, path and query).
    #[must_use]
    pub fn requests(&self) -> Vec<(String, String)> {
        self.shared.lock().requests.clone()
    }

    /// Simulates an outage (`false`): every request gets 503 and open watches end.
    pub fn set_available(&self, available: bool) {
        self.shared.available.send_replace(available);
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_and_merge_patch() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "x"}}, "spec": {"nodeName": "a"}});
        assert!(fields_match(&pod, "spec.nodeName=a"));
        assert!(fields_match(&pod, "spec.nodeName!=b,metadata.name=p"));
        assert!(!fields_match(&pod, "spec.nodeName=b"));
        assert!(fields_match(&pod, "status.phase!=Running"));
        assert!(labels_match(&pod, "app=x"));
        assert!(labels_match(&pod, "app"));
        assert!(!labels_match(&pod, "app!=x"));
        let mut v = json!({"a": {"b": 1, "c": 2}});
        merge_patch(&mut v, &json!({"a": {"b": null, "d": 3}}));
        assert_eq!(v, json!({"a": {"c": 2, "d": 3}}));
        assert_eq!(now_rfc3339().len(), 20);
    }
}
