//! The SQLite backend of postbox: the embedded default, for one relay
//! process next to the service.
//!
//! Services enqueue inside their own transaction:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::SqlitePool) -> postbox_core::Result<()> {
//! use postbox_core::NewEvent;
//! use postbox_sqlite::SqliteOutbox;
//!
//! let outbox = SqliteOutbox::new(pool.clone(), "room_outbox")?;
//! // `BEGIN IMMEDIATE` takes the write lock up front, so a transaction that
//! // reads before it writes never fails with SQLITE_BUSY half-way.
//! let mut tx = pool
//!     .begin_with("BEGIN IMMEDIATE")
//!     .await
//!     .map_err(|e| postbox_core::Error::database("begin", e))?;
//! // ... the service's own writes on &mut *tx ...
//! outbox.enqueue(&mut tx, &NewEvent::new("room", "RoomCreated", r#"{"room_id":42}"#)).await?;
//! tx.commit().await.map_err(|e| postbox_core::Error::database("commit", e))?;
//! # Ok(()) }
//! ```
//!
//! The relay and the CLI use the same type through
//! [`OutboxStore`](postbox_core::OutboxStore).
//!
//! SQLite has no `FOR UPDATE SKIP LOCKED`; each claim is one
//! `BEGIN IMMEDIATE` write transaction instead, so concurrent claims are
//! serialised by the database's write lock and never hand out a row twice.
//! The database clock is this host's clock.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod dialect;
mod explain;
mod sql;

pub use dialect::SqliteDialect;

/// An outbox table in SQLite: the engine with the SQLite dialect.
///
/// [`SqliteOutbox::connect`] opens `url` (`sqlite://path`, `sqlite:path` or
/// `sqlite::memory:`), creating the file if missing, in WAL mode with
/// `synchronous = NORMAL`, a 10 s busy timeout and foreign keys on; an
/// in-memory database gets exactly one connection, kept open, so every
/// user sees the same database. [`SqliteOutbox::connect_existing`] never
/// creates the file: a missing one is an error naming it.
pub type SqliteOutbox = postbox_sqlx::SqlOutbox<SqliteDialect>;

