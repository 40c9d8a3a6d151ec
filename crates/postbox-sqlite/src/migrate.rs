//! Versioned, idempotent schema changes, serialised by SQLite's write lock
//! (`BEGIN IMMEDIATE`); SQLite's DDL is transactional, so a failed run
//! leaves nothing behind.
//!
//! The ledger (`postbox_schema_migrations`) is checked against the tables
//! first, under the same lock ([`check_ledger`]): an outbox table that is
//! gone is created as new, and versions whose tables are gone run again.

use sqlx::Row;

use postbox_core::store::{check_ledger, MigrateReport, EXPECTED_TABLES};
use postbox_core::Result;

use crate::{finish, sql, SqliteOutbox};

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

impl SqliteOutbox {
    pub(crate) async fn run_migrations(&self) -> Result<MigrateReport> {
        let db = |e| crate::db_error("migrate", e);
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(db)?;
        let res = async {
            sqlx::query(sql::CREATE_MIGRATIONS_TABLE)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
            let mut applied: Vec<i64> = sqlx::query(sql::APPLIED_VERSIONS)
                .bind(self.table.as_str())
                .fetch_all(&mut *tx)
                .await
                .map_err(db)?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let mut existing_query = sqlx::query_scalar(sql::EXISTING_TABLES);
            for suffix in EXPECTED_TABLES {
                existing_query = existing_query.bind(format!("{}{suffix}", self.table));
            }
            let existing: Vec<String> = existing_query.fetch_all(&mut *tx).await.map_err(db)?;
            let recorded: Vec<u32> = applied.iter().map(|v| *v as u32).collect();
            let check = check_ledger(self.table.as_str(), &recorded, &existing);
            for note in &check.notes {
                tracing::warn!(table = %self.table, "migrate: {note}");
            }
            if check.forget_ledger {
                sqlx::query(sql::FORGET_VERSIONS)
                    .bind(self.table.as_str())
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
                applied.clear();
            }
            let mut report = MigrateReport {
                notes: check.notes,
                ..MigrateReport::default()
            };
            for (version, description, statements) in MIGRATIONS {
                let pending = !applied.contains(&i64::from(*version));
                if !pending && !check.rerun.contains(version) {
                    continue;
                }
                for stmt in *statements {
                    sqlx::query(&self.table.render(stmt))
                        .execute(&mut *tx)
                        .await
                        .map_err(db)?;
                }
                if pending && *version == 1 {
                    // A (re)created outbox table continues a kept archive's ids.
                    for stmt in sql::CONTINUE_IDS_AFTER_ARCHIVE {
                        sqlx::query(&self.table.render(stmt))
                            .execute(&mut *tx)
                            .await
                            .map_err(db)?;
                    }
                }
                if !pending {
                    continue;
                }
                sqlx::query(sql::RECORD_VERSION)
                    .bind(self.table.as_str())
                    .bind(i64::from(*version))
                    .bind(*description)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
                report.applied.push(*version);
            }
            Ok((applied, report))
        }
        .await;
        let (applied, mut report) = finish(tx, res, "migrate").await?;
        report.version = applied
            .iter()
            .map(|v| *v as u32)
            .chain(report.applied.iter().copied())
            .max()
            .unwrap_or(0);
        Ok(report)
    }
}
