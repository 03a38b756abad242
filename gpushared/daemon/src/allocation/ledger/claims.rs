//! The DRA claims prepared on this node, in the ledger's `claims` table: one row per device
//! share a claim's allocation holds (claim, request, GPU, share, MiB), written in one
//! transaction before `NodePrepareResources` answers, released (kept as history) when the
//! kubelet unprepares the claim. Beside `allocations`, they are the node's one ledger.

use gpushare_core::{GpuUuid, Mib};
use rusqlite::params;

use super::{Ledger, LedgerError, now_ms, sql};

/// One claim's share of one GPU, to be written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewClaimRow {
    /// The ResourceClaim's UID.
    pub claim_uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The request of the claim this share answers.
    pub request: String,
    /// kube-scheduler's share ID (empty where it gave none).
    pub share_id: String,
    /// The GPU.
    pub gpu_uuid: GpuUuid,
    /// Its index.
    pub gpu_index: u32,
    /// The memory consumed.
    pub mib: Mib,
}

/// A claim row as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRow {
    /// Row id.
    pub id: i64,
    /// What was written.
    pub share: NewClaimRow,
    /// When it was prepared (Unix ms).
    pub prepared_at: i64,
}

type Raw = (i64, String, String, String, String, String, String, i64, i64, i64);

impl Ledger {
    /// Writes one claim's shares in one transaction, committed before return.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses (a live row for the same claim, request, GPU and share
    /// among them); then nothing is written.
    pub fn prepare_claim(&mut self, rows: &[NewClaimRow]) -> Result<Vec<ClaimRow>, LedgerError> {
        let at = now_ms();
        let path = self.path.clone();
        let sqlite = |what| sql(&path, what);
        let tx = self.conn.transaction().map_err(sqlite("starting a claim"))?;
        let mut written = Vec::with_capacity(rows.len());
        for r in rows {
            tx.prepare_cached(
                "INSERT INTO claims (claim_uid, namespace, claim_name, request, share_id, gpu_uuid, gpu_index, mib,
                                     prepared_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )
            .and_then(|mut insert| {
                insert.execute(params![
                    r.claim_uid,
                    r.namespace,
                    r.name,
                    r.request,
                    r.share_id,
                    r.gpu_uuid.as_str(),
                    r.gpu_index,
                    i64::try_from(r.mib.get()).unwrap_or(i64::MAX),
                    at
                ])
            })
            .map_err(sqlite("writing a claim"))?;
            written.push(ClaimRow { id: tx.last_insert_rowid(), share: r.clone(), prepared_at: at });
        }
        tx.commit().map_err(sqlite("committing a claim"))?;
        Ok(written)
    }

    /// Releases every live row of a claim, keeping them as history. Returns how many.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses.
    pub fn release_claim(&mut self, claim_uid: &str, reason: &str) -> Result<usize, LedgerError> {
        self.conn
            .execute(
                "UPDATE claims SET released_at = ?1, release_reason = ?2 WHERE claim_uid = ?3 AND released_at IS NULL",
                params![now_ms(), reason, claim_uid],
            )
            .map_err(self.err("releasing a claim"))
    }

    /// Every live claim row, oldest first.
    ///
    /// # Errors
    /// [`LedgerError`] if SQLite refuses or a row breaks the table's rules.
    pub fn live_claims(&self) -> Result<Vec<ClaimRow>, LedgerError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT id, claim_uid, namespace, claim_name, request, share_id, gpu_uuid, gpu_index, mib, prepared_at
                 FROM claims WHERE released_at IS NULL ORDER BY id",
            )
            .map_err(self.err("reading the live claims"))?;
        let raw = stmt
            .query_map([], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                    r.get(8)?,
                    r.get(9)?,
                ))
            })
            .map_err(self.err("reading the live claims"))?
            .collect::<Result<Vec<Raw>, _>>()
            .map_err(self.err("reading the live claims"))?;
        raw.into_iter()
            .map(|(id, claim_uid, namespace, name, request, share_id, uuid, index, mib, prepared_at)| {
                let bad =
                    |why: String| LedgerError::BadRow { path: self.path.clone(), id, why: format!("claims: {why}") };
                Ok(ClaimRow {
                    id,
                    share: NewClaimRow {
                        claim_uid,
                        namespace,
                        name,
                        request,
                        share_id,
                        gpu_uuid: GpuUuid::new(uuid).map_err(|e| bad(e.to_string()))?,
                        gpu_index: u32::try_from(index).map_err(|_| bad(format!("index {index}")))?,
                        mib: Mib::new(u64::try_from(mib).map_err(|_| bad(format!("{mib} MiB")))?),
                    },
                    prepared_at,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(uid: &str, gpu: u32, mib: u64) -> NewClaimRow {
        NewClaimRow {
            claim_uid: uid.to_owned(),
            namespace: "ns".to_owned(),
            name: format!("claim-{uid}"),
            request: "gpu".to_owned(),
            share_id: format!("s{gpu}"),
            gpu_uuid: GpuUuid::new(format!("GPU-{gpu}")).unwrap(),
            gpu_index: gpu,
            mib: Mib::new(mib),
        }
    }

    #[test]
    fn claims_survive_reopening_and_release_keeps_history() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let mut l = Ledger::open(&path).unwrap().ledger;
        l.prepare_claim(&[share("a", 0, 3500), share("a", 1, 3500)]).unwrap();
        l.prepare_claim(&[share("b", 0, 1000)]).unwrap();
        // The same share again is refused by the table: nothing of it is written.
        assert!(l.prepare_claim(&[share("c", 1, 10), share("b", 0, 1000)]).is_err());
        drop(l);
        let mut l = Ledger::open(&path).unwrap().ledger;
        let live = l.live_claims().unwrap();
        let got: Vec<(&str, u32, u64)> =
            live.iter().map(|r| (r.share.claim_uid.as_str(), r.share.gpu_index, r.share.mib.get())).collect();
        assert_eq!(got, [("a", 0, 3500), ("a", 1, 3500), ("b", 0, 1000)]);
        assert_eq!(l.release_claim("a", "unprepared").unwrap(), 2);
        assert_eq!(l.release_claim("a", "unprepared").unwrap(), 0);
        assert_eq!(l.live_claims().unwrap().len(), 1);
        let kept: i64 = l.conn.query_row("SELECT count(*) FROM claims", [], |r| r.get(0)).unwrap();
        assert_eq!(kept, 3, "released rows stay as history");
    }
}
