//! The API-server stand-in driven by the real `kube` client (its `Api`, its `watcher`, its
//! discovery calls): if these pass, the daemon's and the extender's kube code talk to it as to a
//! real API server. Every test is bounded by a 10 s timeout.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt as _;
use gpushare_testkit::apiserver::{ApiServer, Kind, Options};
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use kube::api::{
    DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions, WatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::Status;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Config};
use serde_json::{Value, json};
use tokio::sync::mpsc;

const LIMIT: Duration = Duration::from_secs(10);

/// Runs a test body under the 10 s limit.
async fn within<F: Future>(body: F) -> F::Output {
    tokio::time::timeout(LIMIT, body).await.expect("the test took more than 10 s")
}

/// A kube client built the ordinary way, from a kubeconfig file.
async fn client(server: &ApiServer) -> Client {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let config = Config::from_custom_kubeconfig(Kubeconfig::read_from(&path).unwrap(), &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

fn pod_json(name: &str, node: Option<&str>) -> Value {
    let mut pod = json!({"metadata": {"name": name}, "spec": {"containers": [{"name": "c", "image": "x"}]}});
    if let (Some(node), Some(spec)) = (node, pod.get_mut("spec").and_then(Value::as_object_mut)) {
        spec.insert("nodeName".into(), node.into());
    }
    pod
}

fn pod(name: &str, node: Option<&str>) -> Pod {
    serde_json::from_value(pod_json(name, node)).unwrap()
}

fn binding(pod: &str, node: &str, annotations: &[(&str, &str)]) -> Binding {
    Binding {
        metadata: ObjectMeta {
            name: Some(pod.into()),
            annotations: Some(annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()),
            ..ObjectMeta::default()
        },
        target: ObjectReference { kind: Some("Node".into()), name: Some(node.into()), ..ObjectReference::default() },
    }
}

/// The Status of a failed call.
fn status(error: kube::Error) -> Box<Status> {
    match error {
        kube::Error::Api(status) => status,
        other => panic!("expected an API error, got {other}"),
    }
}

fn names(pods: impl IntoIterator<Item = Pod>) -> Vec<String> {
    pods.into_iter().map(|p| p.metadata.name.unwrap()).collect()
}

fn rv(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap()
}

/// What a watcher reported about one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Apply(String),
    Delete(String),
}

fn apply(name: &str) -> Seen {
    Seen::Apply(name.into())
}

type Events = mpsc::UnboundedReceiver<Result<watcher::Event<Pod>, watcher::Error>>;

/// A `kube_runtime` watcher (with its default backoff) driven in the background, as an
/// application drives it; its events arrive on the channel.
fn watch_pods(api: Api<Pod>, config: watcher::Config) -> Events {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().boxed();
        while let Some(event) = stream.next().await {
            if tx.send(event).is_err() {
                return;
            }
        }
    });
    rx
}

/// The next pod a watcher reports, skipping the markers of its (re)lists and its errors (which
/// it retries with backoff), with the pod itself.
async fn next_pod(events: &mut Events) -> (Seen, Pod) {
    loop {
        match events.recv().await.expect("the watcher ended") {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                return (Seen::Apply(p.metadata.name.clone().unwrap()), p);
            }
            Ok(watcher::Event::Delete(p)) => return (Seen::Delete(p.metadata.name.clone().unwrap()), p),
            Ok(watcher::Event::Init | watcher::Event::InitDone) | Err(_) => {}
        }
    }
}

async fn next_seen(events: &mut Events) -> Seen {
    next_pod(events).await.0
}

/// A server holding pod `early` on node-a, a client's `Api` of the default namespace, and a
/// watcher of node-a's pods that has seen `early`.
async fn watching_early() -> (ApiServer, Api<Pod>, Events) {
    let server = ApiServer::start().await.unwrap();
    server.create_pod("default", pod_json("early", Some("node-a"))).unwrap();
    let client = client(&server).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let config = watcher::Config::default().fields("spec.nodeName=node-a");
    let mut stream = watch_pods(Api::<Pod>::all(client), config);
    assert_eq!(next_seen(&mut stream).await, apply("early"));
    (server, pods, stream)
}

