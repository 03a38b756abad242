//! The kubelet stand-in as a node: the [`Kubelet`](crate::kubelet::Kubelet) device-manager
//! stand-in plus the part of the kubelet that talks to the API server, run as its own process
//! by `gpushare-box kubelet`.
//!
//! - **Registers its Node** (labels, addresses, a `Ready` condition, `pods` capacity) and keeps
//!   the device-plugin resource in `status.capacity` (all devices) and `status.allocatable`
//!   (healthy devices), as the kubelet does from `ListAndWatch`. The real kubelet writes node
//!   status every `nodeStatusUpdateFrequency` (10 s); the stand-in writes within 250 ms of a
//!   change so the box settles in seconds.
//! - **Admits the pods bound to its node** (a watch with `spec.nodeName=<node>`), one at a time
//!   in creation order, those created in the same second in the order the watch delivered
//!   them, as `HandlePodAdditions` does: each container's devices through the
//!   device plugin ([`Kubelet::admit_pod`](crate::kubelet::Kubelet::admit_pod): init
//!   containers first, reuse, `GetPreferredAllocation`, `Allocate`). Resources no plugin
//!   registered (`gpushare.io/gpu-count`) are ignored, as the kubelet's
//!   `removeMissingExtendedResources` does. A pod that needs the resource waits while no plugin
//!   is registered (right after a restart). A sidecar (an init container with
//!   `restartPolicy: Always`) is admitted in init order, before the app containers, and keeps
//!   its devices as an app container does (the kubelet's device manager).
//! - **Marks an admitted pod Running** (`pods/status`: phase, conditions, container statuses,
//!   host and pod IPs) and a refused one `Failed` with the kubelet's reason
//!   (`UnexpectedAdmissionError`, "Allocate failed due to …, which is unexpected"). With
//!   [`NodeConfig::resource_health_status`] each container status lists its devices' health
//!   (`allocatedResourcesStatus`), as the kubelet's `ResourceHealthStatus` gate does.
//! - **Releases** a pod's devices when it is deleted, finishes, or is replaced by a new pod of
//!   the same name.
//! - **Records** every admission, refusal and release as a JSON line in its record file
//!   ([`Record`]), devices as a compact device-set key: what each container received, for the
//!   demo and the end-to-end checks ([`live_admissions`]).
//! - **Restarts** on request ([`NodeAgent::restart`], `SIGHUP` for the process): sockets
//!   deleted, `kubelet.sock` recreated, admitted pods kept (the real kubelet's checkpoint).
//! - **Refuses admission** while told to ([`NodeAgent::set_refusing`], `SIGUSR1` toggles it):
//!   new pods fail with reason `AdmissionRefused`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use futures::StreamExt as _;
use gpushare_core::devices::device_set_key;
use gpushare_core::units::parse_quantity;
use k8s_openapi::api::core::v1::{Container, Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::kubelet::{ContainerSpec, Kubelet};

/// What a node agent needs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The Node's name.
    pub node: String,
    /// The device-plugin directory (`kubelet.sock` is served there).
    pub plugin_dir: PathBuf,
    /// Where PodResources is served.
    pub pod_resources_socket: PathBuf,
    /// The JSON-lines record of admissions.
    pub record: PathBuf,
    /// The node's `InternalIP`.
    pub address: String,
    /// Labels for the Node (besides `kubernetes.io/hostname` and `kubernetes.io/os`).
    pub labels: BTreeMap<String, String>,
    /// The third octet of pod IPs (`10.244.<subnet>.<n>`).
    pub pod_subnet: u8,
    /// Report each allocated device's health in the containers' `allocatedResourcesStatus`,
    /// as the kubelet does with its `ResourceHealthStatus` feature gate (on by default from
    /// 1.36).
    pub resource_health_status: bool,
}

