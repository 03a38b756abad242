//! Which container a kubelet call is for, from what the daemon knows: the pods bound to this
//! node, the live ledger rows ([`HeldRows`]) and the admissions under way ([`Admissions`]). Pure
//! functions over those snapshots, so every rule of the choice is tested on tables.
//!
//! The kubelet admits one pod at a time, its containers in order (init containers first), so
//! the container being admitted is the first container without a row of some pod whose
//! assignment asks for the number of devices the call names. The pod already being admitted
//! wins; then containers without an outstanding proposal (a proposal not yet followed by
//! `Allocate` belongs to another admission); then the kubelet's admission order: the oldest
//! (creation time, in whole seconds), and among pods created in the same second the first its
//! watch delivered (the resource version at which the daemon first saw the pod bound here).
//!
//! A pod whose admission has not started is chosen only from a store read consistently after
//! the call came ([`Care::confirmed`]): the pod watch may lag behind the kubelet's.
//!
//! Where several pods could be the one, the kubelet says which ([`KubeletSays`]): its
//! PodResources `List`, asked during the call, lists the pods it has admitted and the one it is
//! admitting (added before its admission starts, dropped when rejected), with the devices each
//! container holds. The pod being admitted is the listed one whose container holds none yet.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment};
use gpushare_core::codec::node::PodRef;
use gpushare_core::{MemoryUnit, PodRequest, ResourceNames};

use super::AllocError;
use super::admission::{Admissions, Owner};
use super::held::HeldRows;
use crate::allocation::pods::{PodView, StoredPod};

/// A container waiting for its devices.
#[derive(Clone, Debug)]
pub(super) struct Candidate {
    /// The pod, as stored.
    pub pod: Arc<StoredPod>,
    /// Its assignment.
    pub assignment: Arc<Assignment>,
    /// Position of the container in `assignment.containers`.
    pub position: usize,
    /// Devices it asks for.
    pub units: u64,
}

impl Candidate {
    /// Container `position` of `pod`'s `assignment`, with the devices of `unit` it asks for.
    pub(super) fn at(pod: &Arc<StoredPod>, assignment: &Arc<Assignment>, position: usize, unit: MemoryUnit) -> Self {
        let mib: u64 = assignment.containers[position].gpus.iter().map(|g| g.mib.get()).sum();
        Candidate {
            pod: Arc::clone(pod),
            assignment: Arc::clone(assignment),
            position,
            units: mib / unit.mib_per_unit(),
        }
    }

    pub(super) fn view(&self) -> &PodView {
        &self.pod.view
    }

    pub(super) fn container(&self) -> &ContainerAssignment {
        // `position` comes from enumerating this same, immutable assignment.
        &self.assignment.containers[self.position]
    }
}

/// The kubelet's own record of the pods it holds, from PodResources `List`: each pod it has
/// admitted or is admitting, with the containers that hold devices of this daemon's resource.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubeletListing {
    pods: HashMap<(String, String), BTreeSet<String>>,
}

impl KubeletListing {
    /// Adds pod `namespace/name`, whose `holding` containers hold devices of this resource.
    pub fn insert(&mut self, namespace: &str, name: &str, holding: impl IntoIterator<Item = String>) {
        self.pods.entry((namespace.to_owned(), name.to_owned())).or_default().extend(holding);
    }

    /// The pods listed whose containers hold none of this resource's devices, `(namespace,
    /// name)`: those whose admission the kubelet may have begun without the daemon.
    #[must_use]
    pub fn holding_nothing(&self) -> Vec<(String, String)> {
        self.pods.iter().filter(|(_, held)| held.is_empty()).map(|(k, _)| k.clone()).collect()
    }

    /// Whether the kubelet may be admitting `container` of `pod`: it lists the pod, and the
    /// container holds none of this resource's devices yet. (Init containers that are not
    /// sidecars are never listed, so theirs is the pod's listing alone.)
    fn admitting(&self, pod: &PodRef, container: &str) -> bool {
        self.pods.get(&(pod.namespace.clone(), pod.name.clone())).is_some_and(|held| !held.contains(container))
    }
}