/// Waits until `condition` holds of the server's request log.
async fn until_requests(server: &ApiServer, condition: impl Fn(&[(String, String)]) -> bool) {
    while !condition(&server.requests()) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Lists (not watches) of all pods, as counted from the request log.
fn pod_lists(server: &ApiServer) -> usize {
    server
        .requests()
        .iter()
        .filter(|(method, uri)| method == "GET" && uri.starts_with("/api/v1/pods?") && !uri.contains("watch="))
        .count()
}

/// A raw HTTP/1.1 request (no client library), for malformed input; returns the code and the body.
async fn raw(server: &ApiServer, method: &str, path: &str, content_type: &str, body: &str) -> (u16, Value) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let host = server.addr().to_string();
    let mut stream = tokio::net::TcpStream::connect(&host).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let code = response.split_whitespace().nth(1).unwrap().parse().unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.to_ascii_lowercase().contains("content-type: application/json"), "{response}");
    (code, serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}")))
}

#[tokio::test]
async fn create_get_list_with_selectors_and_delete() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        let client = client(&server).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
        let pp = PostParams::default();
        let mut labelled = pod("a", Some("node-a"));
        labelled.metadata.labels = Some([("app".to_owned(), "x".to_owned())].into());
        let a = pods.create(&pp, &labelled).await.unwrap();
        let meta = &a.metadata;
        assert_eq!(meta.uid.as_ref().unwrap().len(), 36);
        assert_eq!(meta.namespace.as_deref(), Some("default"));
        assert!(meta.creation_timestamp.is_some());
        assert_eq!(meta.resource_version.as_deref(), Some(server.resource_version().to_string().as_str()));
        assert_eq!(a.status.unwrap().phase.as_deref(), Some("Pending"));
        assert_eq!(a.spec.unwrap().scheduler_name.as_deref(), Some("default-scheduler"));
        pods.create(&pp, &pod("b", Some("node-b"))).await.unwrap();
        pods.create(&pp, &pod("c", None)).await.unwrap();
        Api::<Pod>::namespaced(client.clone(), "other").create(&pp, &pod("d", Some("node-a"))).await.unwrap();

        let exists = status(pods.create(&pp, &pod("a", None)).await.unwrap_err());
        assert!(exists.is_already_exists() && exists.code == 409, "{exists:?}");
        assert_eq!(exists.message, "pods \"a\" already exists");

        let list = |lp: ListParams| {
            let pods = pods.clone();
            async move { names(pods.list(&lp).await.unwrap()) }
        };
        assert_eq!(list(ListParams::default().fields("spec.nodeName=node-a")).await, ["a"]);
        assert_eq!(list(ListParams::default().fields("spec.nodeName!=node-a,metadata.name!=x")).await, ["b", "c"]);
        assert_eq!(list(ListParams::default().fields("spec.nodeName=")).await, ["c"]);
        assert_eq!(list(ListParams::default().labels("app=x")).await, ["a"]);
        assert_eq!(list(ListParams::default().labels("!app")).await, ["b", "c"]);
        assert_eq!(list(ListParams::default().limit(1)).await, ["a"], "one page of one");
        let everywhere: Api<Pod> = Api::all(client.clone());
        let on_a = everywhere.list(&ListParams::default().fields("spec.nodeName=node-a")).await.unwrap();
        assert_eq!(on_a.metadata.resource_version, Some(server.resource_version().to_string()));
        assert_eq!(names(on_a), ["a", "d"]);
        let bad = status(pods.list(&ListParams::default().fields("spec.nodeName")).await.unwrap_err());
        assert_eq!((bad.code, bad.reason.as_str()), (400, "BadRequest"));

        let mut generated = pod("", None);
        generated.metadata.name = None;
        generated.metadata.generate_name = Some("gen-".into());
        let generated = pods.create(&pp, &generated).await.unwrap().metadata.name.unwrap();
        assert!(generated.len() == 9 && generated.starts_with("gen-"), "{generated}");
        assert!(generated[4..].bytes().all(|b| b.is_ascii_lowercase()), "{generated}");

        let dry = PostParams { dry_run: true, ..PostParams::default() };
        pods.create(&dry, &pod("dry", None)).await.unwrap();
        assert!(server.pod("default", "dry").is_none(), "a dry run stores nothing");

        assert_eq!(pods.get("b").await.unwrap().spec.unwrap().node_name.as_deref(), Some("node-b"));
        let deleted = pods.delete("b", &DeleteParams::default()).await.unwrap().left().unwrap();
        assert_eq!(deleted.metadata.name.as_deref(), Some("b"));
        let gone = status(pods.get("b").await.unwrap_err());
        assert!(gone.is_not_found() && gone.message == "pods \"b\" not found", "{gone:?}");
        assert!(status(pods.delete("b", &DeleteParams::default()).await.unwrap_err()).is_not_found());

        let nodes: Api<Node> = Api::all(client);
        let node: Node = serde_json::from_value(json!({"metadata": {"name": "node-a"}})).unwrap();
        let node = nodes.create(&pp, &node).await.unwrap();
        assert_eq!(node.metadata.namespace, None);
        assert_eq!(names_of_nodes(nodes.list(&ListParams::default()).await.unwrap()), ["node-a"]);
        nodes.delete("node-a", &DeleteParams::default()).await.unwrap();
        assert!(nodes.list(&ListParams::default()).await.unwrap().items.is_empty());
        assert!(server.list(Kind::Pod).len() == 4 && server.list(Kind::Node).is_empty());
    })
    .await;
}

