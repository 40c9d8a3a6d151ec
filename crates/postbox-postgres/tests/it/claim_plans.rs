//! With 1,000,000 delivered rows (and another tenant's backlog) in the
//! table, every claim query reads through its `app_code`-led index and
//! touches only rows it could claim.

use postbox_postgres::PgOutbox;
use postbox_testkit::servers::postgres_url;
use postbox_testkit::store_setup::migrated;
use postbox_testkit::{assert_claim_plans, scratch_table};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_use_their_index_over_a_million_delivered_rows() {
    let store = migrated("postgres", postgres_url(), |url| async move {
        PgOutbox::connect(&url, &scratch_table("plans"), 2).await
    })
    .await;
    let t = store.table().as_str().to_owned();
    let load = [
        // History: a million delivered rows of the tenant being claimed.
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
                 SELECT 'plan', 'd-' || g, 'Old', '{{}}', 'delivered', 1000000000000 + g, 1000000000000 + g \
                 FROM generate_series(1, 1000000) g"),
        // Another tenant's backlog, which a claim for `plan` must not read.
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload) \
                 SELECT 'other', 'o-' || g, 'New', '{{}}' FROM generate_series(1, 20000) g"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload) \
                 SELECT 'plan', 'p-' || g, 'New', '{{}}' FROM generate_series(1, 150) g"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, retry_count, next_retry_at_ms) \
                 SELECT 'plan', 'r-' || g, 'Retry', '{{}}', 'retryable', 1, CASE WHEN g <= 100 THEN 0 ELSE 9000000000000000 END \
                 FROM generate_series(1, 200) g"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, worker_id, lock_until_ms) \
                 SELECT 'plan', 'l-' || g, 'Leased', '{{}}', 'delivering', 'w', CASE WHEN g <= 100 THEN 0 ELSE 9000000000000000 END \
                 FROM generate_series(1, 200) g"),
        format!("ANALYZE {t}"),
    ];
    for sql in &load {
        sqlx::query(sql)
            .execute(store.pool())
            .await
            .expect("load rows");
    }
    let plans = store.explain_claims("plan", 100).await.unwrap();
    // At most the 100 rows claimed, read once through the claim index and
    // once by primary key for the update, with a little slack.
    assert_claim_plans(&plans, 250);
    // Nothing was changed by explaining.
    let s = store.stats(&["plan".into()]).await.unwrap().remove(0);
    assert_eq!(
        (s.pending, s.retryable, s.delivering, s.delivered),
        (150, 200, 200, 1_000_000)
    );
    sqlx::query(&format!("DROP TABLE {t}, {t}_archive, {t}_history"))
        .execute(store.pool())
        .await
        .unwrap();
}
