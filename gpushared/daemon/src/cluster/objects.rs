//! The parts of Pods and Nodes the daemon reads from the API server. Deserializing only these
//! fields (instead of k8s-openapi's complete `Pod` and `Node`) keeps the daemon's code and its
//! memory small: a Pod's spec has some hundred nested types the daemon never looks at.

use std::borrow::Cow;

use gpushare_core::PodSpec;
use gpushare_core::request::Container;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use gpushare_core::request::null_as_default;

/// A Pod, reduced to what allocation needs.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PodObject {
    /// Name, namespace, UID, annotations, creation and deletion times.
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    /// Containers and node.
    #[serde(default, deserialize_with = "null_as_default")]
    pub spec: PodObjectSpec,
    /// Phase.
    #[serde(default, deserialize_with = "null_as_default")]
    pub status: PodObjectStatus,
}

/// `spec` of a [`PodObject`].
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodObjectSpec {
    /// `spec.containers`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub containers: Vec<Container>,
    /// `spec.initContainers`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub init_containers: Vec<Container>,
    /// `spec.nodeName`: set once bound.
    #[serde(default)]
    pub node_name: Option<String>,
}

impl PodObjectSpec {
    /// The containers, as the core reads them.
    #[must_use]
    pub fn core(&self) -> PodSpec {
        PodSpec { containers: self.containers.clone(), init_containers: self.init_containers.clone() }
    }
}

/// `status` of a [`PodObject`].
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodObjectStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed` or `Unknown`.
    #[serde(default)]
    pub phase: Option<String>,
    /// `status.containerStatuses`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub container_statuses: Vec<ContainerStatus>,
    /// `status.initContainerStatuses`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub init_container_statuses: Vec<ContainerStatus>,
}

impl PodObjectStatus {
    /// (container name, runtime container ID without its scheme) of every started container.
    #[must_use]
    pub fn container_ids(&self) -> Vec<(String, String)> {
        self.init_container_statuses
            .iter()
            .chain(&self.container_statuses)
            .filter_map(|c| {
                let id = c.container_id.as_deref()?;
                let id = id.split_once("://").map_or(id, |(_, id)| id);
                (!id.is_empty()).then(|| (c.name.clone(), id.to_owned()))
            })
            .collect()
    }

    /// How many devices of `resource` the kubelet reports the health of in the containers'
    /// `allocatedResourcesStatus` (the `ResourceHealthStatus` feature gate): one per device.
    #[must_use]
    pub fn device_health_entries(&self, resource: &str) -> usize {
        self.init_container_statuses
            .iter()
            .chain(&self.container_statuses)
            .flat_map(|c| &c.allocated_resources_status)
            .filter(|r| r.name == resource)
            .map(|r| r.resources.len())
            .sum()
    }
}

/// One entry of `status.containerStatuses`, reduced to its name, runtime ID and the devices
/// whose health the kubelet reports.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStatus {
    /// The container's name.
    #[serde(default)]
    pub name: String,
    /// `containerd://<64 hex>` (or `docker://`, `cri-o://`) once started.
    #[serde(default, rename = "containerID")]
    pub container_id: Option<String>,
    /// `allocatedResourcesStatus`: per resource, the health of each allocated device.
    #[serde(default, deserialize_with = "null_as_default")]
    pub allocated_resources_status: Vec<ResourceHealth>,
}

/// One entry of `allocatedResourcesStatus`: a resource and its devices, counted, not kept (in
/// MiB mode there is one per MiB).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ResourceHealth {
    /// The resource's name.
    #[serde(default)]
    pub name: String,
    /// One per device; their IDs and health are not read.
    #[serde(default, deserialize_with = "null_as_default")]
    pub resources: Vec<serde::de::IgnoredAny>,
}

/// A Node, reduced to its metadata (the daemon reads and writes one annotation).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct NodeObject {
    /// Name and annotations.
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
}

