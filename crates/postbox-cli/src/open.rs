//! Loading the configuration and opening the store it names.

use std::sync::Arc;

use postbox_core::config::{self, Config, ConfigSource, Uses};
use postbox_core::store::OutboxStore;

use crate::cli::Global;
use crate::error::CliError;

/// Loads the configuration for a command that uses `uses` besides
/// `[database]`: a `${VAR}` left unset in a section it does not use is no
/// error (`postbox status` needs no admin token).
pub fn load_config(g: &Global, uses: Uses) -> Result<Config, CliError> {
    Ok(config::load_for(
        &ConfigSource {
            file: g.config.clone(),
            database_url: g.database_url.clone(),
        },
        uses,
    )?)
}

/// Opens the backend for `database.url`'s scheme; never creates a SQLite
/// database file (a missing one is an error naming it).
pub async fn open_store(config: &Config) -> Result<Arc<dyn OutboxStore>, CliError> {
    open(config, false).await
}

/// [`open_store`] that creates a missing SQLite database file (`migrate`,
/// `relay --migrate`, the quickstart).
pub async fn open_store_creating(config: &Config) -> Result<Arc<dyn OutboxStore>, CliError> {
    open(config, true).await
}

async fn open(config: &Config, create: bool) -> Result<Arc<dyn OutboxStore>, CliError> {
    let db = &config.database;
    let url = db.url.expose();
    let table = db.table.as_str();
    let store: Arc<dyn OutboxStore> = match db.url.scheme() {
        "postgres" | "postgresql" => Arc::new(
            postbox_postgres::PgOutbox::connect(url, table, db.max_connections)
                .await?
                .with_max_payload_bytes(db.max_payload_bytes),
        ),
        "mysql" | "mariadb" => Arc::new(
            postbox_mysql::MySqlOutbox::connect(url, table, db.max_connections)
                .await?
                .with_max_payload_bytes(db.max_payload_bytes),
        ),
        "sqlite" => {
            let store = if create {
                postbox_sqlite::SqliteOutbox::connect(url, table, db.max_connections).await?
            } else {
                postbox_sqlite::SqliteOutbox::connect_existing(url, table, db.max_connections)
                    .await?
            };
            Arc::new(store.with_max_payload_bytes(db.max_payload_bytes))
        }
        other => {
            return Err(CliError::usage(format!(
                "config key `database.url`: unsupported scheme `{other}`"
            )))
        }
    };
    Ok(store)
}

/// Fails with a clear message when the outbox table does not exist yet.
pub async fn require_schema(store: &dyn OutboxStore) -> Result<(), CliError> {
    let probe = postbox_core::store::EventFilter {
        limit: 1,
        ..Default::default()
    };
    store.list(&probe).await.map(|_| ()).map_err(|e| {
        CliError::runtime(format!(
            "cannot read outbox table `{}` ({e}); run `postbox migrate` first",
            store.table()
        ))
    })
}
