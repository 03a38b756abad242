//! Where the kubelet's admissions stand, as the allocator tracks them between calls: which
//! container each outstanding proposal is for, which pod the kubelet is admitting, and which
//! pods are in doubt. Every change is one [`Step`], applied by [`Admissions::apply`]; the
//! resolver only reads.
//!
//! A container's admission goes: proposed (`GetPreferredAllocation` named devices for it) →
//! allocated (`Allocate` committed its rows; its pod is now the one being admitted, until its
//! rows go or the kubelet restarts). A pod
//! whose rows the kubelet later offers as free is in doubt until it is allocated again or
//! released; a kubelet restart drops the proposals it never followed, and explains the rows
//! allocated before it that the new kubelet offers as free (it never recorded them): their pods
//! are not in doubt. Each restart starts a new kubelet generation: a call the dead kubelet made
//! and the daemon finishes only after the restart commits nothing.

use std::collections::{BTreeMap, BTreeSet};

/// Which container a proposal was made for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Owner {
    /// The pod's UID.
    pub uid: String,
    /// The container.
    pub container: String,
}

/// One change of the admissions under way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// `GetPreferredAllocation` proposed the devices of `key` for `owner`.
    Proposed {
        /// The device-set key ([`crate::allocation::ledger::request_key`]).
        key: String,
        /// The container.
        owner: Owner,
    },
    /// `Allocate` of the devices of `key` committed rows for a container of pod `uid`.
    Allocated {
        /// The device-set key.
        key: String,
        /// The pod.
        uid: String,
    },
    /// Rows of pod `uid` were released because the kubelet offered their devices as free: it
    /// may have admitted another pod with them, or freed them because the pod is gone while the
    /// pod watch has not said so yet.
    Offered {
        /// The pod.
        uid: String,
    },
    /// Every row of pod `uid` was released (deleted, finished, gone).
    Released {
        /// The pod.
        uid: String,
    },
    /// The kubelet restarted (at `at_ms`, Unix milliseconds): the admissions it had started are
    /// over.
    KubeletRestarted {
        /// When the daemon saw the new kubelet.
        at_ms: i64,
    },
}

/// The admissions under way on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Admissions {
    /// Proposals by device-set key, not yet followed by `Allocate`.
    proposals: BTreeMap<String, Owner>,
    /// Pods in doubt ([`Step::Offered`]): served again only once it is clear.
    doubtful: BTreeSet<String>,
    /// The pod the kubelet is admitting (the last one allocated).
    admitting: Option<String>,
    /// When the kubelet last restarted, Unix milliseconds.
    kubelet_restarted_at: Option<i64>,
    /// How many times the kubelet restarted: a call made by an earlier kubelet changes nothing.
    generation: u64,
}

impl Admissions {
    /// Applies `step`; returns how many proposals it dropped.
    pub(super) fn apply(&mut self, step: Step) -> usize {
        match step {
            Step::Proposed { key, owner } => {
                self.proposals.insert(key, owner);
                0
            }
            Step::Allocated { key, uid } => {
                let dropped = usize::from(self.proposals.remove(&key).is_some());
                self.doubtful.remove(&uid);
                self.admitting = Some(uid);
                dropped
            }
            Step::Offered { uid } => {
                self.not_admitting(&uid);
                self.doubtful.insert(uid);
                0
            }
            Step::Released { uid } => {
                self.not_admitting(&uid);
                self.doubtful.remove(&uid);
                0
            }
            Step::KubeletRestarted { at_ms } => {
                self.kubelet_restarted_at = Some(at_ms);
                self.generation += 1;
                self.admitting = None;
                std::mem::take(&mut self.proposals).len()
            }
        }
    }

    /// Pod `uid`, if it was the one being admitted, no longer is: its rows are gone, so its
    /// admission failed or ended, and taken for the pod being admitted it would be served
    /// before the pods the kubelet admits next.
    fn not_admitting(&mut self, uid: &str) {
        if self.admitting.as_deref() == Some(uid) {
            self.admitting = None;
        }
    }

    /// The container a proposal of `key` was made for.
    pub(super) fn owner(&self, key: &str) -> Option<&Owner> {
        self.proposals.get(key)
    }

