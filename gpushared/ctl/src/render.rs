//! The text and JSON shapes of each answer: tables for people, JSON for scripts.

use gpushared::dbus::{ActivityRecord, AllocationRecord, GpuRecord, HistoryRecord, OverBudgetRecord};
use serde_json::{Value, json};

use crate::{Status, format_ms, pretty};

/// Renders rows under headers in left-aligned columns three spaces apart, each as wide as its
/// widest cell (counted in characters); the last column is not padded. Control characters in
/// cells (a newline in a detail) become spaces so every row stays one line. A row shorter than
/// the headers leaves its last columns empty; cells beyond the headers are dropped.
#[must_use]
pub fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let clean = |s: &str| s.replace(char::is_control, " ");
    let rows: Vec<Vec<String>> =
        rows.iter().map(|r| r.iter().take(headers.len()).map(|c| clean(c)).collect()).collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, w) in widths.iter().enumerate() {
            let cell = cells.next().unwrap_or("");
            text.push_str(cell);
            if i + 1 < widths.len() {
                text.extend(std::iter::repeat_n(' ', w.saturating_sub(cell.chars().count()) + 3));
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// Renders `key: value` lines with the values aligned.
fn key_values(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.chars().count()).max().unwrap_or(0);
    let mut out = String::new();
    for (k, v) in pairs {
        let pad = width.saturating_sub(k.chars().count());
        out.push_str(k);
        out.push(':');
        out.extend(std::iter::repeat_n(' ', pad + 2));
        out.push_str(v);
        out.push('\n');
    }
    out
}

/// The GPU counts of `status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuCounts {
    /// All GPUs.
    pub total: usize,
    /// Healthy ones.
    pub healthy: usize,
    /// Unhealthy ones.
    pub unhealthy: usize,
    /// Cordoned ones (healthy or not).
    pub cordoned: usize,
    /// Total memory, MiB.
    pub total_mib: u64,
    /// Used memory, MiB.
    pub used_mib: u64,
}

/// Counts `gpus`.
#[must_use]
pub fn count_gpus(gpus: &[GpuRecord]) -> GpuCounts {
    let mut c = GpuCounts::default();
    for g in gpus {
        c.total += 1;
        if g.health == "Healthy" {
            c.healthy += 1;
        } else {
            c.unhealthy += 1;
        }
        if g.cordoned {
            c.cordoned += 1;
        }
        c.total_mib = c.total_mib.saturating_add(g.total_mib);
        c.used_mib = c.used_mib.saturating_add(g.used_mib);
    }
    c
}

/// `status` as `key: value` lines.
#[must_use]
pub fn status_text(s: &Status) -> String {
    let c = count_gpus(&s.gpus);
    key_values(&[
        ("node", s.node.clone()),
        ("version", s.version.clone()),
        ("unit", s.unit.clone()),
        ("gpus", format!("{} ({} healthy, {} unhealthy, {} cordoned)", c.total, c.healthy, c.unhealthy, c.cordoned)),
        (
            "memory",
            format!(
                "{} MiB used of {} MiB ({} MiB free)",
                c.used_mib,
                c.total_mib,
                c.total_mib.saturating_sub(c.used_mib)
            ),
        ),
        ("allocations", s.allocations.to_string()),
        ("over budget", format!("{} containers", s.over_budget)),
    ])
}

/// `status` as a JSON object: `node`, `version`, `unit`, `gpus` {`total`, `healthy`,
/// `unhealthy`, `cordoned`}, `totalMiB`, `usedMiB`, `freeMiB`, `allocations`.
#[must_use]
pub fn status_json(s: &Status) -> Value {
    let c = count_gpus(&s.gpus);
    json!({
        "node": s.node,
        "version": s.version,
        "unit": s.unit,
        "gpus": { "total": c.total, "healthy": c.healthy, "unhealthy": c.unhealthy, "cordoned": c.cordoned },
        "totalMiB": c.total_mib,
        "usedMiB": c.used_mib,
        "freeMiB": c.total_mib.saturating_sub(c.used_mib),
        "allocations": s.allocations,
        "overBudget": s.over_budget,
    })
}

fn sorted_gpus(gpus: &[GpuRecord]) -> Vec<&GpuRecord> {
    let mut sorted: Vec<&GpuRecord> = gpus.iter().collect();
    sorted.sort_by_key(|g| g.index);
    sorted
}

/// The health column: `Healthy`, or `Unhealthy (REASON)` when there is a reason.
fn health_cell(health: &str, reason: &str) -> String {
    if reason.is_empty() { health.to_owned() } else { format!("{health} ({reason})") }
}

/// A GPU's mode, utilisation (`None`: not reported) and memory in use (`None`: not sampled).
fn activity_of(activity: &[ActivityRecord], index: u32) -> (String, Option<i32>, Option<i64>) {
    activity.iter().find(|a| a.index == index).map_or_else(
        || ("shared".to_owned(), None, None),
        |a| {
            let (util, in_use) = (a.utilization_percent, a.memory_in_use_mib);
            (a.mode.clone(), (util >= 0).then_some(util), (in_use >= 0).then_some(in_use))
        },
    )
}

