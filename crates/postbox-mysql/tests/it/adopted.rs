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

/// A legacy table of the seed's shape, made on a scratch name, whose
/// `aggregate_id` is `aggregate` (`VARCHAR(255)`) and whose definition
/// ends with `options`; its name and a store on it.
async fn legacy_with_aggregate(
    aggregate: &str,
    options: &str,
) -> (sqlx::MySqlPool, String, MySqlOutbox) {
    let (pool, table) = scratch().await;
    let name = table.as_str().to_owned();
    let store = MySqlOutbox::named(pool.clone(), table);
    let legacy = ddl(&name).replace(
        "aggregate_id VARCHAR(128)",
        &format!("aggregate_id {aggregate}"),
    ) + options;
    sqlx::query(&legacy).execute(&pool).await.unwrap();
    (pool, name, store)
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

/// A table whose aggregates are longer than postbox's own (255 against
/// 128) keeps them whole in the head index: an `INSERT` of a longer
/// aggregate failed after adopt ("Data too long for column
/// 'open_aggregate_id'"), failing the producer's transaction.
#[tokio::test]
async fn adopt_keeps_aggregates_as_long_as_the_tables() {
    let (pool, name, store) = legacy_with_aggregate("VARCHAR(255)", "").await;
    let plan = store.adopt(true).await.unwrap();
    assert!(plan.applied, "{plan:#?}");
    let long = "r".repeat(200);
    sqlx::query(&format!(
        "INSERT INTO {name} (app_code, event_id, biz_type, aggregate_id, aggregate_version, payload) \
         VALUES ('leg', 'long-1', 'T', ?, 1, '{{}}')"
    ))
    .bind(&long)
    .execute(&pool)
    .await
    .expect("a 200-character aggregate");
    let row = store.find("long-1").await.unwrap().remove(0);
    assert_eq!(row.aggregate_id.as_deref(), Some(long.as_str()));
    postbox_testkit::adopted::drop_adopted(&pool, &name).await;
}

/// Aggregates too long for the head index's key (InnoDB's 3,072 bytes) are
/// a blocker, named before anything changes: the index build failed after
/// the virtual columns were added, leaving the adoption half done.
#[tokio::test]
async fn adopt_names_aggregates_too_long_for_an_index() {
    let (pool, name, store) = legacy_with_aggregate("VARCHAR(1000)", "").await;
    let plan = store.adopt(true).await.unwrap();
    assert!(!plan.applied, "{plan:#?}");
    let said = plan.blockers.join("\n");
    assert!(
        said.contains("`aggregate_id` holds 1000 characters (4000 bytes)"),
        "{said}"
    );
    let virtuals: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.columns WHERE table_schema = DATABASE() \
         AND table_name = ? AND column_name = 'open_aggregate_id'",
    )
    .bind(&name)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(virtuals, 0, "nothing was changed");
    sqlx::query(&format!("DROP TABLE {name}"))
        .execute(&pool)
        .await
        .unwrap();
}

/// A legacy latin1 table's long aggregates fit the head index (one byte a
/// character): no blocker. The check took every character for four bytes.
#[tokio::test]
async fn adopt_takes_long_aggregates_of_a_narrow_character_set() {
    let (pool, name, store) =
        legacy_with_aggregate("VARCHAR(1000)", " DEFAULT CHARSET = latin1").await;
    let plan = store.adopt(true).await.unwrap();
    assert!(plan.applied, "{plan:#?}");
    postbox_testkit::adopted::drop_adopted(&pool, &name).await;
}
