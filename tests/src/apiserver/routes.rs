//! The HTTP side: discovery, the resource paths of core/v1 and what each verb does.
//!
//! Resource paths are parsed here rather than by axum's router so that every path and method the
//! stand-in does not serve gets a Kubernetes `Status` (`404`, `405`) like everything else:
//!
//! ```text
//! /api/v1/pods                                        GET (list, watch)
//! /api/v1/namespaces/{ns}/pods                        GET (list, watch), POST
//! /api/v1/namespaces/{ns}/pods/{name}                 GET, PUT, PATCH, DELETE
//! /api/v1/namespaces/{ns}/pods/{name}/status          GET, PUT, PATCH
//! /api/v1/namespaces/{ns}/pods/{name}/binding         POST
//! /api/v1/namespaces/{ns}/pods/{name}/eviction        POST (no disruption budgets: deletes)
//! /api/v1/nodes                                       GET (list, watch), POST
//! /api/v1/nodes/{name}                                GET, PUT, PATCH, DELETE
//! /api/v1/nodes/{name}/status                         GET, PUT, PATCH
//! ```

use std::collections::BTreeMap;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use super::patch::{JsonPatchError, json_patch, merge_patch, strategic_merge_patch};
use super::selectors::Filter;
use super::status::{ApiError, json_response, success};
use super::store::{Key, Origin, check_type, now_rfc3339};
use super::{Kind, Shared, tables, watch};

/// The real server's request body limit.
const BODY_LIMIT: usize = 3 * 1024 * 1024;

pub(super) fn router(shared: Shared) -> Router {
    Router::new()
        .route("/api", get(api_versions))
        .route("/api/v1", get(api_resources))
        .route("/apis", get(api_groups))
        .route("/openapi/v3", get(openapi_paths))
        .route("/openapi/v3/api/v1", get(openapi_core_v1))
        .route("/version", get(|| async { json_response(StatusCode::OK, &version()) }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .fallback(resource)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn_with_state(shared.clone(), gate))
        .with_state(shared)
}

/// Logs and counts every request, answers `503` during an outage, and turns every error response
/// that is not already a `Status` (axum's own rejections) into one.
async fn gate(State(shared): State<Shared>, request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let uri = request.uri().to_string();
    shared.requests().push((method.to_string(), uri.clone()));
    let response = if shared.is_stopping() {
        // A request on a connection still open when the server stops.
        let mut response = ApiError::unavailable().into_response();
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    } else if shared.is_available() {
        next.run(request).await
    } else {
        ApiError::unavailable().into_response()
    };
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let response = if (status.is_client_error() || status.is_server_error()) && !is_json {
        let body = axum::body::to_bytes(response.into_body(), 64 * 1024).await.unwrap_or_default();
        ApiError::from_code(status, &String::from_utf8_lossy(&body)).into_response()
    } else {
        response
    };
    tracing::debug!(%method, %uri, status = response.status().as_u16(), "API server stand-in request");
    response
}

fn version() -> Value {
    json!({
        "major": "1", "minor": "36", "emulationMajor": "1", "emulationMinor": "36",
        "minCompatibilityMajor": "1", "minCompatibilityMinor": "35",
        "gitVersion": "v1.36.0", "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
        "buildDate": "2026-04-22T00:00:00Z", "goVersion": "go1.26.2", "compiler": "gc", "platform": "linux/amd64",
    })
}

async fn api_versions(headers: HeaderMap) -> Response {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("127.0.0.1").to_owned();
    json_response(
        StatusCode::OK,
        &json!({"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]}),
    )
}

/// No API groups: only the core group is served.
async fn api_groups() -> Response {
    json_response(StatusCode::OK, &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": []}))
}

/// The `OpenAPI` v3 index: the one group-version served.
async fn openapi_paths() -> Response {
    json_response(
        StatusCode::OK,
        &json!({"paths": {"api/v1": {"serverRelativeURL": "/openapi/v3/api/v1?hash=gpushare1"}}}),
    )
}

/// Enough of core/v1's `OpenAPI` v3 document for `kubectl` to see that the server validates
/// fields itself (the `fieldValidation` parameter on create and patch, per kind), so it sends
/// `?fieldValidation=Strict` instead of validating against schemas the stand-in does not carry.
async fn openapi_core_v1() -> Response {
    let op = |kind: &str| {
        json!({"x-kubernetes-group-version-kind": {"group": "", "version": "v1", "kind": kind},
               "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": true}}],
               "responses": {"200": {"description": "OK"}}})
    };
    let mut paths = serde_json::Map::new();
    for (kind, collection, object) in [
        ("Pod", "/api/v1/namespaces/{namespace}/pods", "/api/v1/namespaces/{namespace}/pods/{name}"),
        ("Node", "/api/v1/nodes", "/api/v1/nodes/{name}"),
    ] {
        paths.insert(collection.into(), json!({"post": op(kind)}));
        paths.insert(object.into(), json!({"patch": op(kind), "put": op(kind)}));
    }
    json_response(
        StatusCode::OK,
        &json!({"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": paths,
                "components": {"schemas": {}}}),
    )
}

async fn api_resources() -> Response {
    let all = ["create", "delete", "get", "list", "patch", "update", "watch"];
    let status = ["get", "patch", "update"];
    json_response(
        StatusCode::OK,
        &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1", "resources": [
            {"name": "nodes", "singularName": "node", "namespaced": false, "kind": "Node", "verbs": all,
             "shortNames": ["no"]},
            {"name": "nodes/status", "singularName": "", "namespaced": false, "kind": "Node", "verbs": status},
            {"name": "pods", "singularName": "pod", "namespaced": true, "kind": "Pod", "verbs": all,
             "shortNames": ["po"], "categories": ["all"]},
            {"name": "pods/binding", "singularName": "", "namespaced": true, "kind": "Binding", "verbs": ["create"]},
            {"name": "pods/eviction", "singularName": "", "namespaced": true, "group": "policy", "version": "v1",
             "kind": "Eviction", "verbs": ["create"]},
            {"name": "pods/status", "singularName": "", "namespaced": true, "kind": "Pod", "verbs": status},
        ]}),
    )
}

