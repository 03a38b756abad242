//! The local status API on the D-Bus system bus: bus name [`BUS_NAME`], object [`OBJECT_PATH`],
//! interface [`INTERFACE`] (version 1; documented in `docs/dbus.md`). [`StatusApi`] only
//! translates: every answer comes from the [`Allocator`]. [`Gpushare1Proxy`] is the client side
//! `gpusharectl` uses.
//!
//! The API is never on the allocation path: [`serve`] connects in the background, and when the
//! bus is not there or goes away it retries (1 s doubling to 30 s) while the daemon keeps
//! serving the kubelet.

use std::sync::Arc;
use std::time::Duration;

use zbus::fdo;

use crate::allocation::allocator::{AllocError, Allocator};
use crate::allocation::ledger::{Cursor, MAX_PAGE};
use crate::config::Bus;

/// The well-known bus name.
pub const BUS_NAME: &str = "io.gpushare.GpuShare1";
/// The object path.
pub const OBJECT_PATH: &str = "/io/gpushare/GpuShare1";
/// The interface.
pub const INTERFACE: &str = "io.gpushare.GpuShare1";

mod records;

pub use records::{ActivityRecord, AllocationRecord, ClaimRecord, GpuRecord, HistoryRecord, OverBudgetRecord};

/// The served object.
#[derive(Debug)]
pub struct StatusApi {
    alloc: Arc<Allocator>,
}

impl StatusApi {
    /// An API answering from `alloc`.
    #[must_use]
    pub fn new(alloc: Arc<Allocator>) -> Self {
        StatusApi { alloc }
    }

    /// A page of the history, read on the blocking pool (a long read holds no executor thread
    /// and, on the history's own connection, no allocation either), with the next cursor.
    async fn page(
        &self,
        since_ms: i64,
        after: Option<Cursor>,
        max: usize,
    ) -> fdo::Result<(Vec<HistoryRecord>, String)> {
        let alloc = Arc::clone(&self.alloc);
        let page = tokio::task::spawn_blocking(move || alloc.history_page(since_ms, after, max))
            .await
            .map_err(|e| fdo::Error::Failed(format!("reading the history: {e}")))?
            .map_err(|e| failed(&e))?;
        let lines =
            page.lines.into_iter().map(|l| HistoryRecord { at_ms: l.at_ms, kind: l.kind, detail: l.detail }).collect();
        Ok((lines, page.next.map(|c| c.to_string()).unwrap_or_default()))
    }
}

/// Refuses a call that changes state unless its sender is root, asking the bus who sent it: a
/// `[dbus] address` of the operator's own may have no policy file that says so.
async fn root_only(bus: &zbus::Connection, header: &zbus::message::Header<'_>, method: &str) -> fdo::Result<()> {
    let sender = header
        .sender()
        .ok_or_else(|| fdo::Error::AccessDenied(format!("{method} needs root; the call names no sender")))?;
    let driver = fdo::DBusProxy::new(bus).await.map_err(|e| fdo::Error::Failed(e.to_string()))?;
    let uid = driver.get_connection_unix_user(zbus::names::BusName::Unique(sender.to_owned())).await.map_err(|e| {
        fdo::Error::AccessDenied(format!("{method} needs root; the bus cannot say who {sender} is: {e}"))
    })?;
    if uid == 0 {
        Ok(())
    } else {
        tracing::warn!(method, uid, sender = %sender, "refused a state change from a user other than root");
        Err(fdo::Error::AccessDenied(format!("{method} needs root; the caller is uid {uid}")))
    }
}

fn failed(e: &AllocError) -> fdo::Error {
    match e {
        AllocError::NoSuchGpu(_) => fdo::Error::InvalidArgs(e.to_string()),
        _ => fdo::Error::Failed(e.to_string()),
    }
}

/// `NAMESPACE/NAME`, or an error saying what to write.
fn pod_name(pod: &str) -> fdo::Result<(&str, &str)> {
    pod.split_once('/')
        .filter(|(ns, n)| !ns.is_empty() && !n.is_empty() && !n.contains('/'))
        .ok_or_else(|| fdo::Error::InvalidArgs(format!("{pod:?} is not NAMESPACE/NAME, such as default/infer-1")))
}

