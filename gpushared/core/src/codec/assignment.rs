//! The assignment the extender writes on a pod at bind: schema version 1.
//!
//! ```json
//! {"v":1,"node":"gpu-node-a","unit":"MiB","containers":[
//!   {"name":"fetch","role":"init","gpus":[{"index":0,"uuid":"GPU-8f6e…","mib":1000}]},
//!   {"name":"main","gpus":[{"index":0,"uuid":"GPU-8f6e…","mib":3500}]}]}
//! ```
//!
//! Containers are listed init containers first, in spec order; `role` is `init`, `sidecar` or
//! (the default, omitted) `app`. GPUs carry both the UUID (authoritative: what the container
//! gets) and the index (for people and Alibaba's tools).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{CodecError, app_role, decode_versioned, encode_checked, is_app_role};
use crate::inventory::{GpuUuid, NodeInventory};
use crate::placement::{Placement, footprint};
use crate::request::{ContainerRole, PodRequest};
use crate::units::{MemoryUnit, Mib};

/// The pod annotation key.
pub const ASSIGNMENT_KEY: &str = "gpushare.io/assignment";
/// The schema version this build writes and reads.
pub const ASSIGNMENT_VERSION: u32 = 1;

/// Memory on one GPU for one container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuShare {
    /// NVML index.
    pub index: u32,
    /// NVML UUID.
    pub uuid: GpuUuid,
    /// Memory on this GPU.
    pub mib: Mib,
}

/// Where one container goes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerAssignment {
    /// Container name.
    pub name: String,
    /// How it runs.
    #[serde(default = "app_role", skip_serializing_if = "is_app_role")]
    pub role: ContainerRole,
    /// Its GPUs.
    pub gpus: Vec<GpuShare>,
}

/// A pod's placement on a node, as carried by the pod annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The node the pod is bound to.
    pub node: String,
    /// The unit the assignment was computed in.
    pub unit: MemoryUnit,
    /// Containers, init containers first.
    pub containers: Vec<ContainerAssignment>,
}

#[derive(Serialize, Deserialize)]
struct Wire {
    v: u32,
    node: String,
    unit: MemoryUnit,
    containers: Vec<ContainerAssignment>,
}

impl Assignment {
    /// The assignment for a placement computed on `inventory` for `pod`.
    #[must_use]
    pub fn from_placement(node: &str, inventory: &NodeInventory, pod: &PodRequest, placement: &Placement) -> Self {
        let containers = pod
            .containers()
            .iter()
            .enumerate()
            .map(|(i, c)| ContainerAssignment {
                name: c.name.clone(),
                role: c.role,
                gpus: placement
                    .shares()
                    .iter()
                    .filter(|s| s.container == i)
                    .filter_map(|s| {
                        inventory.gpus().get(s.gpu).map(|g| GpuShare {
                            index: g.index,
                            uuid: g.uuid.clone(),
                            mib: s.mib,
                        })
                    })
                    .collect(),
            })
            .collect();
        Assignment { node: node.to_owned(), unit: inventory.unit(), containers }
    }

    /// The container named `name`.
    #[must_use]
    pub fn container(&self, name: &str) -> Option<&ContainerAssignment> {
        self.containers.iter().find(|c| c.name == name)
    }

    /// What the pod occupies on each GPU, by UUID (the init-container rule of
    /// [`crate::placement`]).
    #[must_use]
    pub fn footprint(&self) -> BTreeMap<GpuUuid, Mib> {
        footprint(self.containers.iter().map(|c| (c.role, c.gpus.iter().map(|g| (g.uuid.clone(), g.mib)))))
    }

    /// The memory of the kubelet's first device request for this pod: its first container, in
    /// admission order (init containers and sidecars first), that has any; `None` if none has.
    /// Device-plugin calls carry only this count, which is all the daemon can tell pods apart by.
    #[must_use]
    pub fn first_request(&self) -> Option<Mib> {
        let init = self.containers.iter().filter(|c| c.role != ContainerRole::App);
        let app = self.containers.iter().filter(|c| c.role == ContainerRole::App);
        init.chain(app).map(|c| c.gpus.iter().fold(Mib::ZERO, |m, g| m.saturating_add(g.mib))).find(|m| *m > Mib::ZERO)
    }

