//! The API-server stand-in driven by the real `kube` client: if these pass, the daemon's and
//! the extender's kube code talk to it exactly as to a real API server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use futures::StreamExt as _;
use gpushare_testkit::apiserver::{ApiServer, Options};
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Api, Client, Config};
use serde_json::json;

async fn client(server: &ApiServer) -> Client {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let config = Config::from_custom_kubeconfig(Kubeconfig::read_from(&path).unwrap(), &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

fn pod(name: &str, node: Option<&str>) -> serde_json::Value {
    let mut p = json!({"metadata": {"name": name}, "spec": {"containers": [{"name": "c", "image": "x"}]}});
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
    }
    p
}

#[tokio::test]
async fn create_get_list_with_field_selector_and_delete() {
    let server = ApiServer::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");
    let created =
        pods.create(&PostParams::default(), &serde_json::from_value(pod("a", Some("node-a"))).unwrap()).await.unwrap();
    assert!(created.metadata.uid.is_some() && created.metadata.resource_version.is_some());
    assert!(created.metadata.creation_timestamp.is_some());
    pods.create(&PostParams::default(), &serde_json::from_value(pod("b", Some("node-b"))).unwrap()).await.unwrap();
    let err = pods.create(&PostParams::default(), &serde_json::from_value(pod("a", None)).unwrap()).await.unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    let on_a = pods.list(&ListParams::default().fields("spec.nodeName=node-a")).await.unwrap();
    assert_eq!(on_a.items.iter().map(|p| p.metadata.name.clone().unwrap()).collect::<Vec<_>>(), ["a"]);
    assert_eq!(pods.get("b").await.unwrap().spec.unwrap().node_name.as_deref(), Some("node-b"));
    pods.delete("b", &Default::default()).await.unwrap();
    assert!(pods.get("b").await.is_err());
}

#[tokio::test]
async fn a_binding_sets_the_node_and_copies_annotations_once() {
    let server = ApiServer::start().await.unwrap();
    let client = client(&server).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &serde_json::from_value(pod("p", None)).unwrap()).await.unwrap();
    let rv_before: u64 =
        server.pod("default", "p").unwrap()["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap();
    let binding = Binding {
        metadata: kube::api::ObjectMeta {
            name: Some("p".into()),
            annotations: Some([("gpushare.io/assignment".to_owned(), "{}".to_owned())].into()),
            ..Default::default()
        },
        target: ObjectReference { kind: Some("Node".into()), name: Some("node-a".into()), ..Default::default() },
    };
    pods.create_subresource::<_, serde_json::Value>("binding", "p", &PostParams::default(), &binding).await.unwrap();
    let stored = server.pod("default", "p").unwrap();
    assert_eq!(stored["spec"]["nodeName"], "node-a");
    assert_eq!(stored["metadata"]["annotations"]["gpushare.io/assignment"], "{}");
    let rv_after: u64 = stored["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap();
    assert_eq!(rv_after, rv_before + 1, "one write");
    let err = pods
        .create_subresource::<_, serde_json::Value>("binding", "p", &PostParams::default(), &binding)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("already assigned"), "{err}");
}

#[tokio::test]
async fn node_annotations_merge_patch_and_null_removes() {
    let server = ApiServer::start().await.unwrap();
    server.create_node(json!({"metadata": {"name": "node-a"}})).unwrap();
    let nodes: Api<Node> = Api::all(client(&server).await);
    let pp = PatchParams::default();
    nodes
        .patch("node-a", &pp, &Patch::Merge(json!({"metadata": {"annotations": {"a": "1", "b": "2"}}})))
        .await
        .unwrap();
    let n = nodes.patch("node-a", &pp, &Patch::Merge(json!({"metadata": {"annotations": {"a": null}}}))).await.unwrap();
    assert_eq!(n.metadata.annotations.unwrap().into_iter().collect::<Vec<_>>(), [("b".to_owned(), "2".to_owned())]);
    let err = nodes.patch("nope", &pp, &Patch::Merge(json!({}))).await.unwrap_err();
    assert!(err.to_string().contains("not found"), "{err}");
}

/// Collects the pod names a watcher reports as present after each event.
async fn next_names(
    stream: &mut (impl futures::Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Unpin),
) -> (String, String) {
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), stream.next()).await.unwrap().unwrap();
        match event {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                return ("apply".into(), p.metadata.name.unwrap());
            }
            Ok(watcher::Event::Delete(p)) => return ("delete".into(), p.metadata.name.unwrap()),
            Ok(_) => {}
            Err(e) => return ("error".into(), e.to_string()),
        }
    }
}

#[tokio::test]
async fn a_watcher_follows_its_node_relists_after_410_and_survives_an_outage() {
    let server =
        ApiServer::start_with(Options { history: 2, bookmark_every: Duration::from_millis(200) }).await.unwrap();
    server.create_pod("default", pod("early", Some("node-a"))).unwrap();
    let api: Api<Pod> = Api::all(client(&server).await);
    let mut stream = watcher(api, watcher::Config::default().fields("spec.nodeName=node-a")).boxed();
    assert_eq!(next_names(&mut stream).await, ("apply".into(), "early".into()));
    server.create_pod("default", pod("other-node", Some("node-b"))).unwrap();
    server.create_pod("default", pod("late", Some("node-a"))).unwrap();
    assert_eq!(next_names(&mut stream).await, ("apply".into(), "late".into()));
    server.patch_pod("default", "late", &json!({"status": {"phase": "Running"}})).unwrap();
    assert_eq!(next_names(&mut stream).await, ("apply".into(), "late".into()));
    server.delete_pod("default", "early").unwrap();
    assert_eq!(next_names(&mut stream).await, ("delete".into(), "early".into()));

    // An outage: the watch ends and every request gets 503 (which kube retries with backoff);
    // once the server is back the watcher resumes.
    server.set_available(false);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..5 {
        server.create_pod("default", pod(&format!("during-{i}"), Some("node-a"))).unwrap();
    }
    server.set_available(true);
    // History holds 2 events, so resuming from the old resourceVersion gets 410 and a relist,
    // which still reports every pod created during the outage.
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 5 {
        let (kind, name) = next_names(&mut stream).await;
        if kind == "apply" && name.starts_with("during-") {
            seen.insert(name);
        }
    }
    let requests = server.requests();
    assert!(requests.iter().any(|(_, uri)| uri.contains("watch=true")));
    let lists =
        requests.iter().filter(|(_, uri)| uri.starts_with("/api/v1/pods?") && !uri.contains("watch=true")).count();
    assert!(lists >= 2, "relisted after 410: {requests:?}");
}

#[tokio::test]
async fn malformed_bodies_get_400_with_the_reason() {
    let server = ApiServer::start().await.unwrap();
    let http = reqwest_like(&server.url(), "/api/v1/namespaces/default/pods", "{not json").await;
    assert_eq!(http.0, 400);
    assert!(http.1.contains("not valid JSON"), "{}", http.1);
}

/// A raw HTTP POST (no client library) for malformed input.
async fn reqwest_like(base: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let host = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(host).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let code = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, out)
}
