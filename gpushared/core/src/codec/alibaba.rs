//! Alibaba gpushare's names, for the compatibility setting: its resource names, the pod
//! annotations its extender writes at bind, and the environment its device plugin hands
//! containers. With the setting on, gpushare writes and reads these too, so workloads and the
//! tools around them keep working, and pods Alibaba's extender already placed are counted.
//!
//! Alibaba's `ALIYUN_COM_GPU_MEM_IDX` names the GPU by its `/dev/nvidiaN` minor number. Its
//! schema holds one GPU per pod, so only assignments whose containers all share one GPU can be
//! expressed ([`AlibabaAnnotations::from_assignment`] returns `None` otherwise).

use std::collections::BTreeMap;

use super::CodecError;
use super::assignment::Assignment;
use crate::inventory::NodeInventory;
use crate::request::PodRequest;
use crate::units::{MemoryUnit, Mib};

pub use crate::{ALIBABA_COUNT_RESOURCE as COUNT_RESOURCE, ALIBABA_MEMORY_RESOURCE as MEMORY_RESOURCE};

/// Pod annotation and env var: the GPU (minor number).
pub const IDX: &str = "ALIYUN_COM_GPU_MEM_IDX";
/// Pod annotation and env var: the GPU's total, in the unit.
pub const DEV: &str = "ALIYUN_COM_GPU_MEM_DEV";
/// Pod annotation and env var: the pod's total request, in the unit.
pub const POD: &str = "ALIYUN_COM_GPU_MEM_POD";
/// Env var: the container's request, in the unit.
pub const CONTAINER: &str = "ALIYUN_COM_GPU_MEM_CONTAINER";
/// Pod annotation: `"false"` at bind, `"true"` once allocated.
pub const ASSIGNED: &str = "ALIYUN_COM_GPU_MEM_ASSIGNED";
/// Pod annotation: bind time, Unix nanoseconds.
pub const ASSUME_TIME: &str = "ALIYUN_COM_GPU_MEM_ASSUME_TIME";

/// Alibaba's pod annotations, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlibabaAnnotations {
    /// The GPU's minor number.
    pub idx: u32,
    /// The GPU's total in the unit.
    pub dev: u64,
    /// The pod's total request in the unit.
    pub pod: u64,
    /// Whether the device plugin has allocated it.
    pub assigned: bool,
    /// Bind time, Unix nanoseconds.
    pub assume_time_ns: u64,
}