    /// Whether `other` places its containers exactly as this one does, names left out: the same
    /// roles, GPUs and budgets in the same order. Two such pods get what they were assigned
    /// whichever of them the daemon serves first.
    #[must_use]
    pub fn same_placement(&self, other: &Assignment) -> bool {
        let gpus = |c: &ContainerAssignment| c.gpus.iter().map(|g| (g.uuid.clone(), g.mib)).collect::<Vec<_>>();
        self.containers.len() == other.containers.len()
            && self.containers.iter().zip(&other.containers).all(|(a, b)| a.role == b.role && gpus(a) == gpus(b))
    }

    /// The memory of each of the kubelet's device requests for this pod, one per container that
    /// has any: what the daemon tells a pod's containers apart by.
    #[must_use]
    pub fn request_sizes(&self) -> BTreeSet<Mib> {
        self.containers
            .iter()
            .map(|c| c.gpus.iter().fold(Mib::ZERO, |m, g| m.saturating_add(g.mib)))
            .filter(|m| *m > Mib::ZERO)
            .collect()
    }

    /// Whether the kubelet cannot tell `other` from this pod while they are placed differently:
    /// a container of each asks for the same memory ([`Self::request_sizes`]). The daemon serves
    /// a call for the next container without a ledger row of some pod; any container can be
    /// next (the first of a pod not admitted yet; a later one of a pod whose admission a kubelet
    /// restart cut short), so serving one in the other's place would hand it the other's GPUs.
    #[must_use]
    pub fn is_lookalike_of(&self, other: &Assignment) -> bool {
        !self.request_sizes().is_disjoint(&other.request_sizes()) && !self.same_placement(other)
    }

    /// Encodes the annotation value.
    ///
    /// # Errors
    /// [`CodecError::Invalid`] if the assignment breaks a schema rule (see [`Assignment::decode`]),
    /// [`CodecError::TooLarge`] if it is over Kubernetes' limit.
    pub fn encode(&self) -> Result<String, CodecError> {
        self.validate()?;
        encode_checked(
            ASSIGNMENT_KEY,
            &Wire {
                v: ASSIGNMENT_VERSION,
                node: self.node.clone(),
                unit: self.unit,
                containers: self.containers.clone(),
            },
        )
    }

    /// Decodes an annotation value.
    ///
    /// # Errors
    /// A [`CodecError`] for oversized, malformed or unknown-version values, and for values that
    /// name no node, repeat a container, give a container no GPU or the same GPU twice, or hold
    /// 0 MiB.
    pub fn decode(value: &str) -> Result<Self, CodecError> {
        let wire: Wire = decode_versioned(ASSIGNMENT_KEY, value, ASSIGNMENT_VERSION)?;
        let a = Assignment { node: wire.node, unit: wire.unit, containers: wire.containers };
        a.validate()?;
        Ok(a)
    }