/// Which part of an object a request is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Main,
    Status,
    Binding,
    Eviction,
}

#[derive(Debug)]
enum Route {
    Collection { kind: Kind, namespace: Option<String> },
    Object { key: Key, part: Part },
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (b, hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(decoded)) => {
                out.push(decoded);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The query's parameters, decoded; the last of repeated ones wins.
fn parse_query(query: Option<&str>) -> BTreeMap<String, String> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn parse_route(path: &str) -> Option<Route> {
    let segments: Vec<String> =
        path.trim_end_matches('/').split('/').skip(1).map(|s| percent_decode(&s.replace('+', "%2B"))).collect();
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    let (namespace, rest) = match segments.as_slice() {
        ["api", "v1", "namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(*ns), rest),
        ["api", "v1", rest @ ..] => (None, rest),
        _ => return None,
    };
    let (plural, rest) = rest.split_first()?;
    let kind = Kind::ALL.into_iter().find(|k| k.plural() == *plural)?;
    if namespace.is_some() != kind.is_namespaced() && !rest.is_empty() {
        return None;
    }
    if namespace.is_some() && !kind.is_namespaced() {
        return None;
    }
    let part = match rest {
        [] => return Some(Route::Collection { kind, namespace: namespace.map(str::to_owned) }),
        [_] => Part::Main,
        [_, "status"] => Part::Status,
        [_, "binding"] if kind == Kind::Pod => Part::Binding,
        [_, "eviction"] if kind == Kind::Pod => Part::Eviction,
        _ => return None,
    };
    let name = rest.first()?;
    Some(Route::Object { key: Key::new(kind, namespace.unwrap_or(""), name), part })
}

/// Every resource path.
async fn resource(State(shared): State<Shared>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let query = parse_query(uri.query());
    let Some(route) = parse_route(uri.path()) else {
        return ApiError::no_route().into_response();
    };
    let table = headers.get(http::header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(tables::wants_table);
    let result = match (route, method) {
        (Route::Collection { kind, namespace }, Method::GET) => list_or_watch(&shared, kind, namespace, &query, table),
        (Route::Collection { kind, namespace }, Method::POST) if namespace.is_some() || !kind.is_namespaced() => {
            create(&shared, kind, namespace.as_deref().unwrap_or(""), &query, &body)
        }
        (Route::Object { key, part: Part::Main }, Method::GET)
            if key.kind == Kind::Pod && shared.pod_gets_forbidden() =>
        {
            Err(ApiError::forbidden(&key))
        }
        (Route::Object { key, part: Part::Main | Part::Status }, Method::GET) => {
            shared.lock().get(&key).cloned().ok_or_else(|| ApiError::not_found(&key)).map(|o| {
                if table {
                    json_response(StatusCode::OK, &tables::table(key.kind, &o, now_seconds()))
                } else {
                    json_response(StatusCode::OK, &o)
                }
            })
        }
        (Route::Object { key, part: part @ (Part::Main | Part::Status) }, Method::PUT) => {
            replace(&shared, &key, part, &query, &body)
        }
        (Route::Object { key, part: part @ (Part::Main | Part::Status) }, Method::PATCH) => {
            patch(&shared, &key, part, &query, &headers, &body)
        }
        (Route::Object { key, part: Part::Main }, Method::DELETE) => delete(&shared, &key, &query, &body),
        (Route::Object { key, part: Part::Binding }, Method::POST) => bind(&shared, &key, &query, &body),
        (Route::Object { key, part: Part::Eviction }, Method::POST) => evict(&shared, &key, &query, &body),
        _ => Err(ApiError::method_not_allowed()),
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

fn parse_json(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
}

fn dry_run(query: &BTreeMap<String, String>) -> Result<bool, ApiError> {
    match query.get("dryRun").map(String::as_str) {
        None | Some("") => Ok(false),
        Some("All") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!("unsupported dry run directive {other:?}"))),
    }
}

fn now_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn list_or_watch(
    shared: &Shared,
    kind: Kind,
    namespace: Option<String>,
    query: &BTreeMap<String, String>,
    table: bool,
) -> Result<Response, ApiError> {
    let filter = Filter::new(
        kind,
        namespace,
        query.get("fieldSelector").map(String::as_str),
        query.get("labelSelector").map(String::as_str),
    )
    .map_err(ApiError::bad_request)?;
    if matches!(query.get("watch").map(String::as_str), Some("true" | "1")) {
        return watch::start(shared, filter, query);
    }
    // Paging as the real server does it: `limit`, and an opaque `continue` token (here the
    // list's resourceVersion and the last key served). Later pages read the current objects;
    // a watch from the first page's resourceVersion replays whatever changed meanwhile.
    let limit = match query.get("limit").map(|l| l.parse::<usize>()) {
        None | Some(Ok(0)) => usize::MAX,
        Some(Ok(n)) => n,
        Some(Err(_)) => return Err(ApiError::bad_request("limit must be a whole number")),
    };
    let store = shared.lock();
    let (rv, after) = match query.get("continue").filter(|c| !c.is_empty()) {
        None => (store.resource_version().to_string(), None),
        Some(token) => match token.split_once(':') {
            Some((rv, after)) if rv.parse::<u64>().is_ok() => (rv.to_owned(), Some(after)),
            _ => return Err(ApiError::bad_request("continue key is not valid")),
        },
    };
    let (items, last) = store.list_page(&filter, after, limit);
    let mut metadata = json!({"resourceVersion": rv});
    if let Some(last) = last {
        metadata["continue"] = json!(format!("{rv}:{last}"));
    }
    let list = json!({"kind": kind.list_kind(), "apiVersion": "v1", "metadata": metadata, "items": items});
    if table {
        return Ok(json_response(StatusCode::OK, &tables::table(kind, &list, now_seconds())));
    }
    Ok(json_response(StatusCode::OK, &list))
}

fn create(
    shared: &Shared,
    kind: Kind,
    namespace: &str,
    query: &BTreeMap<String, String>,
    body: &Bytes,
) -> Result<Response, ApiError> {
    let object = parse_json(body)?;
    let dry_run = dry_run(query)?;
    let created = shared.lock().create(kind, namespace, object, Origin::Client, dry_run)?;
    Ok(json_response(StatusCode::CREATED, &created))
}

/// The rules of the main resource and of `status`: a write to one keeps the other as stored, and
/// a pod's node can only be set by a binding.
fn keep_other_part(key: &Key, part: Part, old: &Value, new: &mut Value) -> Result<(), ApiError> {
    let kept = if part == Part::Status { "spec" } else { "status" };
    if let Some(map) = new.as_object_mut() {
        match old.get(kept) {
            Some(v) => map.insert(kept.into(), v.clone()),
            None => map.remove(kept),
        };
    }
    let node = |v: &Value| v.pointer("/spec/nodeName").and_then(Value::as_str).unwrap_or("").to_owned();
    if key.kind == Kind::Pod && node(old) != node(new) {
        return Err(ApiError::invalid(
            "Pod",
            &key.name,
            "spec.nodeName: Forbidden: pod updates may not change spec.nodeName (bind the pod with pods/binding)",
        ));
    }
    Ok(())
}

fn replace(
    shared: &Shared,
    key: &Key,
    part: Part,
    query: &BTreeMap<String, String>,
    body: &Bytes,
) -> Result<Response, ApiError> {
    let new = parse_json(body)?;
    let dry_run = dry_run(query)?;
    check_type(key.kind, &new)?;
    let name = new.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("");
    if name != key.name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({name}) does not match the name on the URL ({})",
            key.name
        )));
    }
    let namespace = new.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or("");
    if key.kind.is_namespaced() && !namespace.is_empty() && namespace != key.namespace {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let updated = shared.lock().update(key, dry_run, |old| {
        let mut new = new;
        keep_other_part(key, part, old, &mut new)?;
        Ok(new)
    })?;
    Ok(json_response(StatusCode::OK, &updated))
}

#[derive(Debug, Clone, Copy)]
enum PatchType {
    Merge,
    Strategic,
    Json,
}

fn patch(
    shared: &Shared,
    key: &Key,
    part: Part,
    query: &BTreeMap<String, String>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ApiError> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let mime = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let patch_type = match mime.as_str() {
        "application/merge-patch+json" => PatchType::Merge,
        "application/strategic-merge-patch+json" => PatchType::Strategic,
        "application/json-patch+json" => PatchType::Json,
        "application/apply-patch+yaml" | "application/apply-patch+cbor" => {
            return Err(ApiError::unsupported_media_type(
                "server-side apply is not supported by the API server stand-in; \
                 use a merge, strategic merge or JSON patch",
            ));
        }
        _ => {
            return Err(ApiError::unsupported_media_type(format!(
                "the body of the request was in an unknown format ({content_type:?}) - accepted media types include: \
                 application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json"
            )));
        }
    };
    let patch = parse_json(body)?;
    let dry_run = dry_run(query)?;
    let updated = shared.lock().update(key, dry_run, |old| {
        let mut new = old.clone();
        match patch_type {
            PatchType::Merge => merge_patch(&mut new, &patch),
            PatchType::Strategic => strategic_merge_patch(&mut new, &patch).map_err(ApiError::bad_request)?,
            PatchType::Json => json_patch(&mut new, &patch).map_err(|e| match e {
                JsonPatchError::Malformed(m) => ApiError::bad_request(m),
                JsonPatchError::Failed(m) => ApiError::invalid(key.kind.name(), &key.name, &m),
            })?,
        }
        keep_other_part(key, part, old, &mut new)?;
        Ok(new)
    })?;
    Ok(json_response(StatusCode::OK, &updated))
}

/// A `DeleteOptions`' `preconditions` (UID, resourceVersion) against the object.
fn preconditions(key: &Key, options: &Value, old: &Value) -> Result<(), ApiError> {
    for (field, what) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
        let wanted = options.pointer(&format!("/preconditions/{field}")).and_then(Value::as_str);
        let actual = old.pointer(&format!("/metadata/{field}")).and_then(Value::as_str).unwrap_or("");
        if let Some(wanted) = wanted.filter(|w| *w != actual) {
            return Err(ApiError::precondition(key, what, wanted, actual));
        }
    }
    Ok(())
}