fn names_of_nodes(nodes: impl IntoIterator<Item = Node>) -> Vec<String> {
    nodes.into_iter().map(|n| n.metadata.name.unwrap()).collect()
}

#[tokio::test]
async fn node_annotations_merge_patch_and_the_other_patch_types() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        server.create_node(json!({"metadata": {"name": "node-a"}})).unwrap();
        let client = client(&server).await;
        let nodes: Api<Node> = Api::all(client.clone());
        let pp = PatchParams::default();

        let two = Patch::Merge(json!({"metadata": {"annotations": {"a": "1", "b": "2"}}}));
        nodes.patch("node-a", &pp, &two).await.unwrap();
        let before = server.resource_version();
        let remove_a = Patch::Merge(json!({"metadata": {"annotations": {"a": null}}}));
        let node = nodes.patch("node-a", &pp, &remove_a).await.unwrap();
        assert_eq!(node.metadata.annotations.unwrap().into_iter().collect::<Vec<_>>(), [("b".into(), "2".into())]);
        assert_eq!(server.resource_version(), before + 1);
        nodes.patch("node-a", &pp, &Patch::Merge(json!({"metadata": {"annotations": {"b": "2"}}}))).await.unwrap();
        assert_eq!(server.resource_version(), before + 1, "a patch that changes nothing writes nothing");

        let strategic = Patch::Strategic(json!({"metadata": {"labels": {"gpu": "yes"}}}));
        let node = nodes.patch("node-a", &pp, &strategic).await.unwrap();
        assert_eq!(node.metadata.labels.unwrap()["gpu"], "yes");
        let ops = json!([{"op": "add", "path": "/metadata/annotations/c", "value": "3"},
                         {"op": "test", "path": "/metadata/annotations/b", "value": "2"}]);
        let node = nodes.patch("node-a", &pp, &Patch::<()>::Json(serde_json::from_value(ops).unwrap())).await.unwrap();
        assert_eq!(node.metadata.annotations.unwrap().len(), 2);
        let failing = json!([{"op": "test", "path": "/metadata/annotations/b", "value": "9"}]);
        let failing = Patch::<()>::Json(serde_json::from_value(failing).unwrap());
        let err = status(nodes.patch("node-a", &pp, &failing).await.unwrap_err());
        assert!(err.is_invalid() && err.code == 422, "{err:?}");

        let stale = json!({"metadata": {"resourceVersion": "1", "annotations": {"d": "4"}}});
        let err = status(nodes.patch("node-a", &pp, &Patch::Merge(stale)).await.unwrap_err());
        assert!(err.is_conflict() && err.message.contains("the object has been modified"), "{err:?}");
        let apply = PatchParams::apply("test");
        let err = status(nodes.patch("node-a", &apply, &Patch::Apply(json!({"metadata": {}}))).await.unwrap_err());
        assert_eq!((err.code, err.reason.as_str()), (415, "UnsupportedMediaType"));
        let err = status(nodes.patch("nope", &pp, &Patch::Merge(json!({}))).await.unwrap_err());
        assert!(err.is_not_found(), "{err:?}");

        // The main resource ignores status; the status subresource ignores everything but status
        // (and metadata).
        let capacity = json!({"status": {"capacity": {"gpushare.io/gpu-mem": "16384"}},
                               "spec": {"unschedulable": true}});
        let node = nodes.patch("node-a", &pp, &Patch::Merge(capacity.clone())).await.unwrap();
        assert!(node.status.is_none_or(|s| s.capacity.is_none()));
        assert_eq!(node.spec.unwrap().unschedulable, Some(true));
        let status_patch = Patch::Merge(json!({"status": capacity["status"], "spec": {"unschedulable": false}}));
        let node = nodes.patch_status("node-a", &pp, &status_patch).await.unwrap();
        assert_eq!(node.status.unwrap().capacity.unwrap()["gpushare.io/gpu-mem"].0, "16384");
        assert_eq!(node.spec.unwrap().unschedulable, Some(true));
        assert!(nodes.get_status("node-a").await.unwrap().status.unwrap().capacity.is_some());

        // A pod's containers merge by name under a strategic merge patch; its node cannot be patched.
        let pods: Api<Pod> = Api::namespaced(client, "default");
        let two = json!({"metadata": {"name": "p"},
                          "spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "x"}]}});
        pods.create(&PostParams::default(), &serde_json::from_value(two).unwrap()).await.unwrap();
        let image = Patch::Strategic(json!({"spec": {"containers": [{"name": "b", "image": "y:1"}]}}));
        let p = pods.patch("p", &pp, &image).await.unwrap();
        let images: Vec<_> = p.spec.unwrap().containers.into_iter().map(|c| (c.name, c.image.unwrap())).collect();
        assert_eq!(images, [("a".into(), "x".into()), ("b".into(), "y:1".into())]);
        let move_node = Patch::Merge(json!({"spec": {"nodeName": "node-a"}}));
        let err = status(pods.patch("p", &pp, &move_node).await.unwrap_err());
        assert!(err.is_invalid(), "{err:?}");
    })
    .await;
}