    /// Checks the assignment against the pod it is on: every container it places is one of the
    /// pod's, with the same role and the memory the container asks for, on as many GPUs as it
    /// asks for with an equal share on each (the request's rule), and every container that asks
    /// for memory is placed. The kubelet admits the pod's containers by their spec, so an
    /// assignment that disagrees with it would book memory under the wrong container; and since
    /// anyone who may write the pod may write the annotation, one that grants more GPUs or
    /// another split than the spec asks for is a grant the pod's owner widened.
    ///
    /// # Errors
    /// The first disagreement, as a sentence naming the container.
    pub fn check_against(&self, request: &PodRequest) -> Result<(), String> {
        for c in &self.containers {
            let Some(want) = request.containers().iter().find(|r| r.name == c.name) else {
                return Err(format!(
                    "the assignment places container {:?}, which the pod does not have (or which asks for no GPU \
                     memory)",
                    c.name
                ));
            };
            if want.role != c.role {
                return Err(format!(
                    "the assignment places container {:?} as {}, the pod runs it as {}",
                    c.name,
                    role_name(c.role),
                    role_name(want.role)
                ));
            }
            let placed = c.gpus.iter().fold(Mib::ZERO, |m, g| m.saturating_add(g.mib));
            if placed != want.memory {
                return Err(format!(
                    "the assignment gives container {:?} {placed}, it asks for {}",
                    c.name, want.memory
                ));
            }
            if c.gpus.len() != usize::try_from(want.gpus).unwrap_or(usize::MAX) {
                return Err(format!(
                    "the assignment spreads container {:?} over {} GPU(s), it asks for {}",
                    c.name,
                    c.gpus.len(),
                    want.gpus
                ));
            }
            if let Some(g) = c.gpus.iter().find(|g| g.mib != want.per_gpu()) {
                return Err(format!(
                    "the assignment gives container {:?} {} on GPU {}, its request is an equal {} on each of its {} \
                     GPU(s)",
                    c.name,
                    g.mib,
                    g.uuid,
                    want.per_gpu(),
                    want.gpus
                ));
            }
        }
        if let Some(missing) = request.containers().iter().find(|r| self.container(&r.name).is_none()) {
            return Err(format!(
                "container {:?} asks for {} but the assignment does not place it",
                missing.name, missing.memory
            ));
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), CodecError> {
        if self.node.is_empty() {
            return Err(invalid("the node name is empty".into()));
        }
        let mut names = BTreeSet::new();
        for c in &self.containers {
            if c.name.is_empty() {
                return Err(invalid("a container has an empty name".into()));
            }
            if !names.insert(c.name.as_str()) {
                return Err(invalid(format!("container {:?} appears twice", c.name)));
            }
            if c.gpus.is_empty() {
                return Err(invalid(format!("container {:?} has no GPU", c.name)));
            }
            let mut seen = BTreeSet::new();
            for g in &c.gpus {
                if !seen.insert(&g.uuid) {
                    return Err(invalid(format!("container {:?} lists GPU {} twice", c.name, g.uuid)));
                }
                if g.mib == Mib::ZERO {
                    return Err(invalid(format!("container {:?} holds 0 MiB on GPU {}", c.name, g.uuid)));
                }
            }
        }
        Ok(())
    }
}

fn role_name(role: ContainerRole) -> &'static str {
    match role {
        ContainerRole::Init => "an init container",
        ContainerRole::Sidecar => "a sidecar",
        ContainerRole::App => "an app container",
    }
}

