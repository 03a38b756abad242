//! The offline simulator: a cluster description (nodes and their GPUs, in YAML) and a workload
//! of real Pod manifests go in; each pod is read, validated, filtered and scored over every
//! node, and placed on the best one, exactly as the extender decides; the placements, the
//! reasons pods wait, and the `inspect` table come out. No cluster, GPU or network is needed.
//!
//! The cluster file format is documented in `docs/simulate.md`.

use std::collections::BTreeSet;
use std::fmt;

use gpushare_core::codec::assignment::Assignment;
use gpushare_core::placement::{NodeView, Placer, Rejection};
use gpushare_core::request::{ClusterLimits, RequestError};
use gpushare_core::schedule::{Policies, best, evaluate};
use gpushare_core::{Gpu, GpuUuid, Health, MemoryUnit, Mib, NodeInventory, PodRequest, PodSpec, ResourceNames};
use serde::Deserialize;
use thiserror::Error;

use crate::inspect::{GpuCell, NodeRow, summary};

/// A simulated cluster.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// The cluster unit (`MiB` by default).
    #[serde(default)]
    pub unit: MemoryUnit,
    /// The nodes.
    pub nodes: Vec<NodeSpec>,
}

/// A simulated node.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Node name.
    pub name: String,
    /// Its address, shown in the table.
    #[serde(default)]
    pub address: String,
    /// The unit its daemon counts in, if not the cluster's (to show a misconfigured node).
    #[serde(default)]
    pub unit: Option<MemoryUnit>,
    /// Its GPUs, in index order.
    #[serde(default)]
    pub gpus: Vec<GpuSpec>,
}

/// One GPU, or `count` identical ones.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuSpec {
    /// Product name.
    pub model: String,
    /// Total memory in MiB, as NVML would report it.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// How many such GPUs (default 1).
    #[serde(default = "one")]
    pub count: u32,
    /// Marks the GPUs unhealthy, with this reason.
    #[serde(default)]
    pub unhealthy: Option<String>,
    /// Marks the GPUs cordoned.
    #[serde(default)]
    pub cordoned: bool,
}

fn one() -> u32 {
    1
}

/// A Pod manifest, reduced to what placement reads.
#[derive(Clone, Debug)]
pub struct PodManifest {
    /// `metadata.namespace` (`default` when absent).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `spec`.
    pub spec: PodSpec,
}

#[derive(Deserialize)]
struct RawPod {
    #[serde(default)]
    kind: Option<String>,
    metadata: RawMeta,
    #[serde(default)]
    spec: PodSpec,
}

#[derive(Deserialize)]
struct RawMeta {
    name: String,
    #[serde(default)]
    namespace: Option<String>,
}

/// Why the simulator cannot start.
#[derive(Debug, Error)]
pub enum SimError {
    /// The cluster file is not valid YAML of the documented shape.
    #[error("cluster description: {0}")]
    Cluster(Box<serde_saphyr::Error>),
    /// A workload document is not valid YAML or not a Pod.
    #[error("workload{}: {error}", document(*.doc))]
    Workload {
        /// 1-based document number (counting empty documents), when the parser said where.
        doc: Option<usize>,
        /// What the YAML parser said, with the line and column.
        error: Box<serde_saphyr::Error>,
    },
    /// A workload document of another kind.
    #[error("workload document {doc} is a {kind}; the simulator places Pods (write kind: Pod)")]
    NotAPod {
        /// 1-based document number.
        doc: usize,
        /// Its kind.
        kind: String,
    },
    /// A rule of the cluster description broken.
    #[error("cluster description: {0}")]
    Invalid(String),
}

/// `" document 3"`, or nothing when the document is not known.
fn document(doc: Option<usize>) -> String {
    doc.map(|n| format!(" document {n}")).unwrap_or_default()
}

/// How gpushare reads YAML (the simulator's files, and the workloads and configurations the tests
/// read): plain scalars resolve by the YAML 1.2 core schema (as with `serde_yaml` before), so
/// `yes`, `on`, `0755` and `1_000` stay strings and only `true`/`false` are booleans; errors are
/// one line, ending with the line and column.
#[must_use]
pub fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        strict_booleans: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
        with_snippet: false,
    }
}

/// Reads a cluster description.
///
/// # Errors
/// [`SimError`] naming the line and what is wrong.
pub fn parse_cluster(yaml: &str) -> Result<ClusterSpec, SimError> {
    serde_saphyr::from_str_with_options(yaml, yaml_options()).map_err(|e| SimError::Cluster(Box::new(e)))
}

