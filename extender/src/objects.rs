//! The parts of Pods and Nodes the extender reads, as Kubernetes serves them. Deserializing
//! only these fields keeps a cluster's worth of watched objects small in memory, and every
//! field is lenient about `null` (Go writes nil slices and maps as `null`). The same types
//! carry the `Pod` of kube-scheduler's extender calls and the objects of the API-server watch.

use std::borrow::Cow;
use std::collections::BTreeMap;

use gpushare_core::request::Container;
use gpushare_core::{PodSpec, ResourceNames};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use gpushare_core::request::null_as_default;

/// The scheduler name the API server gives a pod that names none.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// A Pod, reduced to what placement needs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PodObject {
    /// Name, namespace, UID, annotations, creation time.
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    /// Containers, node, priority.
    #[serde(default, deserialize_with = "null_as_default")]
    pub spec: PodObjectSpec,
    /// Phase.
    #[serde(default, deserialize_with = "null_as_default")]
    pub status: PodObjectStatus,
}

/// `spec` of a [`PodObject`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodObjectSpec {
    /// `spec.containers`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub containers: Vec<Container>,
    /// `spec.initContainers`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub init_containers: Vec<Container>,
    /// `spec.nodeName`: set once bound.
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "String::is_empty")]
    pub node_name: String,
    /// `spec.priority`, resolved by the API server from the priority class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// `spec.schedulerName`: the scheduler profile that places the pod (the API server
    /// defaults it to `default-scheduler`).
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "String::is_empty")]
    pub scheduler_name: String,
}

/// `status` of a [`PodObject`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodObjectStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed` or `Unknown`.
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "String::is_empty")]
    pub phase: String,
}

impl PodObject {
    /// The scheduler that places the pod: `spec.schedulerName`, or the API server's default.
    #[must_use]
    pub fn scheduler(&self) -> &str {
        if self.spec.scheduler_name.is_empty() { DEFAULT_SCHEDULER } else { &self.spec.scheduler_name }
    }

    /// `namespace/name`.
    #[must_use]
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace(), self.name())
    }

    /// The namespace (`default` when absent, as the API server fills it in).
    #[must_use]
    pub fn namespace(&self) -> &str {
        self.metadata.namespace.as_deref().filter(|n| !n.is_empty()).unwrap_or("default")
    }

    /// The name.
    #[must_use]
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or("")
    }

    /// The UID.
    #[must_use]
    pub fn uid(&self) -> &str {
        self.metadata.uid.as_deref().unwrap_or("")
    }

    /// The annotations (empty when none).
    #[must_use]
    pub fn annotations(&self) -> Cow<'_, BTreeMap<String, String>> {
        match &self.metadata.annotations {
            Some(a) => Cow::Borrowed(a),
            None => Cow::Owned(BTreeMap::new()),
        }
    }

    /// The node it is bound to, if any.
    #[must_use]
    pub fn node(&self) -> Option<&str> {
        Some(self.spec.node_name.as_str()).filter(|n| !n.is_empty())
    }

    /// Succeeded or Failed: its containers hold nothing any more.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        matches!(self.status.phase.as_str(), "Succeeded" | "Failed")
    }

    /// Whether any container asks for the memory or count resource of `names`.
    #[must_use]
    pub fn asks_for_gpu(&self, names: &ResourceNames) -> bool {
        self.spec.containers.iter().chain(&self.spec.init_containers).any(|c| {
            [&c.resources.limits, &c.resources.requests]
                .iter()
                .any(|m| m.contains_key(names.memory.as_str()) || m.contains_key(names.count.as_str()))
        })
    }

    /// The part of the spec the core reads.
    #[must_use]
    pub fn core_spec(&self) -> PodSpec {
        PodSpec { containers: self.spec.containers.clone(), init_containers: self.spec.init_containers.clone() }
    }
}

impl kube::Resource for PodObject {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind((): &()) -> Cow<'_, str> {
        Cow::Borrowed("Pod")
    }
    fn group((): &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn version((): &()) -> Cow<'_, str> {
        Cow::Borrowed("v1")
    }
    fn plural((): &()) -> Cow<'_, str> {
        Cow::Borrowed("pods")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// A Node, reduced to its name, annotations and addresses.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeObject {
    /// Name and annotations.
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    /// Addresses.
    #[serde(default, deserialize_with = "null_as_default")]
    pub status: NodeObjectStatus,
}

/// `status` of a [`NodeObject`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeObjectStatus {
    /// `status.addresses`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub addresses: Vec<NodeAddress>,
    /// `status.capacity`: read for the nodes Alibaba's device plugin still serves.
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "BTreeMap::is_empty")]
    pub capacity: BTreeMap<String, String>,
}

/// One entry of `status.addresses`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddress {
    /// `InternalIP`, `ExternalIP`, `Hostname`…
    #[serde(rename = "type", default, deserialize_with = "null_as_default")]
    pub kind: String,
    /// The address.
    #[serde(default, deserialize_with = "null_as_default")]
    pub address: String,
}

impl NodeObject {
    /// The name.
    #[must_use]
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or("")
    }

    /// The internal IP, else the first address, else empty.
    #[must_use]
    pub fn address(&self) -> &str {
        let a = &self.status.addresses;
        a.iter().find(|a| a.kind == "InternalIP").or_else(|| a.first()).map_or("", |a| a.address.as_str())
    }

    /// One annotation.
    #[must_use]
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.metadata.annotations.as_ref().and_then(|a| a.get(key)).map(String::as_str)
    }

    /// The capacity of `resource` as a whole number (device counts are), or `None` if the node
    /// has none or another form.
    #[must_use]
    pub fn capacity(&self, resource: &str) -> Option<u64> {
        self.status.capacity.get(resource).and_then(|q| q.parse().ok())
    }
}

impl kube::Resource for NodeObject {
    type DynamicType = ();
    type Scope = kube::core::ClusterResourceScope;

    fn kind((): &()) -> Cow<'_, str> {
        Cow::Borrowed("Node")
    }
    fn group((): &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn version((): &()) -> Cow<'_, str> {
        Cow::Borrowed("v1")
    }
    fn plural((): &()) -> Cow<'_, str> {
        Cow::Borrowed("nodes")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_kube_scheduler_sends_including_nulls() {
        let pod: PodObject = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "annotations": null},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"gpushare.io/gpu-mem": "100"}, "requests": null}}],
                     "initContainers": null, "nodeName": null, "priority": 5},
            "status": {"phase": null}
        }))
        .unwrap();
        assert_eq!(pod.key(), "ns/p");
        assert_eq!(pod.uid(), "u1");
        assert_eq!(pod.node(), None);
        assert_eq!(pod.spec.priority, Some(5));
        assert!(pod.asks_for_gpu(&ResourceNames::gpushare()));
        assert!(!pod.asks_for_gpu(&ResourceNames::alibaba()));
        let node: NodeObject = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n"},
            "status": {"addresses": [{"type": "Hostname", "address": "n"}, {"type": "InternalIP", "address": "10.0.0.1"}]}
        }))
        .unwrap();
        assert_eq!(node.address(), "10.0.0.1");
        assert_eq!(node.annotation("x"), None);
    }
}
