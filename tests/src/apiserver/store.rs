//! The objects, the resourceVersion counter and the watch event history.
//!
//! Every write goes through [`Store::commit`]: it bumps the one global resourceVersion, stamps it
//! on the object, keeps the event (with the object's previous state, so that each watch can tell
//! whether the object entered or left its selector) and broadcasts it to the open watches, all
//! under the store's lock, so events are totally ordered by resourceVersion.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use super::Kind;
use super::patch::merge_patch;
use super::selectors::Filter;
use super::status::ApiError;

/// Where an object lives: cluster-scoped kinds have an empty namespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Key {
    pub(super) kind: Kind,
    pub(super) namespace: String,
    pub(super) name: String,
}

impl Key {
    pub(super) fn new(kind: Kind, namespace: &str, name: &str) -> Key {
        let namespace = if kind.is_namespaced() { namespace.to_owned() } else { String::new() };
        Key { kind, namespace, name: name.to_owned() }
    }
}

/// Who writes: a client over HTTP (the API's rules apply) or a test hook (stored as given).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    Client,
    Hook,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One write, as kept in the history and sent to watches.
#[derive(Debug)]
pub(super) struct Event {
    pub(super) rv: u64,
    pub(super) kind: Kind,
    pub(super) event_type: EventType,
    /// The object after the write (for a delete: its last state, with the delete's resourceVersion).
    pub(super) object: Value,
    /// The object before the write.
    pub(super) prev: Option<Value>,
}

/// Capacity of the live event channel; a watch that falls further behind is ended (its client
/// resumes from its last resourceVersion).
const LIVE_EVENTS: usize = 4096;

#[derive(Debug)]
pub(super) struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Arc<Event>>,
    /// Every event with a resourceVersion above this one is in `history`.
    history_start: u64,
    history_limit: usize,
    events: broadcast::Sender<Arc<Event>>,
}

impl Store {
    pub(super) fn new(history_limit: usize) -> Store {
        Store {
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            history_start: 1,
            history_limit: history_limit.max(1),
            events: broadcast::channel(LIVE_EVENTS).0,
        }
    }

    pub(super) fn resource_version(&self) -> u64 {
        self.rv
    }

    pub(super) fn get(&self, key: &Key) -> Option<&Value> {
        self.objects.get(key)
    }

    pub(super) fn all(&self, kind: Kind) -> Vec<Value> {
        self.objects.iter().filter(|(k, _)| k.kind == kind).map(|(_, v)| v.clone()).collect()
    }

    pub(super) fn list(&self, filter: &Filter) -> Vec<Value> {
        self.list_page(filter, None, usize::MAX).0
    }

    /// At most `limit` matching objects after the one at `after` (`namespace/name`), in key
    /// order, and the key of the last one when more remain.
    pub(super) fn list_page(&self, filter: &Filter, after: Option<&str>, limit: usize) -> (Vec<Value>, Option<String>) {
        let start = after.map(|a| {
            let (namespace, name) = a.split_once('/').unwrap_or(("", a));
            Key::new(filter.kind(), namespace, name)
        });
        let range = match &start {
            Some(k) => self.objects.range((std::ops::Bound::Excluded(k.clone()), std::ops::Bound::Unbounded)),
            None => self.objects.range(..),
        };
        let mut items = Vec::new();
        let mut last = None;
        for (k, v) in range.filter(|(k, v)| k.kind == filter.kind() && filter.matches(v)) {
            if items.len() == limit {
                return (items, last);
            }
            items.push(v.clone());
            last = Some(format!("{}/{}", k.namespace, k.name));
        }
        (items, None)
    }