fn invalid(reason: String) -> CodecError {
    CodecError::Invalid { key: ASSIGNMENT_KEY, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(index: u32, mib: u64) -> GpuShare {
        GpuShare { index, uuid: GpuUuid::new(format!("GPU-{index}")).unwrap(), mib: Mib::new(mib) }
    }

    fn sample() -> Assignment {
        Assignment {
            node: "gpu-node-a".into(),
            unit: MemoryUnit::Mib,
            containers: vec![
                ContainerAssignment { name: "fetch".into(), role: ContainerRole::Init, gpus: vec![share(0, 5000)] },
                ContainerAssignment { name: "proxy".into(), role: ContainerRole::Sidecar, gpus: vec![share(0, 500)] },
                ContainerAssignment {
                    name: "main".into(),
                    role: ContainerRole::App,
                    gpus: vec![share(0, 2000), share(1, 2000)],
                },
            ],
        }
    }

    #[test]
    fn look_alikes_share_a_request_size_placed_differently() {
        let a = sample();
        // Init containers first: the kubelet asks for fetch's 5000 MiB before anything else.
        assert_eq!(a.first_request(), Some(Mib::new(5000)));
        let mut renamed = sample();
        renamed.containers[2].name = "server".into();
        assert!(a.same_placement(&renamed), "names do not matter");
        assert!(!a.is_lookalike_of(&renamed), "same placement: either may be served first");
        let mut elsewhere = sample();
        elsewhere.containers[0].gpus = vec![share(1, 5000)];
        assert!(!a.same_placement(&elsewhere));
        assert!(a.is_lookalike_of(&elsewhere));
        let mut other_size = elsewhere.clone();
        other_size.containers[0].gpus = vec![share(1, 4500)];
        other_size.containers[1].gpus = vec![share(1, 400)];
        other_size.containers[2].gpus = vec![share(1, 3000)];
        assert!(!a.is_lookalike_of(&other_size), "the kubelet's count tells them apart");
        // A later container the size of another's: either may be the next the kubelet asks for.
        let mut later = other_size.clone();
        later.containers[2].gpus = vec![share(1, 500)];
        assert_eq!(later.request_sizes(), [4500, 400, 500].map(Mib::new).into());
        assert!(a.is_lookalike_of(&later));
        let request = PodRequest::new(
            MemoryUnit::Mib,
            vec![
                crate::request::ContainerRequest::new("main", ContainerRole::App, Mib::new(4000), 2, MemoryUnit::Mib)
                    .unwrap(),
                crate::request::ContainerRequest::new("fetch", ContainerRole::Init, Mib::new(5000), 1, MemoryUnit::Mib)
                    .unwrap(),
            ],
        );
        assert_eq!(request.first_request(), Some(Mib::new(5000)));
        assert_eq!(request.request_sizes(), [4000, 5000].map(Mib::new).into());
    }

    #[test]
    fn round_trips_and_reads_as_documented() {
        let a = sample();
        let text = a.encode().unwrap();
        assert_eq!(
            text,
            r#"{"v":1,"node":"gpu-node-a","unit":"MiB","containers":[{"name":"fetch","role":"init","gpus":[{"index":0,"uuid":"GPU-0","mib":5000}]},{"name":"proxy","role":"sidecar","gpus":[{"index":0,"uuid":"GPU-0","mib":500}]},{"name":"main","gpus":[{"index":0,"uuid":"GPU-0","mib":2000},{"index":1,"uuid":"GPU-1","mib":2000}]}]}"#
        );
        assert_eq!(Assignment::decode(&text).unwrap(), a);
        assert_eq!(a.container("main").unwrap().gpus.len(), 2);
    }

    #[test]
    fn footprint_follows_the_init_rule() {
        // GPU0: init 5000 ran before the sidecar started -> max(5000, 500 + 2000) = 5000.
        let f = sample().footprint();
        assert_eq!(f[&GpuUuid::new("GPU-0").unwrap()], Mib::new(5000));
        assert_eq!(f[&GpuUuid::new("GPU-1").unwrap()], Mib::new(2000));
    }

    #[test]
    fn an_assignment_is_checked_against_its_pods_containers() {
        use crate::request::ContainerRequest;
        let req = |containers: &[(&str, ContainerRole, u64, u32)]| {
            let cs = containers
                .iter()
                .map(|(n, role, mib, k)| ContainerRequest::new(*n, *role, Mib::new(*mib), *k, MemoryUnit::Mib).unwrap())
                .collect();
            PodRequest::new(MemoryUnit::Mib, cs)
        };
        let pod = req(&[
            ("fetch", ContainerRole::Init, 5000, 1),
            ("proxy", ContainerRole::Sidecar, 500, 1),
            ("main", ContainerRole::App, 4000, 2),
        ]);
        assert_eq!(sample().check_against(&pod), Ok(()));
        let cases: &[(PodRequest, &str)] = &[
            (
                req(&[("fetch", ContainerRole::Init, 5000, 1), ("proxy", ContainerRole::Sidecar, 500, 1)]),
                "places container \"main\", which the pod does not have",
            ),
            (
                req(&[
                    ("fetch", ContainerRole::App, 5000, 1),
                    ("proxy", ContainerRole::Sidecar, 500, 1),
                    ("main", ContainerRole::App, 4000, 2),
                ]),
                "places container \"fetch\" as an init container, the pod runs it as an app container",
            ),
            (
                req(&[
                    ("fetch", ContainerRole::Init, 5000, 1),
                    ("proxy", ContainerRole::Sidecar, 500, 1),
                    ("main", ContainerRole::App, 6000, 2),
                ]),
                "gives container \"main\" 4000 MiB, it asks for 6000 MiB",
            ),
            (
                req(&[
                    ("fetch", ContainerRole::Init, 5000, 1),
                    ("proxy", ContainerRole::Sidecar, 500, 1),
                    ("main", ContainerRole::App, 4000, 2),
                    ("extra", ContainerRole::App, 100, 1),
                ]),
                "container \"extra\" asks for 100 MiB but the assignment does not place it",
            ),
            // A grant its owner widened: the same memory, on more GPUs than asked for.
            (
                req(&[
                    ("fetch", ContainerRole::Init, 5000, 1),
                    ("proxy", ContainerRole::Sidecar, 500, 1),
                    ("main", ContainerRole::App, 4000, 1),
                ]),
                "spreads container \"main\" over 2 GPU(s), it asks for 1",
            ),
        ];
        for (pod, want) in cases {
            let err = sample().check_against(pod).unwrap_err();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn an_uneven_split_of_an_even_request_is_refused() {
        use crate::request::ContainerRequest;
        let main = |k| ContainerRequest::new("main", ContainerRole::App, Mib::new(4000), k, MemoryUnit::Mib).unwrap();
        let pod = PodRequest::new(
            MemoryUnit::Mib,
            vec![
                ContainerRequest::new("fetch", ContainerRole::Init, Mib::new(5000), 1, MemoryUnit::Mib).unwrap(),
                ContainerRequest::new("proxy", ContainerRole::Sidecar, Mib::new(500), 1, MemoryUnit::Mib).unwrap(),
                main(2),
            ],
        );
        let mut sliver = sample();
        sliver.containers[2].gpus = vec![share(0, 100), share(1, 3900)];
        let err = sliver.check_against(&pod).unwrap_err();
        assert!(
            err.contains("gives container \"main\" 100 MiB on GPU GPU-0, its request is an equal 2000 MiB"),
            "{err}"
        );
        assert_eq!(sample().check_against(&pod), Ok(()));
    }

    #[test]
    fn bad_values_are_errors_not_panics() {
        let cases: &[(&str, &str)] = &[
            ("{", "malformed"),
            (r#"{"v":0}"#, "schema version 0 is not supported"),
            (r#"{"v":1,"node":"n","unit":"MiB"}"#, "malformed"),
            (r#"{"v":1,"node":"","unit":"MiB","containers":[]}"#, "node name is empty"),
            (r#"{"v":1,"node":"n","unit":"MiB","containers":[{"name":"a","gpus":[]}]}"#, "has no GPU"),
            (
                r#"{"v":1,"node":"n","unit":"MiB","containers":[{"name":"a","gpus":[{"index":0,"uuid":"g","mib":1}]},{"name":"a","gpus":[{"index":0,"uuid":"g","mib":1}]}]}"#,
                "appears twice",
            ),
            (
                r#"{"v":1,"node":"n","unit":"MiB","containers":[{"name":"a","gpus":[{"index":0,"uuid":"g","mib":1},{"index":1,"uuid":"g","mib":1}]}]}"#,
                "lists GPU g twice",
            ),
            (
                r#"{"v":1,"node":"n","unit":"MiB","containers":[{"name":"a","gpus":[{"index":0,"uuid":"g","mib":0}]}]}"#,
                "holds 0 MiB",
            ),
            (r#"{"v":1,"node":"n","unit":"MiB","containers":[{"name":"a","role":"boss","gpus":[]}]}"#, "malformed"),
            (
                r#"{"v":1,"node":"n","unit":"MiB","containers":[{"name":"a","gpus":[{"index":-1,"uuid":"g","mib":1}]}]}"#,
                "malformed",
            ),
        ];
        for (text, want) in cases {
            let err = Assignment::decode(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
        let mut a = sample();
        a.containers[0].gpus.clear();
        assert!(a.encode().is_err());
    }
}
