//! Reconciliation as the allocation service applies it: the plan ([`crate::allocation::reconcile::plan`])
//! made from the ledger, the kubelet's PodResources answer and the pods bound here, then each
//! repair written to the ledger and its history.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpushare_core::codec::node::PodRef;
use gpushare_core::{ContainerRole, Mib};

use super::held::Held;
use super::room::check_room;
use super::{AllocError, Allocator, State};
use crate::allocation::ledger::{EventKind, NewRow};
use crate::allocation::reconcile::{HeldSets, Kept, KnownPod, KubeletView, Plan, Repair};

impl Allocator {
    /// Makes the ledger agree with the kubelet's PodResources answer (see [`crate::allocation::reconcile`]);
    /// rows younger than `grace_ms` are not released. Call it only once the pod store has
    /// synced ([`crate::allocation::pods::PodStore::is_synced`]): a pod missing from it must mean the pod is gone. Every repair is logged and recorded in
    /// the history. Returns the repairs made, and when a row kept only by its grace period
    /// leaves it ([`Plan::recheck_at_ms`]). A round the rows in memory prove quiet
    /// ([`crate::allocation::reconcile::agrees`]) reads nothing from the ledger.
    ///
    /// # Errors
    /// [`AllocError::Ledger`] if the ledger cannot be read or written; repairs before the
    /// failure are kept.
    pub fn reconcile(&self, kubelet: &KubeletView, grace_ms: i64) -> Result<(Vec<Repair>, Option<i64>), AllocError> {
        let now_ms = crate::allocation::ledger::now_ms();
        {
            // Most rounds find nothing to repair: proven from the rows in memory, the ledger
            // is not read. The kubelet's sets are hashed before the lock is taken.
            let sets = HeldSets::of(kubelet);
            let state = self.lock();
            let kept = state.held.iter().map(|h| Kept {
                id: h.id,
                pod: &h.pod,
                container: &h.container,
                key_hash: h.key_hash,
                allocated_at: h.allocated_at,
            });
            if let Some(recheck_at_ms) = crate::allocation::reconcile::agrees(kept, &sets, now_ms, grace_ms) {
                return Ok((Vec::new(), recheck_at_ms));
            }
        }
        let pods = self.pods.snapshot();
        let known = |ns: &str, name: &str, container: &str| {
            let p = pods
                .iter()
                .filter(|p| p.view.pod.namespace == ns && p.view.pod.name == name)
                .min_by_key(|p| p.view.terminal)?;
            let role = match &p.assignment {
                Some(Ok(a)) => a.containers.iter().find(|c| c.name == container).map(|c| c.role),
                _ => None,
            };
            Some(KnownPod {
                pod: p.view.pod.clone(),
                role: role.unwrap_or(ContainerRole::App),
                finished: p.view.terminal,
            })
        };
        let running = |uid: &str| {
            pods.iter().any(|p| {
                p.view.pod.uid == uid && !p.view.terminal && p.view.node.as_deref() == Some(self.node.as_str())
            })
        };
        let mut state = self.lock();
        let live = state.ledger.live()?;
        let Plan { repairs, recheck_at_ms } =
            crate::allocation::reconcile::plan(&live, kubelet, known, running, now_ms, grace_ms);
        let mut done = Vec::with_capacity(repairs.len());
        for repair in repairs {
            match &repair {
                Repair::Release { rows, pod, container, reason } => {
                    state.ledger.release_rows(rows, reason)?;
                    state.held.remove_where(|h| rows.contains(&h.id));
                    let detail = format!("released {pod} container {container:?}: {reason}");
                    tracing::warn!(pod = %pod, container = %container, %reason, "reconcile: released");
                    state.ledger.record_event(EventKind::Reconcile, &detail)?;
                }
                Repair::Adopt { pod, container, role, device_ids, reason } => {
                    match self.adopt(&mut state, pod, container, *role, device_ids) {
                        Ok(gpus) => {
                            let detail = format!("adopted {gpus} for {pod} container {container:?}: {reason}");
                            tracing::warn!(pod = %pod, container = %container, %gpus, "reconcile: adopted");
                            state.ledger.record_event(EventKind::Reconcile, &detail)?;
                        }
                        Err(AllocError::Ledger(e)) => return Err(AllocError::Ledger(e)),
                        Err(e) => {
                            tracing::error!(pod = %pod, container = %container, error = %e, "reconcile: cannot adopt what the kubelet holds");
                            state.ledger.record_event(
                                EventKind::Reconcile,
                                &format!("could not adopt {pod} container {container:?}: {e}"),
                            )?;
                            continue;
                        }
                    }
                }
                Repair::Unknown { holding } => {
                    tracing::warn!(
                        pod = %format!("{}/{}", holding.namespace, holding.name),
                        container = %holding.container,
                        devices = holding.device_ids.len(),
                        "reconcile: the kubelet holds devices for a pod not bound to this node as far as gpushared knows"
                    );
                    continue;
                }
            }
            done.push(repair);
        }
        drop(state);
        if !done.is_empty() {
            self.changed();
        }
        Ok((done, recheck_at_ms))
    }

    /// Records `device_ids` as held by `pod`'s `container`; returns the GPUs, for the history.
    fn adopt(
        &self,
        state: &mut State,
        pod: &PodRef,
        container: &str,
        role: ContainerRole,
        device_ids: &[String],
    ) -> Result<String, AllocError> {
        let unit = self.inventory.unit().mib_per_unit();
        let mut per_gpu: BTreeMap<usize, u64> = BTreeMap::new();
        for id in device_ids {
            let (pos, _) = self.devices.resolve(id).ok_or_else(|| AllocError::UnknownDevice(id.clone()))?;
            *per_gpu.entry(pos).or_default() += unit;
        }
        let rows: Vec<NewRow> = per_gpu
            .iter()
            .filter_map(|(&pos, &mib)| {
                let g = state.inventory.gpus().get(pos)?;
                Some(NewRow {
                    pod: pod.clone(),
                    container: container.to_owned(),
                    role,
                    gpu_uuid: g.uuid.clone(),
                    gpu_index: g.index,
                    mib: Mib::new(mib),
                    device_ids: device_ids.to_vec(),
                })
            })
            .collect();
        check_room(&self.inventory, &state.held, &state.claims, &rows, &pod.to_string())?;
        let written = state.ledger.allocate(&rows)?;
        state.held.extend(written.iter().map(|r| Arc::new(Held::from(r))));
        Ok(rows.iter().map(|r| format!("GPU{} {} MiB", r.gpu_index, r.mib.get())).collect::<Vec<_>>().join(", "))
    }
}
