//! Watches: newline-delimited JSON `WatchEvent`s over a chunked `200` response.
//!
//! A watch starts from the resourceVersion asked: `0` or none sends a synthetic `ADDED` for every
//! matching object, then live events (as does `sendInitialEvents=true`, which then sends a
//! bookmark annotated `k8s.io/initial-events-end`); a number `N` replays the kept events after
//! `N`, or sends one `ERROR` event with a `410 Expired` Status if they are no longer all kept.
//! Each event is seen through the watch's selectors as the real server's watch cache does: an
//! update that makes an object match is `ADDED`, one that makes it stop matching is `DELETED`
//! (its previous state, with the update's resourceVersion). The stream ends after
//! `timeoutSeconds`, on an outage or a shutdown, or when the watch falls too far behind.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;

use super::Shared;
use super::selectors::Filter;
use super::status::ApiError;
use super::store::{Event, EventType};

/// Without `timeoutSeconds`, a watch lasts this long (the real server picks 30 to 60 minutes).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

#[derive(Serialize)]
struct WatchEvent<'a> {
    #[serde(rename = "type")]
    event_type: &'a str,
    object: &'a Value,
}

fn line(event_type: &str, object: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(&WatchEvent { event_type, object }).unwrap_or_default();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

fn bookmark(filter: &Filter, rv: u64, initial_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_end && let Some(m) = metadata.as_object_mut() {
        m.insert("annotations".into(), json!({"k8s.io/initial-events-end": "true"}));
    }
    line("BOOKMARK", &json!({"kind": filter.kind().name(), "apiVersion": "v1", "metadata": metadata}))
}

/// What a write looks like to a watch with `filter`, if anything.
fn convert(event: &Event, filter: &Filter) -> Option<Bytes> {
    if event.kind != filter.kind() {
        return None;
    }
    let now = event.event_type != EventType::Deleted && filter.matches(&event.object);
    let before = event.prev.as_ref().is_some_and(|p| filter.matches(p));
    match (now, before) {
        (true, false) => Some(line("ADDED", &event.object)),
        (true, true) => Some(line("MODIFIED", &event.object)),
        (false, true) if event.event_type == EventType::Deleted => Some(line("DELETED", &event.object)),
        (false, true) => {
            let mut last = event.prev.clone().unwrap_or(Value::Null);
            if let Some(meta) = last.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.insert("resourceVersion".into(), event.rv.to_string().into());
            }
            Some(line("DELETED", &last))
        }
        (false, false) => None,
    }
}

fn is_true(value: Option<&String>) -> bool {
    value.is_some_and(|v| v == "true" || v == "1")
}

