//! The kube-scheduler stand-in against the API-server stand-in and a fake extender (axum, on
//! loopback) that records every request and answers by a script: the filter keeps the nodes the
//! script does not reject, prioritize scores from the script, bind creates the pod's Binding
//! through the API server. Covered: the exact JSON kube-scheduler sends for each verb, the
//! node-level fit check that rejects without asking the extender, a single feasible node skipping
//! prioritize, the highest score winning, the `FitError` condition and its message, a cluster
//! event retrying an unschedulable pod, assumed pods counting before their binding shows, extender
//! failures retried after a growing backoff, a pod the extender does not manage bound by the
//! scheduler itself, and the watches riding out an API server outage and restart. Every test is bounded by a 10 s timeout and polls instead of sleeping.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse as _, Response};
use axum::routing::post;
use bytes::Bytes;
use gpushare_testkit::apiserver::{ApiServer, Kind};
use gpushare_testkit::scheduler::{Scheduler, SchedulerConfig, VerbCounts};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client, Config};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(10);
const GPU_MEM: &str = "gpushare.io/gpu-mem";

/// Runs a test body under the 10 s limit.
async fn within<F: Future>(body: F) -> F::Output {
    tokio::time::timeout(LIMIT, body).await.expect("the test took more than 10 s")
}