/// What the kubelet was asked about the pods it holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KubeletSays {
    /// It cannot be asked: look-alikes on the same GPUs are told apart by the kubelet's order.
    #[default]
    Unasked,
    /// It can be asked: any two pods that could be the one are [`AllocError::Ambiguous`] (when
    /// patient), so that the caller asks.
    Askable,
    /// Its answer, asked after the call came: only the pods it lists as admitting can be the one.
    Listed(Arc<KubeletListing>),
}

/// How sure a choice must be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Care {
    /// A guess among look-alikes is [`AllocError::Ambiguous`] instead (the caller waits).
    pub patient: bool,
    /// The pod store includes a consistent read begun after the call came. Without it, a
    /// container of a pod whose admission has not started is [`AllocError::Unconfirmed`].
    pub confirmed: bool,
    /// What the kubelet said.
    pub kubelet: KubeletSays,
    /// The kubelet that made the call: [`super::Allocator::kubelet_generation`] when it came. A
    /// call whose kubelet has restarted since is [`AllocError::KubeletRestarted`]: the kubelet
    /// that would record its answer is gone, and the new one admits the pod again.
    pub generation: Option<u64>,
}

impl Care {
    /// The store as it stands is the truth, and the oldest look-alike is taken: a store that
    /// nothing else feeds (tests, tools).
    pub const AS_IS: Care = Care { patient: false, confirmed: true, kubelet: KubeletSays::Unasked, generation: None };
    /// The store is the truth; look-alikes are refused.
    pub const PATIENT: Care = Care { patient: true, confirmed: true, kubelet: KubeletSays::Unasked, generation: None };
}

/// The pods the kubelet has started admitting: the pod being admitted, and those that hold
/// rows.
struct Started<'a> {
    held: &'a HeldRows,
    admissions: &'a Admissions,
}

impl Started<'_> {
    /// Whether the kubelet has started admitting pod `uid`.
    fn pod(&self, uid: &str) -> bool {
        self.admissions.is_admitting(uid) || self.held.holds_any(uid)
    }
}

/// The node the choice is made for.
#[derive(Clone, Copy, Debug)]
pub(super) struct Scope<'a> {
    /// This node.
    pub node: &'a str,
    /// The resources pods ask for.
    pub names: &'a ResourceNames,
    /// The device unit.
    pub unit: MemoryUnit,
}

