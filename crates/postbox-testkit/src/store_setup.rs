//! A store on a test server's database, for the integration tests of the
//! backends and of the publishers: the database is created when missing,
//! and a server that is not running fails loudly, naming how to start it.

use std::future::Future;

use postbox_core::store::SchemaStore;
use postbox_core::Result;

use crate::servers::{ensure_database, how_to_start};

/// Makes sure `server`'s test database at `url` exists, then connects a
/// store to it with `connect` (given `url`); panics with how to start the
/// server when that fails.
pub async fn connected<S, F, Fut>(server: &str, url: String, connect: F) -> S
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<S>>,
{
    ensure_database(server, &url).await;
    connect(url)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start(server)))
}

/// [`connected`], then migrated.
pub async fn migrated<S, F, Fut>(server: &str, url: String, connect: F) -> S
where
    S: SchemaStore,
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<S>>,
{
    let store = connected(server, url, connect).await;
    store.migrate().await.expect("migrate");
    store
}