impl AlibabaAnnotations {
    /// Reads Alibaba's annotations from a pod's annotations; `Ok(None)` if the pod has none
    /// (no `ALIYUN_COM_GPU_MEM_IDX`).
    ///
    /// # Errors
    /// [`CodecError::Invalid`] naming the key whose value is not a number (or boolean).
    pub fn decode(annotations: &BTreeMap<String, String>) -> Result<Option<Self>, CodecError> {
        let Some(idx) = annotations.get(IDX) else { return Ok(None) };
        let number = |key: &'static str, value: Option<&String>| -> Result<u64, CodecError> {
            match value {
                None => Ok(0),
                Some(v) => v
                    .trim()
                    .parse()
                    .map_err(|_| CodecError::Invalid { key, reason: format!("{v:?} is not a whole number") }),
            }
        };
        let idx = u32::try_from(number(IDX, Some(idx))?)
            .map_err(|_| CodecError::Invalid { key: IDX, reason: format!("{idx:?} is too large") })?;
        let assigned = match annotations.get(ASSIGNED).map(|s| s.trim()) {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return Err(CodecError::Invalid {
                    key: ASSIGNED,
                    reason: format!("{other:?} is not \"true\" or \"false\""),
                });
            }
        };
        Ok(Some(AlibabaAnnotations {
            idx,
            dev: number(DEV, annotations.get(DEV))?,
            pod: number(POD, annotations.get(POD))?,
            assigned,
            assume_time_ns: number(ASSUME_TIME, annotations.get(ASSUME_TIME))?,
        }))
    }

    /// The annotations as key/value pairs.
    #[must_use]
    pub fn encode(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (IDX.to_owned(), self.idx.to_string()),
            (DEV.to_owned(), self.dev.to_string()),
            (POD.to_owned(), self.pod.to_string()),
            (ASSIGNED.to_owned(), self.assigned.to_string()),
            (ASSUME_TIME.to_owned(), self.assume_time_ns.to_string()),
        ])
    }

    /// Alibaba's view of one of our assignments, when it has one: every container on the same
    /// single GPU, and that GPU's minor number known.
    #[must_use]
    pub fn from_assignment(
        assignment: &Assignment,
        inventory: &NodeInventory,
        pod: &PodRequest,
        assume_time_ns: u64,
    ) -> Option<Self> {
        let mut uuids = assignment.containers.iter().flat_map(|c| c.gpus.iter().map(|g| &g.uuid));
        let first = uuids.next()?;
        if uuids.any(|u| u != first) {
            return None;
        }
        let gpu = inventory.gpus().iter().find(|g| &g.uuid == first)?;
        let unit = inventory.unit();
        Some(AlibabaAnnotations {
            idx: gpu.minor?,
            dev: unit.whole_units(gpu.total),
            pod: unit.whole_units(pod.long_running_memory()),
            assigned: false,
            assume_time_ns,
        })
    }

    /// Checks the annotations against the pod they are on: anyone who may write the pod may
    /// write them, so they count only as what Alibaba's extender would have written for its
    /// spec: a pod that asks for GPU memory, every container on one GPU (Alibaba places a pod
    /// on one), and no more units in `ALIYUN_COM_GPU_MEM_POD` than the pod's containers ask for
    /// in all.
    ///
    /// # Errors
    /// The first disagreement, as a sentence.
    pub fn check_against(&self, request: &PodRequest) -> Result<(), String> {
        if request.is_empty() {
            return Err("the pod asks for no GPU memory, yet carries Alibaba's placement annotations".to_owned());
        }
        if let Some(c) = request.containers().iter().find(|c| c.gpus != 1) {
            return Err(format!(
                "container {:?} asks for {} GPUs; Alibaba's extender places a pod on one GPU",
                c.name, c.gpus
            ));
        }
        let asked = request.containers().iter().fold(Mib::ZERO, |m, c| m.saturating_add(c.memory));
        let asked = request.unit().whole_units(asked);
        if self.pod > asked {
            return Err(format!("{POD} says {} units, the pod's containers ask for {asked} in all", self.pod));
        }
        Ok(())
    }

    /// Where a pod Alibaba's extender placed sits on `inventory`, and how much it holds: the
    /// GPU position whose minor number is `idx` (or whose index is, when the node reports no
    /// minor numbers) and `pod` units. `None` if no such GPU is on the node.
    #[must_use]
    pub fn usage(&self, inventory: &NodeInventory) -> Option<(usize, Mib)> {
        let gpus = inventory.gpus();
        let by_minor = gpus.iter().position(|g| g.minor == Some(self.idx));
        let by_index = || {
            if gpus.iter().all(|g| g.minor.is_none()) { gpus.iter().position(|g| g.index == self.idx) } else { None }
        };
        let position = by_minor.or_else(by_index)?;
        Some((position, unit_mib(inventory.unit(), self.pod)))
    }
}