/// `gpus` as a table sorted by index: INDEX UUID MODEL TOTAL(MiB) USED(MiB) FREE(MiB) MODE
/// UTIL(%) IN-USE(MiB) HEALTH CORDONED; `-` where NVML gave no figure.
#[must_use]
pub fn gpus_text(gpus: &[GpuRecord], activity: &[ActivityRecord]) -> String {
    if gpus.is_empty() {
        return "no GPUs\n".to_owned();
    }
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    let rows: Vec<Vec<String>> = sorted_gpus(gpus)
        .into_iter()
        .map(|GpuRecord { index, uuid, model, total_mib: total, used_mib: used, health, reason, cordoned }| {
            let (mode, util, in_use) = activity_of(activity, *index);
            vec![
                index.to_string(),
                uuid.clone(),
                model.clone(),
                total.to_string(),
                used.to_string(),
                total.saturating_sub(*used).to_string(),
                mode,
                dash(util.map(|u| u.to_string())),
                dash(in_use.map(|m| m.to_string())),
                health_cell(health, reason),
                if *cordoned { "yes" } else { "no" }.to_owned(),
            ]
        })
        .collect();
    render_table(
        &[
            "INDEX",
            "UUID",
            "MODEL",
            "TOTAL(MiB)",
            "USED(MiB)",
            "FREE(MiB)",
            "MODE",
            "UTIL(%)",
            "IN-USE(MiB)",
            "HEALTH",
            "CORDONED",
        ],
        &rows,
    )
}

/// `gpus` as a JSON array sorted by index; each object has `index`, `uuid`, `model`,
/// `totalMiB`, `usedMiB`, `freeMiB`, `mode`, `utilPercent` and `inUseMiB` (`null` when NVML gave
/// no figure), `health`, `healthReason` (`null` when healthy) and `cordoned`.
#[must_use]
pub fn gpus_json(gpus: &[GpuRecord], activity: &[ActivityRecord]) -> Value {
    Value::Array(
        sorted_gpus(gpus)
            .into_iter()
            .map(|GpuRecord { index, uuid, model, total_mib: total, used_mib: used, health, reason, cordoned }| {
                let (mode, util, in_use) = activity_of(activity, *index);
                json!({
                    "mode": mode,
                    "utilPercent": util,
                    "inUseMiB": in_use,
                    "index": index,
                    "uuid": uuid,
                    "model": model,
                    "totalMiB": total,
                    "usedMiB": used,
                    "freeMiB": total.saturating_sub(*used),
                    "health": health,
                    "healthReason": if reason.is_empty() { Value::Null } else { Value::from(reason.as_str()) },
                    "cordoned": cordoned,
                })
            })
            .collect(),
    )
}

fn sorted_allocations(rows: &[AllocationRecord]) -> Vec<&AllocationRecord> {
    let mut sorted: Vec<&AllocationRecord> = rows.iter().collect();
    sorted.sort_by(|a, b| {
        (&a.namespace, &a.pod, a.allocated_at_ms, &a.container, a.gpu_index).cmp(&(
            &b.namespace,
            &b.pod,
            b.allocated_at_ms,
            &b.container,
            b.gpu_index,
        ))
    });
    sorted
}

/// Live allocations as a table: NAMESPACE POD CONTAINER ROLE GPU MIB SINCE, by pod then time.
/// `pod` is the `--pod` filter, named when there is nothing.
#[must_use]
pub fn allocations_text(rows: &[AllocationRecord], pod: Option<&str>) -> String {
    if rows.is_empty() {
        return match pod {
            Some(p) if !p.is_empty() => format!("no live allocations of {p}\n"),
            _ => "no live allocations\n".to_owned(),
        };
    }
    let rows: Vec<Vec<String>> = sorted_allocations(rows)
        .into_iter()
        .map(
            |AllocationRecord {
                 namespace: ns,
                 pod,
                 container,
                 role,
                 gpu_index: index,
                 mib,
                 allocated_at_ms: at,
                 ..
             }| {
                vec![
                    ns.clone(),
                    pod.clone(),
                    container.clone(),
                    role.clone(),
                    index.to_string(),
                    mib.to_string(),
                    format_ms(*at),
                ]
            },
        )
        .collect();
    render_table(&["NAMESPACE", "POD", "CONTAINER", "ROLE", "GPU", "MIB", "SINCE"], &rows)
}

/// Live allocations as a JSON array; each object has `namespace`, `pod`, `podUid`,
/// `container`, `role`, `gpuIndex`, `gpuUuid`, `mib`, `allocatedAt` (RFC 3339) and
/// `allocatedAtMs` (Unix ms).
#[must_use]
pub fn allocations_json(rows: &[AllocationRecord]) -> Value {
    Value::Array(
        sorted_allocations(rows)
            .into_iter()
            .map(|r| {
                let AllocationRecord {
                    namespace: ns,
                    pod,
                    pod_uid: uid,
                    container,
                    role,
                    gpu_uuid: uuid,
                    gpu_index: index,
                    mib,
                    allocated_at_ms: at,
                } = r;
                json!({
                    "namespace": ns,
                    "pod": pod,
                    "podUid": uid,
                    "container": container,
                    "role": role,
                    "gpuIndex": index,
                    "gpuUuid": uuid,
                    "mib": mib,
                    "allocatedAt": format_ms(*at),
                    "allocatedAtMs": at,
                })
            })
            .collect(),
    )
}