fn role(r: gpushare_core::ContainerRole) -> &'static str {
    match r {
        gpushare_core::ContainerRole::Init => "init",
        gpushare_core::ContainerRole::Sidecar => "sidecar",
        gpushare_core::ContainerRole::App => "app",
    }
}

#[zbus::interface(name = "io.gpushare.GpuShare1")]
impl StatusApi {
    /// This node's name in Kubernetes.
    #[zbus(property)]
    fn node_name(&self) -> String {
        self.alloc.node().to_owned()
    }

    /// The daemon's version.
    #[zbus(property)]
    #[allow(clippy::unused_self)] // a D-Bus property is a method of the served object
    fn version(&self) -> String {
        crate::DAEMON_VERSION.to_owned()
    }

    /// `MiB` or `GiB`: what one kubelet device stands for.
    #[zbus(property)]
    fn unit(&self) -> String {
        self.alloc.inventory().unit().to_string()
    }

    /// The GPUs (see [`GpuRecord`]).
    #[zbus(property)]
    fn gpus(&self) -> Vec<GpuRecord> {
        let state = self.alloc.node_state(0, "");
        state
            .inventory
            .gpus()
            .iter()
            .zip(&state.used)
            .map(|(g, used)| {
                let (health, reason) = match &g.health {
                    gpushare_core::Health::Healthy => ("Healthy", String::new()),
                    gpushare_core::Health::Unhealthy { reason } => ("Unhealthy", reason.clone()),
                };
                GpuRecord {
                    index: g.index,
                    uuid: g.uuid.to_string(),
                    model: g.model.clone(),
                    total_mib: g.total.get(),
                    used_mib: used.get(),
                    health: health.to_owned(),
                    reason,
                    cordoned: g.cordoned,
                }
            })
            .collect()
    }

    /// Each GPU's sharing mode and what it is doing (see [`ActivityRecord`]).
    #[zbus(property)]
    fn gpu_activity(&self) -> Vec<ActivityRecord> {
        self.alloc
            .current_inventory()
            .gpus()
            .iter()
            .map(|g| {
                let util = g.activity.and_then(|a| a.utilization).map_or(-1, i32::from);
                let in_use = g.activity.map_or(-1, |a| i64::try_from(a.in_use.get()).unwrap_or(i64::MAX));
                ActivityRecord {
                    index: g.index,
                    mode: g.mode.as_str().to_owned(),
                    utilization_percent: util,
                    memory_in_use_mib: in_use,
                }
            })
            .collect()
    }

    /// Live allocations in the ledger.
    #[zbus(property)]
    fn allocation_count(&self) -> u32 {
        u32::try_from(self.alloc.summary().allocations).unwrap_or(u32::MAX)
    }

    /// The containers whose processes use more GPU memory than their budget (see
    /// [`OverBudgetRecord`]), as last sampled.
    #[zbus(property)]
    fn over_budget(&self) -> Vec<OverBudgetRecord> {
        self.alloc
            .over_budget()
            .into_iter()
            .map(|o| OverBudgetRecord {
                namespace: o.pod.namespace,
                pod: o.pod.name,
                pod_uid: o.pod.uid,
                container: o.container,
                gpu_index: o.gpu,
                in_use_mib: o.in_use.get(),
                budget_mib: o.budget.get(),
                since_ms: o.since_ms,
            })
            .collect()
    }

    /// Live allocations, all (`pod` empty) or of one pod (`NAMESPACE/NAME`).
    async fn list_allocations(&self, pod: &str) -> fdo::Result<Vec<AllocationRecord>> {
        let filter = if pod.is_empty() { None } else { Some(pod_name(pod)?) };
        let rows = self.alloc.allocations(filter).map_err(|e| failed(&e))?;
        Ok(rows
            .into_iter()
            .map(|r| AllocationRecord {
                namespace: r.pod.namespace,
                pod: r.pod.name,
                pod_uid: r.pod.uid,
                container: r.container,
                role: role(r.role).to_owned(),
                gpu_uuid: r.gpu_uuid.to_string(),
                gpu_index: r.gpu_index,
                mib: r.mib.get(),
                allocated_at_ms: r.allocated_at,
            })
            .collect())
    }

