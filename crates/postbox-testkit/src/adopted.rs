//! An adopted table (`[database.columns]`, `[database.statuses]`,
//! `postbox adopt`): seed 002's legacy outbox table, and what every
//! backend that adopts it must read from its legacy rows.

use std::collections::BTreeMap;
use std::sync::Arc;

use postbox_core::naming::Naming;
use postbox_core::store::{AdoptReport, ArchiveRequest, ClaimRequest, EventFilter, OutboxStore};
use postbox_core::{ClaimSource, NewEvent, Status};

/// The legacy table of seed 002's services: `biz_type` for the event
/// type, `state` for the status (new rows default to `init`),
/// `locked_until_ms`; no `headers`, `delivered_to` or `replay_count`.
/// `id` is the database's auto-increment primary key, `clock` its epoch
/// milliseconds, `text` its payload type.
pub fn legacy_ddl(t: &str, id: &str, text: &str, clock: &str) -> String {
    format!(
        "CREATE TABLE {t} ( \
           id {id}, app_code VARCHAR(64) NOT NULL, event_id VARCHAR(64) NOT NULL, \
           biz_type VARCHAR(128) NOT NULL, aggregate_id VARCHAR(128), aggregate_version BIGINT, \
           payload {text} NOT NULL, state VARCHAR(16) NOT NULL DEFAULT 'init', \
           retry_count INT NOT NULL DEFAULT 0, next_retry_at_ms BIGINT NOT NULL DEFAULT 0, \
           locked_until_ms BIGINT NOT NULL DEFAULT 0, worker_id VARCHAR(128), last_error TEXT, \
           created_at_ms BIGINT NOT NULL DEFAULT ({clock}), \
           updated_at_ms BIGINT NOT NULL DEFAULT ({clock}))"
    )
}

/// How the legacy table names postbox's columns and statuses.
pub fn legacy_naming() -> Naming {
    let pairs = |p: &[(&str, &str)]| -> BTreeMap<String, String> {
        p.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    Naming::new(
        &pairs(&[
            ("event_type", "biz_type"),
            ("status", "state"),
            ("lock_until_ms", "locked_until_ms"),
        ]),
        &pairs(&[
            ("init", "pending"),
            ("done", "delivered"),
            ("running", "delivering"),
            ("dead", "failed"),
        ]),
    )
    .expect("the legacy naming")
}

/// Rows the legacy worker left in `t` under app_code `leg`: two new
/// (`init`), one held by a worker whose lease ran out (`running`, its
/// aggregate's head), delivered ones (`done`, `published`), a dead letter.
pub fn legacy_rows(t: &str) -> String {
    format!(
        "INSERT INTO {t} (app_code, event_id, biz_type, payload, state, worker_id, locked_until_ms, \
           next_retry_at_ms, updated_at_ms, aggregate_id) VALUES \
         ('leg', 'new-1', 'T', '{{}}', 'init', NULL, 0, 0, 1, NULL), \
         ('leg', 'held', 'T', '{{}}', 'running', 'old-worker', 1, 1, 1, 'agg'), \
         ('leg', 'after-held', 'T', '{{}}', 'init', NULL, 0, 0, 1, 'agg'), \
         ('leg', 'old-done', 'T', '{{}}', 'done', NULL, 0, 0, 1, NULL), \
         ('leg', 'old-published', 'T', '{{}}', 'published', NULL, 0, 0, 1, NULL), \
         ('leg', 'old-dead', 'T', '{{}}', 'dead', NULL, 0, 0, 1, NULL)"
    )
}

/// The first `adopt` of the legacy table: everything postbox adds, nothing
/// blocking, nothing run yet.
pub fn assert_first_plan(plan: &AdoptReport, indexes: &[&str]) {
    assert!(!plan.applied && plan.blockers.is_empty(), "{plan:?}");
    assert_eq!(
        plan.missing_columns,
        ["headers", "delivered_to", "replay_count"]
    );
    for index in indexes {
        let name = format!("{}{index}", plan.table);
        assert!(plan.missing_indexes.contains(&name), "{index}: {plan:?}");
    }
    assert_eq!(
        plan.renamed,
        [
            ("event_type", "biz_type"),
            ("lock_until_ms", "locked_until_ms"),
            ("status", "state")
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
}

/// `adopt --apply` on the planned table runs it all and migrates; then
/// nothing is left to add and every object `doctor` expects is there.
pub async fn assert_applied_then_nothing_left(store: &dyn OutboxStore) {
    let applied = store.adopt(true).await.unwrap();
    assert!(applied.applied);
    assert_eq!(applied.migrated.as_ref().map(|m| m.version), Some(11));
    let again = store.adopt(false).await.unwrap();
    assert!(
        again.missing_columns.is_empty()
            && again.missing_indexes.is_empty()
            && again.statements.is_empty(),
        "{again:?}"
    );
    let schema = store.inspect_schema().await.unwrap();
    assert!(schema.objects.iter().all(|o| o.present), "{schema:?}");
}

/// The store (adopted over [`legacy_rows`]) reads the legacy rows as their
/// postbox statuses: counts, lists, claims (new rows and the expired
/// lease), archiving.
pub async fn legacy_rows_read_as_their_postbox_status(store: Arc<dyn OutboxStore>) {
    let s = store.stats(&["leg".into()]).await.unwrap().remove(0);
    assert_eq!(
        (s.pending, s.delivering, s.delivered, s.failed),
        (2, 1, 2, 1),
        "{s:?}"
    );
    let dead = EventFilter {
        app_code: Some("leg".into()),
        status: Some(Status::Failed),
        limit: 10,
        ..Default::default()
    };
    let dead = store.list(&dead).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].event_id.as_str(), dead[0].status),
        ("old-dead", Status::Failed)
    );

    // A new row goes in as the table's default (`init`) and is claimed
    // with the legacy pending one; the aggregate behind the old worker's
    // lease waits.
    let new = NewEvent::new("leg", "T", "{}").event_id("new-2");
    store.enqueue_batch(&[new], 1 << 20).await.unwrap();
    let claim = ClaimRequest {
        app_code: "leg",
        limit: 10,
        worker_id: "adopter",
        lease_ms: 30_000,
        ordered: true,
        skip_types: &[],
    };
    let mut taken: Vec<String> = store
        .claim(ClaimSource::Pending, &claim)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.record.event_id)
        .collect();
    taken.sort();
    assert_eq!(taken, ["new-1", "new-2"]);
    // The old worker's lease has expired: it is taken over.
    let over = store
        .claim(ClaimSource::ExpiredLease, &claim)
        .await
        .unwrap();
    assert_eq!(over.len(), 1);
    assert_eq!(over[0].record.event_id, "held");
    assert_eq!(over[0].record.status, Status::Delivering);

    // `done` and `published` rows are archived like delivered ones.
    let request = ArchiveRequest {
        app_codes: vec!["leg".into()],
        before_ms: i64::MAX,
        batch_size: 100,
        max_batches: None,
        partitions: Default::default(),
    };
    let archived = store.archive(&request, &|_| {}).await.unwrap();
    assert_eq!(archived.moved, 2, "{archived:?}");
}

