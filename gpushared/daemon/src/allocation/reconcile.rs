//! Reconciliation of the ledger with the kubelet's own record, the PodResources API (`List`,
//! asked by [`crate::kubelet::pod_resources`]): which container holds which of this daemon's
//! device IDs. The plan is a pure function of the ledger's live rows and the kubelet's answer
//! ([`plan`]); the allocator applies it
//! ([`crate::allocation::allocator::Allocator::reconcile`]) and records every repair in the history.
//!
//! The rules, in the order they are checked for each live row group (one container's rows):
//! - the kubelet holds the same device set for the same pod and container: kept;
//! - an init container's rows are kept while its pod is listed (the kubelet's `List` shows only
//!   long-running containers, and hands an init container's devices on to the next container);
//!   a sidecar's likewise (older kubelets do not list them);
//! - rows younger than the grace period are kept (the kubelet records an allocation only after
//!   `Allocate` returned, and lists a pod only once it is active);
//! - the kubelet holds the device set for another pod: released at once, grace period or not
//!   ("wrong owner"), and the set
//!   adopted for the pod the kubelet names;
//! - the kubelet does not list the pod at all, but the API server still has it running on this
//!   node: kept (a restarting kubelet lists no pod until it has synced its own; the pod watch
//!   releases the rows when the pod ends);
//! - otherwise the kubelet no longer holds the devices: released. This is how rows of pods
//!   deleted while the daemon was down are released.
//!
//! Rows of no device (a container allocated at its creation where the kubelet counts the
//! memory, `[kubelet] advertise = "capacity"`) are no device set the kubelet can hold: they are
//! kept while the kubelet lists their pod or the API server has it running on this node, or
//! while they are young, and released otherwise.
//!
//! Device sets the kubelet holds that no live row records are adopted for the pod and
//! container it names, when that pod is known (its UID comes from the pods bound to this node)
//! and has not finished (the kubelet lists a finished pod until it is removed; its memory is
//! back in the pool); a set still recorded for another container waits for the next round.
//!
//! Most rounds, those that follow allocations in a burst above all, find nothing to repair.
//! [`agrees`] proves that from the allocator's in-memory mirror of the live rows, without
//! reading the ledger; only a round it cannot prove quiet makes the whole [`plan`].

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use gpushare_core::ContainerRole;
use gpushare_core::codec::node::PodRef;

use crate::allocation::ledger::{Row, key_hash, request_key};

/// One container's devices of this daemon's resource, as the kubelet reports them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Container name.
    pub container: String,
    /// Device IDs.
    pub device_ids: Vec<String>,
}

/// The kubelet's answer, reduced to what reconciliation needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubeletView {
    /// Every pod the kubelet lists (namespace, name), with or without devices.
    pub pods: BTreeSet<(String, String)>,
    /// The containers holding devices of `resource`.
    pub holdings: Vec<Holding>,
}

/// What the daemon knows of a pod the kubelet names: its UID and the role of the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownPod {
    /// The pod.
    pub pod: PodRef,
    /// The container's role, from the pod's spec or assignment (`App` if unknown).
    pub role: ContainerRole,
    /// The pod has finished (`Succeeded`, `Failed`) or is being deleted: its memory went back
    /// to the pool, and the kubelet listing it for a while longer does not book it again.
    pub finished: bool,
}

/// One repair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Repair {
    /// Release these live rows of one container.
    Release {
        /// Ledger row ids.
        rows: Vec<i64>,
        /// The pod.
        pod: PodRef,
        /// The container.
        container: String,
        /// Why, for the history.
        reason: String,
    },
    /// Record the devices the kubelet holds for a container the ledger lacks.
    Adopt {
        /// The pod.
        pod: PodRef,
        /// The container.
        container: String,
        /// Its role.
        role: ContainerRole,
        /// The devices the kubelet holds for it.
        device_ids: Vec<String>,
        /// Why, for the history.
        reason: String,
    },
    /// The kubelet holds devices for a pod this daemon does not know: nothing can be recorded.
    Unknown {
        /// What the kubelet said.
        holding: Holding,
    },
}

