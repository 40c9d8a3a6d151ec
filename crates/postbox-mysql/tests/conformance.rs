//! MySQL / MariaDB runs the shared conformance suite.

use std::sync::Arc;

use postbox_core::store::OutboxStore;
use postbox_mysql::MySqlOutbox;
use postbox_testkit::servers::{ensure_database, how_to_start, mysql_url};
use postbox_testkit::{conformance_suite, scratch_table};

async fn fresh_store() -> Arc<dyn OutboxStore> {
    let url = mysql_url();
    ensure_database("mysql", &url).await;
    let store = MySqlOutbox::connect(&url, &scratch_table("my"), 4)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("mysql")));
    store.migrate().await.expect("migrate");
    Arc::new(store)
}

conformance_suite!(fresh_store);
