//! The cluster table of `kubectl inspect gpushare`, in the layout Alibaba's users and their
//! scripts know: one row per node, one `GPUi(Allocated/Total)` column per GPU, an optional
//! `PENDING(Allocated)` column, and the node and cluster totals, all in the cluster unit.
//! Columns are aligned like Go's `text/tabwriter` with padding 2; percentages are truncated.

use std::fmt::Write as _;

use gpushare_core::MemoryUnit;

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
fn tabulate(table: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = Vec::new();
    for row in table {
        for (i, cell) in row.iter().enumerate().take(row.len().saturating_sub(1)) {
            let w = cell.chars().count();
            match widths.get_mut(i) {
                Some(max) => *max = (*max).max(w),
                None => widths.push(w),
            }
        }
    }
    let mut out = String::new();
    for row in table {
        let last = row.len().saturating_sub(1);
        for (i, cell) in row.iter().enumerate() {
            out.push_str(cell);
            if i < last {
                let pad = widths.get(i).copied().unwrap_or(0) + 2 - cell.chars().count();
                out.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn percentages_truncate_and_never_overflow() {
        assert_eq!(percent(2, 3), 66);
        assert_eq!(percent(u64::MAX, u64::MAX), 100);
        assert_eq!(percent(1, 0), 0);
    }
}