/// A reconciliation's outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The repairs to make, in ledger order.
    pub repairs: Vec<Repair>,
    /// When (ms since the epoch) the first row kept only by its grace period leaves it: a row
    /// of a pod deleted while the daemon was down, say, allocated moments before. Reconciling
    /// again then releases it without waiting for the next interval.
    pub recheck_at_ms: Option<i64>,
}

/// The repairs that make the ledger's live rows agree with the kubelet. `known` resolves a
/// pod named by the kubelet (namespace, name, container); `running` tells whether the API
/// server has a pod UID bound to this node and not finished; rows allocated less than
/// `grace_ms` before `now_ms` are never released.
#[must_use]
pub fn plan(
    live: &[Row],
    kubelet: &KubeletView,
    known: impl Fn(&str, &str, &str) -> Option<KnownPod>,
    running: impl Fn(&str) -> bool,
    now_ms: i64,
    grace_ms: i64,
) -> Plan {
    // The kubelet's holdings by device-set key.
    let mut held_by: BTreeMap<String, &Holding> = BTreeMap::new();
    for h in &kubelet.holdings {
        held_by.insert(request_key(&h.device_ids), h);
    }
    // The ledger's rows by container, in ledger order.
    let mut groups: BTreeMap<(&str, &str), Vec<&Row>> = BTreeMap::new();
    for r in live {
        groups.entry((r.pod.uid.as_str(), r.container.as_str())).or_default().push(r);
    }
    let mut groups: Vec<Vec<&Row>> = groups.into_values().collect();
    groups.sort_by_key(|rows| rows.first().map_or(0, |r| r.id));

    let mut repairs = Vec::new();
    let mut recheck_at_ms: Option<i64> = None;
    let mut matched: BTreeSet<String> = BTreeSet::new();
    for rows in groups {
        let Some(first) = rows.first() else { continue };
        let pod_listed = kubelet.pods.contains(&(first.pod.namespace.clone(), first.pod.name.clone()));
        let same_pod = |h: &Holding| h.namespace == first.pod.namespace && h.name == first.pod.name;
        let release = |reason: String| Repair::Release {
            rows: rows.iter().map(|r| r.id).collect(),
            pod: first.pod.clone(),
            container: first.container.clone(),
            reason,
        };
        if first.device_ids.is_empty() {
            if pod_listed || running(&first.pod.uid) {
                continue;
            }
            if young(first.allocated_at, now_ms, grace_ms) {
                recheck_when_grace_ends(&mut recheck_at_ms, first.allocated_at, grace_ms);
            } else {
                repairs.push(release(
                    "reconcile: the kubelet no longer runs this pod, and it is not running on this node".to_owned(),
                ));
            }
            continue;
        }
        match held_by.get(&first.request_key) {
            Some(h) if same_pod(h) && h.container == first.container => {
                matched.insert(first.request_key.clone());
            }
            Some(h) if same_pod(h) && first.role == ContainerRole::Init => {}
            // The kubelet's positive word that another pod holds the set: no grace period (the
            // kubelet records an allocation before it admits the next container, so a young
            // row it lists under another pod was an answer to that pod's call).
            Some(h) if !same_pod(h) => repairs.push(release(format!(
                "reconcile: the kubelet holds these devices for {}/{} container {:?}",
                h.namespace, h.name, h.container
            ))),
            _ if pod_listed && first.role != ContainerRole::App => {}
            _ if young(first.allocated_at, now_ms, grace_ms) => {
                // Kept for now; looked at again when the grace period ends, unless the API
                // server's word keeps it anyway (the arm below).
                let kept_anyway = !held_by.contains_key(&first.request_key) && !pod_listed && running(&first.pod.uid);
                if !kept_anyway {
                    recheck_when_grace_ends(&mut recheck_at_ms, first.allocated_at, grace_ms);
                }
            }
            None if !pod_listed && running(&first.pod.uid) => {}
            Some(h) => repairs.push(release(format!(
                "reconcile: the kubelet holds these devices for container {:?} of the same pod",
                h.container
            ))),
            None if pod_listed => repairs.push(release(format!(
                "reconcile: the kubelet no longer holds these devices for container {:?}",
                first.container
            ))),
            None => repairs.push(release(
                "reconcile: the kubelet no longer runs this pod, and it is not running on this node".to_owned(),
            )),
        }
    }
    // A set still recorded for another container (an init container's devices handed on, or
    // a row in its grace period) waits for the next round rather than being counted twice.
    let released: BTreeSet<i64> = repairs
        .iter()
        .filter_map(|r| match r {
            Repair::Release { rows, .. } => Some(rows.iter().copied()),
            _ => None,
        })
        .flatten()
        .collect();
    let kept: BTreeSet<&str> =
        live.iter().filter(|r| !released.contains(&r.id)).map(|r| r.request_key.as_str()).collect();
    for (key, h) in &held_by {
        if matched.contains(key) || kept.contains(key.as_str()) {
            continue;
        }
        match known(&h.namespace, &h.name, &h.container) {
            // Never re-adopt a finished pod: its rows were released when it finished.
            Some(k) if k.finished => {}
            Some(k) => repairs.push(Repair::Adopt {
                pod: k.pod,
                container: h.container.clone(),
                role: k.role,
                device_ids: h.device_ids.clone(),
                reason: format!(
                    "reconcile: the kubelet holds {} devices for {}/{} container {:?} that the ledger lacked",
                    h.device_ids.len(),
                    h.namespace,
                    h.name,
                    h.container
                ),
            }),
            None => repairs.push(Repair::Unknown { holding: (*h).clone() }),
        }
    }
    Plan { repairs, recheck_at_ms }
}