/// A Node, reduced to its name and its status's capacity and allocatable (`[kubelet]
/// advertise = "capacity"` keeps one count there).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct NodeCapacity {
    /// Name.
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    /// Capacity and allocatable.
    #[serde(default, deserialize_with = "null_as_default")]
    pub status: NodeCapacityStatus,
}

/// `status` of a [`NodeCapacity`]: each resource's quantity as the API server writes it.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct NodeCapacityStatus {
    /// What the node has.
    #[serde(default, deserialize_with = "null_as_default")]
    pub capacity: std::collections::BTreeMap<String, String>,
    /// What pods may ask for.
    #[serde(default, deserialize_with = "null_as_default")]
    pub allocatable: std::collections::BTreeMap<String, String>,
}

macro_rules! core_v1 {
    ($ty:ty, $kind:literal, $plural:literal, $scope:ty) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = $scope;

            fn kind((): &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group((): &()) -> Cow<'_, str> {
                Cow::Borrowed("")
            }
            fn version((): &()) -> Cow<'_, str> {
                Cow::Borrowed("v1")
            }
            fn plural((): &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

core_v1!(PodObject, "Pod", "pods", kube::core::NamespaceResourceScope);
core_v1!(NodeObject, "Node", "nodes", kube::core::ClusterResourceScope);
core_v1!(NodeCapacity, "Node", "nodes", kube::core::ClusterResourceScope);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_the_api_server_sends_nulls_included() {
        let pod: PodObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": null,
                         "creationTimestamp": "2026-11-23T10:00:00Z"},
            "spec": {"nodeName": "node-a", "initContainers": null, "volumes": [{"name": "v"}],
                     "containers": [{"name": "main", "image": "x",
                                     "resources": {"limits": {"gpushare.io/gpu-mem": "300"}}}]},
            "status": {"phase": "Running", "conditions": [],
                       "initContainerStatuses": null,
                       "containerStatuses": [{"name": "main", "containerID": "containerd://4f2a", "ready": true},
                                             {"name": "waiting", "ready": false}]}
        }))
        .unwrap();
        assert_eq!(pod.metadata.name.as_deref(), Some("p"));
        assert_eq!(pod.spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(pod.spec.core().containers.len(), 1);
        assert!(pod.spec.init_containers.is_empty());
        assert_eq!(pod.status.phase.as_deref(), Some("Running"));
        assert_eq!(pod.status.container_ids(), vec![("main".to_owned(), "4f2a".to_owned())]);
        assert_eq!(pod.status.device_health_entries("gpushare.io/gpu-mem"), 0);
        let reported: PodObject = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "status": {"containerStatuses": [{"name": "main", "allocatedResourcesStatus": [
                {"name": "gpushare.io/gpu-mem", "resources": [{"resourceID": "Q0-0", "health": "Healthy"},
                                                              {"resourceID": "Q0-1", "health": "Healthy"}]},
                {"name": "example.com/nic", "resources": [{"resourceID": "n0", "health": "Healthy"}]}]}],
                       "initContainerStatuses": [{"name": "init", "allocatedResourcesStatus": [
                {"name": "gpushare.io/gpu-mem", "resources": [{"resourceID": "Q0-2", "health": "Unknown"}]}]},
                                                 {"name": "other", "allocatedResourcesStatus": null}]}
        }))
        .unwrap();
        assert_eq!(reported.status.device_health_entries("gpushare.io/gpu-mem"), 3);
        assert_eq!(reported.status.device_health_entries("aliyun.com/gpu-mem"), 0);
        let bare: PodObject = serde_json::from_value(serde_json::json!({"metadata": null, "spec": null})).unwrap();
        assert!(bare.spec.node_name.is_none());
        let node: NodeObject =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "n"}, "status": {"capacity": {}}})).unwrap();
        assert_eq!(node.metadata.name.as_deref(), Some("n"));
    }
}