fn streaming(body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// Starts a watch of the objects `filter` selects, with the query's parameters.
pub(super) fn start(shared: &Shared, filter: Filter, query: &BTreeMap<String, String>) -> Result<Response, ApiError> {
    let since = match query.get("resourceVersion").map(String::as_str) {
        None | Some("" | "0") => None,
        Some(rv) => Some(rv.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!("resourceVersion: Invalid value: {rv:?}: not a valid resource version"))
        })?),
    };
    let send_initial = is_true(query.get("sendInitialEvents"));
    let bookmarks = is_true(query.get("allowWatchBookmarks"));
    // As the real server: none or 0 is the default.
    let timeout = match query.get("timeoutSeconds").map(|t| (t, t.parse::<u64>())) {
        None | Some((_, Ok(0))) => DEFAULT_TIMEOUT,
        Some((_, Ok(seconds))) => Duration::from_secs(seconds),
        Some((t, Err(_))) => return Err(ApiError::bad_request(format!("timeoutSeconds: Invalid value: {t:?}"))),
    };
    let mut closer = shared.closer.subscribe();
    let (first, live, last) = {
        let store = shared.lock();
        let mut first = Vec::new();
        if send_initial || since.is_none() {
            first.extend(store.list(&filter).iter().map(|o| line("ADDED", o)));
            if send_initial && bookmarks {
                first.push(bookmark(&filter, store.resource_version(), true));
            }
        } else if let Some(rv) = since {
            match store.events_after(rv) {
                Ok(events) => first.extend(events.iter().filter_map(|e| convert(e, &filter))),
                Err(gone) => {
                    let event = line("ERROR", &gone.to_status());
                    return Ok(streaming(Body::from(event)));
                }
            }
        }
        (first, store.subscribe(), store.resource_version())
    };
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let every = shared.bookmark_every;
    let instance = shared.clone();
    let mut released = shared.watches_held.subscribe();
    tokio::spawn(async move {
        let mut live = live;
        let mut last = last;
        for bytes in first {
            if tx.send(bytes).await.is_err() {
                return;
            }
        }
        let deadline = Instant::now() + timeout;
        let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let bytes = tokio::select! {
                () = tokio::time::sleep_until(deadline) => return,
                () = tx.closed() => return,
                _ = closer.changed() => return,
                () = instance.stopped() => return,
                _ = ticks.tick(), if bookmarks => bookmark(&filter, last, false),
                received = live.recv() => match received {
                    Ok(event) if event.rv > last => {
                        last = event.rv;
                        match convert(&event, &filter) {
                            Some(bytes) => bytes,
                            None => continue,
                        }
                    }
                    Ok(_) => continue,
                    // Too far behind (the client resumes from its last resourceVersion) or closed.
                    Err(broadcast::error::RecvError::Lagged(_) | broadcast::error::RecvError::Closed) => return,
                },
            };
            // Held back while the server holds watch events: sent in order once released
            // (and not at all if the watch ends meanwhile).
            let release = async {
                tokio::select! {
                    released = released.wait_for(|held| !*held) => released.is_ok(),
                    () = tx.closed() => false,
                    _ = closer.changed() => false,
                    () = instance.stopped() => false,
                }
            };
            if !release.await || tx.send(bytes).await.is_err() {
                return;
            }
        }
    });
    let stream = ReceiverStream::new(rx).map(Ok::<Bytes, Infallible>);
    Ok(streaming(Body::from_stream(stream)))
}

#[cfg(test)]
mod tests {
    use super::super::Kind;
    use super::*;

    fn event(event_type: EventType, object: Value, prev: Option<Value>) -> Event {
        Event { rv: 9, kind: Kind::Pod, event_type, object, prev }
    }

    fn decoded(bytes: Option<Bytes>) -> Option<(String, Value)> {
        let v: Value = serde_json::from_slice(&bytes?).unwrap();
        Some((v["type"].as_str().unwrap().to_owned(), v["object"].clone()))
    }

    #[test]
    fn events_are_seen_through_the_selector() {
        let filter = Filter::new(Kind::Pod, None, Some("spec.nodeName=a"), None).unwrap();
        let on = |node: &str, rv: &str| {
            let metadata = json!({"name": "p", "resourceVersion": rv});
            json!({"metadata": metadata, "spec": {"nodeName": node}})
        };
        let added = decoded(convert(&event(EventType::Added, on("a", "9"), None), &filter)).unwrap();
        assert_eq!(added.0, "ADDED");
        assert!(convert(&event(EventType::Added, on("b", "9"), None), &filter).is_none());
        let moved_in = decoded(convert(&event(EventType::Modified, on("a", "9"), Some(on("b", "8"))), &filter));
        assert_eq!(moved_in.unwrap().0, "ADDED");
        let changed = decoded(convert(&event(EventType::Modified, on("a", "9"), Some(on("a", "8"))), &filter));
        assert_eq!(changed.unwrap().0, "MODIFIED");
        let (t, o) = decoded(convert(&event(EventType::Modified, on("b", "9"), Some(on("a", "8"))), &filter)).unwrap();
        assert_eq!(
            (t.as_str(), &o["spec"]["nodeName"], &o["metadata"]["resourceVersion"]),
            ("DELETED", &json!("a"), &json!("9"))
        );
        let deleted = decoded(convert(&event(EventType::Deleted, on("a", "9"), Some(on("a", "8"))), &filter));
        assert_eq!(deleted.unwrap().0, "DELETED");
        assert!(convert(&event(EventType::Deleted, on("b", "9"), Some(on("b", "8"))), &filter).is_none());
        let nodes = Filter::new(Kind::Node, None, None, None).unwrap();
        assert!(convert(&event(EventType::Added, on("a", "9"), None), &nodes).is_none());
    }
}
