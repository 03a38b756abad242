//! What a pod asks for: each container's and init container's GPU memory and GPU count, read
//! from the pod spec under configurable resource names, validated with reasons a user can act on.
//!
//! The pod model here is the small part of a Kubernetes `PodSpec` that matters to gpushare,
//! deserializable from the API server's JSON (unknown fields ignored, `null` lists accepted)
//! and from hand-written manifests (quantities as numbers or strings).
//!
//! Rules (see `docs/requests.md`):
//! - memory is `<memory-resource>: N`, N in the cluster unit; limits win, requests must match;
//! - the count is `<count-resource>: K` (default 1); N is spread evenly, so N must divide by K;
//! - quantities must be whole: `"4k"` is 4000, but `"1.5"`, `"500m"` and negatives are refused,
//!   and binary suffixes (`"4Gi"`) are refused with the number the user most likely meant;
//! - restartable init containers (`restartPolicy: Always`) are sidecars and run beside the app.
//!
//! The resource names themselves, and which a cluster uses, are in `names`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::inventory::NodeInventory;
use crate::units::{MemoryUnit, Mib, QuantityError, parse_quantity};

mod names;

pub use names::{Compatibility, InvalidResourceName, ResourceName, ResourceNames};

/// A quantity as written in a manifest: the API server sends strings, hand-written YAML may
/// have plain numbers. Kept as text and parsed by [`parse_quantity`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct QuantityText(pub String);

impl<'de> Deserialize<'de> for QuantityText {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Int(i64),
            Uint(u64),
            Float(f64),
        }
        Ok(QuantityText(match Raw::deserialize(d)? {
            Raw::Text(s) => s,
            Raw::Int(i) => i.to_string(),
            Raw::Uint(u) => u.to_string(),
            Raw::Float(f) => f.to_string(),
        }))
    }
}

/// For `#[serde(deserialize_with = ...)]`: a field Go wrote as `null` (a nil slice or map) reads
/// as its default, as an absent one does. Shared by every reader of Kubernetes' JSON.
///
/// # Errors
/// The deserializer's error for a value of the wrong type.
pub fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A container's resource limits and requests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    /// `resources.limits`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub limits: BTreeMap<String, QuantityText>,
    /// `resources.requests`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub requests: BTreeMap<String, QuantityText>,
}

/// The part of a Kubernetes container gpushare reads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    /// Container name, unique within the pod.
    #[serde(default)]
    pub name: String,
    /// Its resources.
    #[serde(default, deserialize_with = "null_as_default")]
    pub resources: Resources,
    /// `Always` on an init container makes it a sidecar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<String>,
}

/// The part of a Kubernetes `PodSpec` gpushare reads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    /// `spec.containers`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub containers: Vec<Container>,
    /// `spec.initContainers`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub init_containers: Vec<Container>,
}

/// How a container runs within its pod, which decides how its memory is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContainerRole {
    /// An init container: runs alone, to completion, before the app containers.
    Init,
    /// A restartable init container: starts in init order and keeps running beside the app.
    Sidecar,
    /// A regular container.
    App,
}

impl ContainerRole {
    /// True for roles that run for the pod's lifetime (app containers and sidecars).
    #[must_use]
    pub fn is_long_running(self) -> bool {
        !matches!(self, ContainerRole::Init)
    }
}

/// One container's validated GPU request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerRequest {
    /// The container's name.
    pub name: String,
    /// How it runs.
    pub role: ContainerRole,
    /// Its whole memory request in MiB (over all its GPUs).
    pub memory: Mib,
    /// How many distinct GPUs the memory is spread over (at least 1).
    pub gpus: u32,
    per_gpu: Mib,
}

