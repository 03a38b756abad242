//! `preempt`: per candidate node, kube-scheduler's victims plus the further pods of lower
//! priority the GPUs need evicted, in the order kube-scheduler reads them.

use gpushare_core::PodRequest;
use gpushare_core::placement::{GpuPolicy, Placer};

use super::{Cluster, Extender, State};
use crate::view::ClusterView;
use crate::wire::{MetaPod, MetaVictims, PreemptionArgs, PreemptionResult};

/// One node's candidate victims: (node, victims as (UID, priority when known), PDB violations).
type Candidates = (String, Vec<(String, Option<i32>)>, i64);

impl<C: Cluster> Extender<C> {
    /// `preempt`: per candidate node, kube-scheduler's victims plus whatever further pods of
    /// lower priority than the preemptor the GPUs need, in decreasing priority.
    ///
    /// kube-scheduler's victims are kept, every one: it chose them for its own resources (CPU,
    /// memory, and the node's total of the memory resource, which the kubelet checks too).
    /// When evicting them does not make room on the GPUs, pods on the node with a lower priority
    /// than the preemptor that hold GPU memory are added, lowest priority (then largest) first,
    /// until the pod fits; any added pod not needed after all is given back, highest priority
    /// first. The list is sorted by decreasing priority, as kube-scheduler reads it (`Pods[0]` is
    /// the most important victim when it picks a node). A node where no such set makes room,
    /// or whose list would be empty, is left out: kube-scheduler abandons the whole preemption on
    /// an empty list. `NumPDBViolations` is kube-scheduler's, kept within 0 and the list's length.
    pub fn preempt(&self, args: &PreemptionArgs) -> PreemptionResult {
        let mut result = PreemptionResult::default();
        let mut s = self.state();
        let State { view, placer } = &mut *s;
        let Ok(request) = view.request_of(&args.pod) else { return result };
        let mut per_node: Vec<Candidates> = Vec::new();
        if let Some(meta) = &args.node_name_to_meta_victims {
            for (node, v) in meta {
                let victims = v.pods.iter().map(|p| (p.uid.clone(), view.pod(&p.uid).map(|e| e.priority))).collect();
                per_node.push((node.clone(), victims, v.num_pdb_violations));
            }
        } else if let Some(full) = &args.node_name_to_victims {
            for (node, v) in full {
                let victims = v.pods.iter().map(|p| (p.uid().to_owned(), Some(p.spec.priority.unwrap_or(0)))).collect();
                per_node.push((node.clone(), victims, v.num_pdb_violations));
            }
        }
        let me = args.pod.uid();
        let my_priority = args.pod.spec.priority.unwrap_or(0);
        for (node, victims, pdb) in per_node {
            let extra = if request.is_empty() {
                Vec::new()
            } else {
                match gpu_victims(view, placer, self.policies.gpu, &node, &request, me, my_priority, &victims) {
                    Some(extra) => extra,
                    None => {
                        tracing::debug!(%node, "preempt: no set of lower-priority pods makes room on its GPUs; node left out");
                        continue;
                    }
                }
            };
            // A victim the view does not know (it holds no GPU memory) ranks with the one before
            // it in kube-scheduler's list, which comes most important first.
            let mut last = i32::MAX;
            let mut all: Vec<(String, i32)> = victims
                .into_iter()
                .map(|(uid, prio)| {
                    last = prio.unwrap_or(last);
                    (uid, last)
                })
                .collect();
            all.extend(extra);
            if all.is_empty() {
                tracing::debug!(%node, "preempt: the pod needs no victim there; node left out");
                continue;
            }
            // Stable: kube-scheduler's own order is kept among equals.
            all.sort_by_key(|(_, prio)| std::cmp::Reverse(*prio));
            let count = i64::try_from(all.len()).unwrap_or(i64::MAX);
            let pods = all.into_iter().map(|(uid, _)| MetaPod { uid }).collect();
            result
                .node_name_to_meta_victims
                .insert(node, MetaVictims { pods, num_pdb_violations: pdb.clamp(0, count) });
        }
        result
    }
}

/// The pods beyond kube-scheduler's `victims` that `node`'s GPUs need evicted for `request`:
/// holders of GPU memory there with a priority below `below`, as few and as unimportant as do.
/// `None` when even all of them would not make room.
#[allow(clippy::too_many_arguments)] // one call site; the parts of one question
fn gpu_victims(
    view: &mut ClusterView,
    placer: &mut Placer,
    policy: GpuPolicy,
    node: &str,
    request: &PodRequest,
    me: &str,
    below: i32,
    victims: &[(String, Option<i32>)],
) -> Option<Vec<(String, i32)>> {
    let holders = view.usage(node).ok()?.pods.clone();
    let mut more: Vec<(String, i32, u64)> = holders
        .iter()
        .filter(|h| !h.assumed && h.uid != me && !victims.iter().any(|(v, _)| *v == h.uid))
        .filter_map(|h| {
            let held = h.mib.iter().map(|m| m.get()).sum::<u64>();
            let prio = view.pod(&h.uid)?.priority;
            (held > 0 && prio < below).then(|| (h.uid.clone(), prio, held))
        })
        .collect();
    more.sort_by_key(|(_, prio, held)| (*prio, std::cmp::Reverse(*held)));
    let fits = |view: &ClusterView, placer: &mut Placer, extra: &[&str]| {
        let mut uids: Vec<&str> = victims.iter().map(|(u, _)| u.as_str()).chain(extra.iter().copied()).collect();
        uids.push(me);
        let gone = view.evicted(&uids);
        view.place(placer, node, request, policy, &gone).is_ok()
    };
    let mut chosen: Vec<(&str, i32)> = Vec::new();
    let mut ok = fits(view, placer, &[]);
    for (uid, prio, _) in &more {
        if ok {
            break;
        }
        chosen.push((uid, *prio));
        ok = fits(view, placer, &chosen.iter().map(|(u, _)| *u).collect::<Vec<_>>());
    }
    if !ok {
        return None;
    }
    for i in (0..chosen.len()).rev() {
        let without: Vec<&str> = chosen.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, (u, _))| *u).collect();
        if fits(view, placer, &without) {
            chosen.remove(i);
        }
    }
    Some(chosen.into_iter().map(|(uid, prio)| (uid.to_owned(), prio)).collect())
}
