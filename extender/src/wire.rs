//! The JSON kube-scheduler sends to an extender and expects back
//! (`k8s.io/kube-scheduler/extender/v1`). The Go structs have no json tags, so every key is the
//! Go field name verbatim — `PascalCase`, with `PodUID`, `UID` and `NumPDBViolations` spelled
//! out — and nil pointers, maps and slices travel as `null`. Replies are written the same way.
//! Node objects of `nodeCacheCapable: false` calls are kept as raw JSON, so the nodes that pass
//! the filter go back exactly as they came.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::objects::PodObject;

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A `v1.NodeList`, its items kept as sent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeList {
    /// The nodes.
    #[serde(default, deserialize_with = "null_as_default")]
    pub items: Vec<Value>,
}

impl NodeList {
    /// The name of an item (empty if it has none).
    #[must_use]
    pub fn name_of(item: &Value) -> &str {
        item.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("")
    }
}

/// `ExtenderArgs`: the body of filter and prioritize.
#[derive(Clone, Debug, Deserialize)]
pub struct ExtenderArgs {
    /// The pod being scheduled.
    #[serde(rename = "Pod")]
    pub pod: PodObject,
    /// Candidate nodes, with `nodeCacheCapable: false`.
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names, with `nodeCacheCapable: true`.
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
}

impl ExtenderArgs {
    /// The candidate node names, whichever form they came in.
    #[must_use]
    pub fn candidates(&self) -> Vec<String> {
        match (&self.node_names, &self.nodes) {
            (Some(names), _) => names.clone(),
            (None, Some(list)) => list.items.iter().map(|n| NodeList::name_of(n).to_owned()).collect(),
            (None, None) => Vec::new(),
        }
    }
}

/// `ExtenderFilterResult`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FilterResult {
    /// Passing nodes as objects (answer to `nodeCacheCapable: false`).
    #[serde(rename = "Nodes")]
    pub nodes: Option<NodeList>,
    /// Passing node names (answer to `nodeCacheCapable: true`).
    #[serde(rename = "NodeNames")]
    pub node_names: Option<Vec<String>>,
    /// Nodes that do not fit now; preemption may help.
    #[serde(rename = "FailedNodes", default, deserialize_with = "null_as_default")]
    pub failed_nodes: BTreeMap<String, String>,
    /// Nodes that can never take the pod.
    #[serde(rename = "FailedAndUnresolvableNodes", default, deserialize_with = "null_as_default")]
    pub failed_and_unresolvable: BTreeMap<String, String>,
    /// A non-empty error fails the whole call.
    #[serde(rename = "Error", default, deserialize_with = "null_as_default")]
    pub error: String,
}

/// `HostPriority`: one node's score.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    /// Node name.
    #[serde(rename = "Host")]
    pub host: String,
    /// 0 to 10.
    #[serde(rename = "Score")]
    pub score: i64,
}

/// `ExtenderBindingArgs`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindingArgs {
    /// Pod name.
    #[serde(rename = "PodName")]
    pub pod_name: String,
    /// Pod namespace.
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node chosen.
    #[serde(rename = "Node")]
    pub node: String,
}

/// `ExtenderBindingResult`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindingResult {
    /// Empty on success.
    #[serde(rename = "Error", default, deserialize_with = "null_as_default")]
    pub error: String,
}

/// `MetaPod`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPod {
    /// The pod's UID.
    #[serde(rename = "UID")]
    pub uid: String,
}

/// `MetaVictims`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaVictims {
    /// The victims.
    #[serde(rename = "Pods", default, deserialize_with = "null_as_default")]
    pub pods: Vec<MetaPod>,
    /// `PodDisruptionBudget` violations the eviction would cause.
    #[serde(rename = "NumPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// `Victims` (full pods, `nodeCacheCapable: false`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Victims {
    /// The victims.
    #[serde(rename = "Pods", default, deserialize_with = "null_as_default")]
    pub pods: Vec<PodObject>,
    /// `PodDisruptionBudget` violations the eviction would cause.
    #[serde(rename = "NumPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// `ExtenderPreemptionArgs`.
#[derive(Clone, Debug, Deserialize)]
pub struct PreemptionArgs {
    /// The pod that wants to preempt.
    #[serde(rename = "Pod")]
    pub pod: PodObject,
    /// Candidate victims per node (`nodeCacheCapable: false`).
    #[serde(rename = "NodeNameToVictims", default)]
    pub node_name_to_victims: Option<BTreeMap<String, Victims>>,
    /// Candidate victims per node (`nodeCacheCapable: true`).
    #[serde(rename = "NodeNameToMetaVictims", default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

/// `ExtenderPreemptionResult`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptionResult {
    /// The nodes where preemption works, with the victims it takes.
    #[serde(rename = "NodeNameToMetaVictims", default, deserialize_with = "null_as_default")]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_are_the_go_field_names() {
        let b: BindingArgs =
            serde_json::from_value(json!({"PodName":"p","PodNamespace":"ns","PodUID":"u","Node":"n"})).unwrap();
        assert_eq!(b.pod_uid, "u");
        let r = serde_json::to_value(PreemptionResult {
            node_name_to_meta_victims: BTreeMap::from([(
                "n".to_owned(),
                MetaVictims { pods: vec![MetaPod { uid: "u".into() }], num_pdb_violations: 1 },
            )]),
        })
        .unwrap();
        assert_eq!(r, json!({"NodeNameToMetaVictims": {"n": {"Pods": [{"UID": "u"}], "NumPDBViolations": 1}}}));
        let f = serde_json::to_value(FilterResult { node_names: Some(vec!["a".into()]), ..FilterResult::default() })
            .unwrap();
        assert_eq!(
            f,
            json!({"Nodes": null, "NodeNames": ["a"], "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""})
        );
        assert_eq!(
            serde_json::to_value(HostPriority { host: "a".into(), score: 3 }).unwrap(),
            json!({"Host":"a","Score":3})
        );
    }

    #[test]
    fn reads_both_node_forms_and_nulls() {
        let cached: ExtenderArgs =
            serde_json::from_value(json!({"Pod": {"metadata": {"name": "p"}}, "Nodes": null, "NodeNames": ["a", "b"]}))
                .unwrap();
        assert_eq!(cached.candidates(), ["a", "b"]);
        let full: ExtenderArgs = serde_json::from_value(
            json!({"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": [{"metadata": {"name": "c"}}]}, "NodeNames": null}),
        )
        .unwrap();
        assert_eq!(full.candidates(), ["c"]);
        let p: PreemptionArgs = serde_json::from_value(json!({
            "Pod": {"metadata": {"name": "p"}},
            "NodeNameToVictims": null,
            "NodeNameToMetaVictims": {"n": {"Pods": null, "NumPDBViolations": 0}}
        }))
        .unwrap();
        assert!(p.node_name_to_meta_victims.unwrap()["n"].pods.is_empty());
    }
}