/// Reads a multi-document YAML stream: each document that is not empty (or `null`), with its
/// 1-based number in the stream (empty documents count, as an editor would count them).
///
/// # Errors
/// [`SimError::Workload`] with the document, line and what is wrong.
pub fn parse_documents<'de, T: Deserialize<'de>>(yaml: &'de str) -> Result<Vec<(usize, T)>, SimError> {
    let starts = document_starts(yaml);
    let number = |at: serde_saphyr::Location| {
        let at = (at.line(), at.column().saturating_sub(1));
        (at.0 > 0).then(|| starts.partition_point(|start| *start <= at)).filter(|n| *n > 0)
    };
    let docs: Vec<serde_saphyr::Spanned<T>> = serde_saphyr::from_multiple_with_options(yaml, yaml_options())
        .map_err(|error| SimError::Workload { doc: error.location().and_then(number), error: Box::new(error) })?;
    // Every document read has a location; `0` would only show if the parser lost it.
    Ok(docs.into_iter().map(|d| (number(d.referenced).unwrap_or(0), d.value)).collect())
}

/// Where each document of a YAML stream starts (line from 1, column from 0), in order, up to the
/// first syntax error.
fn document_starts(yaml: &str) -> Vec<(u64, u64)> {
    use serde_saphyr::granit_parser::{Event, Parser};
    let mut starts = Vec::new();
    for event in Parser::new_from_str(yaml) {
        let Ok((event, span)) = event else { break };
        if let Event::DocumentStart(..) = event {
            let (line, col) = (u64::try_from(span.start.line()), u64::try_from(span.start.col()));
            let (Ok(line), Ok(col)) = (line, col) else { break };
            starts.push((line, col));
        }
    }
    starts
}

/// Reads a multi-document YAML stream of Pod manifests; empty documents are skipped.
///
/// # Errors
/// [`SimError`] naming the document and what is wrong.
pub fn parse_workload(yaml: &str) -> Result<Vec<PodManifest>, SimError> {
    let mut pods = Vec::new();
    for (doc, raw) in parse_documents::<RawPod>(yaml)? {
        if let Some(kind) = raw.kind
            && kind != "Pod"
        {
            return Err(SimError::NotAPod { doc, kind });
        }
        pods.push(PodManifest {
            namespace: raw.metadata.namespace.unwrap_or_else(|| "default".to_owned()),
            name: raw.metadata.name,
            spec: raw.spec,
        });
    }
    Ok(pods)
}

#[derive(Debug)]
struct SimNode {
    name: String,
    address: String,
    inventory: NodeInventory,
    used: Vec<Mib>,
}

/// What happened to one pod.
#[derive(Debug)]
pub enum Outcome {
    /// Bound to a node with this assignment.
    Placed(Assignment),
    /// No node fits now; each node's reason.
    Waiting(Vec<(String, Rejection)>),
    /// The request itself is invalid.
    Refused(RequestError),
    /// The pod asks for no GPU memory under the configured resource name.
    NotGpu,
}

/// A cluster being filled pod by pod.
#[derive(Debug)]
pub struct Simulation {
    unit: MemoryUnit,
    names: ResourceNames,
    policies: Policies,
    nodes: Vec<SimNode>,
    placer: Placer,
}

impl Simulation {
    /// An empty cluster built from its description.
    ///
    /// # Errors
    /// [`SimError::Invalid`] for repeated node names, GPUs without memory, and the like.
    pub fn new(spec: &ClusterSpec, names: ResourceNames, policies: Policies) -> Result<Self, SimError> {
        let mut seen = BTreeSet::new();
        let mut nodes = Vec::with_capacity(spec.nodes.len());
        for (n, node) in spec.nodes.iter().enumerate() {
            if node.name.is_empty() {
                return Err(SimError::Invalid(format!("node {} has no name", n + 1)));
            }
            if !seen.insert(node.name.as_str()) {
                return Err(SimError::Invalid(format!("node {:?} appears twice", node.name)));
            }
            let mut gpus = Vec::new();
            for g in &node.gpus {
                for _ in 0..g.count {
                    let index = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
                    let uuid = GpuUuid::new(format!("GPU-sim-{n:04}-{index:02}"))
                        .map_err(|e| SimError::Invalid(e.to_string()))?;
                    let mut gpu = Gpu::new(index, uuid, g.model.clone(), Mib::new(g.memory_mib));
                    gpu.minor = Some(index);
                    if let Some(reason) = &g.unhealthy {
                        gpu.health = Health::Unhealthy { reason: reason.clone() };
                    }
                    gpu.cordoned = g.cordoned;
                    gpus.push(gpu);
                }
            }
            let used = vec![Mib::ZERO; gpus.len()];
            let inventory = NodeInventory::new(node.unit.unwrap_or(spec.unit), gpus)
                .map_err(|e| SimError::Invalid(format!("node {:?}: {e}", node.name)))?;
            nodes.push(SimNode { name: node.name.clone(), address: node.address.clone(), inventory, used });
        }
        Ok(Simulation { unit: spec.unit, names, policies, nodes, placer: Placer::new() })
    }