#[tokio::test]
async fn a_binding_sets_the_node_and_copies_annotations_in_one_write() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");
        let pp = PostParams::default();
        pods.create(&pp, &pod("p", None)).await.unwrap();
        let before = rv(&server.pod("default", "p").unwrap());

        let b = binding("p", "node-a", &[("gpushare.io/assignment", "{\"gpus\":[0]}")]);
        let answer: Value = pods.create_subresource("binding", "p", &pp, &b).await.unwrap();
        assert_eq!((answer["kind"].as_str(), answer["status"].as_str()), (Some("Status"), Some("Success")));
        let stored = server.pod("default", "p").unwrap();
        assert_eq!(stored["spec"]["nodeName"], "node-a");
        assert_eq!(stored["metadata"]["annotations"]["gpushare.io/assignment"], "{\"gpus\":[0]}");
        assert_eq!(stored["status"]["conditions"][0]["type"], "PodScheduled");
        assert_eq!(rv(&stored), before + 1, "one write");
        assert_eq!(server.resource_version(), before + 1);

        let again = binding("p", "node-b", &[("gpushare.io/assignment", "{}")]);
        let err = status(pods.create_subresource::<_, Value>("binding", "p", &pp, &again).await.unwrap_err());
        assert!(err.is_conflict() && err.code == 409, "{err:?}");
        assert!(err.message.contains("is already assigned to node \"node-a\""), "{err:?}");
        assert_eq!(
            server.pod("default", "p").unwrap()["metadata"]["annotations"]["gpushare.io/assignment"],
            "{\"gpus\":[0]}"
        );
        assert_eq!(server.resource_version(), before + 1, "a refused binding writes nothing");

        let missing = binding("nope", "node-a", &[]);
        let err = status(pods.create_subresource::<_, Value>("binding", "nope", &pp, &missing).await.unwrap_err());
        assert!(err.is_not_found(), "{err:?}");
        pods.create(&pp, &pod("q", None)).await.unwrap();
        let mut untargeted = binding("q", "", &[]);
        untargeted.target.name = None;
        let err = status(pods.create_subresource::<_, Value>("binding", "q", &pp, &untargeted).await.unwrap_err());
        assert!(err.is_invalid(), "{err:?}");
    })
    .await;
}

#[tokio::test]
async fn updates_and_deletes_with_a_stale_resource_version_conflict() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");
        let pp = PostParams::default();
        let created = pods.create(&pp, &pod("p", Some("node-a"))).await.unwrap();

        let mut first = created.clone();
        first.metadata.labels = Some([("v".to_owned(), "1".to_owned())].into());
        let replaced = pods.replace("p", &pp, &first).await.unwrap();
        assert_ne!(replaced.metadata.resource_version, created.metadata.resource_version);
        let mut stale = created.clone();
        stale.metadata.labels = Some([("v".to_owned(), "2".to_owned())].into());
        let err = status(pods.replace("p", &pp, &stale).await.unwrap_err());
        assert!(err.is_conflict(), "{err:?}");
        assert_eq!(
            err.message,
            "Operation cannot be fulfilled on pods \"p\": the object has been modified; \
             please apply your changes to the latest version and try again"
        );
        stale.metadata.resource_version = None;
        let unconditional = pods.replace("p", &pp, &stale).await.unwrap();
        assert_eq!(unconditional.metadata.labels.unwrap()["v"], "2");
        let err = status(pods.replace("other", &pp, &stale).await.unwrap_err());
        assert_eq!(err.code, 400, "the name must match the URL: {err:?}");

        // PUT on status changes the status only.
        let mut running = pods.get("p").await.unwrap();
        running.status.as_mut().unwrap().phase = Some("Running".into());
        running.spec.as_mut().unwrap().containers[0].image = Some("changed".into());
        let after = pods.replace_status("p", &pp, &running).await.unwrap();
        assert_eq!(after.status.unwrap().phase.as_deref(), Some("Running"));
        assert_eq!(after.spec.unwrap().containers[0].image.as_deref(), Some("x"));

        let stale_delete = DeleteParams {
            preconditions: Some(Preconditions { resource_version: Some("2".into()), uid: None }),
            ..DeleteParams::default()
        };
        let err = status(pods.delete("p", &stale_delete).await.unwrap_err());
        assert!(err.is_conflict() && err.message.starts_with("Precondition failed"), "{err:?}");
        let uid = Preconditions { uid: created.metadata.uid, resource_version: None };
        let uid = DeleteParams { preconditions: Some(uid), ..DeleteParams::default() };
        pods.delete("p", &uid).await.unwrap();
        assert!(server.pod("default", "p").is_none());
    })
    .await;
}

