//! Archiving in batches under a session advisory lock.

use sqlx::pool::PoolConnection;
use sqlx::Postgres;

use postbox_core::store::{ArchiveReport, ArchiveRequest, ARCHIVE_QUERIES};
use postbox_core::Result;

use crate::{sql, PgOutbox};

impl PgOutbox {
    pub(crate) async fn archive_rows(
        &self,
        req: &ArchiveRequest,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ArchiveReport> {
        let db = |e| crate::db_error("archive", e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let locked: bool = sqlx::query_scalar(sql::ARCHIVE_LOCK)
            .bind(self.table.as_str())
            .fetch_one(&mut *conn)
            .await
            .map_err(db)?;
        if !locked {
            return Ok(ArchiveReport {
                locked_out: true,
                ..Default::default()
            });
        }
        let report = self.archive_locked(&mut conn, req, on_batch).await;
        let released = sqlx::query(sql::ARCHIVE_UNLOCK)
            .bind(self.table.as_str())
            .execute(&mut *conn)
            .await;
        if let Err(e) = released {
            // The lock dies with the session: make sure the session dies.
            tracing::warn!(error = %e, "could not release the archive lock; closing its connection");
            conn.close_on_drop();
        }
        report
    }

    async fn archive_locked(
        &self,
        conn: &mut PoolConnection<Postgres>,
        req: &ArchiveRequest,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ArchiveReport> {
        let db = |e| crate::db_error("archive", e);
        let mut report = ArchiveReport::default();
        for app_code in &req.app_codes {
            for (_, status, _) in ARCHIVE_QUERIES {
                loop {
                    if req.max_batches.is_some_and(|m| report.batches >= m) {
                        return Ok(report);
                    }
                    let (deleted, copied): (i64, i64) = sqlx::query_as(&self.sql.archive_batch)
                        .bind(app_code)
                        .bind(status)
                        .bind(req.before_ms)
                        .bind(i64::from(req.batch_size))
                        .fetch_one(&mut **conn)
                        .await
                        .map_err(db)?;
                    postbox_core::archive::log_archived_duplicates(
                        self.table.as_str(),
                        deleted,
                        copied,
                    );
                    let moved = deleted as u64;
                    if moved == 0 {
                        break;
                    }
                    report.moved += moved;
                    report.batches += 1;
                    on_batch(moved);
                }
            }
        }
        report.complete = true;
        Ok(report)
    }
}