impl ContainerRequest {
    /// Builds a request, checking that `memory` spreads evenly over `gpus` whole units.
    ///
    /// # Errors
    /// [`RequestError::ZeroMemory`], [`RequestError::ZeroCount`] or [`RequestError::NotDivisible`].
    pub fn new(
        name: impl Into<String>,
        role: ContainerRole,
        memory: Mib,
        gpus: u32,
        unit: MemoryUnit,
    ) -> Result<Self, RequestError> {
        let name = name.into();
        if memory == Mib::ZERO {
            return Err(RequestError::ZeroMemory { container: name });
        }
        if gpus == 0 {
            return Err(RequestError::ZeroCount { container: name });
        }
        let units = unit.whole_units(memory);
        let per_gpu = if units.is_multiple_of(u64::from(gpus)) && unit.round_down(memory) == memory {
            memory.div_exact(u64::from(gpus))
        } else {
            None
        };
        let Some(per_gpu) = per_gpu else {
            return Err(RequestError::NotDivisible { container: name, units, unit, gpus });
        };
        Ok(ContainerRequest { name, role, memory, gpus, per_gpu })
    }

    /// The memory it needs on each of its GPUs.
    #[must_use]
    pub fn per_gpu(&self) -> Mib {
        self.per_gpu
    }
}

/// A whole pod's GPU request: the containers that ask for GPU memory, init containers first
/// in spec order, then app containers in spec order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRequest {
    unit: MemoryUnit,
    containers: Vec<ContainerRequest>,
}

impl PodRequest {
    /// A request made of already validated containers (init containers first), counted in
    /// `unit`.
    #[must_use]
    pub fn new(unit: MemoryUnit, containers: Vec<ContainerRequest>) -> Self {
        PodRequest { unit, containers }
    }

    /// The cluster unit the request was read in; only nodes advertising that unit can take it.
    #[must_use]
    pub fn unit(&self) -> MemoryUnit {
        self.unit
    }

    /// Reads and validates the GPU request of a pod spec. A pod that asks for no GPU memory
    /// gives an empty request.
    ///
    /// # Errors
    /// The first [`RequestError`] found, naming the container and the resource.
    pub fn from_spec(spec: &PodSpec, names: &ResourceNames, unit: MemoryUnit) -> Result<Self, RequestError> {
        let init = spec.init_containers.iter().map(|c| {
            let role = if c.restart_policy.as_deref() == Some("Always") {
                ContainerRole::Sidecar
            } else {
                ContainerRole::Init
            };
            (c, role)
        });
        let app = spec.containers.iter().map(|c| (c, ContainerRole::App));
        let mut containers = Vec::new();
        for (c, role) in init.chain(app) {
            if let Some(req) = container_request(c, role, names, unit)? {
                containers.push(req);
            }
        }
        Ok(PodRequest { unit, containers })
    }

    /// The containers that ask for GPU memory.
    #[must_use]
    pub fn containers(&self) -> &[ContainerRequest] {
        &self.containers
    }

    /// [`Assignment::first_request`](crate::codec::assignment::Assignment::first_request) of
    /// this pod before it is placed.
    #[must_use]
    pub fn first_request(&self) -> Option<Mib> {
        let init = self.containers.iter().filter(|c| c.role != ContainerRole::App);
        let app = self.containers.iter().filter(|c| c.role == ContainerRole::App);
        init.chain(app).map(|c| c.memory).find(|m| *m > Mib::ZERO)
    }

    /// [`Assignment::request_sizes`](crate::codec::assignment::Assignment::request_sizes) of
    /// this pod before it is placed.
    #[must_use]
    pub fn request_sizes(&self) -> std::collections::BTreeSet<Mib> {
        self.containers.iter().map(|c| c.memory).filter(|m| *m > Mib::ZERO).collect()
    }

    /// True if no container asks for GPU memory.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    /// Memory of the long-running containers (app and sidecars), the figure Alibaba's
    /// `ALIYUN_COM_GPU_MEM_POD` carries.
    #[must_use]
    pub fn long_running_memory(&self) -> Mib {
        self.containers.iter().filter(|c| c.role.is_long_running()).map(|c| c.memory).sum()
    }

    /// Checks the request against what the cluster could ever offer.
    ///
    /// # Errors
    /// [`RequestError::TooManyGpus`] or [`RequestError::ShareTooLarge`] for the first container
    /// that no node could hold even when empty.
    pub fn check_feasible(&self, limits: &ClusterLimits) -> Result<(), RequestError> {
        for c in &self.containers {
            if c.gpus > limits.max_gpus_per_node {
                return Err(RequestError::TooManyGpus {
                    container: c.name.clone(),
                    gpus: c.gpus,
                    max: limits.max_gpus_per_node,
                });
            }
            if c.per_gpu > limits.largest_gpu {
                return Err(RequestError::ShareTooLarge {
                    container: c.name.clone(),
                    per_gpu: c.per_gpu,
                    largest: limits.largest_gpu,
                });
            }
        }
        Ok(())
    }
}