#[tokio::test]
async fn a_watcher_follows_the_pods_of_its_node() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        server.create_pod("default", pod_json("early", Some("node-a"))).unwrap();
        server.create_pod("default", pod_json("elsewhere", Some("node-b"))).unwrap();
        let client = client(&server).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
        let config = watcher::Config::default().fields("spec.nodeName=node-a");
        let mut stream = watch_pods(Api::<Pod>::all(client.clone()), config);
        assert_eq!(next_seen(&mut stream).await, apply("early"));

        // Created unbound and on another node: not seen; bound to node-a: seen, with its assignment.
        let pp = PostParams::default();
        pods.create(&pp, &pod("pending", None)).await.unwrap();
        pods.create(&pp, &pod("b-pod", Some("node-b"))).await.unwrap();
        let b = binding("pending", "node-a", &[("gpushare.io/assignment", "x")]);
        pods.create_subresource::<_, Value>("binding", "pending", &pp, &b).await.unwrap();
        let (seen, bound) = next_pod(&mut stream).await;
        assert_eq!(seen, apply("pending"));
        assert_eq!(bound.metadata.annotations.unwrap()["gpushare.io/assignment"], "x");

        let running = Patch::Merge(json!({"status": {"phase": "Running"}}));
        pods.patch_status("pending", &PatchParams::default(), &running).await.unwrap();
        let (seen, changed) = next_pod(&mut stream).await;
        assert_eq!(seen, apply("pending"));
        assert_eq!(changed.status.unwrap().phase.as_deref(), Some("Running"));

        pods.delete("b-pod", &DeleteParams::default()).await.unwrap();
        pods.delete("pending", &DeleteParams::default()).await.unwrap();
        assert_eq!(next_seen(&mut stream).await, Seen::Delete("pending".into()));
        pods.create(&pp, &pod("last", Some("node-a"))).await.unwrap();
        assert_eq!(next_seen(&mut stream).await, apply("last"));

        // A raw watch: an update that moves a pod off the selector is a DELETED for it.
        let from = server.resource_version().to_string();
        server.patch_pod("default", "last", &json!({"spec": {"nodeName": "node-b"}})).unwrap();
        let wp = WatchParams::default().fields("spec.nodeName=node-a").timeout(5);
        let mut raw = pods.watch(&wp, &from).await.unwrap().boxed();
        loop {
            match raw.next().await.unwrap().unwrap() {
                WatchEvent::Deleted(p) => {
                    assert_eq!(p.metadata.name.as_deref(), Some("last"));
                    assert_eq!(p.spec.unwrap().node_name.as_deref(), Some("node-a"), "its last state on the node");
                    assert_eq!(p.metadata.resource_version, Some(server.resource_version().to_string()));
                    break;
                }
                WatchEvent::Bookmark(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn a_watch_ends_after_its_timeout_and_sends_bookmarks() {
    within(async {
        let server =
            ApiServer::start_with(Options { bookmark_every: Duration::from_millis(100), ..Options::default() })
                .await
                .unwrap();
        let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");
        let from = server.resource_version();
        server.create_pod("default", pod_json("p", None)).unwrap();
        let wp = WatchParams::default().timeout(1);
        let events: Vec<_> = pods.watch(&wp, &from.to_string()).await.unwrap().collect().await;
        let events: Vec<WatchEvent<Pod>> = events.into_iter().map(Result::unwrap).collect();
        assert!(matches!(&events[0], WatchEvent::Added(p) if p.metadata.name.as_deref() == Some("p")), "{events:?}");
        let bookmarks = events
            .iter()
            .filter(|e| matches!(e, WatchEvent::Bookmark(b) if b.metadata.resource_version == (from + 1).to_string()))
            .count();
        assert!(bookmarks >= 3, "{events:?}");
    })
    .await;
}

#[tokio::test]
async fn a_watch_from_before_the_kept_history_gets_410_and_the_watcher_relists() {
    within(async {
        let server = ApiServer::start_with(Options { history: 2, ..Options::default() }).await.unwrap();
        server.create_pod("default", pod_json("early", Some("node-a"))).unwrap();
        let client = client(&server).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
        for i in 0..3 {
            server.create_pod("default", pod_json(&format!("filler-{i}"), Some("node-b"))).unwrap();
        }
        let mut expired = pods.watch(&WatchParams::default(), "1").await.unwrap().boxed();
        match expired.next().await.unwrap().unwrap() {
            WatchEvent::Error(e) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired"), "{e:?}"),
            other => panic!("expected 410, got {other:?}"),
        }
        assert!(expired.next().await.is_none(), "the stream ends after the error");

        // Without bookmarks, a watcher whose watch times out resumes from the last event it saw;
        // writes elsewhere have pushed that out of the 2-event history, so it gets 410 and relists.
        let config = watcher::Config::default().fields("spec.nodeName=node-a").timeout(1).disable_bookmarks();
        let mut stream = watch_pods(Api::<Pod>::all(client), config);
        assert_eq!(next_seen(&mut stream).await, apply("early"));
        until_requests(&server, |r| {
            r.iter().any(|(_, uri)| uri.starts_with("/api/v1/pods?") && uri.contains("watch=true"))
        })
        .await;
        assert_eq!(pod_lists(&server), 1);
        for i in 3..6 {
            server.create_pod("default", pod_json(&format!("filler-{i}"), Some("node-b"))).unwrap();
        }
        until_requests(&server, |_| pod_lists(&server) >= 2).await;
        assert_eq!(next_seen(&mut stream).await, apply("early"), "the relist reports it again");
        server.create_pod("default", pod_json("late", Some("node-a"))).unwrap();
        assert_eq!(next_seen(&mut stream).await, apply("late"), "and the watch goes on");
    })
    .await;
}

#[tokio::test]
async fn an_outage_fails_requests_and_the_watcher_resumes_after_it() {
    within(async {
        let (server, pods, mut stream) = watching_early().await;

        server.set_unavailable(true);
        // kube retries a 503 (15 times, with backoff): a client without retries sees it.
        let mut config = Config::from_custom_kubeconfig(
            Kubeconfig::from_yaml(&server.kubeconfig()).unwrap(),
            &KubeConfigOptions::default(),
        )
        .await
        .unwrap();
        config.default_retry = false;
        let impatient: Api<Pod> = Api::namespaced(Client::try_from(config).unwrap(), "default");
        let err = status(impatient.get("early").await.unwrap_err());
        assert_eq!((err.code, err.reason.as_str()), (503, "ServiceUnavailable"));
        for i in 0..3 {
            server.create_pod("default", pod_json(&format!("during-{i}"), Some("node-a"))).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        server.set_unavailable(false);

        let mut seen = BTreeSet::new();
        while seen.len() < 3 {
            if let Seen::Apply(name) = next_seen(&mut stream).await {
                seen.insert(name);
            }
        }
        assert_eq!(seen, ["during-0", "during-1", "during-2"].map(String::from).into());
        assert_eq!(pod_lists(&server), 1, "resumed from its resourceVersion, no relist");
        assert!(pods.get("early").await.is_ok());
        assert!(server.requests().iter().any(|(_, uri)| uri.contains("watch=true")));
    })
    .await;
}

#[tokio::test]
async fn forbidden_gets_and_held_watch_events_lag_one_client_behind() {
    within(async {
        let (server, pods, mut stream) = watching_early().await;

        // The Node authorizer's answer before its graph has a binding: a GET of one pod is
        // refused, a list by node is not.
        server.set_pod_gets_forbidden(true);
        let err = status(pods.get("early").await.unwrap_err());
        assert_eq!((err.code, err.reason.as_str()), (403, "Forbidden"));
        let listed = pods.list(&ListParams::default().fields("spec.nodeName=node-a")).await.unwrap();
        assert_eq!(listed.items.len(), 1);
        server.set_pod_gets_forbidden(false);
        assert!(pods.get("early").await.is_ok());

        // Held, the watch sends nothing; released, it sends what it held, in order.
        server.hold_watch_events(true);
        server.create_pod("default", pod_json("held", Some("node-a"))).unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(300), next_seen(&mut stream)).await.is_err());
        assert!(pods.get("held").await.is_ok(), "other requests are answered at once");
        server.hold_watch_events(false);
        assert_eq!(next_seen(&mut stream).await, apply("held"));
    })
    .await;
}

#[tokio::test]
async fn a_restart_on_the_same_port_keeps_the_objects_and_the_watcher_relists() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        server.create_pod("default", pod_json("early", Some("node-a"))).unwrap();
        let client = client(&server).await;
        let config = watcher::Config::default().fields("spec.nodeName=node-a");
        let mut stream = watch_pods(Api::<Pod>::all(client.clone()), config);
        assert_eq!(next_seen(&mut stream).await, apply("early"));

        server.shutdown().await;
        assert!(tokio::net::TcpStream::connect(server.addr()).await.is_err(), "the port is closed");
        server.create_pod("default", pod_json("while-down", Some("node-a"))).unwrap();
        server.restart().await.unwrap();
        let mut seen = BTreeSet::new();
        while !seen.contains("while-down") {
            if let Seen::Apply(name) = next_seen(&mut stream).await {
                seen.insert(name);
            }
        }
        assert_eq!(pod_lists(&server), 2, "the watch cache was lost, so it relisted");
        let pods: Api<Pod> = Api::namespaced(client, "default");
        assert_eq!(names(pods.list(&ListParams::default()).await.unwrap()), ["early", "while-down"]);
    })
    .await;
}