/// What happened to a pod on this node, one JSON line in the record file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// `admitted`, `refused` or `released`.
    pub event: String,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID.
    pub uid: String,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// For `admitted`: each container, in spec order (init containers first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<RecordedContainer>,
    /// For `refused`: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What one container received.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedContainer {
    /// The container's name.
    pub name: String,
    /// An init container.
    pub init: bool,
    /// Devices it asked for.
    pub units: usize,
    /// The devices it received, as a `gpushare_core::devices::device_set_key` (empty: none).
    pub devices: String,
    /// The environment the device plugin returned.
    pub env: BTreeMap<String, String>,
}

/// Reads a record file (missing: empty); unreadable lines are skipped.
#[must_use]
pub fn read_records(path: &Path) -> Vec<Record> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// The admissions still in force in a record file, by pod UID.
#[must_use]
pub fn live_admissions(path: &Path) -> BTreeMap<String, Record> {
    let mut live = BTreeMap::new();
    for r in read_records(path) {
        match r.event.as_str() {
            "admitted" => {
                live.insert(r.uid.clone(), r);
            }
            "released" => {
                live.remove(&r.uid);
            }
            _ => {}
        }
    }
    live
}

/// A pod this node is dealing with.
#[derive(Debug, Clone)]
struct Known {
    uid: String,
    namespace: String,
    name: String,
}

/// Where a pod stands on this node.
#[derive(Debug, Default)]
struct State {
    /// Admitted pods by `namespace/name`, with their UID.
    admitted: HashMap<(String, String), String>,
    /// UIDs refused (never admitted again).
    refused: HashSet<String>,
    /// Pods waiting for admission, in the kubelet's order: (creation time, resource version
    /// when the watch first delivered it, namespace, name) → pod.
    waiting: BTreeMap<(String, u64, String, String), Pod>,
    /// Status writes the API server has not taken yet, by UID.
    status_pending: HashMap<String, (Known, Value)>,
}

/// A node: its kubelet stand-in and its link to the API server.
pub struct NodeAgent {
    config: NodeConfig,
    kubelet: Kubelet,
    client: kube::Client,
    refusing: AtomicBool,
    next_ip: AtomicU32,
    state: tokio::sync::Mutex<State>,
    record: Mutex<std::fs::File>,
}

