//! The kubelet's PodResources API (`List`): asked over its unix socket for the containers that
//! hold this daemon's devices, and reduced to what reconciliation reads
//! ([`crate::allocation::reconcile::KubeletView`]) and to what tells a device-plugin call's pod
//! apart from its look-alikes ([`KubeletListing`]). The latest answer a device-plugin call got
//! is shared ([`LatestList`]): reconciliation after an allocation uses the next call's answer
//! rather than asking again, so a burst of admissions costs the kubelet one `List` a pod. The
//! calls, and reconciliation, each ask over one kept connection ([`PodResourcesClient`]). A
//! device set's IDs decode into one buffer ([`gpushare_proto::compact::DeviceIds`]): a
//! MiB-mode node lists up to 131,072 of them in every answer.

use gpushare_proto::podresources::ListPodResourcesResponse;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::allocation::allocator::{Allocator, KubeletListing};
use crate::allocation::pods::PodStore;
use crate::allocation::reconcile::{Holding, KubeletView};
use crate::config::ReconcileConfig;

/// Reduces a `List` answer to the devices of `resource`, as reconciliation reads it.
#[must_use]
pub fn kubelet_view(list: &ListPodResourcesResponse, resource: &str) -> KubeletView {
    let mut view = KubeletView::default();
    for pod in &list.pod_resources {
        view.pods.insert((pod.namespace.clone(), pod.name.clone()));
        for c in &pod.containers {
            let device_ids: Vec<String> = c
                .devices
                .iter()
                .filter(|d| d.resource_name == resource)
                .flat_map(|d| d.device_ids.iter().map(str::to_owned))
                .collect();
            if !device_ids.is_empty() {
                view.holdings.push(Holding {
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                    container: c.name.clone(),
                    device_ids,
                });
            }
        }
    }
    view
}

/// Reduces a `List` answer to the pods the kubelet holds and, for each, the containers that
/// hold devices of `resource`.
#[must_use]
pub fn kubelet_listing(list: &ListPodResourcesResponse, resource: &str) -> KubeletListing {
    let mut listing = KubeletListing::default();
    for pod in &list.pod_resources {
        let holding = pod
            .containers
            .iter()
            .filter(|c| c.devices.iter().any(|d| d.resource_name == resource && !d.device_ids.is_empty()))
            .map(|c| c.name.clone());
        listing.insert(&pod.namespace, &pod.name, holding);
    }
    listing
}

/// Asks the kubelet's PodResources `List` through `client` which pods it holds (within
/// `timeout`), and shares the answer in `latest`.
///
/// # Errors
/// [`PodResourcesError`] when the kubelet cannot be reached or refuses.
pub async fn listing(
    client: &PodResourcesClient,
    timeout: Duration,
    resource: &str,
    latest: &LatestList,
) -> Result<KubeletListing, PodResourcesError> {
    let asked = tokio::time::Instant::now();
    let list = client.list(timeout).await?;
    let answered = asked.elapsed();
    let listing = kubelet_listing(&list, resource);
    tracing::debug!(
        pods = list.pod_resources.len(),
        list_us = answered.as_micros(),
        reduced_us = (asked.elapsed() - answered).as_micros(),
        "asked the kubelet which pods it holds"
    );
    latest.record(asked, Arc::new(list));
    Ok(listing)
}

/// The latest `List` answer a device-plugin call got, with when it was asked for; shared by
/// the plugin's calls and reconciliation ([`reconcile_loop`]).
#[derive(Clone, Debug)]
pub struct LatestList(watch::Sender<Option<AskedList>>);

/// A `List` answer and the moment it was asked for: it shows the kubelet's record at some
/// moment after that.
#[derive(Clone, Debug)]
pub struct AskedList {
    /// When it was asked for.
    pub asked: tokio::time::Instant,
    /// The answer.
    pub list: Arc<ListPodResourcesResponse>,
}

impl Default for LatestList {
    fn default() -> Self {
        LatestList(watch::Sender::new(None))
    }
}

impl LatestList {
    /// Shares an answer asked for at `asked`.
    pub fn record(&self, asked: tokio::time::Instant, list: Arc<ListPodResourcesResponse>) {
        self.0.send_replace(Some(AskedList { asked, list }));
    }

    /// Follows the latest answer shared, and each one after it.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<Option<AskedList>> {
        self.0.subscribe()
    }
}