impl Scope<'_> {
    /// Whether the pod is bound to this node and has not finished.
    pub(super) fn bound_here(&self, view: &PodView) -> bool {
        !view.terminal && view.node.as_deref() == Some(self.node)
    }

    /// What is wrong with a pod's assignment on this node, if anything: it cannot be read, or
    /// it disagrees with the pod's containers ([`Assignment::check_against`]). Worked out once
    /// per version of the pod.
    pub(super) fn assignment_problem<'p>(&self, pod: &'p StoredPod) -> Option<&'p str> {
        pod.problem
            .get_or_init(|| match &pod.assignment {
                Some(Err(e)) => Some(e.to_string()),
                Some(Ok(a)) => match PodRequest::from_spec(&pod.view.spec, self.names, self.unit) {
                    Err(e) => Some(e.to_string()),
                    Ok(request) => a.check_against(&request).err(),
                },
                None => None,
            })
            .as_deref()
    }

    /// The containers waiting for devices, one per pod (its first container without a ledger
    /// row), of `units` devices if given, plus notes on pods that cannot be served (for error
    /// messages, when `want_notes` is set).
    pub(super) fn pending(
        &self,
        pods: &[Arc<StoredPod>],
        held: &HeldRows,
        units: Option<usize>,
        want_notes: bool,
    ) -> (Vec<Candidate>, Vec<String>) {
        let mut out = Vec::new();
        let mut notes = Vec::new();
        for pod in pods {
            let view = &pod.view;
            if !self.bound_here(view) {
                continue;
            }
            // Formatted only when asked for: the choice itself never reads them.
            let mut note = |text: &dyn Fn() -> String| {
                if want_notes {
                    notes.push(format!("{}{}", view.pod, text()));
                }
            };
            let assignment = match &pod.assignment {
                Some(Ok(a)) if a.node == self.node => {
                    if let Some(problem) = self.assignment_problem(pod) {
                        note(&|| format!(": {problem}"));
                        continue;
                    }
                    a
                }
                Some(Ok(a)) => {
                    note(&|| format!(" is assigned to node {}", a.node));
                    continue;
                }
                Some(Err(e)) => {
                    note(&|| format!(": {e}"));
                    continue;
                }
                None => {
                    let asks = want_notes
                        && PodRequest::from_spec(&view.spec, self.names, self.unit).map_or(true, |r| !r.is_empty());
                    if asks {
                        note(&|| format!(" has no {ASSIGNMENT_KEY} annotation"));
                    }
                    continue;
                }
            };
            let next = assignment.containers.iter().position(|c| !held.holds(&view.pod.uid, &c.name));
            if let Some(position) = next {
                let candidate = Candidate::at(pod, assignment, position, self.unit);
                if units.is_none_or(|u| usize::try_from(candidate.units).is_ok_and(|n| n == u)) {
                    out.push(candidate);
                }
            }
        }
        (out, notes)
    }

    /// A pod bound here whose assignment is unusable and one of whose containers, without a
    /// ledger row yet, asks for `units` devices: the container the kubelet is admitting, when
    /// no pod with a usable assignment waits for that many.
    pub(super) fn unusable_for(&self, pods: &[Arc<StoredPod>], held: &HeldRows, units: usize) -> Option<AllocError> {
        let per_unit = self.unit.mib_per_unit();
        pods.iter().find_map(|pod| {
            let view = &pod.view;
            if !self.bound_here(view) || matches!(&pod.assignment, Some(Ok(a)) if a.node != self.node) {
                return None;
            }
            let problem = self.assignment_problem(pod)?;
            let request = PodRequest::from_spec(&view.spec, self.names, self.unit).ok();
            let asks = request.is_none_or(|r| {
                r.containers()
                    .iter()
                    .any(|c| c.memory.get() / per_unit == units as u64 && !held.holds(&view.pod.uid, &c.name))
            });
            asks.then(|| AllocError::BadAssignment { pod: view.pod.to_string(), reason: problem.to_owned() })
        })
    }

    /// The container a request of `units` devices is for, as sure as `care` asks.
    pub(super) fn choose(
        &self,
        pods: &[Arc<StoredPod>],
        held: &HeldRows,
        admissions: &Admissions,
        units: usize,
        care: &Care,
    ) -> Result<Candidate, AllocError> {
        if units == 0 {
            return Err(AllocError::BadRequest(
                "the kubelet asked for 0 devices; a container that asks for GPU memory asks for at least one unit"
                    .into(),
            ));
        }
        let (mut fitting, _) = self.pending(pods, held, Some(units), false);
        if fitting.is_empty() && !care.confirmed {
            return Err(AllocError::Unconfirmed { pod: String::new() });
        }
        if fitting.is_empty()
            && let Some(e) = self.unusable_for(pods, held, units)
        {
            return Err(e);
        }
        let started = Started { held, admissions };
        if let KubeletSays::Listed(listing) = &care.kubelet {
            fitting.retain(|c| started.pod(&c.view().pod.uid) || listing.admitting(&c.view().pod, &c.container().name));
        }
        // Only the first in the kubelet's order is served, so it is found, not sorted for.
        let proposed = admissions.proposed();
        let order = |a: &Candidate, b: &Candidate| rank(a, admissions, &proposed).cmp(&rank(b, admissions, &proposed));
        let Some(first) = (0..fitting.len()).min_by(|&a, &b| order(&fitting[a], &fitting[b])) else {
            return Err(self.no_candidate(pods, held, units));
        };
        let top = &fitting[first];
        if !care.confirmed && !started.pod(&top.view().pod.uid) {
            return Err(AllocError::Unconfirmed { pod: top.view().pod.to_string() });
        }
        if admissions.is_doubtful(&top.view().pod.uid) {
            return Err(AllocError::Doubtful { pod: top.view().pod.to_string(), units, unit: self.unit });
        }
        // Asked or askable, the kubelet names even look-alikes on the same GPUs right.
        let any_placement = care.kubelet != KubeletSays::Unasked;
        if care.patient
            && let Some(other) = ambiguity(&started, top, &fitting, any_placement, order)
        {
            return Err(AllocError::Ambiguous {
                first: top.view().pod.to_string(),
                other: other.view().pod.to_string(),
                units,
                unit: self.unit,
            });
        }
        Ok(fitting.swap_remove(first))
    }

    /// Why no container waits for `units` devices: what does wait, and the pods that cannot be
    /// served.
    fn no_candidate(&self, pods: &[Arc<StoredPod>], held: &HeldRows, units: usize) -> AllocError {
        let (pending, notes) = self.pending(pods, held, None, true);
        let mut seen: Vec<String> = pending
            .iter()
            .map(|c| format!("{} container {:?} waits for {} {}", c.view().pod, c.container().name, c.units, self.unit))
            .collect();
        seen.extend(notes);
        let detail = if seen.is_empty() { String::new() } else { format!(" ({})", seen.join("; ")) };
        AllocError::NoCandidate {
            node: self.node.to_owned(),
            units,
            unit: self.unit,
            resource: self.names.memory.to_string(),
            detail,
            key: ASSIGNMENT_KEY,
        }
    }

    /// The candidate for a remembered proposal, if that container of `pod` still waits.
    pub(super) fn candidate_for(&self, pod: Arc<StoredPod>, owner: &Owner, held: &HeldRows) -> Option<Candidate> {
        let (pending, _) = self.pending(&[pod], held, None, false);
        pending.into_iter().find(|c| c.view().pod.uid == owner.uid && c.container().name == owner.container)
    }
}