/// The most any node of the cluster offers, for [`PodRequest::check_feasible`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterLimits {
    /// The most GPUs any node has.
    pub max_gpus_per_node: u32,
    /// The largest capacity of any single GPU (rounded down to the node's unit).
    pub largest_gpu: Mib,
}

impl ClusterLimits {
    /// The limits of a set of nodes, counting every GPU whatever its health (health passes;
    /// a request that fits a sick GPU is not invalid).
    #[must_use]
    pub fn of<'a>(nodes: impl IntoIterator<Item = &'a NodeInventory>) -> Self {
        nodes.into_iter().fold(ClusterLimits::default(), |acc, n| ClusterLimits {
            max_gpus_per_node: acc.max_gpus_per_node.max(u32::try_from(n.gpus().len()).unwrap_or(u32::MAX)),
            largest_gpu: n.gpus().iter().map(|g| g.capacity(n.unit())).fold(acc.largest_gpu, Mib::max),
        })
    }
}

/// Why a pod's GPU request is refused. Every message names the container and says what to write.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RequestError {
    /// A quantity that is not a whole non-negative number.
    #[error("container {container:?}: {resource} {value:?}: {source}; write a whole number such as \"3500\"")]
    InvalidQuantity {
        /// Container name.
        container: String,
        /// Resource name.
        resource: String,
        /// The quantity as written.
        value: String,
        /// What is wrong.
        source: QuantityError,
    },
    /// A binary suffix (`4Gi`) multiplies by 2^30: the user almost surely meant a memory size.
    #[error(
        "container {container:?}: {resource} {value:?} counts {units} {unit} because the binary suffix multiplies; \
         {resource} is counted in {unit}: {hint}"
    )]
    BinarySuffix {
        /// Container name.
        container: String,
        /// Resource name.
        resource: String,
        /// The quantity as written.
        value: String,
        /// What it literally counts.
        units: u64,
        /// The cluster unit.
        unit: MemoryUnit,
        /// What to write instead.
        hint: String,
    },
    /// `limits` and `requests` disagree (the API server refuses this for extended resources).
    #[error(
        "container {container:?}: {resource} limit {limit:?} differs from its request {request:?}; \
         extended resources need equal limit and request, so set only the limit"
    )]
    LimitRequestMismatch {
        /// Container name.
        container: String,
        /// Resource name.
        resource: String,
        /// The limit as written.
        limit: String,
        /// The request as written.
        request: String,
    },
    /// Zero memory.
    #[error("container {container:?} asks for 0 GPU memory; remove the resource or ask for at least 1 unit")]
    ZeroMemory {
        /// Container name.
        container: String,
    },
    /// Zero GPUs.
    #[error("container {container:?} asks for 0 GPUs; remove the count (default 1) or ask for at least 1")]
    ZeroCount {
        /// Container name.
        container: String,
    },
    /// A GPU count with no memory to spread.
    #[error(
        "container {container:?} sets {count_resource} but not {memory_resource}; \
         the count spreads the memory request, so add {memory_resource}"
    )]
    CountWithoutMemory {
        /// Container name.
        container: String,
        /// The count resource.
        count_resource: String,
        /// The memory resource.
        memory_resource: String,
    },
    /// Memory that does not split evenly over the GPUs in whole units.
    #[error(
        "container {container:?}: {units} {unit} does not split evenly over {gpus} GPUs; \
         ask for a multiple of {gpus} {unit}"
    )]
    NotDivisible {
        /// Container name.
        container: String,
        /// The memory in units.
        units: u64,
        /// The cluster unit.
        unit: MemoryUnit,
        /// The GPU count.
        gpus: u32,
    },
    /// More GPUs than any node has.
    #[error("container {container:?} asks for {gpus} GPUs, but no node has more than {max}; lower the GPU count")]
    TooManyGpus {
        /// Container name.
        container: String,
        /// Requested count.
        gpus: u32,
        /// The most GPUs on any node.
        max: u32,
    },
    /// A per-GPU share larger than the largest GPU.
    #[error(
        "container {container:?} needs {per_gpu} on each GPU, but the largest GPU in the cluster offers {largest}; \
         ask for less memory or spread it over more GPUs"
    )]
    ShareTooLarge {
        /// Container name.
        container: String,
        /// Memory per GPU.
        per_gpu: Mib,
        /// The largest GPU's capacity.
        largest: Mib,
    },
}