/// An answer asked for at or after `since`, shared within `wait`; `None` if none was.
async fn shared_since(
    latest: &mut watch::Receiver<Option<AskedList>>,
    since: tokio::time::Instant,
    wait: Duration,
) -> Option<Arc<ListPodResourcesResponse>> {
    let fresh = |a: &Option<AskedList>| a.as_ref().is_some_and(|a| a.asked >= since);
    let found = tokio::time::timeout(wait, latest.wait_for(fresh)).await.ok()?.ok()?;
    found.as_ref().map(|a| Arc::clone(&a.list))
}

/// How long reconciliation after an allocation waits for a device-plugin call's `List` before
/// asking the kubelet itself: as long as a publication of the node state may be held back by an
/// admission. In a burst the kubelet's next admission asks within this time (about 30 ms apart
/// in GiB mode, 200 ms in MiB mode, where each `List` carries every one of 131,072 device IDs).
const SHARED_LIST_WAIT: Duration = Duration::from_millis(250);

/// The least time between the starts of two rounds that follow allocations. Each round reduces
/// a whole `List` and checks every live row, so in a burst, where a round could follow every
/// admission, the rounds would cost the daemon work that grows with the pods on the node for
/// each pod admitted; spaced out, the allocations of the meantime are reconciled together.
const AFTER_CHANGES_EVERY: Duration = Duration::from_secs(1);

/// Spaces the rounds that follow allocations at least `every` apart ([`AFTER_CHANGES_EVERY`]).
#[derive(Debug)]
struct Pacer {
    every: Duration,
    last: Option<tokio::time::Instant>,
}

impl Pacer {
    fn new(every: Duration) -> Self {
        Pacer { every, last: None }
    }

    /// Returns once a round may start (at once, unless one started less than `every` ago),
    /// and counts that round as started.
    async fn next_round(&mut self) {
        if let Some(last) = self.last {
            tokio::time::sleep_until(last + self.every).await;
        }
        self.last = Some(tokio::time::Instant::now());
    }
}

/// The kubelet's PodResources API cannot be asked.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket cannot be dialled.
    #[error(
        "cannot reach the kubelet's PodResources API at {socket}: {reason}; set [kubelet] pod_resources_socket to \
         the kubelet's pod-resources socket"
    )]
    Unreachable {
        /// The socket.
        socket: String,
        /// What failed.
        reason: String,
    },
    /// The kubelet answered `List` with an error.
    #[error("the kubelet's PodResources List at {socket} failed: {code:?}: {message}")]
    List {
        /// The socket.
        socket: String,
        /// The gRPC status code.
        code: tonic::Code,
        /// Its message.
        message: String,
    },
}

impl PodResourcesError {
    /// Whether the kubelet only refused for now: its rate limit (100 calls a second, bursts of
    /// 10) was spent.
    #[must_use]
    pub fn is_busy(&self) -> bool {
        matches!(self, PodResourcesError::List { code, .. } if *code == tonic::Code::ResourceExhausted)
    }
}

/// The kubelet's PodResources API at one socket, over a connection kept between questions: a
/// device-plugin call asks once an admission, and a connection dialled for each question would
/// cost the kubelet and the daemon its setup every time. A question the kept connection fails
/// (a restarted kubelet cut it and listens on a new socket) is asked once more over a new one.
#[derive(Clone, Debug)]
pub struct PodResourcesClient {
    socket: Arc<std::path::Path>,
    kept: Arc<std::sync::Mutex<Option<tonic::transport::Channel>>>,
}

impl PodResourcesClient {
    /// A client of the PodResources API at `socket`, dialling on its first question.
    #[must_use]
    pub fn new(socket: &std::path::Path) -> Self {
        PodResourcesClient { socket: Arc::from(socket), kept: Arc::default() }
    }

    /// Asks `List` (within `timeout`, a new connection included).
    ///
    /// # Errors
    /// [`PodResourcesError`] when the kubelet cannot be reached or refuses.
    pub async fn list(&self, timeout: Duration) -> Result<ListPodResourcesResponse, PodResourcesError> {
        let name = self.socket.display().to_string();
        within(timeout, &name, async {
            if let Some(channel) = self.kept() {
                match ask_list(channel, &name).await {
                    // Any failure but the kubelet's rate limit (an answer, so the connection
                    // works) may be the connection's own.
                    Err(e) if !e.is_busy() => {
                        tracing::debug!(error = %e, "the kept PodResources connection failed; dialling again");
                        self.keep(None);
                    }
                    answer => return answer,
                }
            }
            let channel = dial(&self.socket, &name).await?;
            self.keep(Some(channel.clone()));
            ask_list(channel, &name).await
        })
        .await
    }

