//! The kubelet's PodResources API (`List`): asked over its unix socket for the containers that
//! hold this daemon's devices, and reduced to what reconciliation reads
//! ([`crate::allocation::reconcile::KubeletView`]) and to what tells a device-plugin call's pod
//! apart from its look-alikes ([`KubeletListing`], read from the answer's bytes without its
//! device IDs: [`listing`]). The latest answer a device-plugin call got is shared, as it came
//! ([`LatestList`]): reconciliation after an allocation uses the next call's answer rather than
//! asking again, so a burst of admissions costs the kubelet one `List` a pod. The calls, and
//! reconciliation, each ask over one kept connection ([`PodResourcesClient`]).

mod listing;

use gpushare_proto::podresources::ListPodResourcesResponse;

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use prost::bytes::{Buf, Bytes};
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
                .flat_map(|d| d.device_ids.iter().cloned())
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

/// Asks the kubelet's PodResources `List` through `client` which pods it holds (within
/// `timeout`), reads from the answer the pods and their containers that hold devices of
/// `resource`, and shares the answer in `latest`.
///
/// # Errors
/// [`PodResourcesError`] when the kubelet cannot be reached, refuses, or answers what is no
/// `List` answer.
pub async fn listing(
    client: &PodResourcesClient,
    timeout: Duration,
    resource: &str,
    latest: &LatestList,
) -> Result<KubeletListing, PodResourcesError> {
    let asked = tokio::time::Instant::now();
    let answer = client.answer(timeout).await?;
    let answered = asked.elapsed();
    let listing = listing::kubelet_listing(&answer, resource).map_err(|e| client.malformed(&e))?;
    tracing::debug!(
        bytes = answer.len(),
        list_us = answered.as_micros(),
        reduced_us = (asked.elapsed() - answered).as_micros(),
        "asked the kubelet which pods it holds"
    );
    latest.record(asked, answer);
    Ok(listing)
}

/// Decodes a `List` answer, as the kubelet at `socket` sent it, in full.
///
/// # Errors
/// [`PodResourcesError::Malformed`] when the bytes are no `List` answer.
pub fn decode_list(answer: &Bytes, socket: &str) -> Result<ListPodResourcesResponse, PodResourcesError> {
    ListPodResourcesResponse::decode(answer.clone())
        .map_err(|e| PodResourcesError::Malformed { socket: socket.to_owned(), reason: e.to_string() })
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
    /// The answer, as the kubelet sent it (protobuf): decoded in full only by reconciliation
    /// ([`decode_list`]), which reads the device IDs.
    pub answer: Bytes,
}

impl Default for LatestList {
    fn default() -> Self {
        LatestList(watch::Sender::new(None))
    }
}

impl LatestList {
    /// Shares an answer asked for at `asked`.
    pub fn record(&self, asked: tokio::time::Instant, answer: Bytes) {
        self.0.send_replace(Some(AskedList { asked, answer }));
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
) -> Option<Bytes> {
    let fresh = |a: &Option<AskedList>| a.as_ref().is_some_and(|a| a.asked >= since);
    let found = tokio::time::timeout(wait, latest.wait_for(fresh)).await.ok()?.ok()?;
    found.as_ref().map(|a| a.answer.clone())
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
    /// The kubelet's answer does not decode as a `List` answer.
    #[error(
        "the kubelet's PodResources List at {socket} answered what is no ListPodResourcesResponse: {reason}; \
         is [kubelet] pod_resources_socket the kubelet's pod-resources socket?"
    )]
    Malformed {
        /// The socket.
        socket: String,
        /// What did not decode.
        reason: String,
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

    /// Asks `List` (within `timeout`, a new connection included), decoded in full.
    ///
    /// # Errors
    /// [`PodResourcesError`] when the kubelet cannot be reached, refuses, or answers what is no
    /// `List` answer.
    pub async fn list(&self, timeout: Duration) -> Result<ListPodResourcesResponse, PodResourcesError> {
        decode_list(&self.answer(timeout).await?, &self.socket.display().to_string())
    }

    /// Asks `List` (within `timeout`, a new connection included): the answer as sent.
    ///
    /// # Errors
    /// [`PodResourcesError`] when the kubelet cannot be reached or refuses.
    pub async fn answer(&self, timeout: Duration) -> Result<Bytes, PodResourcesError> {
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

    /// The error for an answer of this kubelet's that did not decode.
    fn malformed(&self, e: &prost::DecodeError) -> PodResourcesError {
        PodResourcesError::Malformed { socket: self.socket.display().to_string(), reason: e.to_string() }
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

/// Asks `List` over `channel`; the answer as sent ([`AsSent`]).
async fn ask_list(channel: tonic::transport::Channel, name: &str) -> Result<Bytes, PodResourcesError> {
    use gpushare_proto::podresources::ListPodResourcesRequest;
    let refused = |s: &tonic::Status| PodResourcesError::List {
        socket: name.to_owned(),
        code: s.code(),
        message: s.message().to_owned(),
    };
    // A full MiB-mode node lists 131 072 device IDs (about 1.3 MB).
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(64 * 1024 * 1024);
    grpc.ready().await.map_err(|e| refused(&tonic::Status::unavailable(e.to_string())))?;
    let path = http::uri::PathAndQuery::from_static("/v1.PodResourcesLister/List");
    grpc.unary(tonic::Request::new(ListPodResourcesRequest {}), path, AsSent)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| refused(&s))
}

/// The codec of `List` that keeps the answer as the kubelet sent it: a device-plugin call
/// reads only its pods and containers ([`listing`]), and reconciliation decodes it in full
/// ([`decode_list`]).
#[derive(Clone, Copy, Debug, Default)]
struct AsSent;

impl tonic::codec::Codec for AsSent {
    type Encode = gpushare_proto::podresources::ListPodResourcesRequest;
    type Decode = Bytes;
    type Encoder = AsSent;
    type Decoder = AsSent;

    fn encoder(&mut self) -> AsSent {
        AsSent
    }

    fn decoder(&mut self) -> AsSent {
        AsSent
    }
}

impl tonic::codec::Encoder for AsSent {
    type Item = gpushare_proto::podresources::ListPodResourcesRequest;
    type Error = tonic::Status;

    fn encode(&mut self, item: Self::Item, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        item.encode(dst).map_err(|e| tonic::Status::internal(format!("cannot encode the List request: {e}")))
    }
}

impl tonic::codec::Decoder for AsSent {
    type Item = Bytes;
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Bytes>, tonic::Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
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
                    shared = shared_lists.borrow().as_ref().map(|a| a.answer.clone()).or(shared);
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
            Some(answer) => decode_list(&answer, &socket.display().to_string()),
            None => client.list(Duration::from_secs(10)).await,
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
        latest.record(tokio::time::Instant::now(), Bytes::new());
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
            let answer = ListPodResourcesResponse { pod_resources: vec![one] }.encode_to_vec();
            call.record(tokio::time::Instant::now(), Bytes::from(answer));
        });
        let taken = shared_since(&mut shared, change, Duration::from_secs(5)).await.expect("the call's later answer");
        assert_eq!(decode_list(&taken, "kubelet.sock").unwrap().pod_resources.len(), 1, "is taken");
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
                                device_ids: vec!["x1".into()],
                                topology: None,
                            },
                            ContainerDevices {
                                resource_name: "nvidia.com/gpu".into(),
                                device_ids: vec!["GPU-1".into()],
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