#[tokio::test]
async fn a_streaming_list_watcher_works_too() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        server.create_pod("default", pod_json("early", Some("node-a"))).unwrap();
        server.create_pod("default", pod_json("other", Some("node-b"))).unwrap();
        let client = client(&server).await;
        let config = watcher::Config::default().fields("spec.nodeName=node-a").streaming_lists();
        let mut stream = watch_pods(Api::<Pod>::all(client), config);
        let mut events = Vec::new();
        while !matches!(events.last(), Some(watcher::Event::InitDone)) {
            events.push(stream.recv().await.unwrap().unwrap());
        }
        let [watcher::Event::Init, watcher::Event::InitApply(p), watcher::Event::InitDone] = &events[..] else {
            panic!("{events:?}");
        };
        assert_eq!(p.metadata.name.as_deref(), Some("early"));
        server.create_pod("default", pod_json("late", Some("node-a"))).unwrap();
        assert_eq!(next_seen(&mut stream).await, apply("late"));
        assert_eq!(pod_lists(&server), 0, "no list at all");
    })
    .await;
}

/// `pods/eviction` as kube's `Api::evict` and gpushared send it: the pod goes (no disruption
/// budgets here); a UID precondition that does not hold, a name that is not the URL's, or
/// another kind is refused and the pod stays.
#[tokio::test]
async fn eviction_deletes_the_pod_or_says_why_not() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        let client = client(&server).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
        for name in ["a", "b"] {
            server
                .create_pod("default", json!({"metadata": {"name": name}, "spec": {"containers": [{"name": "c"}]}}))
                .unwrap();
        }
        pods.evict("a", &kube::api::EvictParams::default()).await.unwrap();
        assert!(server.pod("default", "a").is_none());
        let raw = |name: &str, body: Value| {
            http::Request::post(format!("/api/v1/namespaces/default/pods/{name}/eviction"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body.to_string().into_bytes())
                .unwrap()
        };
        let refused = |body: Value| {
            let client = client.clone();
            async move {
                match client.request::<Value>(raw("b", body)).await {
                    Err(kube::Error::Api(s)) => (s.code, s.message),
                    other => panic!("{other:?}"),
                }
            }
        };
        let (code, message) = refused(json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "b"},
                                             "deleteOptions": {"preconditions": {"uid": "not-b"}}}))
        .await;
        assert_eq!(code, 409, "{message}");
        assert!(message.contains("UID in precondition: not-b"), "{message}");
        let (code, message) =
            refused(json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "a"}})).await;
        assert_eq!((code, message.as_str()), (400, "name in URL does not match name in Eviction object"));
        let (code, _) = refused(json!({"apiVersion": "policy/v1", "kind": "Binding", "metadata": {"name": "b"}})).await;
        assert_eq!(code, 400);
        assert!(server.pod("default", "b").is_some(), "refused evictions leave the pod");
        let uid = server.pod("default", "b").unwrap()["metadata"]["uid"].as_str().unwrap().to_owned();
        client
            .request::<Value>(raw(
                "b",
                json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "b"},
                                               "deleteOptions": {"preconditions": {"uid": uid}}}),
            ))
            .await
            .unwrap();
        assert!(server.pod("default", "b").is_none());
    })
    .await;
}