/// A live row as the allocator keeps it in memory, for [`agrees`].
#[derive(Clone, Copy, Debug)]
pub struct Kept<'a> {
    /// Ledger row id.
    pub id: i64,
    /// The pod.
    pub pod: &'a PodRef,
    /// The container.
    pub container: &'a str,
    /// [`key_hash`] of the row's device-set key.
    pub key_hash: u64,
    /// Unix milliseconds.
    pub allocated_at: i64,
}

/// Whether a row allocated at `allocated_at` (Unix milliseconds) is still in its grace period at
/// `now_ms`: the kubelet may not list it yet. One rule for [`plan`] and [`agrees`].
fn young(allocated_at: i64, now_ms: i64, grace_ms: i64) -> bool {
    now_ms.saturating_sub(allocated_at) < grace_ms
}

/// Moves `at` earlier to when a young row allocated at `allocated_at` leaves its grace period.
fn recheck_when_grace_ends(at: &mut Option<i64>, allocated_at: i64, grace_ms: i64) {
    let ends = allocated_at.saturating_add(grace_ms);
    *at = Some(at.map_or(ends, |a| a.min(ends)));
}

/// The device sets the kubelet holds, hashed for [`agrees`]: made before the allocator's lock
/// is taken, so that the kubelet's calls do not wait while every set is keyed and hashed.
#[derive(Debug)]
pub struct HeldSets<'k> {
    /// Each holding's set hash, by namespace, pod name and container.
    by_container: HashMap<(&'k str, &'k str, &'k str), u64>,
    /// Every hash.
    sets: HashSet<u64>,
    /// Every pod the kubelet lists, by namespace and name.
    pods: HashSet<(&'k str, &'k str)>,
    /// Two holdings share a set or a container: only the whole [`plan`] can tell what that means.
    unclear: bool,
}

impl<'k> HeldSets<'k> {
    /// The sets `kubelet` holds.
    #[must_use]
    pub fn of(kubelet: &'k KubeletView) -> Self {
        let mut held = HeldSets {
            by_container: HashMap::with_capacity(kubelet.holdings.len()),
            sets: HashSet::with_capacity(kubelet.holdings.len()),
            pods: kubelet.pods.iter().map(|(ns, name)| (ns.as_str(), name.as_str())).collect(),
            unclear: false,
        };
        for h in &kubelet.holdings {
            let hash = key_hash(&request_key(&h.device_ids));
            let fresh = held.by_container.insert((&h.namespace, &h.name, &h.container), hash).is_none();
            held.unclear |= !held.sets.insert(hash) || !fresh;
        }
        held
    }
}