    /// Live events from now on.
    pub(super) fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.events.subscribe()
    }

    /// The events after `rv`, or `410 Expired` if the history no longer holds them all.
    pub(super) fn events_after(&self, rv: u64) -> Result<Vec<Arc<Event>>, ApiError> {
        if rv < self.history_start {
            return Err(ApiError::expired(format!("too old resource version: {rv} ({})", self.history_start)));
        }
        Ok(self.history.iter().filter(|e| e.rv > rv).cloned().collect())
    }

    /// Drops the history, as a restarted server's empty watch cache.
    pub(super) fn forget_history(&mut self) {
        self.history.clear();
        self.history_start = self.rv;
    }

    /// Creates an object in `namespace` (ignored for cluster-scoped kinds).
    pub(super) fn create(
        &mut self,
        kind: Kind,
        namespace: &str,
        mut object: Value,
        origin: Origin,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        check_type(kind, &object)?;
        let Some(map) = object.as_object_mut() else {
            return Err(ApiError::bad_request("the object is not a JSON object"));
        };
        map.insert("kind".into(), kind.name().into());
        map.insert("apiVersion".into(), "v1".into());
        let meta = metadata_mut(map)?;
        let has_rv = meta.get("resourceVersion").and_then(Value::as_str).is_some_and(|s| !s.is_empty());
        if origin == Origin::Client && has_rv {
            return Err(ApiError::internal("resourceVersion should not be set on objects to be created"));
        }
        let mut system = vec!["resourceVersion", "uid", "creationTimestamp", "selfLink"];
        if origin == Origin::Client {
            system.extend(["deletionTimestamp", "deletionGracePeriodSeconds"]);
        }
        for field in system {
            meta.remove(field);
        }
        if kind.is_namespaced() {
            let given = meta.get("namespace").and_then(Value::as_str).filter(|ns| !ns.is_empty());
            if origin == Origin::Client && given.is_some_and(|ns| ns != namespace) {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            if let Err(why) = valid_name(namespace, 63, false) {
                return Err(ApiError::invalid(kind.name(), "", &format!("metadata.namespace: Invalid value: {why}")));
            }
            meta.insert("namespace".into(), namespace.into());
        } else {
            meta.remove("namespace");
        }
        let name = match (non_empty(meta.get("name")), non_empty(meta.get("generateName"))) {
            (Some(name), _) => name.to_owned(),
            (None, Some(prefix)) => self.generate_name(kind, namespace, prefix),
            (None, None) => {
                return Err(ApiError::invalid(
                    kind.name(),
                    "",
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
        };
        if let Err(why) = valid_name(&name, 253, true) {
            return Err(ApiError::invalid(kind.name(), &name, &format!("metadata.name: Invalid value: {why}")));
        }
        let key = Key::new(kind, namespace, &name);
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(kind, &name));
        }
        meta.insert("name".into(), name.into());
        meta.insert("uid".into(), new_uid().into());
        meta.insert("creationTimestamp".into(), now_rfc3339().into());
        if kind == Kind::Pod {
            default_pod(map, origin);
        }
        validate(kind, &object)?;
        if dry_run {
            return Ok(object);
        }
        Ok(self.commit(&key, EventType::Added, object, None))
    }

    fn generate_name(&self, kind: Kind, namespace: &str, prefix: &str) -> String {
        // As the real server: the prefix is cut to leave room for the 5 random characters.
        let prefix: String = prefix.chars().take(58).collect();
        let mut name = format!("{prefix}{}", random_suffix());
        for _ in 0..16 {
            if !self.objects.contains_key(&Key::new(kind, namespace, &name)) {
                break;
            }
            name = format!("{prefix}{}", random_suffix());
        }
        name
    }

    /// Replaces an object by what `change` makes of it. The object's identity (kind, name,
    /// namespace, uid, creationTimestamp) cannot change; a resourceVersion in the new object must
    /// be the stored one (`409` otherwise); a change that changes nothing writes nothing.
    pub(super) fn update(
        &mut self,
        key: &Key,
        dry_run: bool,
        change: impl FnOnce(&Value) -> Result<Value, ApiError>,
    ) -> Result<Value, ApiError> {
        let Some(old) = self.objects.get(key).cloned() else {
            return Err(ApiError::not_found(key));
        };
        let mut new = change(&old)?;
        let Some(map) = new.as_object_mut() else {
            return Err(ApiError::invalid(key.kind.name(), &key.name, "the result is not a JSON object"));
        };
        let meta = metadata_mut(map)?;
        match meta.get("resourceVersion") {
            None | Some(Value::Null) => {}
            Some(Value::String(rv)) if rv.is_empty() => {}
            Some(Value::String(rv)) => {
                if old.pointer("/metadata/resourceVersion").and_then(Value::as_str) != Some(rv.as_str()) {
                    return Err(ApiError::modified(key));
                }
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!("metadata.resourceVersion {other} is not a string")));
            }
        }
        for field in ["name", "namespace", "uid", "creationTimestamp", "resourceVersion"] {
            match old.get("metadata").and_then(|m| m.get(field)) {
                Some(v) => meta.insert(field.into(), v.clone()),
                None => meta.remove(field),
            };
        }
        map.insert("kind".into(), key.kind.name().into());
        map.insert("apiVersion".into(), "v1".into());
        validate(key.kind, &new)?;
        if new == old || dry_run {
            return Ok(new);
        }
        Ok(self.commit(key, EventType::Modified, new, Some(old)))
    }

    /// A JSON merge patch anywhere in the object, for the test hooks.
    pub(super) fn patch_unchecked(&mut self, key: &Key, patch: &Value) -> Result<Value, ApiError> {
        self.update(key, false, |old| {
            let mut new = old.clone();
            merge_patch(&mut new, patch);
            Ok(new)
        })
    }

    /// Creates or replaces, for the test hooks.
    pub(super) fn upsert(&mut self, kind: Kind, namespace: &str, mut object: Value) -> Result<Value, ApiError> {
        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
        }
        let key = Key::new(kind, namespace, object.pointer("/metadata/name").and_then(Value::as_str).unwrap_or(""));
        if self.objects.contains_key(&key) {
            check_type(kind, &object)?;
            self.update(&key, false, |_| Ok(object))
        } else {
            self.create(kind, namespace, object, Origin::Hook, false)
        }
    }

    /// Deletes an object once `check` (the preconditions) accepts it; returns its last state.
    pub(super) fn delete(
        &mut self,
        key: &Key,
        dry_run: bool,
        check: impl FnOnce(&Value) -> Result<(), ApiError>,
    ) -> Result<Value, ApiError> {
        let Some(old) = self.objects.get(key).cloned() else {
            return Err(ApiError::not_found(key));
        };
        check(&old)?;
        if dry_run {
            return Ok(old);
        }
        Ok(self.commit(key, EventType::Deleted, old.clone(), Some(old)))
    }

    /// Records a write: bumps the resourceVersion, stamps it, stores, keeps and sends the event.
    fn commit(&mut self, key: &Key, event_type: EventType, mut object: Value, prev: Option<Value>) -> Value {
        self.rv += 1;
        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), self.rv.to_string().into());
        }
        if event_type == EventType::Deleted {
            self.objects.remove(key);
        } else {
            self.objects.insert(key.clone(), object.clone());
        }
        let event = Arc::new(Event { rv: self.rv, kind: key.kind, event_type, object: object.clone(), prev });
        self.history.push_back(Arc::clone(&event));
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.history_start = dropped.rv;
            }
        }
        // No watch open is not an error.
        let _ = self.events.send(event);
        object
    }
}

