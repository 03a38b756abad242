//! The tables of `kubectl inspect gpushare`, in the layout Alibaba's users and their scripts
//! know: the summary (one row per node, one `GPUi(Allocated/Total)` column per GPU, an optional
//! `PENDING(Allocated)` column, and the node and cluster totals) and the details (`-d`: per
//! node, one row per pod, then one per DRA claim), all in the cluster unit. Columns are aligned
//! like Go's `text/tabwriter` with padding 2; percentages are truncated.

use std::fmt::Write as _;

use gpushare_core::{MemoryUnit, Mib};

use super::ClusterReport;

/// One GPU's cell: allocated and total, in the cluster unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCell {
    /// Allocated units.
    pub allocated: u64,
    /// Total units.
    pub total: u64,
}

/// One node's row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRow {
    /// Node name.
    pub name: String,
    /// The node's internal IP address.
    pub address: String,
    /// Its GPUs in index order.
    pub gpus: Vec<GpuCell>,
    /// Units held by pods bound to the node but not yet given a GPU.
    pub pending: u64,
}

/// Renders the summary table. Nodes are listed in the order given (callers sort them).
#[must_use]
pub fn summary(rows: &[NodeRow], unit: MemoryUnit) -> String {
    let columns = rows.iter().map(|r| r.gpus.len()).max().unwrap_or(0);
    let has_pending = rows.iter().any(|r| r.pending > 0);
    let mut table: Vec<Vec<String>> = Vec::with_capacity(rows.len() + 1);
    let mut header = vec!["NAME".to_owned(), "IPADDRESS".to_owned()];
    header.extend((0..columns).map(|i| format!("GPU{i}(Allocated/Total)")));
    if has_pending {
        header.push("PENDING(Allocated)".to_owned());
    }
    header.push(format!("GPU Memory({unit})"));
    table.push(header);

    let (mut cluster_used, mut cluster_total) = (0u64, 0u64);
    for row in rows {
        let mut cells = vec![row.name.clone(), row.address.clone()];
        for i in 0..columns {
            let cell = row.gpus.get(i).copied().unwrap_or_default();
            cells.push(format!("{}/{}", cell.allocated, cell.total));
        }
        let used = row.gpus.iter().map(|g| g.allocated).fold(row.pending, u64::saturating_add);
        let total = row.gpus.iter().map(|g| g.total).fold(0, u64::saturating_add);
        if has_pending {
            cells.push(if row.pending > 0 { row.pending.to_string() } else { String::new() });
        }
        cells.push(format!("{used}/{total}"));
        cluster_used = cluster_used.saturating_add(used);
        cluster_total = cluster_total.saturating_add(total);
        table.push(cells);
    }

    let mut out = tabulate(&table);
    out.push_str("-------------------------------------------------------------\n");
    out.push_str("Allocated/Total GPU Memory In Cluster:\n");
    let _ = writeln!(out, "{cluster_used}/{cluster_total} ({}%)", percent(cluster_used, cluster_total));
    out
}

/// `part` of `whole` in whole percent, truncated; 0 for an empty whole.
#[must_use]
pub fn percent(part: u64, whole: u64) -> u64 {
    if whole == 0 {
        return 0;
    }
    u64::try_from(u128::from(part) * 100 / u128::from(whole)).unwrap_or(u64::MAX)
}

