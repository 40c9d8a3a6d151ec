//! A team's own outbox table, adopted (`[database.columns]`,
//! `[database.statuses]`, `postbox adopt --apply`): the conformance suite
//! once more on it, and its legacy rows read as their postbox statuses.

use std::collections::BTreeMap;
use std::sync::Arc;

use postbox_core::naming::Naming;
use postbox_core::store::{ArchiveRequest, ClaimRequest, EventFilter, OutboxStore, RelayStore};
use postbox_core::{ClaimSource, NewEvent, Status, TableName};
use postbox_postgres::PgOutbox;
use postbox_testkit::servers::postgres_url;
use postbox_testkit::store_setup::connected;
use postbox_testkit::{conformance_suite, scratch_table};

/// The legacy table of seed 002's services: `biz_type` for the event
/// type, `state` for the status (new rows default to `init`),
/// `locked_until_ms`; no `headers`, `delivered_to` or `replay_count`.
fn legacy_ddl(t: &str) -> String {
    format!(
        "CREATE TABLE {t} ( \
           id BIGSERIAL PRIMARY KEY, app_code VARCHAR(64) NOT NULL, event_id VARCHAR(64) NOT NULL, \
           biz_type VARCHAR(128) NOT NULL, aggregate_id VARCHAR(128), aggregate_version BIGINT, \
           payload TEXT NOT NULL, state VARCHAR(16) NOT NULL DEFAULT 'init', \
           retry_count INT NOT NULL DEFAULT 0, next_retry_at_ms BIGINT NOT NULL DEFAULT 0, \
           locked_until_ms BIGINT NOT NULL DEFAULT 0, worker_id VARCHAR(128), last_error TEXT, \
           created_at_ms BIGINT NOT NULL DEFAULT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT, \
           updated_at_ms BIGINT NOT NULL DEFAULT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT)"
    )
}

fn legacy_naming() -> Naming {
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
    .unwrap()
}

/// A legacy table (made by `setup`, which may add rows), adopted.
async fn adopt_with(setup: impl AsyncFnOnce(&sqlx::PgPool, &str)) -> PgOutbox {
    let name = scratch_table("pgadopt");
    let plain: PgOutbox = connected("postgres", postgres_url(), |url| {
        let name = name.clone();
        async move { PgOutbox::connect(&url, &name, 4).await }
    })
    .await;
    let pool = plain.pool().clone();
    sqlx::query(&legacy_ddl(&name))
        .execute(&pool)
        .await
        .unwrap();
    setup(&pool, &name).await;
    let table = TableName::new(&name).unwrap().with_naming(legacy_naming());
    let store = PgOutbox::named(pool, table);
    let report = store.adopt(true).await.expect("adopt --apply");
    assert!(report.blockers.is_empty() && report.applied, "{report:?}");
    store
}

async fn adopted_store() -> Arc<dyn OutboxStore> {
    Arc::new(adopt_with(async |_, _| {}).await)
}

mod conformance {
    use super::*;
    conformance_suite!(adopted_store);
}