/// Whether the kubelet's answer agrees with the live rows so plainly that [`plan`] would repair
/// nothing, told from the rows' device-set hashes alone: every set the kubelet holds
/// ([`HeldSets`]) is the set of exactly one container's rows, for the same pod name and
/// container, every container's rows of no device (allocated at its creation) are of a pod the
/// kubelet lists, and every other container's rows are in their grace period with a set the
/// kubelet holds for no one. Then it returns `Some` with when the first of those rows leaves its grace
/// period (reconciling again then, the whole [`plan`] decides). `None` when it cannot tell: make
/// the whole [`plan`].
///
/// Sets are compared by their 64-bit hash; two different sets of the same container sharing one
/// would leave a repair to a later round that this function cannot prove quiet (the periodic
/// one, when nothing else changes).
#[must_use]
pub fn agrees<'a>(
    rows: impl IntoIterator<Item = Kept<'a>>,
    held: &HeldSets<'_>,
    now_ms: i64,
    grace_ms: i64,
) -> Option<Option<i64>> {
    if held.unclear {
        return None;
    }
    // The rows by container; the first row (the lowest id) speaks for the group, as in `plan`.
    let mut groups: HashMap<(&str, &str), Kept<'a>> = HashMap::new();
    for r in rows {
        match groups.entry((r.pod.uid.as_str(), r.container)) {
            Entry::Occupied(mut e) => {
                if e.get().key_hash != r.key_hash {
                    return None;
                }
                if r.id < e.get().id {
                    e.insert(r);
                }
            }
            Entry::Vacant(e) => {
                e.insert(r);
            }
        }
    }
    let no_device = key_hash(&request_key(&[]));
    // The holdings a row group matched, each at most once.
    let mut matched: HashSet<(&str, &str, &str)> = HashSet::with_capacity(held.by_container.len());
    let mut recheck_at_ms: Option<i64> = None;
    for g in groups.values() {
        let container = (g.pod.namespace.as_str(), g.pod.name.as_str(), g.container);
        match held.by_container.get(&container) {
            Some(hash) if *hash == g.key_hash => {
                if !matched.insert(container) {
                    return None;
                }
            }
            _ if held.sets.contains(&g.key_hash) => return None,
            // Rows of no device, kept while the kubelet lists their pod.
            _ if g.key_hash == no_device && held.pods.contains(&(container.0, container.1)) => {}
            _ if young(g.allocated_at, now_ms, grace_ms) => {
                recheck_when_grace_ends(&mut recheck_at_ms, g.allocated_at, grace_ms);
            }
            _ => return None,
        }
    }
    (matched.len() == held.by_container.len()).then_some(recheck_at_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_core::{GpuUuid, Mib};

    fn pod(name: &str) -> PodRef {
        PodRef { namespace: "default".into(), name: name.into(), uid: format!("uid-{name}") }
    }

    fn row(id: i64, p: &str, container: &str, role: ContainerRole, ids: &[&str], at: i64) -> Row {
        let ids: Vec<String> = ids.iter().map(|s| (*s).to_owned()).collect();
        Row {
            id,
            pod: pod(p),
            container: container.into(),
            role,
            gpu_uuid: GpuUuid::new("GPU-a").unwrap(),
            gpu_index: 0,
            mib: Mib::new(u64::try_from(ids.len()).unwrap()),
            request_key: request_key(&ids),
            device_ids: ids,
            allocated_at: at,
            released_at: None,
            release_reason: None,
        }
    }

    fn holding(p: &str, container: &str, ids: &[&str]) -> Holding {
        Holding {
            namespace: "default".into(),
            name: p.into(),
            container: container.into(),
            device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn kubelet(pods: &[&str], holdings: Vec<Holding>) -> KubeletView {
        KubeletView { pods: pods.iter().map(|p| ("default".to_owned(), (*p).to_owned())).collect(), holdings }
    }

    fn known(ns: &str, name: &str, _: &str) -> Option<KnownPod> {
        (ns == "default" && name != "stranger").then(|| KnownPod {
            pod: pod(name),
            role: ContainerRole::App,
            finished: name.starts_with("done"),
        })
    }

    /// No pod is running as far as the API server says.
    fn gone(_: &str) -> bool {
        false
    }

    const NOW: i64 = 1_000_000;
    const GRACE: i64 = 30_000;
    const OLD: i64 = NOW - 60_000;

    #[test]
    fn agreement_needs_no_repair() {
        let live = [row(1, "a", "main", ContainerRole::App, &["x1", "x2"], OLD)];
        let k = kubelet(&["a"], vec![holding("a", "main", &["x2", "x1"])]);
        assert_eq!(plan(&live, &k, known, gone, NOW, GRACE).repairs, vec![]);
    }

    #[test]
    fn rows_the_kubelet_no_longer_holds_are_released_after_the_grace_period() {
        let live = [
            row(1, "gone", "main", ContainerRole::App, &["x1"], OLD),
            row(2, "new", "main", ContainerRole::App, &["x2"], NOW - 1_000),
            row(3, "alive", "old", ContainerRole::App, &["x3"], OLD),
        ];
        let k = kubelet(&["alive"], vec![]);
        let repairs = plan(&live, &k, known, gone, NOW, GRACE).repairs;
        assert_eq!(repairs.len(), 2, "{repairs:?}");
        assert!(
            matches!(&repairs[0], Repair::Release { rows, reason, .. } if rows == &[1] && reason.contains("no longer runs this pod"))
        );
        assert!(
            matches!(&repairs[1], Repair::Release { rows, reason, .. } if rows == &[3] && reason.contains("no longer holds these devices for container \"old\""))
        );
        // A pod the API server still has running is not released while the kubelet does not
        // list it (a restarting kubelet lists nothing until it has synced).
        let running = |uid: &str| uid == "uid-gone";
        let repairs = plan(&live, &k, known, running, NOW, GRACE).repairs;
        assert_eq!(repairs.len(), 1, "{repairs:?}");
        assert!(matches!(&repairs[0], Repair::Release { rows, .. } if rows == &[3]));
    }

    #[test]
    fn a_row_kept_only_by_its_grace_period_is_looked_at_again_when_it_ends() {
        // "deleted" went while the daemon was down, just after its allocation; "admitting" is
        // being admitted (bound and running as far as the API server says); "settled" is held.
        let live = [
            row(1, "deleted", "main", ContainerRole::App, &["x1"], NOW - 5_000),
            row(2, "admitting", "main", ContainerRole::App, &["x2"], NOW - 1_000),
            row(3, "settled", "main", ContainerRole::App, &["x3"], NOW - 2_000),
        ];
        let k = kubelet(&["settled"], vec![holding("settled", "main", &["x3"])]);
        let running = |uid: &str| uid == "uid-admitting";
        let p = plan(&live, &k, known, running, NOW, GRACE);
        assert_eq!(p.repairs, vec![]);
        assert_eq!(p.recheck_at_ms, Some(NOW - 5_000 + GRACE));
        // Once it is over, released; nothing is left to look at again.
        let later = NOW - 5_000 + GRACE;
        let p = plan(&live, &k, known, running, later, GRACE);
        assert!(matches!(&p.repairs[..], [Repair::Release { rows, .. }] if rows == &[1]), "{:?}", p.repairs);
        assert_eq!(p.recheck_at_ms, None);
    }

    #[test]
    fn init_containers_and_sidecars_are_kept_while_their_pod_is_listed() {
        let live = [
            row(1, "a", "setup", ContainerRole::Init, &["x1"], OLD),
            row(2, "a", "proxy", ContainerRole::Sidecar, &["x2"], OLD),
            row(3, "a", "main", ContainerRole::App, &["x1"], OLD),
        ];
        let k = kubelet(&["a"], vec![holding("a", "main", &["x1"])]);
        assert_eq!(plan(&live, &k, known, gone, NOW, GRACE).repairs, vec![]);
        // Once the pod is gone, everything goes.
        let repairs = plan(&live, &kubelet(&[], vec![]), known, gone, NOW, GRACE).repairs;
        assert_eq!(repairs.len(), 3);
    }

    #[test]
    fn devices_the_ledger_lacks_are_adopted_for_known_pods_only() {
        let k = kubelet(
            &["a", "stranger", "done"],
            vec![holding("a", "main", &["x1"]), holding("stranger", "c", &["x9"]), holding("done", "c", &["x5"])],
        );
        let repairs = plan(&[], &k, known, gone, NOW, GRACE).repairs;
        // The finished pod the kubelet still lists is not booked again.
        assert_eq!(repairs.len(), 2, "{repairs:?}");
        assert!(matches!(&repairs[0], Repair::Adopt { pod, container, device_ids, .. }
            if pod.uid == "uid-a" && container == "main" && device_ids == &["x1"]));
        assert!(matches!(&repairs[1], Repair::Unknown { holding } if holding.name == "stranger"));
    }

    #[test]
    fn a_young_row_the_kubelet_lists_under_another_pod_is_released_at_once() {
        // The answer went to b's call, though the daemon took it for a: no grace period.
        let live = [row(1, "a", "main", ContainerRole::App, &["x1"], NOW)];
        let k = kubelet(&["b"], vec![holding("b", "main", &["x1"])]);
        let repairs = plan(&live, &k, known, gone, NOW, GRACE).repairs;
        assert!(
            matches!(&repairs[0], Repair::Release { rows, reason, .. }
            if rows == &[1] && reason.contains("for default/b container \"main\"")),
            "{repairs:?}"
        );
    }

    #[test]
    fn a_wrong_owner_is_released_and_the_right_one_adopted() {
        let live = [row(1, "a", "main", ContainerRole::App, &["x1", "x2"], OLD)];
        let k = kubelet(&["a", "b"], vec![holding("b", "worker", &["x1", "x2"])]);
        let repairs = plan(&live, &k, known, gone, NOW, GRACE).repairs;
        assert_eq!(repairs.len(), 2, "{repairs:?}");
        assert!(matches!(&repairs[0], Repair::Release { rows, reason, .. }
            if rows == &[1] && reason.contains("for default/b container \"worker\"")));
        assert!(
            matches!(&repairs[1], Repair::Adopt { pod, container, .. } if pod.name == "b" && container == "worker")
        );
    }

    fn kept(live: &[Row]) -> Vec<Kept<'_>> {
        live.iter()
            .map(|r| Kept {
                id: r.id,
                pod: &r.pod,
                container: &r.container,
                key_hash: key_hash(&r.request_key),
                allocated_at: r.allocated_at,
            })
            .collect()
    }

    #[test]
    fn agreement_is_proven_without_the_plan() {
        let live = [
            row(1, "a", "main", ContainerRole::App, &["x1", "x2"], OLD),
            row(2, "a", "main", ContainerRole::App, &["x1", "x2"], OLD),
            row(3, "b", "main", ContainerRole::App, &["x3"], OLD),
        ];
        let k = kubelet(&["a", "b"], vec![holding("a", "main", &["x2", "x1"]), holding("b", "main", &["x3"])]);
        assert_eq!(agrees(kept(&live), &HeldSets::of(&k), NOW, GRACE), Some(None));
    }

    #[test]
    fn a_young_row_the_kubelet_does_not_list_yet_is_looked_at_again_when_its_grace_ends() {
        let live = [
            row(1, "a", "main", ContainerRole::App, &["x1"], OLD),
            row(2, "b", "main", ContainerRole::App, &["x2"], NOW - 1_000),
        ];
        let k = kubelet(&["a"], vec![holding("a", "main", &["x1"])]);
        assert_eq!(agrees(kept(&live), &HeldSets::of(&k), NOW, GRACE), Some(Some(NOW - 1_000 + GRACE)));
    }

    #[test]
    fn what_may_need_a_repair_is_left_to_the_plan() {
        let cases: [(Vec<Row>, KubeletView); 8] = [
            // Another pod holds the young row's set.
            (
                vec![row(1, "a", "main", ContainerRole::App, &["x1"], NOW)],
                kubelet(&["b"], vec![holding("b", "main", &["x1"])]),
            ),
            // The kubelet holds a set the ledger lacks.
            (vec![], kubelet(&["a"], vec![holding("a", "main", &["x1"])])),
            // An old row the kubelet does not hold.
            (vec![row(1, "a", "main", ContainerRole::App, &["x1"], OLD)], kubelet(&["a"], vec![])),
            // The kubelet holds another set for the container.
            (
                vec![row(1, "a", "main", ContainerRole::App, &["x1"], OLD)],
                kubelet(&["a"], vec![holding("a", "main", &["x2"])]),
            ),
            // Two containers' rows hold one set (an init container's, handed on).
            (
                vec![
                    row(1, "a", "init", ContainerRole::Init, &["x1"], OLD),
                    row(2, "a", "main", ContainerRole::App, &["x1"], OLD),
                ],
                kubelet(&["a"], vec![holding("a", "main", &["x1"])]),
            ),
            // One container's rows with two sets.
            (
                vec![
                    row(1, "a", "main", ContainerRole::App, &["x1"], OLD),
                    row(2, "a", "main", ContainerRole::App, &["x2"], OLD),
                ],
                kubelet(&["a"], vec![holding("a", "main", &["x1"])]),
            ),
            // Two pods hold one set, each by its own rows.
            (
                vec![
                    row(1, "a", "main", ContainerRole::App, &["x1"], OLD),
                    row(2, "b", "main", ContainerRole::App, &["x1"], OLD),
                ],
                kubelet(&["a", "b"], vec![holding("a", "main", &["x1"]), holding("b", "main", &["x1"])]),
            ),
            // The kubelet lists one container twice, with two sets.
            (
                vec![row(1, "a", "main", ContainerRole::App, &["x2"], OLD)],
                kubelet(&["a"], vec![holding("a", "main", &["x1"]), holding("a", "main", &["x2"])]),
            ),
        ];
        for (live, k) in &cases {
            assert_eq!(agrees(kept(live), &HeldSets::of(k), NOW, GRACE), None, "{live:?} {k:?}");
        }
    }

    proptest::proptest! {
        /// Whenever the shortcut says the kubelet agrees, the whole plan repairs nothing, and
        /// it looks again no later than the plan would.
        #[test]
        fn the_shortcut_never_skips_a_repair(
            rows in proptest::collection::vec((0usize..4, 0usize..3, 0usize..5, 0usize..3, proptest::bool::ANY), 0..8),
            listed in proptest::collection::vec((0usize..4, 0usize..3, 0usize..5), 0..8),
            copy in proptest::collection::vec(proptest::bool::ANY, 8),
            running in proptest::bool::ANY,
        ) {
            const PODS: [&str; 4] = ["a", "b", "done", "stranger"];
            const CONTAINERS: [&str; 3] = ["main", "side", "init"];
            const SETS: [&[&str]; 5] = [&["x1"], &["x2"], &["x1", "x2"], &["x3", "x4"], &["x5"]];
            const ROLES: [ContainerRole; 3] = [ContainerRole::App, ContainerRole::Sidecar, ContainerRole::Init];
            let live: Vec<Row> = rows
                .iter()
                .enumerate()
                .map(|(i, &(p, c, set, role, young))| {
                    let at = if young { NOW - 1_000 - i64::try_from(i).unwrap() } else { OLD };
                    row(i64::try_from(i).unwrap() + 1, PODS[p], CONTAINERS[c], ROLES[role], SETS[set], at)
                })
                .collect();
            // Mostly what the ledger holds, so that agreement is common; then anything.
            let mut holdings: Vec<Holding> = live
                .iter()
                .zip(&copy)
                .filter(|(_, copied)| **copied)
                .map(|(r, _)| holding(&r.pod.name, &r.container, &r.device_ids.iter().map(String::as_str).collect::<Vec<_>>()))
                .collect();
            holdings.extend(listed.iter().map(|&(p, c, set)| holding(PODS[p], CONTAINERS[c], SETS[set])));
            let names: Vec<&str> = holdings.iter().map(|h| h.name.as_str()).chain(["a"]).collect();
            let k = kubelet(&names, holdings.clone());
            let whole = plan(&live, &k, known, |_| running, NOW, GRACE);
            if let Some(recheck) = agrees(kept(&live), &HeldSets::of(&k), NOW, GRACE) {
                proptest::prop_assert_eq!(&whole.repairs, &vec![]);
                if let Some(at) = whole.recheck_at_ms {
                    proptest::prop_assert!(recheck.is_some_and(|r| r <= at));
                }
            }
        }
    }
}