/// Reads one resource of a container: the limit, else the request; both must agree.
fn read_resource(c: &Container, resource: &ResourceName) -> Result<Option<String>, RequestError> {
    let limit = c.resources.limits.get(resource.as_str());
    let request = c.resources.requests.get(resource.as_str());
    match (limit, request) {
        (Some(l), Some(r)) => {
            let same = match (parse_quantity(&l.0), parse_quantity(&r.0)) {
                (Ok(a), Ok(b)) => a == b,
                _ => l == r,
            };
            if same {
                Ok(Some(l.0.clone()))
            } else {
                Err(RequestError::LimitRequestMismatch {
                    container: c.name.clone(),
                    resource: resource.to_string(),
                    limit: l.0.clone(),
                    request: r.0.clone(),
                })
            }
        }
        (Some(v), None) | (None, Some(v)) => Ok(Some(v.0.clone())),
        (None, None) => Ok(None),
    }
}

fn whole(c: &Container, resource: &ResourceName, value: &str, unit: MemoryUnit) -> Result<u64, RequestError> {
    let q = parse_quantity(value).map_err(|source| RequestError::InvalidQuantity {
        container: c.name.clone(),
        resource: resource.to_string(),
        value: value.to_owned(),
        source,
    })?;
    if q.binary_suffix {
        // "4Gi" was almost surely meant as bytes of memory: suggest that many units.
        let bytes_per_unit = unit.mib_per_unit() << 20;
        let hint = if q.value % bytes_per_unit == 0 {
            format!("write \"{}\"", q.value / bytes_per_unit)
        } else {
            format!("write a plain number of {unit}")
        };
        return Err(RequestError::BinarySuffix {
            container: c.name.clone(),
            resource: resource.to_string(),
            value: value.to_owned(),
            units: q.value,
            unit,
            hint,
        });
    }
    Ok(q.value)
}

