//! Asking who the kubelet is admitting, for [`Plugin::waiting_for_the_pod`]: the kubelet's
//! PodResources `List` ([`Plugin::ask_kubelet`]) and the consistent reads of the node's pods it
//! narrows ([`Plugin::confirm`]), each timed into the call's [`Stages`].

use std::sync::Arc;
use std::time::Duration;

use super::Plugin;
use super::stages::{Stages, timed};
use crate::allocation::allocator::{Care, KubeletSays};
use crate::kubelet::pod_resources;

impl Plugin {
    /// Reads consistently what the pod store may lack for this call. Asked first, the kubelet
    /// names the pods it may be admitting: reading those alone (a `GET` each) is cheaper than
    /// reading every pod of the node not running yet, which is what happens when it cannot be
    /// asked, names many, or a `GET` settles nothing (the Node authorizer refusing a pod bound
    /// here moments ago). `guess` (`namespace/name`), the pod the store would serve, is read
    /// while the kubelet is asked: it is usually the one the kubelet names.
    pub(super) async fn confirm(
        &self,
        guess: &str,
        care: &mut Care,
        asked: &mut bool,
        stages: &mut Stages,
    ) -> Result<bool, String> {
        let mut guessed = None;
        // Whether the reads by name settle what they read: not once the API server would not
        // show the guess to this node (then the node's pods are read by list instead).
        let mut settling = true;
        if care.kubelet == KubeletSays::Askable {
            let guess = guess.split_once('/').map(|(ns, name)| (ns.to_owned(), name.to_owned()));
            let read_guess = async {
                match &guess {
                    Some(g) => Some(self.alloc.pods().confirm_named(vec![g.clone()]).await),
                    None => None,
                }
            };
            let ((kubelet, asking), (read, reading)) = tokio::join!(timed(self.ask_kubelet()), timed(read_guess));
            (stages.kubelet, stages.read) = (stages.kubelet + asking, stages.read + reading);
            care.kubelet = kubelet;
            *asked |= matches!(care.kubelet, KubeletSays::Listed(_));
            match read {
                Some(Ok(true)) => guessed = guess,
                Some(Ok(false)) => settling = false,
                _ => {}
            }
        }
        if let KubeletSays::Listed(listing) = &care.kubelet {
            let store = self.alloc.pods().snapshot();
            // A pod the store has without an assignment asks nothing of this daemon (the
            // extender binds with the assignment in the same update).
            let plain = |ns: &str, name: &str| {
                store.iter().any(|p| p.view.pod.namespace == ns && p.view.pod.name == name && p.assignment.is_none())
            };
            let named = listing.holding_nothing();
            let to_read: Vec<(String, String)> = named
                .iter()
                .filter(|(ns, name)| {
                    !plain(ns, name) && guessed.as_ref().is_none_or(|g| g != &(ns.clone(), name.clone()))
                })
                .cloned()
                .collect();
            if to_read.is_empty() && guessed.as_ref().is_some_and(|g| named.contains(g)) {
                return Ok(true);
            }
            if settling && !to_read.is_empty() && to_read.len() <= NAMED_READS {
                let (read, took) = timed(self.alloc.pods().confirm_named(to_read)).await;
                stages.read += took;
                if read != Ok(false) {
                    return read;
                }
            }
        }
        let (read, took) = timed(self.alloc.pods().confirm()).await;
        stages.read += took;
        read
    }

    /// Asks the kubelet's PodResources which pods it holds. A kubelet that cannot be asked
    /// turns the node back to look-alikes admitted one at a time (published), and the call
    /// goes on by the kubelet's order; one that is only busy (its rate limit) is asked again.
    pub(super) async fn ask_kubelet(&self) -> KubeletSays {
        let Some(client) = &self.pod_resources else { return KubeletSays::Unasked };
        for _ in 0..KUBELET_ASKS {
            match pod_resources::listing(client, KUBELET_TIMEOUT, self.alloc.resource(), &self.latest_list).await {
                Ok(listing) => return KubeletSays::Listed(Arc::new(listing)),
                Err(e) if e.is_busy() => {
                    tracing::debug!(error = %e, "the kubelet's PodResources is busy; asking again");
                    tokio::time::sleep(KUBELET_RETRY).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot ask the kubelet which pod it is admitting");
                    self.alloc.set_kubelet_answers(false);
                    return KubeletSays::Unasked;
                }
            }
        }
        KubeletSays::Unasked
    }
}

/// The most pods a call reads by name; more, and it reads the node's pods not running instead.
const NAMED_READS: usize = 16;

/// How long the kubelet's PodResources has to answer a call's question.
const KUBELET_TIMEOUT: Duration = Duration::from_secs(2);

/// How soon the kubelet is asked again when busy, or when its answer left a call ambiguous.
pub(super) const KUBELET_RETRY: Duration = Duration::from_millis(20);

/// How often a busy kubelet is asked before the call goes on by the kubelet's order.
const KUBELET_ASKS: u32 = 25;