/// Aligns cells in columns, each as wide as its widest cell plus two spaces; the last cell
/// of a line is not padded.
/// A cell as it is safe to print to a terminal: what nodes publish (claim and pod names in
/// their node state, addresses) is not trusted, so control characters (escape sequences, line
/// breaks, tabs) and the bidirectional overrides that reorder what a terminal shows are
/// written as `\u{..}` escapes instead.
fn printable(cell: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| {
        c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !cell.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(cell);
    }
    let mut out = String::with_capacity(cell.len() + 8);
    for c in cell.chars() {
        if unsafe_char(c) {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

fn tabulate(table: &[Vec<String>]) -> String {
    let table: Vec<Vec<std::borrow::Cow<'_, str>>> =
        table.iter().map(|row| row.iter().map(|cell| printable(cell)).collect()).collect();
    let mut widths: Vec<usize> = Vec::new();
    for row in &table {
        for (i, cell) in row.iter().enumerate().take(row.len().saturating_sub(1)) {
            let w = cell.chars().count();
            match widths.get_mut(i) {
                Some(max) => *max = (*max).max(w),
                None => widths.push(w),
            }
        }
    }
    let mut out = String::new();
    for row in &table {
        let last = row.len().saturating_sub(1);
        for (i, cell) in row.iter().enumerate() {
            out.push_str(cell.as_ref());
            if i < last {
                let pad = widths.get(i).copied().unwrap_or(0) + 2 - cell.chars().count();
                out.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.truncate(out.trim_end_matches(' ').len());
        out.push('\n');
    }
    out
}

impl ClusterReport {
    /// The summary table's rows, in the cluster unit.
    #[must_use]
    pub fn rows(&self) -> Vec<NodeRow> {
        let units = |mib: u64| self.unit.whole_units(Mib::new(mib));
        self.nodes
            .iter()
            .map(|n| NodeRow {
                name: n.name.clone(),
                address: n.address.clone(),
                gpus: n
                    .gpus
                    .iter()
                    .map(|g| GpuCell { allocated: units(g.used_mib), total: units(g.total_mib) })
                    .collect(),
                pending: n.pending.iter().map(|p| units(p.mib)).sum(),
            })
            .collect()
    }

    /// The summary table (`kubectl inspect gpushare`).
    #[must_use]
    pub fn summary(&self) -> String {
        summary(&self.rows(), self.unit)
    }

    /// The details table (`kubectl inspect gpushare -d`): per node, one row per pod with what
    /// it holds on each GPU, then one per DRA claim (named `resourceclaim/<name>`).
    #[must_use]
    pub fn details(&self) -> String {
        let units = |mib: u64| self.unit.whole_units(Mib::new(mib));
        let mut out = String::new();
        let (mut cluster_used, mut cluster_total) = (0u64, 0u64);
        for n in &self.nodes {
            let _ = writeln!(out, "NAME:       {}", n.name);
            let _ = writeln!(out, "IPADDRESS:  {}\n", n.address);
            let mut header = vec!["NAME".to_owned(), "NAMESPACE".to_owned()];
            header.extend(n.gpus.iter().map(|g| format!("GPU{}(Allocated)", g.index)));
            // As Alibaba's: the pending column only on a node with pending pods.
            let with_pending = !n.pending.is_empty();
            if with_pending {
                header.push("Pending(Allocated)".to_owned());
            }
            let rule = "-".repeat(header.iter().map(|h| h.chars().count() + 2).sum::<usize>() + 8);
            // pod -> (per-GPU units, pending units)
            let mut pods: std::collections::BTreeMap<&str, (Vec<u64>, u64)> = std::collections::BTreeMap::new();
            for (i, g) in n.gpus.iter().enumerate() {
                for p in &g.pods {
                    let e = pods.entry(p.pod.as_str()).or_insert_with(|| (vec![0; n.gpus.len()], 0));
                    e.0[i] += units(p.mib);
                }
            }
            for p in &n.pending {
                pods.entry(p.pod.as_str()).or_insert_with(|| (vec![0; n.gpus.len()], 0)).1 += units(p.mib);
            }
            // claim -> per-GPU units (a claim's shares on several GPUs make one row).
            let mut claims: std::collections::BTreeMap<&str, Vec<u64>> = std::collections::BTreeMap::new();
            for (i, g) in n.gpus.iter().enumerate() {
                for c in &g.claims {
                    claims.entry(c.claim.as_str()).or_insert_with(|| vec![0; n.gpus.len()])[i] += units(c.mib);
                }
            }
            let mut table = vec![header];
            let rows = pods
                .iter()
                .map(|(pod, (gpus, pending))| (String::new(), *pod, gpus, Some(*pending)))
                .chain(claims.iter().map(|(claim, gpus)| ("resourceclaim/".to_owned(), *claim, gpus, None)));
            for (kind, object, gpus, pending) in rows {
                let (namespace, name) = object.split_once('/').unwrap_or(("", object));
                let mut row = vec![format!("{kind}{name}"), namespace.to_owned()];
                row.extend(gpus.iter().map(u64::to_string));
                if with_pending {
                    row.push(pending.map(|p| p.to_string()).unwrap_or_default());
                }
                table.push(row);
            }
            let used: u64 = n.gpus.iter().map(|g| units(g.used_mib)).sum::<u64>()
                + n.pending.iter().map(|p| units(p.mib)).sum::<u64>();
            let total: u64 = n.gpus.iter().map(|g| units(g.total_mib)).sum();
            // The totals are cells of the same table, aligned with its columns (as Alibaba's
            // tabwriter aligns them); the empty last cell makes the figures a column too.
            table.push(vec!["Allocated :".to_owned(), format!("{used} ({}%)", percent(used, total)), String::new()]);
            table.push(vec!["Total :".to_owned(), total.to_string(), String::new()]);
            out.push_str(&tabulate(&table));
            for g in &n.gpus {
                for o in &g.over_budget {
                    let who =
                        if o.container.is_empty() { o.pod.clone() } else { format!("{} {:?}", o.pod, o.container) };
                    let _ = writeln!(
                        out,
                        "Over budget :  {who} on GPU{}: {} MiB in use, budget {} MiB",
                        g.index, o.in_use_mib, o.budget_mib
                    );
                }
            }
            out.push_str(&rule);
            out.push('\n');
            cluster_used += used;
            cluster_total += total;
        }
        let _ = writeln!(
            out,
            "\nAllocated/Total GPU Memory In Cluster:  {cluster_used}/{cluster_total} ({}%)",
            percent(cluster_used, cluster_total)
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inspect::{ClaimShare, GpuReport, NodeReport, OverBudgetShare, PodShare};

    fn row(name: &str, address: &str, gpus: &[(u64, u64)], pending: u64) -> NodeRow {
        NodeRow {
            name: name.into(),
            address: address.into(),
            gpus: gpus.iter().map(|&(allocated, total)| GpuCell { allocated, total }).collect(),
            pending,
        }
    }

    #[test]
    fn matches_alibabas_layout() {
        let rows = [
            row("gpu-node-a", "192.168.0.10", &[(9, 15), (2, 15)], 0),
            row("gpu-node-b", "192.168.0.11", &[(4, 15)], 2),
        ];
        let want = "\
NAME        IPADDRESS     GPU0(Allocated/Total)  GPU1(Allocated/Total)  PENDING(Allocated)  GPU Memory(GiB)
gpu-node-a  192.168.0.10  9/15                   2/15                                       11/30
gpu-node-b  192.168.0.11  4/15                   0/0                    2                   6/15
-------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
17/45 (37%)
";
        assert_eq!(summary(&rows, MemoryUnit::Gib), want);
    }

    #[test]
    fn no_pending_column_without_pending_pods_and_empty_clusters_render() {
        let out = summary(&[row("n", "10.0.0.1", &[(3500, 15360)], 0)], MemoryUnit::Mib);
        assert!(out.starts_with("NAME  IPADDRESS  GPU0(Allocated/Total)  GPU Memory(MiB)\n"), "{out}");
        assert!(out.ends_with("3500/15360 (22%)\n"), "{out}");
        let empty = summary(&[], MemoryUnit::Mib);
        assert!(empty.ends_with("0/0 (0%)\n"), "{empty}");
    }

    #[test]
    fn what_nodes_publish_cannot_drive_the_terminal() {
        let rows = [NodeRow {
            name: "n1".into(),
            address: "10.0.0.1\u{1b}[2J\r\nfake-node\t1/1\u{202e}".into(),
            gpus: vec![GpuCell { allocated: 1, total: 2 }],
            pending: 0,
        }];
        let out = summary(&rows, MemoryUnit::Mib);
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(out.contains(r"10.0.0.1\u{1b}[2J\u{d}\u{a}fake-node\u{9}1/1\u{202e}"), "{out}");
        assert!(!out.lines().any(|l| l.starts_with("fake-node")), "a row was forged: {out}");
    }

    #[test]
    fn details_name_containers_over_budget() {
        let gpu = |index: u32, over: Vec<OverBudgetShare>| GpuReport {
            index,
            total_mib: 15_360,
            used_mib: 4096,
            healthy: true,
            mode: "shared".into(),
            pods: vec![PodShare { pod: "ml/train".into(), uid: "u".into(), mib: 4096, in_flight: false }],
            over_budget: over,
            ..GpuReport::default()
        };
        let over = vec![
            OverBudgetShare { pod: "ml/train".into(), container: "main".into(), in_use_mib: 5200, budget_mib: 4096 },
            OverBudgetShare { pod: "ml/rogue".into(), container: String::new(), in_use_mib: 800, budget_mib: 0 },
        ];
        let report = ClusterReport {
            unit: MemoryUnit::Mib,
            nodes: vec![NodeReport {
                name: "n".into(),
                address: "10.0.0.1".into(),
                unit: MemoryUnit::Mib,
                gpus: vec![gpu(0, vec![]), gpu(1, over)],
                pending: vec![],
                ..NodeReport::default()
            }],
            unreadable: vec![],
        };
        let out = report.details();
        assert!(out.contains("Over budget :  ml/train \"main\" on GPU1: 5200 MiB in use, budget 4096 MiB\n"), "{out}");
        assert!(out.contains("Over budget :  ml/rogue on GPU1: 800 MiB in use, budget 0 MiB\n"), "{out}");
        let clean = ClusterReport {
            nodes: vec![NodeReport { gpus: vec![gpu(0, vec![])], ..report.nodes[0].clone() }],
            ..report.clone()
        };
        assert!(!clean.details().contains("Over budget"), "nothing when nobody is over");
    }

    #[test]
    fn details_show_the_pending_column_only_on_a_node_with_pending_pods() {
        let gpu = GpuReport {
            index: 0,
            total_mib: 15_360,
            used_mib: 4096,
            healthy: true,
            pods: vec![PodShare { pod: "ml/train".into(), uid: "u".into(), mib: 4096, in_flight: false }],
            ..GpuReport::default()
        };
        let node = |name: &str, pending: Vec<PodShare>| NodeReport {
            name: name.into(),
            address: "10.0.0.1".into(),
            unit: MemoryUnit::Mib,
            gpus: vec![gpu.clone()],
            pending,
            ..NodeReport::default()
        };
        let waiting = PodShare { pod: "ml/next".into(), uid: String::new(), mib: 2000, in_flight: false };
        let report = ClusterReport {
            unit: MemoryUnit::Mib,
            nodes: vec![node("a", vec![]), node("b", vec![waiting])],
            unreadable: vec![],
        };
        let out = report.details();
        let (a, b) = out.split_at(out.find("NAME:       b").unwrap());
        assert!(a.contains("NAME         NAMESPACE   GPU0(Allocated)\ntrain        ml          4096\n"), "{a}");
        assert!(a.contains("Allocated :  4096 (26%)\nTotal :      15360\n"), "{a}");
        assert!(!a.contains("Pending"), "{a}");
        assert!(b.contains("GPU0(Allocated)  Pending(Allocated)\n"), "{b}");
        assert!(b.contains("next         ml          0                2000\n"), "{b}");
        assert!(b.contains("Allocated :  6096 (39%)\n"), "{b}");
    }

    #[test]
    fn details_list_dra_claims_beside_the_pods() {
        let claim =
            |name: &str, mib| ClaimShare { claim: format!("ml/{name}"), uid: "u".into(), request: "gpu".into(), mib };
        let gpu = |index, pods: Vec<PodShare>, claims: Vec<ClaimShare>| GpuReport {
            index,
            total_mib: 40_960,
            used_mib: pods.iter().map(|p| p.mib).chain(claims.iter().map(|c| c.mib)).sum(),
            healthy: true,
            pods,
            claims,
            ..GpuReport::default()
        };
        let train = PodShare { pod: "ml/train".into(), uid: "p".into(), mib: 4096, in_flight: false };
        let waiting = PodShare { pod: "ml/next".into(), uid: String::new(), mib: 2000, in_flight: false };
        let report = ClusterReport {
            unit: MemoryUnit::Mib,
            nodes: vec![NodeReport {
                name: "n".into(),
                address: "10.0.0.1".into(),
                unit: MemoryUnit::Mib,
                // A claim with shares on both GPUs is one row.
                gpus: vec![
                    gpu(0, vec![train], vec![claim("wide", 1000)]),
                    gpu(1, vec![], vec![claim("infer-gpu", 3500), claim("wide", 1000)]),
                ],
                pending: vec![waiting],
                ..NodeReport::default()
            }],
            unreadable: vec![],
        };
        let out = report.details();
        let want = "\
NAME                     NAMESPACE    GPU0(Allocated)  GPU1(Allocated)  Pending(Allocated)
next                     ml           0                0                2000
train                    ml           4096             0                0
resourceclaim/infer-gpu  ml           0                3500
resourceclaim/wide       ml           1000             1000
Allocated :              11596 (14%)
";
        assert!(out.contains(want), "{out}");
        // The JSON carries each share; none on a GPU without claims.
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            json["nodes"][0]["gpus"][1]["claims"][0],
            serde_json::json!({"claim": "ml/infer-gpu", "uid": "u", "request": "gpu", "mib": 3500})
        );
        let plain = ClusterReport {
            nodes: vec![NodeReport { gpus: vec![gpu(0, vec![], vec![])], ..report.nodes[0].clone() }],
            ..report.clone()
        };
        assert!(serde_json::to_string(&plain).unwrap().find("claims").is_none());
    }

    #[test]
    fn percentages_truncate_and_never_overflow() {
        assert_eq!(percent(2, 3), 66);
        assert_eq!(percent(u64::MAX, u64::MAX), 100);
        assert_eq!(percent(1, 0), 0);
    }
}