/// Polls `probe` every 20 ms until it gives something.
async fn wait_for<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(started.elapsed() < LIMIT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One request the fake extender received.
#[derive(Debug, Clone)]
struct Call {
    verb: String,
    content_type: Option<String>,
    body: Value,
    at: Instant,
}

impl Call {
    fn pod_name(&self) -> &str {
        self.body
            .pointer("/Pod/metadata/name")
            .or_else(|| self.body.get("PodName"))
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    fn node_names(&self) -> Vec<String> {
        self.body["NodeNames"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_owned()).collect()
    }
}

/// How the fake extender answers.
#[derive(Debug, Default)]
struct Script {
    /// Node → reason, answered in `FailedNodes`.
    reject: BTreeMap<String, String>,
    /// Node → reason, answered in `FailedAndUnresolvableNodes`.
    unresolvable: BTreeMap<String, String>,
    /// Scores for prioritize (0 for the others).
    scores: BTreeMap<String, i64>,
    /// Raw answers (status, body) the filter gives first, one per call.
    filter_replies: VecDeque<(u16, String)>,
}

#[derive(Clone)]
struct FakeExtender {
    calls: Arc<Mutex<Vec<Call>>>,
    script: Arc<Mutex<Script>>,
    client: Client,
    url: String,
}

impl FakeExtender {
    async fn start(client: Client) -> FakeExtender {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let extender = FakeExtender {
            calls: Arc::default(),
            script: Arc::default(),
            client,
            url: format!("http://{addr}/gpushare-scheduler"),
        };
        let app = Router::new().route("/gpushare-scheduler/{verb}", post(answer)).with_state(extender.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        extender
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn verbs(&self) -> Vec<String> {
        self.calls().into_iter().map(|c| c.verb).collect()
    }

    fn script(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script.lock().unwrap()
    }
}

async fn answer(
    State(extender): State<FakeExtender>,
    Path(verb): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let content_type = headers.get(header::CONTENT_TYPE).map(|v| v.to_str().unwrap().to_owned());
    let call = Call { verb: verb.clone(), content_type, body: body.clone(), at: Instant::now() };
    extender.calls.lock().unwrap().push(call);
    match verb.as_str() {
        "filter" => {
            let mut script = extender.script();
            if let Some((status, raw)) = script.filter_replies.pop_front() {
                let status = StatusCode::from_u16(status).unwrap();
                return (status, [(header::CONTENT_TYPE, "application/json")], raw).into_response();
            }
            let sent: Vec<String> =
                body["NodeNames"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_owned()).collect();
            let failed: BTreeMap<_, _> = script.reject.iter().filter(|(n, _)| sent.contains(n)).collect();
            let unresolvable: BTreeMap<_, _> = script.unresolvable.iter().filter(|(n, _)| sent.contains(n)).collect();
            let kept: Vec<&String> =
                sent.iter().filter(|n| !failed.contains_key(n) && !unresolvable.contains_key(n)).collect();
            axum::Json(json!({"Nodes": null, "NodeNames": kept, "FailedNodes": failed,
                              "FailedAndUnresolvableNodes": unresolvable, "Error": ""}))
            .into_response()
        }
        "prioritize" => {
            let script = extender.script();
            let list: Vec<Value> = body["NodeNames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| json!({"Host": n, "Score": script.scores.get(n.as_str().unwrap()).copied().unwrap_or(0)}))
                .collect();
            axum::Json(Value::Array(list)).into_response()
        }
        "bind" => {
            let (name, namespace) = (body["PodName"].as_str().unwrap(), body["PodNamespace"].as_str().unwrap());
            let binding = json!({
                "apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "uid": body["PodUID"], "annotations": {"fake-extender/bound": "yes"}},
                "target": {"apiVersion": "v1", "kind": "Node", "name": body["Node"]},
            });
            let api: Api<Pod> = Api::namespaced(extender.client.clone(), namespace);
            let error =
                match api.create_subresource::<_, Value>("binding", name, &PostParams::default(), &binding).await {
                    Ok(_) => String::new(),
                    Err(e) => e.to_string(),
                };
            axum::Json(json!({"Error": error})).into_response()
        }
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

/// An API server, a fake extender and a running scheduler.
struct Cluster {
    api: ApiServer,
    extender: FakeExtender,
    scheduler: Scheduler,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Cluster {
    /// Starts everything; `tweak` adjusts the shipped configuration (whose backoff here starts at
    /// 50 ms and stops at 200 ms).
    async fn start(tweak: impl FnOnce(&mut SchedulerConfig)) -> Cluster {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let api = ApiServer::start().await.unwrap();
        let client = Client::try_from(Config::new(api.url().parse().unwrap())).unwrap();
        let extender = FakeExtender::start(client.clone()).await;
        let mut config = SchedulerConfig::gpushare(&extender.url);
        config.initial_backoff = Duration::from_millis(50);
        config.max_backoff = Duration::from_millis(200);
        tweak(&mut config);
        let scheduler = Scheduler::new(config);
        let running = scheduler.clone();
        let task = tokio::spawn(async move { running.run(client).await });
        Cluster { api, extender, scheduler, task }
    }

    fn node(&self, name: &str, gpu_mem: Option<u64>) {
        let mut allocatable = json!({"cpu": "8", "memory": "32Gi", "pods": "110"});
        if let Some(mib) = gpu_mem {
            allocatable[GPU_MEM] = json!(mib.to_string());
        }
        self.api
            .create_node(json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                "status": {"allocatable": allocatable, "capacity": allocatable,
                           "conditions": [{"type": "Ready", "status": "True"}]},
            }))
            .unwrap();
    }

    /// Creates a pod in `default` whose one container has `resources`; returns its uid.
    fn pod(&self, name: &str, resources: &Value) -> String {
        let pod = self
            .api
            .create_pod(
                "default",
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                       "spec": {"containers": [{"name": "main", "image": "cuda", "resources": resources}]}}),
            )
            .unwrap();
        pod["metadata"]["uid"].as_str().unwrap().to_owned()
    }

    fn gpu_pod(&self, name: &str, mib: u64) -> String {
        self.pod(name, &json!({"limits": {GPU_MEM: mib.to_string()}}))
    }

    fn node_of(&self, pod: &str) -> Option<String> {
        let pod = self.api.pod("default", pod)?;
        pod.pointer("/spec/nodeName").and_then(Value::as_str).map(str::to_owned)
    }

    async fn bound(&self, pod: &str) -> String {
        wait_for(&format!("{pod} to be bound"), || self.node_of(pod)).await
    }

    /// The pod's `PodScheduled=False` condition: (reason, message).
    fn unscheduled(&self, pod: &str) -> Option<(String, String)> {
        let pod = self.api.pod("default", pod)?;
        let conditions = pod.pointer("/status/conditions")?.as_array()?;
        let c = conditions.iter().find(|c| c["type"] == "PodScheduled" && c["status"] == "False")?;
        Some((c["reason"].as_str()?.to_owned(), c["message"].as_str()?.to_owned()))
    }

    async fn unschedulable_message(&self, pod: &str) -> String {
        let (reason, message) = wait_for(&format!("{pod}'s PodScheduled=False"), || {
            self.unscheduled(pod).filter(|(reason, _)| reason == "Unschedulable")
        })
        .await;
        assert_eq!(reason, "Unschedulable");
        message
    }

    async fn stats_where(
        &self,
        what: &str,
        check: impl Fn(&gpushare_testkit::scheduler::SchedulerStats) -> bool,
    ) -> gpushare_testkit::scheduler::SchedulerStats {
        wait_for(what, || Some(self.scheduler.stats()).filter(|s| check(s))).await
    }
}

fn keys(value: &Value) -> BTreeSet<&str> {
    value.as_object().unwrap().keys().map(String::as_str).collect()
}

#[tokio::test]
async fn a_gpu_pod_goes_through_filter_prioritize_and_the_extenders_bind() {
    within(async {
        let cluster = Cluster::start(|_| {}).await;
        cluster.extender.script().scores = BTreeMap::from([("node-a".into(), 3), ("node-b".into(), 7)]);
        cluster.node("node-a", Some(16));
        cluster.node("node-b", Some(16));
        cluster.node("node-c", None);
        let uid = cluster.gpu_pod("gpu-pod", 4);

        assert_eq!(cluster.bound("gpu-pod").await, "node-b", "the higher score wins");
        let stats = cluster.stats_where("the binding to be counted", |s| s.scheduled == 1).await;
        assert_eq!(stats.extender_calls, VerbCounts { filter: 1, prioritize: 1, bind: 1 });
        assert_eq!((stats.attempts, stats.direct_binds, stats.errors, stats.unschedulable), (1, 0, 0, 0));
        let pod = cluster.api.pod("default", "gpu-pod").unwrap();
        assert_eq!(pod["metadata"]["annotations"]["fake-extender/bound"], "yes", "the extender made the Binding");

        let calls = cluster.extender.calls();
        assert_eq!(cluster.extender.verbs(), ["filter", "prioritize", "bind"]);
        for call in &calls {
            assert_eq!(call.content_type.as_deref(), Some("application/json"), "{}", call.verb);
        }
        // ExtenderArgs with nodeCacheCapable: the Pod, null Nodes, and the names that passed the
        // scheduler's own fit check (node-c has no GPU memory at all).
        for call in &calls[..2] {
            assert_eq!(keys(&call.body), BTreeSet::from(["Pod", "Nodes", "NodeNames"]), "{}", call.verb);
            assert!(call.body["Nodes"].is_null());
            assert_eq!(call.node_names(), ["node-a", "node-b"], "{}", call.verb);
            let sent = &call.body["Pod"];
            assert_eq!(sent["metadata"]["name"], "gpu-pod");
            assert_eq!(sent["metadata"]["namespace"], "default");
            assert_eq!(sent["metadata"]["uid"], uid.as_str());
            assert_eq!(sent["spec"]["containers"][0]["resources"]["limits"][GPU_MEM], "4");
        }
        // ExtenderBindingArgs.
        assert_eq!(
            calls[2].body,
            json!({"PodName": "gpu-pod", "PodNamespace": "default", "PodUID": uid, "Node": "node-b"})
        );
    })
    .await;
}

#[tokio::test]
async fn a_single_feasible_node_skips_prioritize() {
    within(async {
        let cluster = Cluster::start(|_| {}).await;
        cluster.extender.script().reject.insert("node-a".into(), "no GPU has 4 MiB free".into());
        cluster.node("node-a", Some(16));
        cluster.node("node-b", Some(16));
        cluster.gpu_pod("gpu-pod", 4);

        assert_eq!(cluster.bound("gpu-pod").await, "node-b");
        cluster.stats_where("the binding to be counted", |s| s.scheduled == 1).await;
        assert_eq!(cluster.extender.verbs(), ["filter", "bind"]);
        assert_eq!(cluster.extender.calls()[0].node_names(), ["node-a", "node-b"]);
    })
    .await;
}

#[tokio::test]
async fn no_node_with_the_resource_is_a_fit_error_without_asking_the_extender() {
    within(async {
        let cluster = Cluster::start(|_| {}).await;
        cluster.node("node-a", None);
        cluster.node("node-b", None);
        // gpu-count is ignoredByScheduler: no node advertises it, and it is not a reason.
        cluster.pod("gpu-pod", &json!({"limits": {GPU_MEM: "4", "gpushare.io/gpu-count": "2"}}));

        let message = cluster.unschedulable_message("gpu-pod").await;
        assert_eq!(message, "0/2 nodes are available: 2 Insufficient gpushare.io/gpu-mem.");
        assert!(cluster.extender.calls().is_empty(), "the extender was asked: {:?}", cluster.extender.verbs());
        let stats = cluster.stats_where("the status patch to be counted", |s| s.status_patches >= 1).await;
        assert!(stats.unschedulable >= 1 && stats.scheduled == 0, "{stats:?}");

        // A node that has the resource is a cluster event: the pod is retried and placed.
        cluster.node("node-c", Some(16));
        assert_eq!(cluster.bound("gpu-pod").await, "node-c");
        assert_eq!(cluster.extender.verbs(), ["filter", "bind"]);
        assert_eq!(cluster.extender.calls()[0].node_names(), ["node-c"]);
    })
    .await;
}

#[tokio::test]
async fn extender_reasons_make_the_fit_error_and_a_node_change_retries() {
    within(async {
        let cluster = Cluster::start(|_| {}).await;
        {
            let mut script = cluster.extender.script();
            script.reject.insert("node-b".into(), "no GPU has 4 MiB free".into());
            script.unresolvable.insert("node-c".into(), "no GPU has 4 MiB free".into());
        }
        cluster.node("node-a", Some(2));
        cluster.node("node-b", Some(16));
        cluster.node("node-c", Some(16));
        cluster.gpu_pod("gpu-pod", 4);

        let message = cluster.unschedulable_message("gpu-pod").await;
        assert_eq!(message, "0/3 nodes are available: 1 Insufficient gpushare.io/gpu-mem, 2 no GPU has 4 MiB free.");
        assert_eq!(cluster.extender.calls()[0].node_names(), ["node-b", "node-c"]);
        assert!(cluster.node_of("gpu-pod").is_none());

        // node-b's GPU memory frees up: its daemon rewrites the node's annotation, an event.
        cluster.extender.script().reject.clear();
        cluster
            .api
            .patch(Kind::Node, "", "node-b", &json!({"metadata": {"annotations": {"gpushare.io/state": "2"}}}))
            .unwrap();
        assert_eq!(cluster.bound("gpu-pod").await, "node-b");
    })
    .await;
}

#[tokio::test]
async fn assumed_pods_count_and_a_deleted_pod_frees_room() {
    within(async {
        let cluster = Cluster::start(|_| {}).await;
        cluster.node("node-a", Some(10));
        cluster.gpu_pod("first", 6);
        cluster.gpu_pod("second", 6);

        assert_eq!(cluster.bound("first").await, "node-a");
        let message = cluster.unschedulable_message("second").await;
        assert_eq!(message, "0/1 nodes are available: 1 Insufficient gpushare.io/gpu-mem.");
        let asked: Vec<String> = cluster.extender.calls().iter().map(|c| c.pod_name().to_owned()).collect();
        assert!(
            !asked.iter().any(|p| p == "second"),
            "the extender was asked about the pod that cannot fit: {asked:?}"
        );

        cluster.api.delete_pod("default", "first").unwrap();
        assert_eq!(cluster.bound("second").await, "node-a");
    })
    .await;
}

#[tokio::test]
async fn extender_failures_are_retried_after_a_growing_backoff() {
    within(async {
        let cluster = Cluster::start(|c| {
            c.initial_backoff = Duration::from_millis(100);
            c.max_backoff = Duration::from_secs(1);
        })
        .await;
        {
            let mut script = cluster.extender.script();
            script.filter_replies.push_back((500, String::new()));
            script.filter_replies.push_back((200, "not json".into()));
            script
                .filter_replies
                .push_back((200, r#"{"NodeNames": null, "Error": "GPU state not published yet"}"#.into()));
        }
        cluster.node("node-a", Some(16));
        cluster.gpu_pod("gpu-pod", 4);

        assert_eq!(cluster.bound("gpu-pod").await, "node-a");
        let stats = cluster.stats_where("the binding to be counted", |s| s.scheduled == 1).await;
        assert_eq!(stats.errors, 3);
        assert_eq!(stats.extender_failures, VerbCounts { filter: 3, prioritize: 0, bind: 0 });
        assert_eq!(stats.extender_calls, VerbCounts { filter: 4, prioritize: 0, bind: 1 });

        // Each retry waited at least its backoff: 100 ms, then 200 ms, then 400 ms.
        let filters: Vec<Instant> =
            cluster.extender.calls().iter().filter(|c| c.verb == "filter").map(|c| c.at).collect();
        for (i, wanted) in [100, 200, 400].into_iter().enumerate() {
            let waited = filters[i + 1] - filters[i];
            assert!(waited >= Duration::from_millis(wanted), "retry {i} came after {waited:?}, not {wanted} ms");
        }
        // Each failure was written to the pod as a SchedulerError condition.
        let patches = cluster
            .api
            .requests()
            .into_iter()
            .filter(|(method, path)| {
                method == "PATCH" && path.starts_with("/api/v1/namespaces/default/pods/gpu-pod/status")
            })
            .count();
        assert!(patches >= 1, "no PodScheduled condition was written");
    })
    .await;
}

#[tokio::test]
async fn a_pod_without_managed_resources_is_bound_by_the_scheduler() {
    within(async {
        let cluster = Cluster::start(|_| {}).await;
        cluster.node("node-a", Some(16));
        cluster.node("node-b", None);
        // Another scheduler's pod, ahead in the queue order if it were ours.
        cluster
            .api
            .create_pod(
                "default",
                json!({"metadata": {"name": "a-other"},
                       "spec": {"schedulerName": "other-scheduler", "containers": [{"name": "main", "image": "x"}]}}),
            )
            .unwrap();
        cluster.pod("b-plain", &json!({"requests": {"cpu": "1", "memory": "1Gi"}}));

        let node = cluster.bound("b-plain").await;
        assert!(node == "node-a" || node == "node-b", "{node}");
        let stats = cluster.stats_where("the binding to be counted", |s| s.scheduled == 1).await;
        assert_eq!((stats.direct_binds, stats.attempts), (1, 1), "{stats:?}");
        assert!(cluster.extender.calls().is_empty(), "the extender was asked: {:?}", cluster.extender.verbs());
        assert!(
            cluster
                .api
                .requests()
                .iter()
                .any(|(m, p)| m == "POST" && p.starts_with("/api/v1/namespaces/default/pods/b-plain/binding")),
            "the scheduler did not create the Binding"
        );
        assert!(cluster.node_of("a-other").is_none());
    })
    .await;
}

#[tokio::test]
async fn the_scheduler_rides_out_an_api_server_outage_and_restart() {
    within(async {
        let cluster = Cluster::start(|_| {}).await;
        cluster.node("node-a", Some(16));
        cluster.gpu_pod("before", 4);
        assert_eq!(cluster.bound("before").await, "node-a");

        // An outage (503s, watches cut) while a pod is created: the watches retry and relist.
        cluster.api.set_unavailable(true);
        cluster.gpu_pod("during-outage", 4);
        tokio::time::sleep(Duration::from_millis(300)).await;
        cluster.api.set_unavailable(false);
        assert_eq!(cluster.bound("during-outage").await, "node-a");

        // A restart loses the watch history: resuming gets 410 Gone, and the watches relist.
        cluster.api.restart().await.unwrap();
        cluster.gpu_pod("after-restart", 4);
        assert_eq!(cluster.bound("after-restart").await, "node-a");
        let asked: BTreeSet<String> = cluster.extender.calls().iter().map(|c| c.pod_name().to_owned()).collect();
        assert_eq!(asked, BTreeSet::from(["before", "during-outage", "after-restart"].map(str::to_owned)));
    })
    .await;
}