fn non_empty(value: Option<&Value>) -> Option<&str> {
    value.and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// `kind` and `apiVersion`, when given, must be the resource's.
pub(super) fn check_type(kind: Kind, object: &Value) -> Result<(), ApiError> {
    let wrong = |field: &str, want: &str| match object.get(field) {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) => !s.is_empty() && s != want,
        Some(_) => true,
    };
    if wrong("kind", kind.name()) || wrong("apiVersion", "v1") {
        return Err(ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type {}, apiVersion v1)",
            kind.name()
        )));
    }
    Ok(())
}

/// The object's `metadata`, created if absent.
fn metadata_mut(object: &mut Map<String, Value>) -> Result<&mut Map<String, Value>, ApiError> {
    let meta = object.entry("metadata").or_insert_with(|| Value::Object(Map::new()));
    if meta.is_null() {
        *meta = Value::Object(Map::new());
    }
    meta.as_object_mut().ok_or_else(|| ApiError::bad_request("metadata must be an object"))
}

/// An RFC 1123 subdomain (`dots`) or label.
fn valid_name(name: &str, max: usize, dots: bool) -> Result<(), String> {
    let chars_ok =
        name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || (dots && b == b'.'));
    let ends_ok = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if name.len() <= max && chars_ok && ends_ok(name.bytes().next()) && ends_ok(name.bytes().last()) {
        return Ok(());
    }
    Err(format!(
        "{name:?}: a lowercase RFC 1123 {} must consist of at most {max} lower case alphanumeric characters, '-'{}, \
         and must start and end with an alphanumeric character",
        if dots { "subdomain" } else { "label" },
        if dots { " or '.'" } else { "" },
    ))
}

