//! A device-plugin call's reading of the kubelet's `List` answer: which pods it holds and which
//! of their containers hold devices of this daemon's resource, decoded straight from the
//! answer's bytes. The device IDs are counted, never copied: a MiB-mode node lists up to 131,072
//! of them, and every call would otherwise allocate and free each one again. Reconciliation,
//! which reads the IDs, decodes the same bytes in full ([`super::decode_list`]) when it takes
//! an answer, at most about once a second.
//!
//! The messages below are `k8s.io/kubelet/pkg/apis/podresources/v1`'s, by field number, less
//! the fields this reading skips (a pod's and a container's CPUs, memory and dynamic resources,
//! a device set's topology).

use prost::Message;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, check_wire_type, skip_field, string};

use crate::allocation::allocator::KubeletListing;

/// `ListPodResourcesResponse`.
#[derive(Clone, PartialEq, Message)]
struct List {
    #[prost(message, repeated, tag = "1")]
    pod_resources: Vec<Pod>,
}

/// `PodResources`.
#[derive(Clone, PartialEq, Message)]
struct Pod {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    namespace: String,
    #[prost(message, repeated, tag = "3")]
    containers: Vec<Container>,
}

/// `ContainerResources`.
#[derive(Clone, PartialEq, Message)]
struct Container {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, repeated, tag = "2")]
    devices: Vec<Devices>,
}

/// `ContainerDevices`: the resource's name and how many device IDs it lists (field 2, each
/// checked to be length-delimited as a string is, and skipped).
#[derive(Clone, Debug, Default, PartialEq)]
struct Devices {
    resource_name: String,
    ids: usize,
}

impl Message for Devices {
    /// Writes the resource's name only: this reading keeps no IDs to write (it only decodes).
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if !self.resource_name.is_empty() {
            string::encode(1, &self.resource_name, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        match tag {
            1 => string::merge(wire_type, &mut self.resource_name, buf, ctx),
            2 => {
                check_wire_type(WireType::LengthDelimited, wire_type)?;
                self.ids += 1;
                skip_field(wire_type, tag, buf, ctx)
            }
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        if self.resource_name.is_empty() { 0 } else { string::encoded_len(1, &self.resource_name) }
    }

    fn clear(&mut self) {
        *self = Devices::default();
    }
}

/// The pods a `List` answer (its protobuf bytes) holds and, for each, the containers that hold
/// devices of `resource`.
///
/// # Errors
/// [`prost::DecodeError`] when the bytes are not a `ListPodResourcesResponse`.
pub(super) fn kubelet_listing(answer: &[u8], resource: &str) -> Result<KubeletListing, prost::DecodeError> {
    let list = List::decode(answer)?;
    let mut listing = KubeletListing::default();
    for pod in &list.pod_resources {
        let holding = pod
            .containers
            .iter()
            .filter(|c| c.devices.iter().any(|d| d.resource_name == resource && d.ids > 0))
            .map(|c| c.name.clone());
        listing.insert(&pod.namespace, &pod.name, holding);
    }
    Ok(listing)
}

#[cfg(test)]
mod tests {
    use gpushare_proto::podresources::{
        ContainerDevices, ContainerMemory, ContainerResources, ListPodResourcesResponse, NumaNode, PodResources,
        TopologyInfo,
    };
    use prost::Message;

    use super::kubelet_listing;
    use crate::allocation::allocator::KubeletListing;

    const MINE: &str = "gpushare.io/gpu-mem";

    fn devices(resource: &str, ids: &[&str]) -> ContainerDevices {
        ContainerDevices {
            resource_name: resource.into(),
            device_ids: ids.iter().map(|&i| i.to_owned()).collect(),
            topology: Some(TopologyInfo { nodes: vec![NumaNode { id: 1 }] }),
        }
    }

    fn container(name: &str, devices: Vec<ContainerDevices>) -> ContainerResources {
        ContainerResources {
            name: name.into(),
            devices,
            cpu_ids: vec![2, 3],
            memory: vec![ContainerMemory { memory_type: "memory".into(), size: 1 << 20, topology: None }],
            ..ContainerResources::default()
        }
    }

    fn pod(name: &str, containers: Vec<ContainerResources>) -> PodResources {
        PodResources { name: name.into(), namespace: "ns".into(), containers, ..PodResources::default() }
    }

    #[test]
    fn reads_the_holders_of_this_resource_as_the_full_answer_says() {
        let answer = ListPodResourcesResponse {
            pod_resources: vec![
                pod("held", vec![container("main", vec![devices(MINE, &["Q0-1", "Q0-2"])])]),
                // Only another resource's devices, an empty set of this one's, or none at all:
                // the pod is listed and its containers hold nothing of this resource.
                pod(
                    "admitting",
                    vec![
                        container("gpu", vec![devices("nvidia.com/gpu", &["GPU-1"])]),
                        container("empty", vec![devices(MINE, &[])]),
                        container("plain", vec![]),
                    ],
                ),
                pod("sidecar", vec![container("init", vec![devices(MINE, &["Q1-0"])]), container("main", vec![])]),
            ],
        };
        let listing = kubelet_listing(&answer.encode_to_vec(), MINE).unwrap();
        let mut nothing = listing.holding_nothing();
        nothing.sort();
        assert_eq!(nothing, vec![("ns".to_owned(), "admitting".to_owned())]);
        let mut expected = KubeletListing::default();
        expected.insert("ns", "held", ["main".to_owned()]);
        expected.insert("ns", "admitting", []);
        expected.insert("ns", "sidecar", ["init".to_owned()]);
        assert_eq!(listing, expected);
        assert_eq!(kubelet_listing(&[], MINE).unwrap(), KubeletListing::default(), "an empty answer");
    }

    #[test]
    fn refuses_bytes_that_are_no_list_answer() {
        let mut answer = ListPodResourcesResponse {
            pod_resources: vec![pod("p", vec![container("c", vec![devices(MINE, &["x"])])])],
        }
        .encode_to_vec();
        answer.truncate(answer.len() - 1);
        assert!(kubelet_listing(&answer, MINE).is_err(), "a cut answer");
        // A pod whose container's device set has field 2 (its IDs) as a number, not a string:
        // list field 1 { pod field 3 { container field 2 { device set: field 2 = 1 } } }.
        let devices_as_number = [0x0a, 0x06, 0x1a, 0x04, 0x12, 0x02, 0x10, 0x01];
        assert!(kubelet_listing(&devices_as_number, MINE).is_err(), "a device ID that is not a string");
    }
}
