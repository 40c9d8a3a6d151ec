//! A team's own outbox table on MariaDB/MySQL, adopted: the conformance
//! suite once more on it, and its legacy rows read as their postbox
//! statuses.

use std::sync::Arc;

use postbox_core::store::OutboxStore;
use postbox_core::TableName;
use postbox_mysql::MySqlOutbox;
use postbox_testkit::adopted::{self, assert_first_plan, legacy_ddl, legacy_naming, legacy_rows};
use postbox_testkit::servers::mysql_url;
use postbox_testkit::store_setup::connected;
use postbox_testkit::{conformance_suite, scratch_table};

fn ddl(t: &str) -> String {
    legacy_ddl(
        t,
        "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
        "MEDIUMTEXT",
        "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
    )
}

/// A pool, and a fresh table name with the legacy naming.
async fn scratch() -> (sqlx::MySqlPool, TableName) {
    let name = scratch_table("myadopt");
    let plain: MySqlOutbox = connected("mysql", mysql_url(), |url| {
        let name = name.clone();
        async move { MySqlOutbox::connect(&url, &name, 4).await }
    })
    .await;
    let table = TableName::new(&name).unwrap().with_naming(legacy_naming());
    (plain.pool().clone(), table)
}

/// A legacy table, with rows if `rows`, adopted.
async fn adopted_table(rows: bool) -> MySqlOutbox {
    let (pool, table) = scratch().await;
    sqlx::query(&ddl(table.as_str()))
        .execute(&pool)
        .await
        .unwrap();
    if rows {
        sqlx::query(&legacy_rows(table.as_str()))
            .execute(&pool)
            .await
            .unwrap();
    }
    let store = MySqlOutbox::named(pool, table);
    let report = store.adopt(true).await.expect("adopt --apply");
    assert!(report.blockers.is_empty() && report.applied, "{report:?}");
    store
}

async fn adopted_store() -> Arc<dyn OutboxStore> {
    Arc::new(adopted_table(false).await)
}

mod conformance {
    use super::*;
    conformance_suite!(adopted_store);
}

#[tokio::test]
async fn legacy_rows_read_as_their_postbox_status() {
    adopted::legacy_rows_read_as_their_postbox_status(Arc::new(adopted_table(true).await)).await;
}

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