/// Where a candidate stands in the kubelet's order, first lowest: the pod being admitted; then
/// containers without an outstanding proposal; then the oldest pod, the first its watch
/// delivered, and the name.
fn rank<'c>(
    c: &'c Candidate,
    admissions: &Admissions,
    proposed: &BTreeSet<(&str, &str)>,
) -> (bool, bool, &'c str, u64, &'c str, &'c str) {
    let view = c.view();
    (
        !admissions.is_admitting(&view.pod.uid),
        proposed.contains(&(view.pod.uid.as_str(), c.container().name.as_str())),
        &view.created,
        c.pod.arrival,
        &view.pod.namespace,
        &view.pod.name,
    )
}

/// Whether `top`, the first of `fitting` in the kubelet's `order` ([`Scope::choose`]), is a
/// guess: it has not started admission (no row, not the pod being admitted), and another pod
/// that has not either waits for as many units but is assigned differently (or at all, with
/// `any_placement`). Returns the first such other pod in that order.
fn ambiguity<'f>(
    started: &Started<'_>,
    top: &Candidate,
    fitting: &'f [Candidate],
    any_placement: bool,
    order: impl Fn(&Candidate, &Candidate) -> std::cmp::Ordering,
) -> Option<&'f Candidate> {
    let uid = top.view().pod.uid.as_str();
    if started.pod(uid) {
        return None;
    }
    fitting
        .iter()
        .filter(|c| {
            c.view().pod.uid != uid
                && !started.pod(&c.view().pod.uid)
                && (any_placement || !c.assignment.same_placement(&top.assignment))
        })
        .min_by(|a, b| order(a, b))
}

#[cfg(test)]
mod tests;