    /// The live DRA claims' shares, in preparation order (docs/dra.md).
    async fn list_claims(&self) -> Vec<ClaimRecord> {
        self.alloc
            .live_claims()
            .into_iter()
            .map(|r| ClaimRecord {
                namespace: r.share.namespace,
                claim: r.share.name,
                claim_uid: r.share.claim_uid,
                gpu_uuid: r.share.gpu_uuid.to_string(),
                gpu_index: r.share.gpu_index,
                mib: r.share.mib.get(),
                prepared_at_ms: r.prepared_at,
            })
            .collect()
    }

    /// Where a pod (`NAMESPACE/NAME`) is on this node and why, or why it is not.
    async fn explain(&self, pod: &str) -> fdo::Result<String> {
        let (ns, name) = pod_name(pod)?;
        self.alloc.explain(ns, name).map_err(|e| failed(&e))
    }

    /// The history since `since_ms` (Unix ms), oldest first: its first page, at most
    /// [`MAX_PAGE`] lines (`HistoryPage` reads on from there).
    async fn history(&self, since_ms: i64) -> fdo::Result<Vec<HistoryRecord>> {
        Ok(self.page(since_ms, None, MAX_PAGE).await?.0)
    }

    /// A page of the history since `since_ms`, oldest first, of at most `max` lines (0 or more
    /// than [`MAX_PAGE`]: [`MAX_PAGE`]), starting after `cursor` (empty: at the start). Returns
    /// the lines and the cursor of the next page, empty once there is no more.
    async fn history_page(&self, since_ms: i64, cursor: &str, max: u32) -> fdo::Result<(Vec<HistoryRecord>, String)> {
        let after = match cursor {
            "" => None,
            c => Some(c.parse::<Cursor>().map_err(|e| fdo::Error::InvalidArgs(e.to_string()))?),
        };
        let max = match usize::try_from(max) {
            Ok(0) | Err(_) => MAX_PAGE,
            Ok(n) => n,
        };
        self.page(since_ms, after, max).await
    }

    /// Cordons a GPU (index or UUID): it keeps its allocations and takes no new ones. Returns
    /// whether anything changed. Root only: the bus policy says so, and the daemon checks.
    async fn cordon(
        &self,
        gpu: &str,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] bus: &zbus::Connection,
    ) -> fdo::Result<bool> {
        root_only(bus, &header, "Cordon").await?;
        self.alloc.set_cordon(gpu, true).map(|(_, changed)| changed).map_err(|e| failed(&e))
    }

    /// Uncordons a GPU (index or UUID). Returns whether anything changed. Root only.
    async fn uncordon(
        &self,
        gpu: &str,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] bus: &zbus::Connection,
    ) -> fdo::Result<bool> {
        root_only(bus, &header, "Uncordon").await?;
        self.alloc.set_cordon(gpu, false).map(|(_, changed)| changed).map_err(|e| failed(&e))
    }
}

/// The client side of the interface.
#[zbus::proxy(
    interface = "io.gpushare.GpuShare1",
    default_service = "io.gpushare.GpuShare1",
    default_path = "/io/gpushare/GpuShare1"
)]
pub trait Gpushare1 {
    /// This node's name.
    #[zbus(property)]
    fn node_name(&self) -> zbus::Result<String>;
    /// The daemon's version.
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    /// The unit.
    #[zbus(property)]
    fn unit(&self) -> zbus::Result<String>;
    /// The GPUs.
    #[zbus(property)]
    fn gpus(&self) -> zbus::Result<Vec<GpuRecord>>;
    /// Live allocations.
    #[zbus(property)]
    fn allocation_count(&self) -> zbus::Result<u32>;
    /// Containers over their budget.
    #[zbus(property)]
    fn over_budget(&self) -> zbus::Result<Vec<OverBudgetRecord>>;
    /// Each GPU's mode and activity.
    #[zbus(property)]
    fn gpu_activity(&self) -> zbus::Result<Vec<ActivityRecord>>;
    /// Live allocations, of one pod if `pod` is not empty.
    fn list_allocations(&self, pod: &str) -> zbus::Result<Vec<AllocationRecord>>;
    /// The live DRA claims.
    fn list_claims(&self) -> zbus::Result<Vec<ClaimRecord>>;
    /// Where a pod is and why.
    fn explain(&self, pod: &str) -> zbus::Result<String>;
    /// The history since a time (its first page).
    fn history(&self, since_ms: i64) -> zbus::Result<Vec<HistoryRecord>>;
    /// A page of the history since a time, after a cursor; the next page's cursor.
    fn history_page(&self, since_ms: i64, cursor: &str, max: u32) -> zbus::Result<(Vec<HistoryRecord>, String)>;
    /// Cordons a GPU.
    fn cordon(&self, gpu: &str) -> zbus::Result<bool>;
    /// Uncordons a GPU.
    fn uncordon(&self, gpu: &str) -> zbus::Result<bool>;
}