#[tokio::test]
async fn discovery_and_version() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        let client = client(&server).await;
        assert_eq!(client.list_core_api_versions().await.unwrap().versions, ["v1"]);
        let resources = client.list_core_api_resources("v1").await.unwrap();
        let names: BTreeSet<_> = resources.resources.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["nodes", "nodes/status", "pods", "pods/binding", "pods/eviction", "pods/status"].into());
        assert!(
            resources.resources.iter().any(|r| r.name == "pods" && r.namespaced && r.verbs.contains(&"watch".into()))
        );
        assert_eq!(client.apiserver_version().await.unwrap().git_version, "v1.36.0");
        assert!(client.list_api_groups().await.unwrap().groups.is_empty());
    })
    .await;
}

#[tokio::test]
async fn malformed_requests_get_a_status_with_the_reason() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        server.create_pod("default", pod_json("p", None)).unwrap();
        let (code, body) =
            raw(&server, "POST", "/api/v1/namespaces/default/pods", "application/json", "{not json").await;
        assert_eq!((code, body["kind"].as_str(), body["reason"].as_str()), (400, Some("Status"), Some("BadRequest")));
        assert!(body["message"].as_str().unwrap().contains("not valid JSON"), "{body}");
        let merge = "application/merge-patch+json";
        let (code, body) = raw(&server, "PATCH", "/api/v1/namespaces/default/pods/p", merge, "{\"metadata\":").await;
        assert_eq!((code, body["reason"].as_str()), (400, Some("BadRequest")), "{body}");
        let (code, body) = raw(&server, "PATCH", "/api/v1/namespaces/default/pods/p", "text/plain", "{}").await;
        assert_eq!((code, body["reason"].as_str()), (415, Some("UnsupportedMediaType")), "{body}");
        let labels = "{\"metadata\":{\"labels\":{\"a\":1}}}";
        let (code, body) = raw(&server, "PATCH", "/api/v1/namespaces/default/pods/p", merge, labels).await;
        assert_eq!(code, 400, "labels must be strings: {body}");
        let (code, body) = raw(&server, "POST", "/api/v1/namespaces/default/pods", "application/json", "[]").await;
        assert_eq!(code, 400, "{body}");
        let (code, body) = raw(
            &server,
            "POST",
            "/api/v1/namespaces/default/pods",
            "application/json",
            "{\"metadata\":{\"name\":\"Bad_Name\"}}",
        )
        .await;
        assert_eq!((code, body["reason"].as_str()), (422, Some("Invalid")), "{body}");
        let (code, body) = raw(&server, "GET", "/api/v1/configmaps", "application/json", "").await;
        assert_eq!((code, body["reason"].as_str()), (404, Some("NotFound")), "{body}");
        let (code, body) = raw(&server, "POST", "/api/v1/pods", "application/json", "{}").await;
        assert_eq!((code, body["reason"].as_str()), (405, Some("MethodNotAllowed")), "{body}");
        let (code, body) =
            raw(&server, "DELETE", "/api/v1/namespaces/default/pods/p/status", "application/json", "").await;
        assert_eq!(code, 405, "{body}");
        let (code, body) =
            raw(&server, "GET", "/api/v1/pods?watch=true&resourceVersion=x", "application/json", "").await;
        assert_eq!(code, 400, "{body}");
        assert!(server.pod("default", "p").is_some());
    })
    .await;
}

#[tokio::test]
async fn lists_page_with_limit_and_continue() {
    within(async {
        let server = ApiServer::start().await.unwrap();
        for i in 0..5 {
            server.create_pod("default", pod_json(&format!("p{i}"), None)).unwrap();
        }
        server.create_pod("other", pod_json("q", None)).unwrap();
        let pods: Api<Pod> = Api::all(client(&server).await);
        let mut names = Vec::new();
        let mut params = ListParams::default().limit(2);
        let mut pages = 0;
        loop {
            let page = pods.list(&params).await.unwrap();
            pages += 1;
            names.extend(page.items.iter().map(|p| p.metadata.name.clone().unwrap()));
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        assert_eq!(pages, 3);
        assert_eq!(names, ["p0", "p1", "p2", "p3", "p4", "q"]);
        // The watcher pages its initial list the same way and sees every pod.
        let seen = watcher(pods, watcher::Config::default().page_size(2))
            .default_backoff()
            .applied_objects()
            .take(6)
            .collect::<Vec<_>>()
            .await;
        assert_eq!(seen.len(), 6);
        let (code, _) = raw(&server, "GET", "/api/v1/pods?limit=x", "application/json", "").await;
        assert_eq!(code, 400);
    })
    .await;
}
