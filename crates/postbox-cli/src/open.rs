//! Loading the configuration and opening the store it names.

use std::sync::Arc;
use std::time::Duration;

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
        "postgres" | "postgresql" => {
            let at = url
                .parse::<sqlx::postgres::PgConnectOptions>()
                .ok()
                .map(|o| (o.get_host().to_owned(), o.get_port()));
            match postbox_postgres::PgOutbox::connect(url, table, db.max_connections).await {
                Ok(s) => Arc::new(s.with_max_payload_bytes(db.max_payload_bytes)),
                Err(e) => return Err(not_reached(e, at).await),
            }
        }
        "mysql" | "mariadb" => {
            let at = url
                .replacen("mariadb://", "mysql://", 1)
                .parse::<sqlx::mysql::MySqlConnectOptions>()
                .ok()
                .map(|o| (o.get_host().to_owned(), o.get_port()));
            match postbox_mysql::MySqlOutbox::connect(url, table, db.max_connections).await {
                Ok(s) => Arc::new(s.with_max_payload_bytes(db.max_payload_bytes)),
                Err(e) => return Err(not_reached(e, at).await),
            }
        }
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

/// A pool that cannot open a connection says only `pool timed out`: this
/// names the address it tried (never the credentials) and the cause, from
/// one plain TCP connection to it.
async fn not_reached(e: postbox_core::Error, at: Option<(String, u16)>) -> CliError {
    let timed_out = matches!(
        &e,
        postbox_core::Error::Database { source, .. }
            if matches!(source.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::PoolTimedOut))
    );
    let Some((host, port)) = at.filter(|_| timed_out) else {
        return e.into();
    };
    if host.starts_with('/') {
        return CliError::runtime(format!(
            "cannot connect to the database through the socket in `{host}` (port {port}): no connection within the pool's timeout; check database.url and that the server is running"
        ));
    }
    let address = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let probe = tokio::net::TcpStream::connect((host.as_str(), port));
    let cause = match tokio::time::timeout(Duration::from_secs(5), probe).await {
        Ok(Err(io)) => io.to_string(),
        Err(_) => "no answer within 5 s (a firewall, or the wrong host)".to_owned(),
        Ok(Ok(_)) => "the port accepts TCP connections, but no database connection opened in time (TLS settings, a proxy, or an overloaded server?)".to_owned(),
    };
    CliError::runtime(format!(
        "cannot connect to the database at {address}: {cause}; check database.url and that the server is running"
    ))
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
