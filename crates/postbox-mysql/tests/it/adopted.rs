//! A team's own outbox table on MariaDB/MySQL, adopted: the conformance
//! suite once more on it, and its legacy rows read as their postbox
//! statuses.

use postbox_mysql::MySqlOutbox;
use postbox_testkit::adopted::{assert_applied_then_nothing_left, assert_first_plan, legacy_ddl};
use postbox_testkit::servers::mysql_url;

fn ddl(t: &str) -> String {
    legacy_ddl(
        t,
        "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
        "MEDIUMTEXT",
        "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
    )
}

postbox_testkit::adopted_suite!(server: "mysql", store: MySqlOutbox, pool: sqlx::MySqlPool, url: mysql_url, ddl: ddl);

#[tokio::test]
async fn adopt_reports_what_it_adds_then_runs_it_in_place_and_then_finds_nothing() {
    let (pool, table) = scratch().await;
    let name = table.as_str().to_owned();
    let store = MySqlOutbox::named(pool.clone(), table);
    sqlx::query(&ddl(&name)).execute(&pool).await.unwrap();
    let plan = store.adopt(false).await.unwrap();
    println!("adopt plan: {plan:#?}");
    assert_first_plan(&plan, &["_event_uq", "_due_idx", "_head_idx"]);
    assert!(
        plan.statements
            .iter()
            .all(|s| s.ends_with("ALGORITHM=INPLACE, LOCK=NONE")),
        "{:?}",
        plan.statements
    );
    let head = plan
        .statements
        .iter()
        .find(|s| s.contains("open_aggregate_id VARCHAR"))
        .unwrap();
    assert!(
        head.contains("state IN ('pending', 'delivering', 'retryable', 'init', 'running')"),
        "{head}"
    );

    assert_applied_then_nothing_left(&store).await;
}