    /// Reads, validates and places one pod, updating the cluster's usage when it is placed.
    pub fn schedule(&mut self, pod: &PodManifest) -> Outcome {
        let request = match PodRequest::from_spec(&pod.spec, &self.names, self.unit) {
            Ok(r) if r.is_empty() => return Outcome::NotGpu,
            Ok(r) => r,
            Err(e) => return Outcome::Refused(e),
        };
        if let Err(e) = request.check_feasible(&ClusterLimits::of(self.nodes.iter().map(|n| &n.inventory))) {
            return Outcome::Refused(e);
        }
        let views: Vec<NodeView<'_>> =
            self.nodes.iter().filter_map(|n| NodeView::new(&n.inventory, &n.used).ok()).collect();
        let verdicts = evaluate(&mut self.placer, views.iter().copied(), &request, self.policies);
        let Some(chosen) = best(&verdicts) else {
            let reasons =
                self.nodes.iter().zip(verdicts).filter_map(|(n, v)| v.err().map(|r| (n.name.clone(), r))).collect();
            return Outcome::Waiting(reasons);
        };
        let Some(view) = views.get(chosen).copied() else {
            return Outcome::Waiting(Vec::new());
        };
        let placement = match self.placer.place(view, &request, self.policies.gpu) {
            Ok(p) => p,
            Err(r) => return Outcome::Waiting(vec![(self.nodes[chosen].name.clone(), r)]),
        };
        let node = &mut self.nodes[chosen];
        for (used, add) in node.used.iter_mut().zip(placement.footprint()) {
            *used = used.saturating_add(*add);
        }
        Outcome::Placed(Assignment::from_placement(&node.name, &node.inventory, &request, &placement))
    }

    /// The `inspect` table rows, nodes sorted by name.
    #[must_use]
    pub fn rows(&self) -> Vec<NodeRow> {
        let mut rows: Vec<NodeRow> = self
            .nodes
            .iter()
            .map(|n| {
                let unit = n.inventory.unit();
                NodeRow {
                    name: n.name.clone(),
                    address: n.address.clone(),
                    gpus: n
                        .inventory
                        .gpus()
                        .iter()
                        .zip(&n.used)
                        .map(|(g, used)| GpuCell {
                            allocated: unit.whole_units(*used),
                            total: unit.whole_units(g.total),
                        })
                        .collect(),
                    pending: 0,
                }
            })
            .collect();
        rows.sort_by(|a, b| a.name.cmp(&b.name));
        rows
    }

    /// The cluster unit.
    #[must_use]
    pub fn unit(&self) -> MemoryUnit {
        self.unit
    }
}

/// A whole run: every pod's outcome, and the table after the last one.
#[derive(Debug)]
pub struct Report {
    /// `(namespace/name, outcome)` in workload order.
    pub outcomes: Vec<(String, Outcome)>,
    /// The `inspect` table after all pods.
    pub table: String,
    /// Whether to print each assignment's annotation value.
    pub show_annotations: bool,
}

