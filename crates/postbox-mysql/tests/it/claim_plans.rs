//! With 1,000,000 delivered rows (and another tenant's backlog) in the
//! table, every claim query reads through its `app_code`-led index and
//! touches only rows it could claim (MariaDB `ANALYZE` measures it).

use postbox_mysql::MySqlOutbox;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::mysql_url;
use postbox_testkit::store_setup::migrated;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_use_their_index_over_a_million_delivered_rows() {
    let store = migrated("mysql", mysql_url(), |url| async move {
        MySqlOutbox::connect(&url, &scratch_table("plans"), 2).await
    })
    .await;
    let t = store.table().as_str().to_owned();
    let load = [
        // History: a million delivered rows (MariaDB's sequence engine).
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
                 SELECT 'plan', CONCAT('d-', seq), 'Old', '{{}}', 'delivered', 1000000000000 + seq, 1000000000000 + seq \
                 FROM seq_1_to_1000000"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload) \
                 SELECT 'other', CONCAT('o-', seq), 'New', '{{}}' FROM seq_1_to_20000"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload) \
                 SELECT 'plan', CONCAT('p-', seq), 'New', '{{}}' FROM seq_1_to_150"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, retry_count, next_retry_at_ms) \
                 SELECT 'plan', CONCAT('r-', seq), 'Retry', '{{}}', 'retryable', 1, IF(seq <= 100, 0, 9000000000000000) \
                 FROM seq_1_to_200"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, worker_id, lock_until_ms) \
                 SELECT 'plan', CONCAT('l-', seq), 'Leased', '{{}}', 'delivering', 'w', IF(seq <= 100, 0, 9000000000000000) \
                 FROM seq_1_to_200"),
        format!("ANALYZE TABLE {t}"),
    ];
    let plans = postbox_testkit::conformance::claims_use_their_index_over(
        std::sync::Arc::new(store.clone()),
        store.pool().clone(),
        &load,
    )
    .await;
    assert!(
        plans.iter().all(|p| p.rows_examined.is_some()),
        "MariaDB measures rows read"
    );
}