impl NodeAgent {
    /// Starts the kubelet's sockets (Registration, PodResources) and opens the record file.
    ///
    /// # Errors
    /// A socket that cannot be bound or a record file that cannot be opened.
    pub async fn start(config: NodeConfig, client: kube::Client) -> anyhow::Result<Arc<NodeAgent>> {
        let kubelet = Kubelet::start_with_pod_resources(&config.plugin_dir, &config.pod_resources_socket).await?;
        if let Some(parent) = config.record.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        let record = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&config.record)
            .with_context(|| format!("opening the record file {}", config.record.display()))?;
        Ok(Arc::new(NodeAgent {
            config,
            kubelet,
            client,
            refusing: AtomicBool::new(false),
            next_ip: AtomicU32::new(2),
            state: tokio::sync::Mutex::new(State::default()),
            record: Mutex::new(record),
        }))
    }

    /// Restarts the kubelet (see [`Kubelet::restart`]).
    ///
    /// # Errors
    /// If the sockets cannot be recreated.
    pub async fn restart(&self) -> anyhow::Result<()> {
        self.kubelet.restart().await
    }

    /// Starts or stops refusing new pods.
    pub fn set_refusing(&self, refusing: bool) {
        self.refusing.store(refusing, Ordering::SeqCst);
    }

    /// Whether new pods are refused.
    #[must_use]
    pub fn is_refusing(&self) -> bool {
        self.refusing.load(Ordering::SeqCst)
    }

    /// Runs the node: registers the Node, keeps its device capacity current, and admits and
    /// releases its pods. Returns only on an error that cannot be retried.
    ///
    /// # Errors
    /// The pod watch ended for good.
    pub async fn run(self: Arc<Self>) -> anyhow::Result<()> {
        let this = Arc::clone(&self);
        let capacity = tokio::spawn(async move { this.keep_node().await });
        let result = self.watch_pods().await;
        capacity.abort();
        result
    }

    /// Registers the Node, then keeps `status.capacity`/`allocatable` of the registered
    /// resource equal to the device list.
    async fn keep_node(&self) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let mut registered = false;
        let mut published: Option<(String, usize, usize)> = None;
        let mut devices = self.kubelet.watch_devices();
        loop {
            if !registered {
                match self.register_node(&nodes).await {
                    Ok(()) => registered = true,
                    Err(e) => {
                        tracing::warn!(node = %self.config.node, error = %format!("{e:#}"), "registering the Node");
                    }
                }
            }
            if registered && let Some(resource) = self.kubelet.resource() {
                let (all, healthy) = self.kubelet.device_counts();
                let current = (resource.clone(), all, healthy);
                if published.as_ref() != Some(&current) {
                    let patch = json!({"status": {"capacity": {&resource: all.to_string()},
                                                  "allocatable": {&resource: healthy.to_string()}}});
                    match nodes.patch_status(&self.config.node, &PatchParams::default(), &Patch::Merge(&patch)).await {
                        Ok(_) => {
                            tracing::info!(node = %self.config.node, %resource, all, healthy, "node capacity");
                            published = Some(current);
                        }
                        Err(kube::Error::Api(e)) if e.code == 404 => registered = false,
                        Err(e) => tracing::warn!(node = %self.config.node, error = %e, "updating node capacity"),
                    }
                }
            }
            let _ = tokio::time::timeout(Duration::from_millis(250), devices.changed()).await;
        }
    }

    async fn register_node(&self, nodes: &Api<Node>) -> anyhow::Result<()> {
        let mut labels = self.config.labels.clone();
        labels.insert("kubernetes.io/hostname".into(), self.config.node.clone());
        labels.insert("kubernetes.io/os".into(), "linux".into());
        let now = now_rfc3339();
        let status = json!({
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                            "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": self.config.address},
                          {"type": "Hostname", "address": self.config.node}],
            "nodeInfo": {"kubeletVersion": "v1.32.0-gpushare-box", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "box://1",
                         "kernelVersion": "", "osImage": "gpushare-box", "kubeProxyVersion": "",
                         "machineID": "", "systemUUID": "", "bootID": ""}
        });
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.config.node, "labels": labels},
            "status": status
        }))?;
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e).context("creating the Node"),
        }
        nodes
            .patch_status(&self.config.node, &PatchParams::default(), &Patch::Merge(&json!({"status": status})))
            .await
            .context("writing the Node's status")?;
        tracing::info!(node = %self.config.node, "node registered");
        Ok(())
    }

    /// Watches the pods bound to this node; admits, releases, and retries status writes.
    async fn watch_pods(&self) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let config = watcher::Config::default().fields(&format!("spec.nodeName={}", self.config.node));
        let mut stream = watcher(pods, config).default_backoff().boxed();
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut listing: Option<HashSet<String>> = None;
        loop {
            tokio::select! {
                event = stream.next() => {
                    let Some(event) = event else { anyhow::bail!("the pod watch ended") };
                    match event {
                        Ok(watcher::Event::Init) => listing = Some(HashSet::new()),
                        Ok(watcher::Event::InitApply(pod)) => {
                            if let Some(seen) = listing.as_mut() {
                                seen.insert(uid_of(&pod));
                            }
                            self.observe(pod).await;
                        }
                        Ok(watcher::Event::InitDone) => {
                            if let Some(seen) = listing.take() {
                                self.release_missing(&seen).await;
                            }
                        }
                        Ok(watcher::Event::Apply(pod)) => self.observe(pod).await,
                        Ok(watcher::Event::Delete(pod)) => self.release(&known(&pod)).await,
                        Err(e) => tracing::warn!(node = %self.config.node, error = %e, "pod watch"),
                    }
                }
                _ = tick.tick() => {}
            }
            self.admit_waiting().await;
            self.write_pending_status().await;
        }
    }

    /// A pod seen in the watch.
    async fn observe(&self, pod: Pod) {
        let k = known(&pod);
        let phase = pod.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
        if phase == "Succeeded" || phase == "Failed" || pod.metadata.deletion_timestamp.is_some() {
            self.release(&k).await;
            return;
        }
        let replaced = {
            let state = self.state.lock().await;
            if state.refused.contains(&k.uid) {
                return;
            }
            match state.admitted.get(&(k.namespace.clone(), k.name.clone())) {
                Some(uid) if *uid == k.uid => return,
                Some(uid) => Some(uid.clone()),
                None => None,
            }
        };
        if let Some(old) = replaced {
            self.release(&Known { uid: old, namespace: k.namespace.clone(), name: k.name.clone() }).await;
        }
        let created = pod.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default();
        let version = pod.metadata.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut state = self.state.lock().await;
        // A pod seen again keeps its place in line.
        let key = state
            .waiting
            .iter()
            .find(|(_, p)| uid_of(p) == k.uid)
            .map_or((created, version, k.namespace, k.name), |(key, _)| key.clone());
        state.waiting.insert(key, pod);
    }

    /// Releases the admitted pods a fresh list no longer has, and forgets the waiting ones.
    async fn release_missing(&self, seen: &HashSet<String>) {
        let gone: Vec<Known> = {
            let mut state = self.state.lock().await;
            // Pods deleted while the watch was away are no longer waiting either, as the
            // kubelet's pod config drops the pods a new list no longer has.
            state.waiting.retain(|_, p| seen.contains(&uid_of(p)));
            state
                .admitted
                .iter()
                .filter(|(_, uid)| !seen.contains(*uid))
                .map(|((ns, name), uid)| Known { uid: uid.clone(), namespace: ns.clone(), name: name.clone() })
                .collect()
        };
        for k in gone {
            self.release(&k).await;
        }
    }

    /// Frees a pod's devices, if it was admitted under this UID.
    async fn release(&self, k: &Known) {
        let mut state = self.state.lock().await;
        state.waiting.retain(|_, p| uid_of(p) != k.uid);
        let key = (k.namespace.clone(), k.name.clone());
        if state.admitted.get(&key) == Some(&k.uid) {
            state.admitted.remove(&key);
            state.status_pending.remove(&k.uid);
            drop(state);
            self.kubelet.remove_pod(&k.namespace, &k.name);
            tracing::info!(node = %self.config.node, pod = %format!("{}/{}", k.namespace, k.name), "released");
            self.record(&Record {
                event: "released".into(),
                namespace: k.namespace.clone(),
                name: k.name.clone(),
                uid: k.uid.clone(),
                at_ms: now_ms(),
                containers: Vec::new(),
                reason: None,
            });
        }
    }

    /// Admits the waiting pods in the kubelet's order (`HandlePodAdditions` sorts each batch by
    /// creation time; within a second, the watch's order stands); stops at one that must wait
    /// for the plugin.
    async fn admit_waiting(&self) {
        loop {
            let next = {
                let state = self.state.lock().await;
                state.waiting.iter().next().map(|(key, pod)| (key.clone(), pod.clone()))
            };
            let Some((key, pod)) = next else { return };
            let k = known(&pod);
            let resource = self.kubelet.resource();
            let specs = match container_specs(&pod, resource.as_deref()) {
                Ok(specs) => specs,
                Err(e) => {
                    self.state.lock().await.waiting.remove(&key);
                    self.refuse(&k, "UnexpectedAdmissionError", &format!("{e:#}")).await;
                    continue;
                }
            };
            let needs_devices = specs.iter().any(|s| s.units > 0);
            if needs_devices && !self.kubelet.is_registered() {
                return;
            }
            self.state.lock().await.waiting.remove(&key);
            if self.is_refusing() {
                self.refuse(&k, "AdmissionRefused", "the kubelet stand-in was told to refuse new pods (SIGUSR1)").await;
                continue;
            }
            match self.kubelet.admit_pod(&k.namespace, &k.name, &specs).await {
                Ok(admitted) => {
                    let devices: BTreeMap<String, Vec<String>> =
                        specs.iter().zip(&admitted).map(|(s, a)| (s.name.clone(), a.devices.clone())).collect();
                    let containers = specs
                        .iter()
                        .zip(admitted)
                        .map(|(s, a)| RecordedContainer {
                            name: s.name.clone(),
                            init: s.init,
                            units: s.units,
                            devices: if a.devices.is_empty() { String::new() } else { device_set_key(&a.devices) },
                            env: a.envs,
                        })
                        .collect();
                    self.state.lock().await.admitted.insert((k.namespace.clone(), k.name.clone()), k.uid.clone());
                    tracing::info!(node = %self.config.node, pod = %format!("{}/{}", k.namespace, k.name), "admitted");
                    self.record(&Record {
                        event: "admitted".into(),
                        namespace: k.namespace.clone(),
                        name: k.name.clone(),
                        uid: k.uid.clone(),
                        at_ms: now_ms(),
                        containers,
                        reason: None,
                    });
                    let status = self.running_status(&pod, resource.as_deref(), &devices);
                    self.state.lock().await.status_pending.insert(k.uid.clone(), (k, status));
                }
                Err(e) => {
                    let message = format!("Allocate failed due to {e:#}, which is unexpected");
                    self.refuse(&k, "UnexpectedAdmissionError", &message).await;
                }
            }
            self.write_pending_status().await;
        }
    }

    /// Fails a pod's admission: recorded, and `Failed` with `reason` in its status.
    async fn refuse(&self, k: &Known, reason: &str, message: &str) {
        tracing::warn!(node = %self.config.node, pod = %format!("{}/{}", k.namespace, k.name), reason, message, "admission refused");
        self.record(&Record {
            event: "refused".into(),
            namespace: k.namespace.clone(),
            name: k.name.clone(),
            uid: k.uid.clone(),
            at_ms: now_ms(),
            containers: Vec::new(),
            reason: Some(format!("{reason}: {message}")),
        });
        let status = json!({"status": {"phase": "Failed", "reason": reason, "message": message}});
        let mut state = self.state.lock().await;
        state.refused.insert(k.uid.clone());
        state.status_pending.insert(k.uid.clone(), (k.clone(), status));
    }

    /// The status the kubelet writes once a pod's containers run.
    /// The status of an admitted pod; `devices`, by container, are those of `resource` it was
    /// given.
    fn running_status(&self, pod: &Pod, resource: Option<&str>, devices: &BTreeMap<String, Vec<String>>) -> Value {
        let now = now_rfc3339();
        // The kubelet's ResourceHealthStatus: each allocated device and its health.
        let health = |c: &Container| -> Value {
            let ids = devices.get(&c.name).filter(|d| !d.is_empty() && self.config.resource_health_status);
            match (ids, resource) {
                (Some(ids), Some(resource)) => {
                    let entries: Vec<Value> =
                        ids.iter().map(|id| json!({"resourceID": id, "health": "Healthy"})).collect();
                    json!([{"name": resource, "resources": entries}])
                }
                _ => Value::Null,
            }
        };
        let ip = self.next_ip.fetch_add(1, Ordering::Relaxed);
        let pod_ip = format!("10.244.{}.{}", self.config.pod_subnet, ip % 250 + 2);
        let spec = pod.spec.clone().unwrap_or_default();
        let uid = uid_of(pod);
        let running = |c: &Container| {
            json!({"name": c.name, "ready": true, "started": true, "restartCount": 0,
                   "image": c.image.clone().unwrap_or_default(), "imageID": "",
                   "containerID": format!("box://{uid}/{}", c.name),
                   "allocatedResourcesStatus": health(c),
                   "state": {"running": {"startedAt": now}}})
        };
        let done = |c: &Container| {
            json!({"name": c.name, "ready": true, "restartCount": 0,
                   "image": c.image.clone().unwrap_or_default(), "imageID": "",
                   "containerID": format!("box://{uid}/{}", c.name),
                   "allocatedResourcesStatus": health(c),
                   "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}}})
        };
        let condition = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now});
        json!({"status": {
            "phase": "Running",
            "hostIP": self.config.address,
            "podIP": pod_ip,
            "startTime": now,
            "conditions": [condition("PodReadyToStartContainers"), condition("Initialized"), condition("Ready"),
                           condition("ContainersReady"), condition("PodScheduled")],
            "initContainerStatuses": spec.init_containers.unwrap_or_default().iter().map(done).collect::<Vec<_>>(),
            "containerStatuses": spec.containers.iter().map(running).collect::<Vec<_>>(),
        }})
    }

    /// Writes the statuses the API server has not taken yet (it may be down).
    async fn write_pending_status(&self) {
        let pending: Vec<(String, Known, Value)> = {
            let state = self.state.lock().await;
            state.status_pending.iter().map(|(uid, (k, v))| (uid.clone(), k.clone(), v.clone())).collect()
        };
        for (uid, k, status) in pending {
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &k.namespace);
            let mut patch = status;
            patch["metadata"] = json!({"uid": uid});
            match pods.patch_status(&k.name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => {
                    self.state.lock().await.status_pending.remove(&uid);
                }
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {
                    // The pod is gone or is another pod now: nothing to write.
                    self.state.lock().await.status_pending.remove(&uid);
                }
                Err(e) => {
                    tracing::debug!(node = %self.config.node, error = %e, "status write deferred");
                    return;
                }
            }
        }
    }

    fn record(&self, record: &Record) {
        let Ok(mut line) = serde_json::to_string(record) else { return };
        line.push('\n');
        let mut file = self.record.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = file.write_all(line.as_bytes()) {
            tracing::error!(record = %self.config.record.display(), error = %e, "writing the record");
        }
    }
}

