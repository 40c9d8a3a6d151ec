//! A team's own outbox table, adopted (`[database.columns]`,
//! `[database.statuses]`, `postbox adopt --apply`): the conformance suite
//! once more on it, and its legacy rows read as their postbox statuses.

use postbox_postgres::PgOutbox;
use postbox_testkit::adopted::{assert_applied_then_nothing_left, assert_first_plan, legacy_ddl};
use postbox_testkit::servers::postgres_url;

const CLOCK: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

fn ddl(t: &str) -> String {
    legacy_ddl(t, "BIGSERIAL PRIMARY KEY", "TEXT", CLOCK)
}

postbox_testkit::adopted_suite!(server: "postgres", store: PgOutbox, pool: sqlx::PgPool, url: postgres_url, ddl: ddl);

/// Whether table `t` has the `headers` column `adopt` adds.
async fn has_headers(pool: &sqlx::PgPool, t: &str) -> bool {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns WHERE table_name = $1 AND column_name = 'headers'",
    )
    .bind(t)
    .fetch_one(pool)
    .await
    .unwrap();
    n > 0
}

#[tokio::test]
async fn adopt_reports_what_it_adds_then_runs_it_online_and_then_finds_nothing() {
    let (pool, table) = scratch().await;
    let name = table.as_str().to_owned();
    let store = PgOutbox::named(pool.clone(), table);
    let missing = store.adopt(false).await.unwrap_err().to_string();
    assert!(missing.contains("does not exist"), "{missing}");

    sqlx::query(&ddl(&name)).execute(&pool).await.unwrap();
    // `migrate` would build the indexes under its lock and leave the
    // columns out: it sends the user to `adopt`.
    let refused = store.migrate().await.unwrap_err().to_string();
    assert!(refused.contains("postbox adopt"), "{refused}");
    let plan = store.adopt(false).await.unwrap();
    println!("adopt plan: {plan:#?}");
    let indexes = [
        "_event_uq",
        "_pending_idx",
        "_retry_idx",
        "_lease_idx",
        "_failed_idx",
        "_done_idx",
        "_head_idx",
    ];
    assert_first_plan(&plan, &indexes);
    assert!(
        plan.statements
            .iter()
            .filter(|s| s.contains("INDEX"))
            .all(|s| s.contains(" CONCURRENTLY ")),
        "{:?}",
        plan.statements
    );
    // The indexes read the table's names and legacy statuses.
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
    assert!(!has_headers(&pool, &name).await);

    assert_applied_then_nothing_left(&store).await;

    // An event column the table lacks blocks the adoption, naming the key.
    let (_, other) = scratch().await;
    sqlx::query(&ddl(other.as_str()).replace("biz_type", "kind"))
        .execute(&pool)
        .await
        .unwrap();
    let blocked = PgOutbox::named(pool.clone(), other)
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

/// An event stored twice blocks the adoption, naming it, before anything
/// changes; the unique index a failed online build left invalid (and so
/// present by name, but never used by `ON CONFLICT`) is dropped and built
/// again.
#[tokio::test]
async fn duplicates_block_and_an_invalid_index_is_built_again() {
    let (pool, table) = scratch().await;
    let t = table.as_str().to_owned();
    sqlx::query(&ddl(&t)).execute(&pool).await.unwrap();
    let twice = format!(
        "INSERT INTO {t} (app_code, event_id, biz_type, payload) VALUES \
         ('leg', 'dup', 'T', '{{}}'), ('leg', 'dup', 'T', '{{}}'), ('leg', 'one', 'T', '{{}}')"
    );
    sqlx::query(&twice).execute(&pool).await.unwrap();
    let failed =
        format!("CREATE UNIQUE INDEX CONCURRENTLY {t}_event_uq ON {t} (app_code, event_id)");
    assert!(sqlx::query(&failed).execute(&pool).await.is_err());
    let store = PgOutbox::named(pool.clone(), table);

    let blocked = store.adopt(true).await.unwrap();
    assert!(!blocked.applied, "{blocked:?}");
    assert!(
        blocked.blockers.iter().any(|b| b.contains("leg/dup")),
        "{blocked:?}"
    );
    assert!(
        blocked.statements[..4]
            .iter()
            .any(|s| s == &format!("DROP INDEX CONCURRENTLY IF EXISTS {t}_event_uq")),
        "{:?}",
        blocked.statements
    );
    assert!(!has_headers(&pool, &t).await, "nothing ran");

    let keep_one =
        format!("DELETE FROM {t} WHERE id = (SELECT max(id) FROM {t} WHERE event_id = 'dup')");
    sqlx::query(&keep_one).execute(&pool).await.unwrap();
    let applied = store.adopt(true).await.unwrap();
    assert!(applied.applied, "{applied:?}");
    let valid: bool = sqlx::query_scalar(
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = $1",
    )
    .bind(format!("{t}_event_uq"))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(valid);
    let dup = postbox_core::NewEvent::new("leg", "T", "{}").event_id("one");
    let err = store.enqueue_batch(&[dup], 1 << 20).await;
    assert!(
        matches!(
            err.as_deref(),
            Ok([postbox_core::store::EnqueueOutcome::Duplicate])
        ),
        "{err:?}"
    );
}

/// Long aggregates are no blocker on PostgreSQL (its head index is over
/// the column itself): the check meant for InnoDB's key limit refused a
/// PostgreSQL table with a `VARCHAR(1000)` aggregate.
#[tokio::test]
async fn adopt_takes_long_aggregates() {
    let (pool, table) = scratch().await;
    let name = table.as_str().to_owned();
    let store = PgOutbox::named(pool.clone(), table);
    let legacy = ddl(&name).replace("aggregate_id VARCHAR(128)", "aggregate_id VARCHAR(1000)");
    assert!(legacy.contains("VARCHAR(1000)"));
    sqlx::query(&legacy).execute(&pool).await.unwrap();
    let plan = store.adopt(false).await.unwrap();
    assert!(plan.blockers.is_empty(), "{plan:#?}");
    sqlx::query(&format!("DROP TABLE {name}"))
        .execute(&pool)
        .await
        .unwrap();
}