fn container_request(
    c: &Container,
    role: ContainerRole,
    names: &ResourceNames,
    unit: MemoryUnit,
) -> Result<Option<ContainerRequest>, RequestError> {
    let memory = read_resource(c, &names.memory)?;
    let count = read_resource(c, &names.count)?;
    let Some(memory) = memory else {
        return match count {
            Some(_) => Err(RequestError::CountWithoutMemory {
                container: c.name.clone(),
                count_resource: names.count.to_string(),
                memory_resource: names.memory.to_string(),
            }),
            None => Ok(None),
        };
    };
    let units = whole(c, &names.memory, &memory, unit)?;
    let gpus = match &count {
        Some(text) => {
            let n = whole(c, &names.count, text, unit)?;
            u32::try_from(n).map_err(|_| RequestError::InvalidQuantity {
                container: c.name.clone(),
                resource: names.count.to_string(),
                value: text.clone(),
                source: QuantityError::TooLarge(text.clone()),
            })?
        }
        None => 1,
    };
    let mib = unit.to_mib(units).ok_or_else(|| RequestError::InvalidQuantity {
        container: c.name.clone(),
        resource: names.memory.to_string(),
        value: memory.clone(),
        source: QuantityError::TooLarge(memory.clone()),
    })?;
    ContainerRequest::new(c.name.clone(), role, mib, gpus, unit).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{Gpu, GpuUuid};

    fn spec(json: &str) -> PodSpec {
        serde_json::from_str(json).unwrap()
    }

    fn one(limits: &str) -> Result<PodRequest, RequestError> {
        let s = spec(&format!(r#"{{"containers":[{{"name":"main","resources":{{"limits":{limits}}}}}]}}"#));
        PodRequest::from_spec(&s, &ResourceNames::gpushare(), MemoryUnit::Mib)
    }

    #[test]
    fn resource_names_are_validated() {
        for ok in ["gpushare.io/gpu-mem", "aliyun.com/gpu-mem", "example.com/a.b_c"] {
            assert!(ResourceName::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "gpu-mem",
            "/gpu-mem",
            "kubernetes.io/gpu",
            "foo.kubernetes.io/gpu",
            "requests.example.com/gpu",
            "Example.com/gpu",
            "example.com/",
            "example.com/-gpu",
            "exa mple.com/gpu",
        ] {
            assert!(ResourceName::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn reads_memory_and_count_in_mib() {
        let r = one(r#"{"gpushare.io/gpu-mem":"3500"}"#).unwrap();
        assert_eq!(r.containers().len(), 1);
        assert_eq!(r.containers()[0].memory, Mib::new(3500));
        assert_eq!(r.containers()[0].gpus, 1);
        let r = one(r#"{"gpushare.io/gpu-mem":"8k","gpushare.io/gpu-count":2}"#).unwrap();
        assert_eq!(r.containers()[0].per_gpu(), Mib::new(4000));
        assert_eq!(r.containers()[0].gpus, 2);
    }

    #[test]
    fn reads_gib_and_alibaba_names() {
        let s = spec(r#"{"containers":[{"name":"a","resources":{"limits":{"aliyun.com/gpu-mem":"4"}}}]}"#);
        let r = PodRequest::from_spec(&s, &ResourceNames::alibaba(), MemoryUnit::Gib).unwrap();
        assert_eq!(r.containers()[0].memory, Mib::new(4096));
        // The gpushare names do not see Alibaba's resource at all.
        assert!(PodRequest::from_spec(&s, &ResourceNames::gpushare(), MemoryUnit::Gib).unwrap().is_empty());
    }

    #[test]
    fn roles_and_order_follow_kubernetes() {
        let s = spec(
            r#"{"initContainers":[
                  {"name":"fetch","resources":{"limits":{"gpushare.io/gpu-mem":"1000"}}},
                  {"name":"proxy","restartPolicy":"Always","resources":{"limits":{"gpushare.io/gpu-mem":"500"}}}],
                "containers":[
                  {"name":"cpu-only","resources":{"limits":{"cpu":"2"}}},
                  {"name":"model","resources":{"limits":{"gpushare.io/gpu-mem":"3000"}}},
                  {"name":"nulls","resources":{"limits":null,"requests":null}}]}"#,
        );
        let r = PodRequest::from_spec(&s, &ResourceNames::gpushare(), MemoryUnit::Mib).unwrap();
        let got: Vec<(&str, ContainerRole)> = r.containers().iter().map(|c| (c.name.as_str(), c.role)).collect();
        assert_eq!(
            got,
            [("fetch", ContainerRole::Init), ("proxy", ContainerRole::Sidecar), ("model", ContainerRole::App)]
        );
        assert_eq!(r.long_running_memory(), Mib::new(3500));
    }

    #[test]
    fn null_lists_and_missing_resources_mean_no_request() {
        let r = PodRequest::from_spec(
            &spec(r#"{"containers":null,"initContainers":null}"#),
            &ResourceNames::gpushare(),
            MemoryUnit::Mib,
        )
        .unwrap();
        assert!(r.is_empty());
    }

    #[test]
    fn requests_must_match_limits() {
        let s = spec(
            r#"{"containers":[{"name":"m","resources":{"limits":{"gpushare.io/gpu-mem":"4k"},
                "requests":{"gpushare.io/gpu-mem":"4000"}}}]}"#,
        );
        assert!(PodRequest::from_spec(&s, &ResourceNames::gpushare(), MemoryUnit::Mib).is_ok());
        let s = spec(r#"{"containers":[{"name":"m","resources":{"requests":{"gpushare.io/gpu-mem":"10"}}}]}"#);
        let r = PodRequest::from_spec(&s, &ResourceNames::gpushare(), MemoryUnit::Mib).unwrap();
        assert_eq!(r.containers()[0].memory, Mib::new(10));
        let s = spec(
            r#"{"containers":[{"name":"m","resources":{"limits":{"gpushare.io/gpu-mem":"5"},
                "requests":{"gpushare.io/gpu-mem":"4"}}}]}"#,
        );
        let err = PodRequest::from_spec(&s, &ResourceNames::gpushare(), MemoryUnit::Mib).unwrap_err();
        assert!(matches!(err, RequestError::LimitRequestMismatch { .. }), "{err}");
    }

    #[test]
    fn invalid_requests_are_refused_with_actionable_reasons() {
        let cases: &[(&str, &str)] = &[
            (r#"{"gpushare.io/gpu-mem":"0"}"#, "asks for 0 GPU memory"),
            (r#"{"gpushare.io/gpu-mem":"-3"}"#, "is negative"),
            (r#"{"gpushare.io/gpu-mem":"1.5"}"#, "is not a whole number"),
            (r#"{"gpushare.io/gpu-mem":1.5}"#, "is not a whole number"),
            (r#"{"gpushare.io/gpu-mem":"500m"}"#, "is not a whole number"),
            (r#"{"gpushare.io/gpu-mem":"lots"}"#, "is not a Kubernetes quantity"),
            (r#"{"gpushare.io/gpu-mem":"4Gi"}"#, "write \"4096\""),
            (r#"{"gpushare.io/gpu-mem":"1000","gpushare.io/gpu-count":"3"}"#, "ask for a multiple of 3"),
            (r#"{"gpushare.io/gpu-mem":"1000","gpushare.io/gpu-count":"0"}"#, "asks for 0 GPUs"),
            (r#"{"gpushare.io/gpu-count":"2"}"#, "add gpushare.io/gpu-mem"),
            (r#"{"gpushare.io/gpu-mem":"1000","gpushare.io/gpu-count":"99999999999"}"#, "too large"),
            (r#"{"gpushare.io/gpu-mem":"18446744073709551615Mi"}"#, "too large"),
        ];
        for (limits, want) in cases {
            let err = one(limits).unwrap_err().to_string();
            assert!(err.contains(want), "{limits}: {err}");
            assert!(err.contains("container \"main\""), "{limits}: {err}");
        }
        // In GiB mode the hint is in GiB, and memory must divide in whole GiB.
        let s = spec(r#"{"containers":[{"name":"m","resources":{"limits":{"gpushare.io/gpu-mem":"8Gi"}}}]}"#);
        let err = PodRequest::from_spec(&s, &ResourceNames::gpushare(), MemoryUnit::Gib).unwrap_err();
        assert!(err.to_string().contains("write \"8\""), "{err}");
        let s = spec(
            r#"{"containers":[{"name":"m","resources":{"limits":{"gpushare.io/gpu-mem":"3","gpushare.io/gpu-count":"2"}}}]}"#,
        );
        assert!(matches!(
            PodRequest::from_spec(&s, &ResourceNames::gpushare(), MemoryUnit::Gib),
            Err(RequestError::NotDivisible { units: 3, gpus: 2, .. })
        ));
    }

    #[test]
    fn feasibility_against_the_cluster() {
        let inv = NodeInventory::new(
            MemoryUnit::Mib,
            vec![
                Gpu::new(0, GpuUuid::new("a").unwrap(), "T4", Mib::new(15_360)),
                Gpu::new(1, GpuUuid::new("b").unwrap(), "T4", Mib::new(15_360)),
            ],
        )
        .unwrap();
        let limits = ClusterLimits::of([&inv]);
        assert_eq!(limits, ClusterLimits { max_gpus_per_node: 2, largest_gpu: Mib::new(15_360) });
        assert!(
            one(r#"{"gpushare.io/gpu-mem":"30720","gpushare.io/gpu-count":"2"}"#)
                .unwrap()
                .check_feasible(&limits)
                .is_ok()
        );
        let err = one(r#"{"gpushare.io/gpu-mem":"3000","gpushare.io/gpu-count":"3"}"#)
            .unwrap()
            .check_feasible(&limits)
            .unwrap_err();
        assert!(err.to_string().contains("no node has more than 2"), "{err}");
        let err = one(r#"{"gpushare.io/gpu-mem":"16000"}"#).unwrap().check_feasible(&limits).unwrap_err();
        assert!(err.to_string().contains("largest GPU in the cluster offers 15360 MiB"), "{err}");
    }
}
