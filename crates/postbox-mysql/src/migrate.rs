//! Versioned, idempotent schema changes, serialised by a named lock.
//!
//! MySQL commits implicitly around every DDL statement, so there is no
//! transaction here: the lock is held by one connection for the whole run,
//! and every statement is idempotent, so a run cut short is simply re-run.

use sqlx::pool::PoolConnection;
use sqlx::{Executor, MySql, Row};

use postbox_core::store::MigrateReport;
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
        let applied: Vec<i32> = sqlx::query(sql::APPLIED_VERSIONS)
            .bind(self.table.as_str())
            .fetch_all(&mut **conn)
            .await
            .map_err(db)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut report = MigrateReport::default();
        for (version, description, statements) in MIGRATIONS {
            if applied.contains(&(*version as i32)) {
                continue;
            }
            for stmt in *statements {
                // Plain text protocol: DDL need not be prepared or cached.
                conn.execute(self.table.render(stmt).as_str())
                    .await
                    .map_err(db)?;
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