fn delete(shared: &Shared, key: &Key, query: &BTreeMap<String, String>, body: &Bytes) -> Result<Response, ApiError> {
    let options = if body.iter().all(u8::is_ascii_whitespace) { Value::Null } else { parse_json(body)? };
    let body_dry_run = options.get("dryRun").and_then(Value::as_array).is_some_and(|d| !d.is_empty());
    let dry_run = dry_run(query)? || body_dry_run;
    let deleted = shared.lock().delete(key, dry_run, |old| preconditions(key, &options, old))?;
    Ok(json_response(StatusCode::OK, &deleted))
}

/// `pods/binding`: sets `spec.nodeName`, copies the Binding's annotations and marks the pod
/// scheduled, in one write.
fn bind(shared: &Shared, key: &Key, query: &BTreeMap<String, String>, body: &Bytes) -> Result<Response, ApiError> {
    let binding = parse_json(body)?;
    let dry_run = dry_run(query)?;
    if !binding.is_object() {
        return Err(ApiError::bad_request("the Binding is not a JSON object"));
    }
    if binding.get("kind").and_then(Value::as_str).is_some_and(|k| !k.is_empty() && k != "Binding") {
        return Err(ApiError::bad_request("the object provided is unrecognized (must be of type Binding)"));
    }
    let name = binding.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("");
    if !name.is_empty() && name != key.name {
        return Err(ApiError::bad_request("name in URL does not match name in Binding object"));
    }
    let Some(node) = binding.pointer("/target/name").and_then(Value::as_str).filter(|n| !n.is_empty()) else {
        return Err(ApiError::invalid("Binding", &key.name, "target.name: Required value"));
    };
    if binding.pointer("/target/kind").and_then(Value::as_str).is_some_and(|k| !k.is_empty() && k != "Node") {
        return Err(ApiError::invalid("Binding", &key.name, "target.kind: Invalid value: must be empty or Node"));
    }
    let annotations = match binding.pointer("/metadata/annotations") {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(a)) if a.values().all(Value::is_string) => a.clone(),
        Some(_) => return Err(ApiError::bad_request("Binding metadata.annotations must be a map of strings")),
    };
    let uid = binding.pointer("/metadata/uid").and_then(Value::as_str).filter(|u| !u.is_empty());
    shared.lock().update(key, dry_run, |pod| {
        let actual_uid = pod.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or("");
        if let Some(uid) = uid.filter(|u| *u != actual_uid) {
            return Err(ApiError::precondition(key, "UID", uid, actual_uid));
        }
        if pod.pointer("/metadata/deletionTimestamp").is_some_and(|t| !t.is_null()) {
            let why = format!("pod {} is being deleted, cannot be assigned to a host", key.name);
            return Err(ApiError::conflict("pods/binding", &key.name, &why));
        }
        if let Some(bound) = pod.pointer("/spec/nodeName").and_then(Value::as_str).filter(|n| !n.is_empty()) {
            let why = format!("pod {} is already assigned to node \"{bound}\"", key.name);
            return Err(ApiError::conflict("pods/binding", &key.name, &why));
        }
        let mut pod = pod.clone();
        merge_patch(&mut pod, &json!({"spec": {"nodeName": node}, "metadata": {"annotations": annotations}}));
        set_scheduled(&mut pod);
        Ok(pod)
    })?;
    Ok(json_response(StatusCode::CREATED, &success(StatusCode::CREATED)))
}

