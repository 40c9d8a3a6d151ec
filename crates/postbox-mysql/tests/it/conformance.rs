//! MySQL / MariaDB runs the shared conformance suite.

use std::sync::Arc;

use postbox_core::store::OutboxStore;
use postbox_mysql::MySqlOutbox;
use postbox_testkit::servers::mysql_url;
use postbox_testkit::store_setup::migrated;
use postbox_testkit::{conformance_suite, scratch_table};

async fn fresh_store() -> Arc<dyn OutboxStore> {
    let store = migrated("mysql", mysql_url(), |url| async move {
        MySqlOutbox::connect(&url, &scratch_table("my"), 4).await
    })
    .await;
    Arc::new(store)
}

conformance_suite!(fresh_store);

/// Issue 9.13: after a killed connection whose mark had committed, the
/// retried mark is the relay's own result, not a takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_recognises_its_own_mark_after_a_lost_answer() {
    postbox_testkit::faults::relay_recognises_its_own_mark_after_a_lost_answer(fresh_store().await)
        .await;
}

/// Issue 12: a batch that failed alike is one failure write per attempt
/// (failed before: one per row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_writes_a_batch_of_failures_at_once() {
    postbox_testkit::faults::relay_writes_a_batch_of_failures_at_once(fresh_store().await).await;
}

/// A database blip while marking loses no result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_rides_out_a_database_blip_while_marking() {
    postbox_testkit::faults::relay_rides_out_a_database_blip_while_marking(fresh_store().await)
        .await;
}

/// Issue 11: a database error while marking is reported as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_reports_a_failed_mark_as_a_database_error() {
    postbox_testkit::faults::relay_reports_a_failed_mark_as_a_database_error(fresh_store().await)
        .await;
}