async fn connect(bus: &Bus, alloc: &Arc<Allocator>) -> zbus::Result<zbus::Connection> {
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system(),
        Bus::Address(a) => zbus::connection::Builder::address(a.as_str()),
    };
    builder.name(BUS_NAME).serve_at(OBJECT_PATH, StatusApi::new(Arc::clone(alloc))).build().await
}

/// Serves the API on `bus` forever: connects (retrying with backoff while the bus is not
/// there), emits `PropertiesChanged` for `Gpus`, `AllocationCount` and `OverBudget` after every change (a
/// burst within 100 ms is one signal), and reconnects when the bus goes away. `first`, when
/// given, hears whether the first attempt succeeded (the daemon waits for it before READY).
pub async fn serve(bus: Bus, alloc: Arc<Allocator>, mut first: Option<tokio::sync::oneshot::Sender<bool>>) {
    let mut delay = Duration::from_secs(1);
    let mut warned = false;
    loop {
        let attempt = connect(&bus, &alloc).await;
        if let Some(tell) = first.take() {
            let _ = tell.send(attempt.is_ok());
        }
        match attempt {
            Ok(conn) => {
                tracing::info!(bus = ?bus, name = BUS_NAME, "serving the status API on D-Bus");
                warned = false;
                delay = Duration::from_secs(1);
                follow(&conn, &alloc).await;
                tracing::warn!(bus = ?bus, "lost the D-Bus connection; reconnecting (the kubelet is still served)");
            }
            Err(e) => {
                if warned {
                    tracing::debug!(bus = ?bus, error = %e, "D-Bus still unavailable");
                } else {
                    tracing::warn!(bus = ?bus, error = %e, "D-Bus unavailable; the status API waits for it (the kubelet is still served)");
                    warned = true;
                }
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

/// Emits change signals until the connection fails.
async fn follow(conn: &zbus::Connection, alloc: &Arc<Allocator>) {
    let Ok(iface) = conn.object_server().interface::<_, StatusApi>(OBJECT_PATH).await else { return };
    let mut changes = alloc.subscribe();
    let Ok(peer) = zbus::fdo::DBusProxy::new(conn).await else { return };
    loop {
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
                // A burst of allocations becomes one signal, not one each.
                tokio::time::sleep(Duration::from_millis(100)).await;
                changes.borrow_and_update();
                // The properties in one PropertiesChanged: a client never sees the new GPUs
                // beside the old count.
                let (gpus, count, over) = {
                    let api = iface.get().await;
                    (api.gpus(), api.allocation_count(), api.over_budget())
                };
                let (Ok(gpus), Ok(over)) =
                    (zbus::as_variant::to_owned_variant(&gpus), zbus::as_variant::to_owned_variant(&over))
                else {
                    // Plain records always serialize; were one not to, no signal beats a torn one.
                    tracing::error!("the status API's records could not be serialized; no change signal sent");
                    continue;
                };
                let changed = std::collections::HashMap::from([
                    ("Gpus", zbus::Variant::from(gpus)),
                    ("AllocationCount", zbus::Variant::from(count)),
                    ("OverBudget", zbus::Variant::from(over)),
                ]);
                let name = zbus::names::InterfaceName::from_static_str_unchecked(INTERFACE);
                let signal = fdo::Properties::properties_changed(iface.signal_emitter(), name, changed, (&[][..]).into());
                if signal.await.is_err() {
                    return;
                }
            }
            () = tokio::time::sleep(Duration::from_secs(5)) => {
                // The bus answers, or the connection is gone.
                if peer.get_id().await.is_err() {
                    return;
                }
            }
        }
    }
}