fn sorted_over_budget(rows: &[OverBudgetRecord]) -> Vec<&OverBudgetRecord> {
    let mut sorted: Vec<&OverBudgetRecord> = rows.iter().collect();
    sorted.sort_by(|a, b| {
        (&a.namespace, &a.pod, &a.container, a.gpu_index).cmp(&(&b.namespace, &b.pod, &b.container, b.gpu_index))
    });
    sorted
}

/// The containers over budget as a table: NAMESPACE POD CONTAINER GPU IN-USE(MiB) BUDGET(MiB)
/// SINCE, by pod. A container not tied to one of the pod's containers shows `-`.
#[must_use]
pub fn over_budget_text(rows: &[OverBudgetRecord]) -> String {
    if rows.is_empty() {
        return "no container is over its budget\n".to_owned();
    }
    let rows: Vec<Vec<String>> = sorted_over_budget(rows)
        .into_iter()
        .map(
            |OverBudgetRecord {
                 namespace: ns,
                 pod,
                 container,
                 gpu_index: gpu,
                 in_use_mib: in_use,
                 budget_mib: budget,
                 since_ms: since,
                 ..
             }| {
                vec![
                    ns.clone(),
                    pod.clone(),
                    if container.is_empty() { "-".to_owned() } else { container.clone() },
                    gpu.to_string(),
                    in_use.to_string(),
                    budget.to_string(),
                    format_ms(*since),
                ]
            },
        )
        .collect();
    render_table(&["NAMESPACE", "POD", "CONTAINER", "GPU", "IN-USE(MiB)", "BUDGET(MiB)", "SINCE"], &rows)
}

/// The containers over budget as a JSON array; each object has `namespace`, `pod`, `podUid`,
/// `container` (`null` when not tied to one), `gpuIndex`, `inUseMiB`, `budgetMiB`, `since`
/// (RFC 3339) and `sinceMs`.
#[must_use]
pub fn over_budget_json(rows: &[OverBudgetRecord]) -> Value {
    Value::Array(
        sorted_over_budget(rows)
            .into_iter()
            .map(|r| {
                let OverBudgetRecord {
                    namespace: ns,
                    pod,
                    pod_uid: uid,
                    container,
                    gpu_index: gpu,
                    in_use_mib: in_use,
                    budget_mib: budget,
                    since_ms: since,
                } = r;
                json!({
                    "namespace": ns,
                    "pod": pod,
                    "podUid": uid,
                    "container": if container.is_empty() { Value::Null } else { Value::from(container.as_str()) },
                    "gpuIndex": gpu,
                    "inUseMiB": in_use,
                    "budgetMiB": budget,
                    "since": format_ms(*since),
                    "sinceMs": since,
                })
            })
            .collect(),
    )
}

/// History as a table, oldest first: TIME KIND DETAIL. `since` is named when there is nothing.
#[must_use]
pub fn history_text(rows: &[HistoryRecord], since: i64) -> String {
    if rows.is_empty() {
        return format!("nothing since {}\n", format_ms(since));
    }
    let rows: Vec<Vec<String>> =
        rows.iter().map(|r| vec![format_ms(r.at_ms), r.kind.clone(), r.detail.clone()]).collect();
    render_table(&["TIME", "KIND", "DETAIL"], &rows)
}

/// History as a JSON array, oldest first; each object has `time` (RFC 3339), `timeMs` (Unix
/// ms), `kind` and `detail`.
#[must_use]
pub fn history_json(rows: &[HistoryRecord]) -> Value {
    Value::Array(
        rows.iter()
            .map(|r| json!({ "time": format_ms(r.at_ms), "timeMs": r.at_ms, "kind": r.kind, "detail": r.detail }))
            .collect(),
    )
}

/// What `cordon` (`cordon` true) or `uncordon` prints for `gpu`, given whether anything changed:
/// `GPU 1 cordoned`, `GPU 1 was already cordoned`, `GPU 1 uncordoned`, `GPU 1 was not
/// cordoned`; or `{"gpu": "1", "cordoned": true, "changed": true}`.
#[must_use]
pub fn cordon_output(gpu: &str, cordon: bool, changed: bool, json: bool) -> String {
    if json {
        return pretty(&json!({ "gpu": gpu, "cordoned": cordon, "changed": changed }));
    }
    match (cordon, changed) {
        (true, true) => format!("GPU {gpu} cordoned\n"),
        (true, false) => format!("GPU {gpu} was already cordoned\n"),
        (false, true) => format!("GPU {gpu} uncordoned\n"),
        (false, false) => format!("GPU {gpu} was not cordoned\n"),
    }
}