/// The shape typed clients rely on: a client that cannot decode one object cannot list any.
fn validate(kind: Kind, object: &Value) -> Result<(), ApiError> {
    let bad = |what: &str| Err(ApiError::bad_request(format!("{}: {what}", kind.name())));
    let Some(meta) = object.get("metadata").and_then(Value::as_object) else {
        return bad("metadata must be an object");
    };
    for field in ["labels", "annotations"] {
        match meta.get(field) {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) if m.values().all(Value::is_string) => {}
            Some(_) => return bad(&format!("metadata.{field} must be a map of strings")),
        }
    }
    // The real API server's limit on all annotations of an object together, keys and values.
    if let Some(Value::Object(a)) = meta.get("annotations") {
        let total: usize = a.iter().map(|(k, v)| k.len() + v.as_str().map_or(0, str::len)).sum();
        if total > 256 * 1024 {
            let name = meta.get("name").and_then(Value::as_str).unwrap_or_default();
            return Err(ApiError::invalid(
                kind.name(),
                name,
                "metadata.annotations: Too long: may not be more than 262144 bytes",
            ));
        }
    }
    match meta.get("finalizers") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => {}
        Some(_) => return bad("metadata.finalizers must be a list of strings"),
    }
    for field in ["spec", "status"] {
        if !matches!(object.get(field), None | Some(Value::Null | Value::Object(_))) {
            return bad(&format!("{field} must be an object"));
        }
    }
    if kind == Kind::Pod {
        if !matches!(object.pointer("/spec/nodeName"), None | Some(Value::Null | Value::String(_))) {
            return bad("spec.nodeName must be a string");
        }
        for list in ["containers", "initContainers"] {
            match object.get("spec").and_then(|s| s.get(list)) {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) if items.iter().all(|c| c.get("name").is_some_and(Value::is_string)) => {}
                Some(_) => return bad(&format!("spec.{list} must be a list of containers with names")),
            }
        }
    }
    Ok(())
}

/// The defaults the real API server fills in a new pod (the ones code may read), and its initial
/// status: `Pending` for a client's pod; for a hook's, the status given, `Pending` if it has no phase.
fn default_pod(pod: &mut Map<String, Value>, origin: Origin) {
    if let Some(spec) = pod.entry("spec").or_insert_with(|| json!({})).as_object_mut() {
        let defaults = [
            ("restartPolicy", json!("Always")),
            ("terminationGracePeriodSeconds", json!(30)),
            ("dnsPolicy", json!("ClusterFirst")),
            ("securityContext", json!({})),
            ("schedulerName", json!("default-scheduler")),
            ("priority", json!(0)),
            ("enableServiceLinks", json!(true)),
            ("preemptionPolicy", json!("PreemptLowerPriority")),
        ];
        for (field, value) in defaults {
            spec.entry(field).or_insert(value);
        }
        for list in ["initContainers", "containers"] {
            let Some(Value::Array(containers)) = spec.get_mut(list) else { continue };
            for container in containers.iter_mut().filter_map(Value::as_object_mut) {
                let pull = image_pull_policy(container.get("image").and_then(Value::as_str).unwrap_or(""));
                container.entry("imagePullPolicy").or_insert(pull.into());
                container.entry("terminationMessagePath").or_insert("/dev/termination-log".into());
                container.entry("terminationMessagePolicy").or_insert("File".into());
                let resources = container.entry("resources").or_insert_with(|| json!({}));
                // Requests default to limits.
                let Some(resources) = resources.as_object_mut() else { continue };
                let Some(Value::Object(limits)) = resources.get("limits").cloned() else { continue };
                if let Some(requests) = resources.entry("requests").or_insert_with(|| json!({})).as_object_mut() {
                    for (name, quantity) in limits {
                        requests.entry(name).or_insert(quantity);
                    }
                }
            }
        }
    }
    match origin {
        Origin::Client => {
            pod.insert("status".into(), json!({"phase": "Pending"}));
        }
        Origin::Hook => {
            let status = pod.entry("status").or_insert_with(|| json!({}));
            if let Some(status) = status.as_object_mut() {
                status.entry("phase").or_insert("Pending".into());
            }
        }
    }
}

/// `Always` for an untagged or `:latest` image, `IfNotPresent` otherwise.
fn image_pull_policy(image: &str) -> &'static str {
    let last = image.rsplit('/').next().unwrap_or(image);
    let tag = last.split_once(':').map(|(_, t)| t);
    if image.contains('@') || tag.is_some_and(|t| t != "latest") { "IfNotPresent" } else { "Always" }
}