impl std::fmt::Debug for NodeAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeAgent")
            .field("config", &self.config)
            .field("kubelet", &self.kubelet)
            .finish_non_exhaustive()
    }
}

fn uid_of(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

fn known(pod: &Pod) -> Known {
    Known {
        uid: uid_of(pod),
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
    }
}

/// The device-manager view of a pod: per container (spec order, init containers first), the
/// devices of `resource` it asks for (its limit, else its request).
fn container_specs(pod: &Pod, resource: Option<&str>) -> anyhow::Result<Vec<ContainerSpec>> {
    let spec = pod.spec.clone().unwrap_or_default();
    let units = |c: &Container| -> anyhow::Result<usize> {
        let Some(resource) = resource else { return Ok(0) };
        let r = c.resources.as_ref();
        let q = r
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get(resource))
            .or_else(|| r.and_then(|r| r.requests.as_ref()).and_then(|l| l.get(resource)));
        match q {
            None => Ok(0),
            Some(q) => {
                let parsed = parse_quantity(&q.0).with_context(|| format!("container {:?}: {resource}", c.name))?;
                usize::try_from(parsed.value).with_context(|| format!("container {:?}: {resource} too large", c.name))
            }
        }
    };
    let mut out = Vec::new();
    for c in spec.init_containers.iter().flatten() {
        let sidecar = c.restart_policy.as_deref() == Some("Always");
        out.push(ContainerSpec { name: c.name.clone(), units: units(c)?, init: !sidecar, sidecar });
    }
    for c in &spec.containers {
        out.push(ContainerSpec { name: c.name.clone(), units: units(c)?, init: false, sidecar: false });
    }
    Ok(out)
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0))
}

fn now_rfc3339() -> String {
    gpushare_core::time::format_ms(i64::try_from(now_ms()).unwrap_or(0))
}
