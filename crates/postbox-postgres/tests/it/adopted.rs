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
    let headers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns WHERE table_name = $1 AND column_name = 'headers'",
    )
    .bind(&name)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(headers, 0);

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