/// Opens an outbox table as a `dyn OutboxStore`: [`postbox_sqlx::SqlOutbox::open`].
pub fn open(options: postbox_sqlx::OpenOptions<'_>) -> postbox_sqlx::Opened<'_> {
    SqliteOutbox::open(options)
}

#[cfg(test)]
mod tests {
    use super::dialect::is_memory_url;
    use postbox_core::ClaimSource;

    /// A migrated outbox `room_outbox` in a database of its own, in memory.
    async fn migrated_in_memory() -> super::SqliteOutbox {
        let o = super::SqliteOutbox::connect("sqlite::memory:", "room_outbox", 1)
            .await
            .unwrap();
        o.migrate().await.unwrap();
        o
    }

    /// Over the count cap, `stats` asks the dialect for the delivered rows
    /// while a pool of one connection (an in-memory database) must still
    /// serve it: the count comes back exact, not after the pool's
    /// acquire timeout.
    #[tokio::test]
    async fn stats_over_the_count_cap_on_a_pool_of_one() {
        use postbox_core::store::DELIVERED_COUNT_CAP;
        let o = migrated_in_memory().await;
        let n = DELIVERED_COUNT_CAP + 5;
        sqlx::query(&format!(
            "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < {n}) \
             INSERT INTO room_outbox (app_code, event_id, event_type, payload, status) \
             SELECT 'room', 'e' || i, 'T', '{{}}', 'delivered' FROM g"
        ))
        .execute(o.pool())
        .await
        .unwrap();
        let stats = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            o.stats(&["room".to_owned()]),
        )
        .await
        .expect("stats answers without waiting for a second connection")
        .unwrap();
        assert_eq!(stats[0].delivered, n);
        assert!(!stats[0].delivered_estimated, "SQLite counts");
    }

    /// The `detail` column of `EXPLAIN QUERY PLAN`, one line per step.
    async fn plan<'q>(
        q: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
        pool: &sqlx::SqlitePool,
    ) -> String {
        use sqlx::Row;
        q.fetch_all(pool)
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<String, _>("detail"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every claim and the backlog query is answered from the index its
    /// comment names, never by scanning the table, and sorts nothing but
    /// the pending claims' candidates (dealt across types: at most the
    /// batch size per pending type), whose rows it then finds by rowid.
    #[tokio::test]
    async fn claims_use_their_indexes() {
        let o = migrated_in_memory().await;
        let cases = [
            (
                o.own().claims.of(ClaimSource::Pending, false),
                "room_outbox_pending_idx",
            ),
            (
                o.own().claims.of(ClaimSource::Pending, true),
                "room_outbox_head_idx",
            ),
            (
                o.own().claims.of(ClaimSource::DueRetry, false),
                "room_outbox_retry_idx",
            ),
            (
                o.own().claims.of(ClaimSource::ExpiredLease, false),
                "room_outbox_lease_idx",
            ),
            (o.statements().backlog.as_str(), "room_outbox_pending_idx"),
            (o.statements().backlog.as_str(), "room_outbox_retry_idx"),
            (o.statements().count_open.as_str(), "room_outbox_failed_idx"),
            (o.statements().count_open.as_str(), "room_outbox_done_idx"),
            (o.statements().find.as_str(), "room_outbox_event_uq"),
        ];
        for (sql, index) in cases {
            let plan = plan(
                sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .bind("room")
                    .bind(10_i64)
                    .bind("w")
                    .bind(1_i64)
                    .bind(1_i64),
                o.pool(),
            )
            .await;
            assert!(plan.contains(index), "{sql}\n{plan}");
            assert!(!plan.contains("SCAN room_outbox"), "{sql}\n{plan}");
            if sql.contains("fair (fid, rn, t)") {
                let first = plan.lines().next().unwrap_or_default();
                assert!(first.contains("INTEGER PRIMARY KEY"), "{sql}\n{plan}");
            } else {
                assert!(!plan.contains("TEMP B-TREE"), "{sql}\n{plan}");
            }
        }
        for (sql, what) in [
            (&o.statements().mark_delivered, "INTEGER PRIMARY KEY"),
            (&o.statements().release, "INTEGER PRIMARY KEY"),
        ] {
            let plan = plan(
                sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .bind("[1]")
                    .bind("w")
                    .bind(1_i64),
                o.pool(),
            )
            .await;
            assert!(plan.contains(what), "{sql}\n{plan}");
        }
        // The history prune (each failed attempt, takeover and replay, in
        // the write lock producers wait for) reads the events' entries
        // through `_history_event_idx`: it scanned the whole history,
        // which only grows.
        let sql = &o.statements().history_prune;
        let plan = plan(
            sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
                .bind("[1]")
                .bind(50_i64),
            o.pool(),
        )
        .await;
        assert!(
            plan.contains("room_outbox_history_event_idx"),
            "{sql}\n{plan}"
        );
        assert!(
            !plan
                .lines()
                .any(|l| l.starts_with("SCAN") && !l.contains("json_each")),
            "{sql}\n{plan}"
        );
    }

    /// Issue 11: `doctor` read a failed schema-version query as "version
    /// 0"; it is an error now. A database without the ledger is version 0.
    #[tokio::test]
    async fn a_failed_version_read_is_an_error_not_version_0() {
        let o = migrated_in_memory().await;
        for sql in [
            "DROP TABLE postbox_schema_migrations",
            "CREATE TABLE postbox_schema_migrations (table_name TEXT, version TEXT)",
            "INSERT INTO postbox_schema_migrations VALUES ('room_outbox', 'three')",
        ] {
            sqlx::query(sql).execute(o.pool()).await.unwrap();
        }
        let err = o.inspect_schema().await.unwrap_err();
        assert!(err.to_string().contains("inspect schema"), "{err}");
        sqlx::query("DROP TABLE postbox_schema_migrations")
            .execute(o.pool())
            .await
            .unwrap();
        assert_eq!(o.inspect_schema().await.unwrap().version, 0);
    }

    #[test]
    fn recognises_memory_urls() {
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite://?mode=memory",
            "sqlite://x?cache=shared&mode=memory",
        ] {
            assert!(is_memory_url(url), "{url}");
        }
        for url in [
            "sqlite://postbox.db",
            "sqlite:postbox.db",
            "sqlite:///tmp/a.db",
        ] {
            assert!(!is_memory_url(url), "{url}");
        }
    }
}