/// `pods/eviction`: an `Eviction` (`policy/v1` or `v1beta1`) naming the pod; with no
/// disruption budgets in the stand-in it is always allowed, and deletes the pod as `DELETE`
/// does, honouring `deleteOptions.preconditions`.
fn evict(shared: &Shared, key: &Key, query: &BTreeMap<String, String>, body: &Bytes) -> Result<Response, ApiError> {
    let eviction = parse_json(body)?;
    if !eviction.is_object() {
        return Err(ApiError::bad_request("the Eviction is not a JSON object"));
    }
    if eviction.get("kind").and_then(Value::as_str).is_some_and(|k| !k.is_empty() && k != "Eviction") {
        return Err(ApiError::bad_request("the object provided is unrecognized (must be of type Eviction)"));
    }
    if let Some(v) = eviction.get("apiVersion").and_then(Value::as_str)
        && !matches!(v, "" | "policy/v1" | "policy/v1beta1")
    {
        return Err(ApiError::bad_request(format!("no kind \"Eviction\" is registered for version {v:?}")));
    }
    let name = eviction.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("");
    if name != key.name {
        return Err(ApiError::bad_request("name in URL does not match name in Eviction object"));
    }
    let options = eviction.get("deleteOptions").cloned().unwrap_or(Value::Null);
    let dry_run = dry_run(query)? || options.get("dryRun").and_then(Value::as_array).is_some_and(|d| !d.is_empty());
    shared.lock().delete(key, dry_run, |old| preconditions(key, &options, old))?;
    Ok(json_response(StatusCode::CREATED, &success(StatusCode::CREATED)))
}