/// For one backend (`$store`, a `SqlOutbox`, on `$server` at `$url()`,
/// the legacy table made by `$ddl(name)`): `scratch()` (a pool and a fresh
/// table name with [`legacy_naming`]), `adopted_table(rows)` (the legacy
/// table, with [`legacy_rows`] if `rows`, adopted with `--apply`), the
/// conformance suite on an adopted table, and
/// [`legacy_rows_read_as_their_postbox_status`].
#[macro_export]
macro_rules! adopted_suite {
    (server: $server:literal, store: $store:ty, pool: $pool:ty, url: $url:path, ddl: $ddl:path) => {
        /// A pool, and a fresh table name with the legacy naming.
        async fn scratch() -> ($pool, postbox_core::TableName) {
            let name = $crate::scratch_table(concat!($server, "_adopt"));
            let plain: $store = $crate::store_setup::connected($server, $url(), |url| {
                let name = name.clone();
                async move { <$store>::connect(&url, &name, 4).await }
            })
            .await;
            let table = postbox_core::TableName::new(&name)
                .unwrap()
                .with_naming($crate::adopted::legacy_naming());
            (plain.pool().clone(), table)
        }

        /// A legacy table, with rows if `rows`, adopted.
        async fn adopted_table(rows: bool) -> $store {
            let (pool, table) = scratch().await;
            sqlx::query(&$ddl(table.as_str()))
                .execute(&pool)
                .await
                .unwrap();
            if rows {
                let insert = $crate::adopted::legacy_rows(table.as_str());
                sqlx::query(&insert).execute(&pool).await.unwrap();
            }
            let store = <$store>::named(pool, table);
            let report = store.adopt(true).await.expect("adopt --apply");
            assert!(report.blockers.is_empty() && report.applied, "{report:?}");
            store
        }

        async fn adopted_store() -> std::sync::Arc<dyn postbox_core::store::OutboxStore> {
            std::sync::Arc::new(adopted_table(false).await)
        }

        mod conformance {
            $crate::conformance_suite!(super::adopted_store);
        }

        #[tokio::test]
        async fn legacy_rows_read_as_their_postbox_status() {
            let store: std::sync::Arc<dyn postbox_core::store::OutboxStore> =
                std::sync::Arc::new(adopted_table(true).await);
            $crate::adopted::legacy_rows_read_as_their_postbox_status(store).await;
        }

        /// Columns postbox's statements would never match are named before
        /// anything changes: a lease end that allows NULL (a row with a NULL
        /// one was never taken over), a status with no default (rows written
        /// by `enqueue` got NULL and were never claimed). Both were adopted
        /// silently.
        #[tokio::test]
        async fn adopt_names_columns_its_statements_would_never_match() {
            let (pool, table) = scratch().await;
            let name = table.as_str().to_owned();
            let store = <$store>::named(pool.clone(), table);
            let legacy = $ddl(&name)
                .replace(
                    "locked_until_ms BIGINT NOT NULL DEFAULT 0",
                    "locked_until_ms BIGINT NULL",
                )
                .replace(
                    "state VARCHAR(16) NOT NULL DEFAULT 'init'",
                    "state VARCHAR(16) NULL",
                );
            sqlx::query(&legacy).execute(&pool).await.unwrap();
            let plan = store.adopt(true).await.unwrap();
            assert!(!plan.applied, "{plan:#?}");
            let said = plan.blockers.join("\n");
            assert!(said.contains("`locked_until_ms` allows NULL"), "{said}");
            assert!(
                said.contains("`state` allows NULL") && said.contains("`state` has no default"),
                "{said}"
            );
            $crate::adopted::drop_adopted(&pool, &name).await;
        }
    };
}

/// Drops a table `adopt` worked on and the tables `migrate` added beside it.
pub async fn drop_adopted<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, name: &str)
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    for suffix in [
        "_archive",
        "_history",
        "_controls",
        "_control_log",
        "_relays",
        "",
    ] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {name}{suffix}"))
            .execute(pool)
            .await;
    }
}