fn unit_mib(unit: MemoryUnit, units: u64) -> Mib {
    unit.to_mib(units).unwrap_or(Mib::new(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::assignment::{ContainerAssignment, GpuShare};
    use crate::inventory::{Gpu, GpuUuid};
    use crate::request::{ContainerRequest, ContainerRole};

    fn inventory(minors: bool) -> NodeInventory {
        let gpus = (0..2)
            .map(|i| {
                let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "T4", Mib::new(16_276));
                g.minor = minors.then_some(i + 4);
                g
            })
            .collect();
        NodeInventory::new(MemoryUnit::Gib, gpus).unwrap()
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn decodes_what_alibabas_extender_writes() {
        let a = AlibabaAnnotations::decode(&map(&[
            (IDX, "5"),
            (DEV, "15"),
            (POD, "4"),
            (ASSIGNED, "true"),
            (ASSUME_TIME, "1700000000000000000"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(a.idx, 5);
        assert!(a.assigned);
        assert_eq!(AlibabaAnnotations::decode(&a.encode()).unwrap().unwrap(), a);
        // Minor 5 is position 1 on a node whose GPUs have minors 4 and 5.
        assert_eq!(a.usage(&inventory(true)), Some((1, Mib::new(4096))));
        // Without minors, IDX is read as the index.
        assert_eq!(AlibabaAnnotations { idx: 1, ..a.clone() }.usage(&inventory(false)), Some((1, Mib::new(4096))));
        assert_eq!(AlibabaAnnotations { idx: 9, ..a }.usage(&inventory(true)), None);
        assert_eq!(AlibabaAnnotations::decode(&map(&[("other", "1")])).unwrap(), None);
    }

    #[test]
    fn malformed_values_name_their_key() {
        for (pairs, key) in [
            (vec![(IDX, "one")], IDX),
            (vec![(IDX, "-1")], IDX),
            (vec![(IDX, "99999999999")], IDX),
            (vec![(IDX, "1"), (POD, "4.5")], POD),
            (vec![(IDX, "1"), (ASSIGNED, "yes")], ASSIGNED),
        ] {
            let err = AlibabaAnnotations::decode(&map(&pairs)).unwrap_err();
            assert!(err.to_string().starts_with(&format!("annotation {key}:")), "{err}");
        }
    }

    #[test]
    fn expresses_single_gpu_assignments_only() {
        let inv = inventory(true);
        let pod = PodRequest::new(
            MemoryUnit::Gib,
            vec![
                ContainerRequest::new("a", ContainerRole::App, Mib::new(2048), 1, MemoryUnit::Gib).unwrap(),
                ContainerRequest::new("b", ContainerRole::App, Mib::new(1024), 1, MemoryUnit::Gib).unwrap(),
            ],
        );
        let share =
            |i: u32, mib| GpuShare { index: i, uuid: GpuUuid::new(format!("GPU-{i}")).unwrap(), mib: Mib::new(mib) };
        let mut a = Assignment {
            node: "n".into(),
            unit: MemoryUnit::Gib,
            containers: vec![
                ContainerAssignment { name: "a".into(), role: ContainerRole::App, gpus: vec![share(1, 2048)] },
                ContainerAssignment { name: "b".into(), role: ContainerRole::App, gpus: vec![share(1, 1024)] },
            ],
        };
        let ali = AlibabaAnnotations::from_assignment(&a, &inv, &pod, 42).unwrap();
        assert_eq!((ali.idx, ali.dev, ali.pod, ali.assigned, ali.assume_time_ns), (5, 15, 3, false, 42));
        a.containers[1].gpus = vec![share(0, 1024)];
        assert_eq!(AlibabaAnnotations::from_assignment(&a, &inv, &pod, 42), None);
        assert_eq!(AlibabaAnnotations::from_assignment(&a, &inventory(false), &pod, 42), None);
    }

    #[test]
    fn annotations_count_only_as_what_the_spec_asks_for() {
        let request = |mib: u64, gpus: u32| {
            let c = ContainerRequest::new("main", ContainerRole::App, Mib::new(mib), gpus, MemoryUnit::Mib).unwrap();
            PodRequest::new(MemoryUnit::Mib, vec![c])
        };
        let a = |pod| AlibabaAnnotations { idx: 0, dev: 16384, pod, assigned: true, assume_time_ns: 1 };
        assert_eq!(a(3000).check_against(&request(3000, 1)), Ok(()));
        assert_eq!(a(2000).check_against(&request(3000, 1)), Ok(()));
        let e = a(16384).check_against(&request(3000, 1)).unwrap_err();
        assert!(e.contains("ALIYUN_COM_GPU_MEM_POD says 16384 units, the pod's containers ask for 3000"), "{e}");
        let e = a(3000).check_against(&request(3000, 2)).unwrap_err();
        assert!(e.contains("asks for 2 GPUs"), "{e}");
        let e = a(3000).check_against(&PodRequest::new(MemoryUnit::Mib, vec![])).unwrap_err();
        assert!(e.contains("asks for no GPU memory"), "{e}");
    }
}