#[tokio::test]
async fn adopt_reports_what_it_adds_and_then_nothing() {
    let name = scratch_table("pgadopt");
    let plain: PgOutbox = connected("postgres", postgres_url(), |url| {
        let name = name.clone();
        async move { PgOutbox::connect(&url, &name, 2).await }
    })
    .await;
    let pool = plain.pool().clone();
    let table = TableName::new(&name).unwrap().with_naming(legacy_naming());
    let store = PgOutbox::named(pool.clone(), table);
    let missing = store.adopt(false).await.unwrap_err().to_string();
    assert!(missing.contains("does not exist"), "{missing}");

    sqlx::query(&legacy_ddl(&name))
        .execute(&pool)
        .await
        .unwrap();
    let plan = store.adopt(false).await.unwrap();
    println!("adopt plan: {plan:#?}");
    assert!(!plan.applied && plan.blockers.is_empty());
    assert_eq!(
        plan.missing_columns,
        ["headers", "delivered_to", "replay_count"]
    );
    for index in [
        "event_uq",
        "pending_idx",
        "retry_idx",
        "lease_idx",
        "failed_idx",
        "done_idx",
        "head_idx",
    ] {
        assert!(
            plan.missing_indexes.contains(&format!("{name}_{index}")),
            "{index}: {plan:?}"
        );
    }
    assert!(
        plan.statements
            .iter()
            .filter(|s| s.contains("INDEX"))
            .all(|s| s.contains(" CONCURRENTLY ")),
        "{:?}",
        plan.statements
    );
    // The plan reads the table's names and legacy statuses.
    let pending = plan
        .statements
        .iter()
        .find(|s| s.contains("_pending_idx"))
        .unwrap();
    assert!(
        pending.contains("biz_type") && pending.contains("state IN ('pending', 'init')"),
        "{pending}"
    );
    // Nothing ran.
    let columns: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns WHERE table_name = $1 AND column_name = 'headers'",
    )
    .bind(&name)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(columns, 0);

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
    let schema = postbox_core::store::SchemaStore::inspect_schema(&store)
        .await
        .unwrap();
    assert!(schema.objects.iter().all(|o| o.present), "{schema:?}");

    // An event column the table lacks blocks the adoption, naming the key.
    let other = scratch_table("pgadopt");
    sqlx::query(&legacy_ddl(&other).replace("biz_type", "kind"))
        .execute(&pool)
        .await
        .unwrap();
    let table = TableName::new(&other).unwrap().with_naming(legacy_naming());
    let blocked = PgOutbox::named(pool.clone(), table)
        .adopt(true)
        .await
        .unwrap();
    assert!(!blocked.applied, "{blocked:?}");
    assert!(
        blocked.blockers[0].contains("`biz_type`")
            && blocked.blockers[0].contains("[database.columns]"),
        "{blocked:?}"
    );
}

#[tokio::test]
async fn legacy_rows_read_as_their_postbox_status() {
    let store = adopt_with(async |pool, t| {
        let rows = format!(
            "INSERT INTO {t} (app_code, event_id, biz_type, payload, state, worker_id, locked_until_ms, \
               next_retry_at_ms, updated_at_ms, aggregate_id) VALUES \
             ('leg', 'new-1', 'T', '{{}}', 'init', NULL, 0, 0, 1, NULL), \
             ('leg', 'held', 'T', '{{}}', 'running', 'old-worker', 1, 1, 1, 'agg'), \
             ('leg', 'after-held', 'T', '{{}}', 'init', NULL, 0, 0, 1, 'agg'), \
             ('leg', 'old-done', 'T', '{{}}', 'done', NULL, 0, 0, 1, NULL), \
             ('leg', 'old-published', 'T', '{{}}', 'published', NULL, 0, 0, 1, NULL), \
             ('leg', 'old-dead', 'T', '{{}}', 'dead', NULL, 0, 0, 1, NULL)"
        );
        sqlx::query(&rows).execute(pool).await.unwrap();
    })
    .await;
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
    let mut conn = store.pool().acquire().await.unwrap();
    let new = NewEvent::new("leg", "T", "{}").event_id("new-2");
    store.enqueue(&mut conn, &new).await.unwrap();
    let claim = ClaimRequest {
        app_code: "leg",
        limit: 10,
        worker_id: "adopter",
        lease_ms: 30_000,
        ordered: true,
        skip_types: &[],
    };
    let mut taken: Vec<String> = RelayStore::claim(&store, ClaimSource::Pending, &claim)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.record.event_id)
        .collect();
    taken.sort();
    assert_eq!(taken, ["new-1", "new-2"]);
    // The old worker's lease has expired: it is taken over.
    let over = RelayStore::claim(&store, ClaimSource::ExpiredLease, &claim)
        .await
        .unwrap();
    assert_eq!(over.len(), 1);
    assert_eq!(over[0].record.event_id, "held");
    assert_eq!(over[0].record.status, Status::Delivering);

    // `done` and `published` rows are archived like delivered ones.
    let archived = store
        .archive(
            &ArchiveRequest {
                app_codes: vec!["leg".into()],
                before_ms: i64::MAX,
                batch_size: 100,
                max_batches: None,
            },
            &|_| {},
        )
        .await
        .unwrap();
    assert_eq!(archived.moved, 2, "{archived:?}");
}