/// A random number (no `rand` here: the std hasher's random keys, a counter and the clock).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher as _, RandomState};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    RandomState::new().hash_one((n, nanos))
}

/// A random (version 4) UUID.
fn new_uid() -> String {
    let (a, b) = (random_u64(), random_u64());
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0x0fff,
        ((b >> 48) & 0x3fff) | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

/// Five random lowercase letters, for `generateName`.
fn random_suffix() -> String {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    let mut bits = random_u64();
    let mut suffix = String::with_capacity(5);
    for _ in 0..5 {
        let i = usize::try_from(bits % 26).unwrap_or(0);
        suffix.push(char::from(LETTERS.get(i).copied().unwrap_or(b'x')));
        bits /= 26;
    }
    suffix
}

/// RFC 3339 UTC time of now, second precision (Kubernetes' `metav1.Time`).
pub(super) fn now_rfc3339() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

fn rfc3339(unix_secs: u64) -> String {
    gpushare_core::time::format_ms(i64::try_from(unix_secs).unwrap_or(i64::MAX / 1000) * 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_021_200), "2026-11-18T17:00:00Z");
        assert_eq!(now_rfc3339().len(), 20);
    }

    #[test]
    fn uids_and_suffixes_are_random() {
        let uids: std::collections::BTreeSet<String> = (0..100).map(|_| new_uid()).collect();
        assert_eq!(uids.len(), 100);
        assert!(uids.iter().all(|u| u.len() == 36 && u.as_bytes().get(14) == Some(&b'4')));
        let s = random_suffix();
        assert!(s.len() == 5 && s.bytes().all(|b| b.is_ascii_lowercase()), "{s}");
    }

    #[test]
    fn names_and_pull_policies() {
        assert!(valid_name("a-b.c", 253, true).is_ok());
        for bad in ["", "A", "-a", "a-", "a_b", "a/b"] {
            assert!(valid_name(bad, 253, true).is_err(), "{bad}");
        }
        assert!(valid_name("a.b", 63, false).is_err());
        assert_eq!(image_pull_policy("x"), "Always");
        assert_eq!(image_pull_policy("reg:5000/x:latest"), "Always");
        assert_eq!(image_pull_policy("reg:5000/x"), "Always");
        assert_eq!(image_pull_policy("x:1.0"), "IfNotPresent");
        assert_eq!(image_pull_policy("x@sha256:00"), "IfNotPresent");
    }

    #[test]
    fn history_expires_and_updates_keep_identity() {
        let mut store = Store::new(2);
        let pod = store.create(Kind::Pod, "ns", json!({"metadata": {"name": "p"}}), Origin::Client, false).unwrap();
        assert_eq!(pod["metadata"]["resourceVersion"], "2");
        assert_eq!(pod["status"]["phase"], "Pending");
        let key = Key::new(Kind::Pod, "ns", "p");
        let updated = store
            .update(&key, false, |_| Ok(json!({"metadata": {"name": "p", "uid": "other", "labels": {"a": "b"}}})))
            .unwrap();
        assert_eq!(updated["metadata"]["uid"], pod["metadata"]["uid"]);
        assert_eq!(updated["metadata"]["resourceVersion"], "3");
        assert_eq!(updated["metadata"]["namespace"], "ns");
        let same = store.update(&key, false, |o| Ok(o.clone())).unwrap();
        assert_eq!(same["metadata"]["resourceVersion"], "3", "a no-op writes nothing");
        let stale = store.update(&key, false, |o| {
            let mut o = o.clone();
            merge_patch(&mut o, &json!({"metadata": {"resourceVersion": "2", "labels": {"a": "c"}}}));
            Ok(o)
        });
        assert_eq!(stale.unwrap_err().code.as_u16(), 409);
        store.delete(&key, false, |_| Ok(())).unwrap();
        assert_eq!(store.events_after(2).unwrap().len(), 2);
        assert_eq!(store.events_after(1).unwrap_err().code.as_u16(), 410);
        store.forget_history();
        assert_eq!(store.events_after(3).unwrap_err().code.as_u16(), 410);
        assert!(store.events_after(4).unwrap().is_empty());
    }
}