    fn kept(&self) -> Option<tonic::transport::Channel> {
        self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn keep(&self, channel: Option<tonic::transport::Channel>) {
        *self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = channel;
    }
}

/// Dials the PodResources socket `socket` (named `name` in errors).
async fn dial(socket: &std::path::Path, name: &str) -> Result<tonic::transport::Channel, PodResourcesError> {
    gpushare_proto::uds::connect(socket)
        .await
        .map_err(|e| PodResourcesError::Unreachable { socket: name.to_owned(), reason: e.to_string() })
}

/// Asks `List` over `channel`.
async fn ask_list(
    channel: tonic::transport::Channel,
    name: &str,
) -> Result<ListPodResourcesResponse, PodResourcesError> {
    use gpushare_proto::podresources::ListPodResourcesRequest;
    use gpushare_proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
    // A full MiB-mode node lists 131 072 device IDs (about 1.3 MB).
    PodResourcesListerClient::new(channel)
        .max_decoding_message_size(64 * 1024 * 1024)
        .list(ListPodResourcesRequest {})
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| PodResourcesError::List {
            socket: name.to_owned(),
            code: s.code(),
            message: s.message().to_owned(),
        })
}

/// `ask`, or an error naming `name` if it takes longer than `timeout`.
async fn within<T>(
    timeout: Duration,
    name: &str,
    ask: impl std::future::Future<Output = Result<T, PodResourcesError>>,
) -> Result<T, PodResourcesError> {
    tokio::time::timeout(timeout, ask).await.unwrap_or_else(|_| {
        Err(PodResourcesError::Unreachable { socket: name.to_owned(), reason: format!("no answer within {timeout:?}") })
    })
}

