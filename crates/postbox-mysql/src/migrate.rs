//! Versioned, idempotent schema changes, serialised by a named lock.
//!
//! MySQL commits implicitly around every DDL statement, so there is no
//! transaction here: the lock is held by one connection for the whole run,
//! and every statement is idempotent, so a run cut short is simply re-run.
//!
//! The ledger (`postbox_schema_migrations`) is checked against the tables
//! first, under the same lock ([`check_ledger`]): an outbox table that is
//! gone is created as new, and versions whose tables are gone run again.

use sqlx::pool::PoolConnection;
use sqlx::{Executor, MySql, Row};

use postbox_core::store::{check_ledger, MigrateReport, EXPECTED_TABLES};
use postbox_core::{Error, Result};

use crate::{sql, MySqlOutbox};

/// `(version, description, statements)`, applied in order.
pub(crate) const MIGRATIONS: &[(u32, &str, &[&str])] = &[
    (
        1,
        "outbox table, claim indexes, archive table",
        sql::V1_SCHEMA,
    ),
    (2, "attempt history", sql::V2_HISTORY),
    (3, "list index (app_code, status, id)", sql::V3_LIST_INDEX),
];

impl MySqlOutbox {
    pub(crate) async fn run_migrations(&self) -> Result<MigrateReport> {
        let db = |e| crate::db_error("migrate", e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let locked: Option<i64> = sqlx::query_scalar(sql::MIGRATION_LOCK)
            .bind(self.table.as_str())
            .fetch_one(&mut *conn)
            .await
            .map_err(db)?;
        if locked != Some(1) {
            return Err(Error::Schema(format!(
                "another `postbox migrate` on table `{}` held the migration lock for 60s; try again",
                self.table
            )));
        }
        let report = self.migrate_locked(&mut conn).await;
        let released = sqlx::query(sql::MIGRATION_UNLOCK)
            .bind(self.table.as_str())
            .execute(&mut *conn)
            .await;
        if let Err(e) = released {
            // The lock dies with the session: make sure the session dies.
            tracing::warn!(error = %e, "could not release the migration lock; closing its connection");
            conn.close_on_drop();
        }
        report
    }

    async fn migrate_locked(&self, conn: &mut PoolConnection<MySql>) -> Result<MigrateReport> {
        let db = |e| crate::db_error("migrate", e);
        sqlx::query(sql::CREATE_MIGRATIONS_TABLE)
            .execute(&mut **conn)
            .await
            .map_err(db)?;
        let mut applied: Vec<i32> = sqlx::query(sql::APPLIED_VERSIONS)
            .bind(self.table.as_str())
            .fetch_all(&mut **conn)
            .await
            .map_err(db)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut existing_query = sqlx::query_scalar(sql::EXISTING_TABLES);
        for suffix in EXPECTED_TABLES {
            existing_query = existing_query.bind(format!("{}{suffix}", self.table));
        }
        let existing: Vec<String> = existing_query.fetch_all(&mut **conn).await.map_err(db)?;
        let recorded: Vec<u32> = applied.iter().map(|v| *v as u32).collect();
        let check = check_ledger(self.table.as_str(), &recorded, &existing);
        for note in &check.notes {
            tracing::warn!(table = %self.table, "migrate: {note}");
        }
        if check.forget_ledger {
            sqlx::query(sql::FORGET_VERSIONS)
                .bind(self.table.as_str())
                .execute(&mut **conn)
                .await
                .map_err(db)?;
            applied.clear();
        }
        let mut report = MigrateReport {
            notes: check.notes,
            ..MigrateReport::default()
        };
        for (version, description, statements) in MIGRATIONS {
            let pending = !applied.contains(&(*version as i32));
            // Versions 1 and 2, the only ones re-run, are `IF NOT EXISTS`.
            if !pending && !check.rerun.contains(version) {
                continue;
            }
            for stmt in *statements {
                // Plain text protocol: DDL need not be prepared or cached.
                conn.execute(self.table.render(stmt).as_str())
                    .await
                    .map_err(db)?;
            }
            // A (re)created outbox table continues the ids of an archive
            // that was kept; done before version 1 is recorded, so that a
            // run cut short here does it again.
            if pending && *version == 1 {
                let kept: Option<i64> = sqlx::query_scalar(&self.table.render(sql::ARCHIVE_MAX_ID))
                    .fetch_one(&mut **conn)
                    .await
                    .map_err(db)?;
                if let Some(max) = kept {
                    let next = max.saturating_add(1);
                    conn.execute(
                        self.table
                            .render(&format!("ALTER TABLE {{table}} AUTO_INCREMENT = {next}"))
                            .as_str(),
                    )
                    .await
                    .map_err(db)?;
                }
            }
            if !pending {
                continue;
            }
            sqlx::query(sql::RECORD_VERSION)
                .bind(self.table.as_str())
                .bind(*version as i32)
                .bind(*description)
                .execute(&mut **conn)
                .await
                .map_err(db)?;
            report.applied.push(*version);
        }
        report.version = applied
            .iter()
            .map(|v| *v as u32)
            .chain(report.applied.iter().copied())
            .max()
            .unwrap_or(0);
        Ok(report)
    }
}