/// Places every pod of `workload` in order.
#[must_use]
pub fn run(sim: &mut Simulation, workload: &[PodManifest], show_annotations: bool) -> Report {
    let outcomes = workload.iter().map(|p| (format!("{}/{}", p.namespace, p.name), sim.schedule(p))).collect();
    Report { outcomes, table: summary(&sim.rows(), sim.unit()), show_annotations }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.outcomes.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
        for (pod, outcome) in &self.outcomes {
            match outcome {
                Outcome::Placed(a) => {
                    writeln!(f, "{pod:width$}  placed on {}", a.node)?;
                    for c in &a.containers {
                        let role = match c.role {
                            gpushare_core::ContainerRole::Init => " (init)",
                            gpushare_core::ContainerRole::Sidecar => " (sidecar)",
                            gpushare_core::ContainerRole::App => "",
                        };
                        let gpus: Vec<String> = c.gpus.iter().map(|g| format!("GPU{} {}", g.index, g.mib)).collect();
                        writeln!(f, "{:width$}    {}{role}: {}", "", c.name, gpus.join(", "))?;
                    }
                    if self.show_annotations {
                        match a.encode() {
                            Ok(v) => writeln!(
                                f,
                                "{:width$}    {}: {v}",
                                "",
                                gpushare_core::codec::assignment::ASSIGNMENT_KEY
                            )?,
                            Err(e) => writeln!(f, "{:width$}    annotation not encodable: {e}", "")?,
                        }
                    }
                }
                Outcome::Waiting(reasons) => {
                    writeln!(f, "{pod:width$}  waits: no node fits")?;
                    for (node, why) in reasons {
                        let hint = if why.is_resolvable() { " [preemption could make room]" } else { "" };
                        writeln!(f, "{:width$}    {node}: {why}{hint}", "")?;
                    }
                }
                Outcome::Refused(e) => writeln!(f, "{pod:width$}  refused: {e}")?,
                Outcome::NotGpu => writeln!(f, "{pod:width$}  asks for no GPU memory; left to kube-scheduler")?,
            }
        }
        writeln!(f)?;
        f.write_str(&self.table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: &str = "
unit: MiB
nodes:
  - name: b
    address: 10.0.0.2
    gpus:
      - {model: A10, memoryMiB: 23028, count: 2}
  - name: a
    address: 10.0.0.1
    gpus:
      - {model: T4, memoryMiB: 15360}
      - {model: T4, memoryMiB: 15360, unhealthy: Xid 79}
";

    fn sim() -> Simulation {
        Simulation::new(&parse_cluster(CLUSTER).unwrap(), ResourceNames::gpushare(), Policies::default()).unwrap()
    }

    fn pod(name: &str, limits: &str) -> PodManifest {
        let yaml = format!(
            "kind: Pod\nmetadata: {{name: {name}}}\nspec:\n  containers:\n  - name: main\n    resources:\n      limits: {limits}\n"
        );
        parse_workload(&yaml).unwrap().remove(0)
    }

    #[test]
    fn places_binpacks_and_explains_waiting_pods() {
        let mut s = sim();
        let Outcome::Placed(a) = s.schedule(&pod("p1", "{gpushare.io/gpu-mem: 20000}")) else { panic!() };
        assert_eq!(a.node, "b");
        // Binpack: the next pod goes to the fuller node b (GPU0 has 3028 left; GPU1 empty).
        let Outcome::Placed(a) = s.schedule(&pod("p2", "{gpushare.io/gpu-mem: 3000}")) else { panic!() };
        assert_eq!((a.node.as_str(), a.containers[0].gpus[0].index), ("b", 0));
        // GPU0 has 28 MiB left, so this one takes b's GPU1.
        let Outcome::Placed(a) = s.schedule(&pod("p3", "{gpushare.io/gpu-mem: 1000}")) else { panic!() };
        assert_eq!((a.node.as_str(), a.containers[0].gpus[0].index), ("b", 1));
        let Outcome::Waiting(reasons) =
            s.schedule(&pod("p4", "{gpushare.io/gpu-mem: 23028, gpushare.io/gpu-count: 1}"))
        else {
            panic!()
        };
        let reason = |node: &str| reasons.iter().find(|(n, _)| n == node).map(|(_, r)| r.clone()).unwrap();
        assert_eq!(
            reason("a").to_string(),
            "container \"main\" needs 23028 MiB on a GPU, the largest usable GPU here has 15360 MiB"
        );
        assert!(!reason("a").is_resolvable());
        assert_eq!(
            reason("b").to_string(),
            "container \"main\" does not fit: GPU0: 28 of 23028 MiB free, needs 23028; \
             GPU1: 22028 of 23028 MiB free, needs 23028"
        );
        assert!(reason("b").is_resolvable());
        let rows = s.rows();
        assert_eq!(rows[0].name, "a");
        assert_eq!(rows[1].gpus[0], GpuCell { allocated: 23_000, total: 23_028 });
    }

    #[test]
    fn refuses_invalid_requests_and_ignores_non_gpu_pods() {
        let mut s = sim();
        assert!(matches!(s.schedule(&pod("x", "{gpushare.io/gpu-mem: 4Gi}")), Outcome::Refused(_)));
        assert!(matches!(
            s.schedule(&pod("x", "{gpushare.io/gpu-mem: 3000, gpushare.io/gpu-count: 3}")),
            Outcome::Refused(RequestError::TooManyGpus { .. })
        ));
        assert!(matches!(s.schedule(&pod("x", "{cpu: 1}")), Outcome::NotGpu));
        assert!(matches!(s.schedule(&pod("x", "{aliyun.com/gpu-mem: 2}")), Outcome::NotGpu));
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let err = parse_cluster("nodes:\n  - name: a\n    gpus: [{model: T4, memory: 1}]\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `memory`"), "{err}");
        assert!(err.to_string().contains("line 3"), "{err}");
        let err =
            parse_workload("kind: Pod\nmetadata: {name: a}\n---\nkind: Deployment\nmetadata: {name: d}\n").unwrap_err();
        assert_eq!(err.to_string(), "workload document 2 is a Deployment; the simulator places Pods (write kind: Pod)");
        let err = parse_workload("kind: Pod\nmetadata: {}\n").unwrap_err();
        assert!(err.to_string().starts_with("workload document 1:"), "{err}");
        let dup = parse_cluster("nodes: [{name: a}, {name: a}]").unwrap();
        let err = Simulation::new(&dup, ResourceNames::gpushare(), Policies::default()).unwrap_err();
        assert_eq!(err.to_string(), "cluster description: node \"a\" appears twice");
        let zero = parse_cluster("nodes: [{name: a, gpus: [{model: T4, memoryMiB: 0}]}]").unwrap();
        assert!(Simulation::new(&zero, ResourceNames::gpushare(), Policies::default()).is_err());
        assert!(parse_workload("---\n---\n").unwrap().is_empty());
    }

    #[test]
    fn workload_errors_name_the_document_counting_empty_ones() {
        // Document 2 is empty; document 3 lacks its name.
        let err =
            parse_workload("kind: Pod\nmetadata: {name: a}\n---\n---\nkind: Pod\nmetadata: {nam: b}\n").unwrap_err();
        assert_eq!(err.to_string(), "workload document 3: missing field `name` at line 6, column 12");
        // A syntax error in document 2.
        let err = parse_workload("kind: Pod\nmetadata: {name: a}\n---\nkind: Pod\nmetadata: {name: a\n").unwrap_err();
        assert_eq!(err.to_string(), "workload document 2: unclosed bracket '{' at line 5, column 11");
        // A leading `---` (and comments) opens document 1, as in most manifests.
        let err = parse_workload("# deployments\n---\nkind: Deployment\nmetadata: {name: d}\n").unwrap_err();
        assert!(err.to_string().starts_with("workload document 1 is a Deployment"), "{err}");
        let docs = parse_documents::<serde_json::Value>("a: 1\n--- {b: 2}\n...\n---\n# nothing\n---\nc: 3\n").unwrap();
        let numbers: Vec<usize> = docs.iter().map(|(n, _)| *n).collect();
        assert_eq!(numbers, [1, 2, 4]);
    }

    #[test]
    fn scalars_resolve_by_the_yaml_1_2_core_schema() {
        let docs = parse_documents::<serde_json::Value>(
            "a: yes\nb: on\nc: 0755\nd: 1_000\ne: \"1024\"\nf: 1024\ng: true\nh: 4Gi\ni: ~\nj: 0o17\n",
        )
        .unwrap();
        assert_eq!(
            docs[0].1,
            serde_json::json!({"a": "yes", "b": "on", "c": "0755", "d": "1_000", "e": "1024", "f": 1024,
                               "g": true, "h": "4Gi", "i": null, "j": 15})
        );
        let err = parse_cluster("nodes: [{name: a, gpus: [{model: T4, memoryMiB: 1, cordoned: yes}]}]").unwrap_err();
        assert!(
            err.to_string().contains("invalid boolean (strict mode expects true/false) at line 1, column 62"),
            "{err}"
        );
        // Quoted or plain, a quantity reads as its text.
        let p = pod("q", "{gpushare.io/gpu-mem: \"1024\", cpu: 0.5}");
        let limits = &p.spec.containers[0].resources.limits;
        assert_eq!((limits["gpushare.io/gpu-mem"].0.as_str(), limits["cpu"].0.as_str()), ("1024", "0.5"));
    }
}