/// Reconciles the ledger with the kubelet's PodResources API every interval, when asked (after
/// each registration) and soon after allocations (at most once a second, [`AFTER_CHANGES_EVERY`]),
/// then with the `List` a device-plugin call asked for after the allocation when there is one
/// ([`LatestList`]).
pub async fn reconcile_loop(
    alloc: Arc<Allocator>,
    pods: PodStore,
    socket: std::path::PathBuf,
    config: ReconcileConfig,
    now: Arc<tokio::sync::Notify>,
    latest: LatestList,
) {
    // Reconciliation's own questions, rarer than the calls', keep a connection of their own.
    let client = PodResourcesClient::new(&socket);
    let mut shared_lists = latest.subscribe();
    let mut admission = alloc.subscribe_admission();
    let grace = i64::try_from(config.grace_seconds.duration().as_millis()).unwrap_or(i64::MAX);
    let mut every = tokio::time::interval(config.interval_seconds.duration());
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    let mut warned = false;
    let mut changes = alloc.subscribe();
    let mut after_changes = Pacer::new(AFTER_CHANGES_EVERY);
    // When a row kept only by its grace period leaves it (a pod deleted while the daemon or
    // the node was down, allocated moments before): reconciled again then, not an interval later.
    let mut recheck: Option<tokio::time::Instant> = None;
    loop {
        let due = recheck.take();
        let mut shared = None;
        tokio::select! {
            _ = every.tick() => {}
            () = now.notified() => {}
            () = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {}
            // Soon after allocations: the kubelet's record says whether an answer went to the
            // pod the daemon took it for.
            Ok(()) = changes.changed() => {
                let since = tokio::time::Instant::now();
                after_changes.next_round().await;
                shared = shared_since(&mut shared_lists, since, SHARED_LIST_WAIT).await;
                changes.borrow_and_update();
                if shared.is_some() {
                    // A call's answer arrives while that call still runs: reconciliation holds
                    // the allocator while it reads the ledger, so it waits, as a publication
                    // does, until the kubelet admits nothing (at most 250 ms), then takes the
                    // newest answer. Allocations meanwhile start the next round.
                    crate::cluster::publish::kubelet_quiet(&mut admission, crate::cluster::publish::Timing::default())
                        .await;
                    shared = shared_lists.borrow().as_ref().map(|a| Arc::clone(&a.list)).or(shared);
                }
            }
        }
        if !pods.is_synced() {
            tracing::info!("reconciliation waits for the first complete list of this node's pods");
            let mut stored = pods.subscribe();
            while !pods.is_synced() {
                if stored.changed().await.is_err() {
                    return;
                }
            }
        }
        let asked = match shared {
            Some(list) => Ok(list),
            None => client.list(Duration::from_secs(10)).await.map(Arc::new),
        };
        let list = match asked {
            Ok(list) => {
                warned = false;
                alloc.set_kubelet_answers(true);
                list
            }
            Err(e) => {
                if !e.is_busy() {
                    alloc.set_kubelet_answers(false);
                }
                if warned {
                    tracing::debug!(error = %e, "reconciliation skipped");
                } else {
                    tracing::warn!(error = %e, "reconciliation skipped; will retry");
                    warned = true;
                }
                continue;
            }
        };
        let view = kubelet_view(&list, alloc.resource());
        let probe = Arc::clone(&alloc);
        match tokio::task::spawn_blocking(move || probe.reconcile(&view, grace)).await {
            Ok(Ok((repairs, recheck_at_ms))) => {
                if repairs.is_empty() {
                    tracing::debug!("reconciled with the kubelet: nothing to repair");
                } else {
                    tracing::info!(repairs = repairs.len(), "reconciled with the kubelet");
                }
                recheck = recheck_at_ms.map(|at| {
                    let wait = u64::try_from(at.saturating_sub(crate::allocation::ledger::now_ms())).unwrap_or(0);
                    // Past the end by a little, and never more often than once a second.
                    tokio::time::Instant::now() + Duration::from_millis(wait + 100).max(Duration::from_secs(1))
                });
            }
            Ok(Err(e)) => tracing::error!(error = %e, "reconciliation failed"),
            // The runtime stopping under the task: the daemon is stopping, nothing failed.
            Err(e) if e.is_cancelled() => tracing::debug!("reconciliation cancelled: the daemon is stopping"),
            Err(e) => tracing::error!(error = %e, "reconciliation task failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reconciliation_takes_a_list_asked_after_the_change_and_not_one_asked_before() {
        use gpushare_proto::podresources::PodResources;
        let latest = LatestList::default();
        let mut shared = latest.subscribe();
        latest.record(tokio::time::Instant::now(), Arc::new(ListPodResourcesResponse::default()));
        tokio::time::sleep(Duration::from_millis(2)).await;
        let change = tokio::time::Instant::now();
        assert!(
            shared_since(&mut shared, change, Duration::from_millis(30)).await.is_none(),
            "an answer asked before the change does not show it"
        );
        let call = latest.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let one = PodResources { name: "p".into(), namespace: "ns".into(), ..PodResources::default() };
            call.record(tokio::time::Instant::now(), Arc::new(ListPodResourcesResponse { pod_resources: vec![one] }));
        });
        let taken = shared_since(&mut shared, change, Duration::from_secs(5)).await;
        assert_eq!(taken.map(|l| l.pod_resources.len()), Some(1), "the call's later answer is taken");
    }

    #[tokio::test(start_paused = true)]
    async fn rounds_after_allocations_start_at_most_once_a_second() {
        let mut pacer = Pacer::new(AFTER_CHANGES_EVERY);
        let start = tokio::time::Instant::now();
        pacer.next_round().await;
        assert_eq!(start.elapsed(), Duration::ZERO, "the first round starts at once");
        tokio::time::sleep(Duration::from_millis(300)).await;
        pacer.next_round().await;
        assert_eq!(start.elapsed(), AFTER_CHANGES_EVERY, "the next waits until a second after the first");
        tokio::time::sleep(Duration::from_secs(3)).await;
        let quiet = tokio::time::Instant::now();
        pacer.next_round().await;
        assert_eq!(quiet.elapsed(), Duration::ZERO, "after a quiet second a round starts at once");
    }

    #[tokio::test]
    async fn one_connection_serves_every_question_and_a_restarted_kubelet_is_dialled_again() {
        use gpushare_testkit::kubelet::Kubelet;
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("pod-resources").join("kubelet.sock");
        let kubelet = Kubelet::start_with_pod_resources(&dir.path().join("plugins"), &socket).await.unwrap();
        let client = PodResourcesClient::new(&socket);
        let ask = Duration::from_secs(5);
        for _ in 0..3 {
            client.list(ask).await.expect("the kubelet answers");
        }
        assert_eq!(kubelet.pod_resources_requests(), 3);
        assert_eq!(kubelet.pod_resources_connections(), 1, "the three questions share one connection");
        kubelet.restart().await.unwrap();
        client.list(ask).await.expect("asked again over a new connection to the restarted kubelet");
        assert_eq!(kubelet.pod_resources_connections(), 2, "one new connection after the restart");
        assert_eq!(kubelet.pod_resources_requests(), 4, "the question reached the restarted kubelet once");
        let other = PodResourcesClient::new(&socket);
        assert!(other.list(ask).await.is_ok(), "a question on a connection of its own is answered too");
        assert_eq!(kubelet.pod_resources_connections(), 3);
    }

    #[test]
    fn a_call_reads_the_holders_of_this_resource_as_the_answer_on_the_wire_says() {
        use gpushare_proto::podresources::{
            ContainerDevices, ContainerMemory, ContainerResources, NumaNode, PodResources, TopologyInfo,
        };
        use prost::Message;
        const MINE: &str = "gpushare.io/gpu-mem";
        let devices = |resource: &str, ids: &[&str]| ContainerDevices {
            resource_name: resource.into(),
            device_ids: ids.iter().collect(),
            topology: Some(TopologyInfo { nodes: vec![NumaNode { id: 1 }] }),
        };
        let container = |name: &str, devices: Vec<ContainerDevices>| ContainerResources {
            name: name.into(),
            devices,
            cpu_ids: vec![2, 3],
            memory: vec![ContainerMemory { memory_type: "memory".into(), size: 1 << 20, topology: None }],
            ..ContainerResources::default()
        };
        let pod = |name: &str, containers| PodResources {
            name: name.into(),
            namespace: "ns".into(),
            containers,
            ..PodResources::default()
        };
        let sent = ListPodResourcesResponse {
            pod_resources: vec![
                pod("held", vec![container("main", vec![devices(MINE, &["Q0-1", "Q0-2"])])]),
                // Only another resource's devices, an empty set of this one's, or none at all:
                // the pod is listed and its containers hold nothing of this resource.
                pod(
                    "admitting",
                    vec![
                        container("gpu", vec![devices("nvidia.com/gpu", &["GPU-1"])]),
                        container("empty", vec![devices(MINE, &[])]),
                        container("plain", vec![]),
                    ],
                ),
                pod("sidecar", vec![container("init", vec![devices(MINE, &["Q1-0"])]), container("main", vec![])]),
            ],
        };
        let answer = ListPodResourcesResponse::decode(sent.encode_to_vec().as_slice()).unwrap();
        let listing = kubelet_listing(&answer, MINE);
        let mut nothing = listing.holding_nothing();
        nothing.sort();
        assert_eq!(nothing, vec![("ns".to_owned(), "admitting".to_owned())]);
        let mut expected = KubeletListing::default();
        expected.insert("ns", "held", ["main".to_owned()]);
        expected.insert("ns", "admitting", []);
        expected.insert("ns", "sidecar", ["init".to_owned()]);
        assert_eq!(listing, expected);
        assert_eq!(kubelet_listing(&ListPodResourcesResponse::default(), MINE), KubeletListing::default());
        let view = kubelet_view(&answer, MINE);
        assert_eq!(view.pods.len(), 3);
        let held: Vec<_> = view.holdings.iter().map(|h| (h.name.as_str(), h.device_ids.clone())).collect();
        assert_eq!(held, [("held", vec!["Q0-1".to_owned(), "Q0-2".to_owned()]), ("sidecar", vec!["Q1-0".to_owned()])]);
    }

    #[test]
    fn only_this_resource_counts() {
        use gpushare_proto::podresources::{ContainerDevices, ContainerResources, PodResources};
        let list = ListPodResourcesResponse {
            pod_resources: vec![PodResources {
                name: "a".into(),
                namespace: "ns".into(),
                containers: vec![
                    ContainerResources {
                        name: "main".into(),
                        devices: vec![
                            ContainerDevices {
                                resource_name: "gpushare.io/gpu-mem".into(),
                                device_ids: ["x1"].into_iter().collect(),
                                topology: None,
                            },
                            ContainerDevices {
                                resource_name: "nvidia.com/gpu".into(),
                                device_ids: ["GPU-1"].into_iter().collect(),
                                topology: None,
                            },
                        ],
                        ..Default::default()
                    },
                    ContainerResources { name: "other".into(), ..Default::default() },
                ],
                ..Default::default()
            }],
        };
        let view = kubelet_view(&list, "gpushare.io/gpu-mem");
        assert_eq!(view.pods.len(), 1);
        assert_eq!(
            view.holdings,
            vec![Holding {
                namespace: "ns".into(),
                name: "a".into(),
                container: "main".into(),
                device_ids: vec!["x1".into()]
            }]
        );
    }
}