    /// Whether a row allocated at `allocated_at_ms` came before the kubelet's last restart: the
    /// new kubelet never recorded it, so its offering the row's devices as free is explained.
    pub(super) fn before_kubelet_restart(&self, allocated_at_ms: i64) -> bool {
        self.kubelet_restarted_at.is_some_and(|at| allocated_at_ms < at)
    }

    /// Which kubelet is running: how many times it restarted.
    pub(super) fn kubelet_generation(&self) -> u64 {
        self.generation
    }

    /// Whether pod `uid` is in doubt.
    pub(super) fn is_doubtful(&self, uid: &str) -> bool {
        self.doubtful.contains(uid)
    }

    /// Whether pod `uid` is the one the kubelet is admitting.
    pub(super) fn is_admitting(&self, uid: &str) -> bool {
        self.admitting.as_deref() == Some(uid)
    }

    /// The (pod UID, container) pairs with an outstanding proposal.
    pub(super) fn proposed(&self) -> BTreeSet<(&str, &str)> {
        self.proposals.values().map(|o| (o.uid.as_str(), o.container.as_str())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(uid: &str, container: &str) -> Owner {
        Owner { uid: uid.into(), container: container.into() }
    }

    #[test]
    fn each_step_moves_the_admission_as_documented() {
        let mut a = Admissions::default();
        assert_eq!(a.apply(Step::Proposed { key: "k1".into(), owner: owner("p", "c") }), 0);
        assert_eq!(a.owner("k1"), Some(&owner("p", "c")));
        assert!(a.proposed().contains(&("p", "c")));
        assert!(!a.is_admitting("p"));

        // Allocated: the proposal is used up, the pod is being admitted and no longer in doubt.
        a.apply(Step::Offered { uid: "p".into() });
        assert!(a.is_doubtful("p"));
        assert_eq!(a.apply(Step::Allocated { key: "k1".into(), uid: "p".into() }), 1);
        assert_eq!(a.owner("k1"), None);
        assert!(a.is_admitting("p") && !a.is_doubtful("p"));

        // An allocation without a proposal still makes its pod the one being admitted.
        assert_eq!(a.apply(Step::Allocated { key: "k2".into(), uid: "q".into() }), 0);
        assert!(a.is_admitting("q") && !a.is_admitting("p"));

        // Released clears the doubt, nothing else.
        a.apply(Step::Offered { uid: "r".into() });
        a.apply(Step::Released { uid: "r".into() });
        assert!(!a.is_doubtful("r"));
        assert!(a.is_admitting("q"));

        // The pod being admitted is no longer once its rows go, offered as free or released.
        a.apply(Step::Offered { uid: "q".into() });
        assert!(!a.is_admitting("q") && a.is_doubtful("q"));
        a.apply(Step::Allocated { key: "k3".into(), uid: "s".into() });
        a.apply(Step::Released { uid: "s".into() });
        assert!(!a.is_admitting("s"));
    }

    #[test]
    fn a_kubelet_restart_drops_every_proposal_and_counts_them() {
        let mut a = Admissions::default();
        a.apply(Step::Proposed { key: "k1".into(), owner: owner("p", "c") });
        a.apply(Step::Proposed { key: "k2".into(), owner: owner("q", "c") });
        a.apply(Step::Offered { uid: "q".into() });
        assert!(!a.before_kubelet_restart(1_000), "no restart yet");
        a.apply(Step::Allocated { key: "k3".into(), uid: "p".into() });
        assert_eq!(a.kubelet_generation(), 0);
        assert_eq!(a.apply(Step::KubeletRestarted { at_ms: 2_000 }), 2);
        assert_eq!(a.kubelet_generation(), 1);
        // The new kubelet admits in its own order: the pod the old one was admitting is not first.
        assert!(!a.is_admitting("p"));
        assert!(a.proposed().is_empty());
        // Doubt survives: the pod watch, not the kubelet, settles it.
        assert!(a.is_doubtful("q"));
        assert_eq!(a.apply(Step::KubeletRestarted { at_ms: 3_000 }), 0);
        // Rows from before the last restart, not after it.
        assert!(a.before_kubelet_restart(2_999));
        assert!(!a.before_kubelet_restart(3_000));
    }
}
