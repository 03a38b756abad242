//! `gpusharectl claims`: the live DRA claims as a table or JSON (docs/gpusharectl.md).

use gpushared::dbus::ClaimRecord;
use serde_json::{Value, json};

use crate::{format_ms, render_table};

fn sorted(rows: &[ClaimRecord]) -> Vec<&ClaimRecord> {
    let mut sorted: Vec<&ClaimRecord> = rows.iter().collect();
    sorted.sort_by(|a, b| {
        (&a.namespace, &a.claim, a.prepared_at_ms, a.gpu_index).cmp(&(
            &b.namespace,
            &b.claim,
            b.prepared_at_ms,
            b.gpu_index,
        ))
    });
    sorted
}

/// The claims as a table: NAMESPACE CLAIM GPU MIB SINCE, by claim.
#[must_use]
pub fn claims_text(rows: &[ClaimRecord]) -> String {
    if rows.is_empty() {
        return "no live DRA claims\n".to_owned();
    }
    let rows: Vec<Vec<String>> = sorted(rows)
        .into_iter()
        .map(|r| {
            vec![
                r.namespace.clone(),
                r.claim.clone(),
                r.gpu_index.to_string(),
                r.mib.to_string(),
                format_ms(r.prepared_at_ms),
            ]
        })
        .collect();
    render_table(&["NAMESPACE", "CLAIM", "GPU", "MIB", "SINCE"], &rows)
}

/// The claims as a JSON array; each object has `namespace`, `claim`, `claimUid`, `gpuIndex`,
/// `gpuUuid`, `mib`, `preparedAt` (RFC 3339) and `preparedAtMs` (Unix ms).
#[must_use]
pub fn claims_json(rows: &[ClaimRecord]) -> Value {
    Value::Array(
        sorted(rows)
            .into_iter()
            .map(|r| {
                json!({
                    "namespace": r.namespace,
                    "claim": r.claim,
                    "claimUid": r.claim_uid,
                    "gpuIndex": r.gpu_index,
                    "gpuUuid": r.gpu_uuid,
                    "mib": r.mib,
                    "preparedAt": format_ms(r.prepared_at_ms),
                    "preparedAtMs": r.prepared_at_ms,
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(claim: &str, gpu: u32, mib: u64) -> ClaimRecord {
        ClaimRecord {
            namespace: "ml".to_owned(),
            claim: claim.to_owned(),
            claim_uid: format!("uid-{claim}"),
            gpu_uuid: format!("GPU-{gpu}"),
            gpu_index: gpu,
            mib,
            prepared_at_ms: 1_764_000_000_000,
        }
    }

    #[test]
    fn claims_print_by_name_as_a_table_and_as_json() {
        assert_eq!(claims_text(&[]), "no live DRA claims\n");
        let rows = [row("serve-b", 1, 3500), row("serve-a", 0, 81_919)];
        let text = claims_text(&rows);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("NAMESPACE") && lines[0].contains("CLAIM"), "{text}");
        assert!(lines[1].contains("serve-a") && lines[1].contains("81919"), "{text}");
        assert!(lines[2].contains("serve-b") && lines[2].contains("3500"), "{text}");
        let json = claims_json(&rows);
        assert_eq!(json[0]["claim"], "serve-a");
        assert_eq!(json[1]["gpuUuid"], "GPU-1");
        assert_eq!(json[1]["preparedAt"], "2025-11-24T16:00:00Z");
    }
}
