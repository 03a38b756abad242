//! The JSON kube-scheduler sends to an extender and expects back
//! (`k8s.io/kube-scheduler/extender/v1`). The Go structs have no json tags, so every key is the
//! Go field name verbatim — `PascalCase`, with `PodUID`, `UID` and `NumPDBViolations` spelled
//! out — and nil pointers, maps and slices travel as `null`. Replies are written the same way.
//! Node objects of `nodeCacheCapable: false` calls are kept as raw JSON, so the nodes that pass
//! the filter go back exactly as they came.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use serde::de::Visitor;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::objects::PodObject;

use gpushare_core::request::null_as_default;

/// A node name borrowed from the request body when it has no escapes (they never do): a
/// 5,000-name filter then allocates no string per name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name<'a>(pub Cow<'a, str>);

impl Name<'_> {
    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'a> From<&'a str> for Name<'a> {
    fn from(s: &'a str) -> Self {
        Name(Cow::Borrowed(s))
    }
}

impl From<String> for Name<'_> {
    fn from(s: String) -> Self {
        Name(Cow::Owned(s))
    }
}

impl Serialize for Name<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Name<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Name<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a node name")
            }
            fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
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
pub struct ExtenderArgs<'a> {
    /// The pod being scheduled.
    #[serde(rename = "Pod")]
    pub pod: PodObject,
    /// Candidate nodes, with `nodeCacheCapable: false`.
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names, with `nodeCacheCapable: true`.
    #[serde(rename = "NodeNames", default, borrow)]
    pub node_names: Option<Vec<Name<'a>>>,
}

impl ExtenderArgs<'_> {
    /// The candidate node names, whichever form they came in.
    #[must_use]
    pub fn candidates(&self) -> Vec<&str> {
        match (&self.node_names, &self.nodes) {
            (Some(names), _) => names.iter().map(Name::as_str).collect(),
            (None, Some(list)) => list.items.iter().map(NodeList::name_of).collect(),
            (None, None) => Vec::new(),
        }
    }
}

/// `ExtenderFilterResult`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FilterResult<'a> {
    /// Passing nodes as objects (answer to `nodeCacheCapable: false`).
    #[serde(rename = "Nodes")]
    pub nodes: Option<NodeList>,
    /// Passing node names (answer to `nodeCacheCapable: true`).
    #[serde(rename = "NodeNames", borrow)]
    pub node_names: Option<Vec<Name<'a>>>,
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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority<'a> {
    /// Node name.
    #[serde(rename = "Host", borrow)]
    pub host: Name<'a>,
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
            serde_json::to_value(HostPriority { host: Name::from("a"), score: 3 }).unwrap(),
            json!({"Host":"a","Score":3})
        );
    }

    #[test]
    fn reads_both_node_forms_and_nulls() {
        let text =
            json!({"Pod": {"metadata": {"name": "p"}}, "Nodes": null, "NodeNames": ["a", "b\\u0063"]}).to_string();
        let cached: ExtenderArgs = serde_json::from_str(&text).unwrap();
        assert_eq!(cached.candidates(), ["a", "b\\u0063"]);
        let escaped: ExtenderArgs = serde_json::from_str(r#"{"Pod": {}, "NodeNames": ["\u0061b"]}"#).unwrap();
        assert_eq!(escaped.candidates(), ["ab"]);
        let text =
            json!({"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": [{"metadata": {"name": "c"}}]}, "NodeNames": null})
                .to_string();
        let full: ExtenderArgs = serde_json::from_str(&text).unwrap();
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