/// The `PodScheduled=True` condition a binding sets.
fn set_scheduled(pod: &mut Value) {
    let condition = json!({"type": "PodScheduled", "status": "True", "lastProbeTime": null,
                           "lastTransitionTime": now_rfc3339()});
    let Some(pod) = pod.as_object_mut() else { return };
    let status = pod.entry("status").or_insert_with(|| json!({}));
    let Some(status) = status.as_object_mut() else { return };
    let conditions = status.entry("conditions").or_insert_with(|| json!([]));
    if !conditions.is_array() {
        *conditions = json!([]);
    }
    if let Some(conditions) = conditions.as_array_mut() {
        conditions.retain(|c| c.get("type").and_then(Value::as_str) != Some("PodScheduled"));
        conditions.push(condition);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_queries_parse() {
        let route = |p: &str| format!("{:?}", parse_route(p));
        assert!(route("/api/v1/pods").contains("Collection { kind: Pod, namespace: None }"));
        assert!(route("/api/v1/namespaces/ns/pods/").contains("namespace: Some(\"ns\")"));
        assert!(route("/api/v1/namespaces/ns/pods/p%2Dq/status").contains("name: \"p-q\" }, part: Status"));
        assert!(route("/api/v1/namespaces/ns/pods/p/binding").contains("part: Binding"));
        assert!(route("/api/v1/nodes/n").contains("kind: Node, namespace: \"\", name: \"n\" }, part: Main"));
        for none in [
            "/api/v1/nodes/n/binding",
            "/api/v1/namespaces/ns/nodes",
            "/api/v1/pods/p",
            "/api/v1/configmaps",
            "/api/v2/pods",
            "/api/v1/namespaces/ns",
            "/api/v1/nodes/n/status/x",
        ] {
            assert_eq!(route(none), "None", "{none}");
        }
        let q = parse_query(Some("fieldSelector=spec.nodeName%3Dnode-a&watch=1&labelSelector=a+in+(b)&x"));
        assert_eq!(q["fieldSelector"], "spec.nodeName=node-a");
        assert_eq!(q["labelSelector"], "a in (b)");
        assert_eq!(q["x"], "");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }
}
