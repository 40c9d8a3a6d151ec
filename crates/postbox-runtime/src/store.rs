//! Opening the outbox store `database.url` names: the one place that maps
//! a URL scheme to a backend.

use std::sync::Arc;
use std::time::Duration;

use postbox_core::config::{DatabaseKind, Settings};
use postbox_core::store::{EventFilter, OutboxStore};
use postbox_core::{BoxFuture, Error};

/// Whether opening may create a missing SQLite database file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// A missing SQLite file is an error naming it (every reading command).
    Never,
    /// A missing SQLite file is created (`migrate`, `relay --migrate`).
    IfMissing,
}

/// Opens the backend for `database.url` with `database.table`,
/// `max_connections` and `max_payload_bytes`. A pool that cannot reach
/// its server fails with the address it tried and why (never the
/// credentials).
pub fn open(
    settings: &Settings,
    create: Create,
) -> BoxFuture<'_, Result<Arc<dyn OutboxStore>, Error>> {
    Box::pin(open_here(settings, create))
}

async fn open_here(settings: &Settings, create: Create) -> Result<Arc<dyn OutboxStore>, Error> {
    let db = &settings.database;
    let table = db.adopted_table()?;
    let archive = open_archive_here(settings, create).await?;
    let options = postbox_sqlx::OpenOptions {
        url: db.url.expose(),
        table: &table,
        max_connections: db.max_connections,
        connect: postbox_sqlx::Connect::now(create == Create::IfMissing),
        max_payload_bytes: db.max_payload_bytes,
        archive,
        partitioning: db.partitioning,
        relay_commit: db.relay_commit,
    };
    match open_kind(settings.database_kind(), options).await {
        Ok(store) => Ok(store),
        // SQLite has no server address: its error stands as it is.
        Err(e) => {
            let at = server_address(settings.database_kind(), db.url.expose());
            Err(not_reached(e, at, "database.url").await)
        }
    }
}

/// The store `archive.url` names, for the outbox table (only its archive
/// is used there); `None` when the archive is beside the table.
pub fn open_archive(
    settings: &Settings,
    create: Create,
) -> BoxFuture<'_, Result<Option<Arc<dyn OutboxStore>>, Error>> {
    Box::pin(open_archive_here(settings, create))
}

async fn open_archive_here(
    settings: &Settings,
    create: Create,
) -> Result<Option<Arc<dyn OutboxStore>>, Error> {
    let (Some(url), Some(kind)) = (&settings.archive.url, settings.archive_kind()) else {
        return Ok(None);
    };
    let table = settings.database.adopted_table()?;
    let options = postbox_sqlx::OpenOptions {
        url: url.expose(),
        table: &table,
        max_connections: settings.archive.max_connections,
        // Connected on first use: the relay starts and delivers while the
        // archive's database is down (only archiving and archive reads
        // wait for it).
        connect: postbox_sqlx::Connect {
            create: create == Create::IfMissing,
            lazy: true,
            key: "archive.url",
        },
        max_payload_bytes: settings.database.max_payload_bytes,
        archive: None,
        partitioning: None,
        // Nothing relays there.
        relay_commit: postbox_core::config::RelayCommit::Sync,
    };
    match open_kind(kind, options).await {
        Ok(store) => Ok(Some(store)),
        Err(e) => Err(not_reached(e, server_address(kind, url.expose()), "archive.url").await),
    }
}

async fn open_kind(
    kind: DatabaseKind,
    options: postbox_sqlx::OpenOptions<'_>,
) -> Result<Arc<dyn OutboxStore>, Error> {
    match kind {
        DatabaseKind::Postgres => postbox_postgres::open(options).await,
        DatabaseKind::MySql => postbox_mysql::open(options).await,
        DatabaseKind::Sqlite => postbox_sqlite::open(options).await,
    }
}

pub use postbox_sqlx::ScriptVersion;

/// The statements `migrate` runs for `database.table` on the database
/// `database.url` names, for the schema versions after `from`, as SQL text
/// (`postbox migrate --print-sql`); no connection is made.
pub fn migration_script(settings: &Settings, from: u32) -> Vec<ScriptVersion> {
    let partitioned = settings.database.partitioning.is_some();
    let table = &settings
        .database
        .adopted_table()
        .expect("the settings checked the table's names");
    match settings.database_kind() {
        DatabaseKind::Postgres => {
            postbox_sqlx::migration_script::<postbox_postgres::PgDialect>(table, from, partitioned)
        }
        DatabaseKind::MySql => {
            postbox_sqlx::migration_script::<postbox_mysql::MySqlDialect>(table, from, partitioned)
        }
        DatabaseKind::Sqlite => postbox_sqlx::migration_script::<postbox_sqlite::SqliteDialect>(
            table,
            from,
            partitioned,
        ),
    }
}

/// Fails with a clear message when the outbox table does not exist yet, or
/// is not partitioned as `database.partitioning` says.
pub fn require_schema(store: &dyn OutboxStore) -> BoxFuture<'_, Result<(), Error>> {
    Box::pin(require_schema_here(store))
}

async fn require_schema_here(store: &dyn OutboxStore) -> Result<(), Error> {
    let probe = EventFilter {
        limit: 1,
        ..Default::default()
    };
    store.list(&probe).await.map(|_| ()).map_err(|e| {
        Error::Schema(format!(
            "cannot read outbox table `{}` ({e}); run `postbox migrate` first",
            store.table()
        ))
    })?;
    store.check_partitioning().await
}

/// Host and port of a PostgreSQL or MariaDB/MySQL database URL.
fn server_address(kind: DatabaseKind, url: &str) -> Option<(String, u16)> {
    match kind {
        DatabaseKind::Postgres => url
            .parse::<sqlx::postgres::PgConnectOptions>()
            .ok()
            .map(|o| (o.get_host().to_owned(), o.get_port())),
        DatabaseKind::MySql => url
            .replacen("mariadb://", "mysql://", 1)
            .parse::<sqlx::mysql::MySqlConnectOptions>()
            .ok()
            .map(|o| (o.get_host().to_owned(), o.get_port())),
        DatabaseKind::Sqlite => None,
    }
}

/// A pool that cannot open a connection says only `pool timed out`: this
/// names the address it tried and the cause, from one plain TCP connection
/// to it.
async fn not_reached(e: Error, at: Option<(String, u16)>, key: &str) -> Error {
    let timed_out = matches!(
        &e,
        Error::Database { source, .. }
            if matches!(source.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::PoolTimedOut))
    );
    let Some((host, port)) = at.filter(|_| timed_out) else {
        return e;
    };
    let unreachable = |context: String, cause: String| Error::Io {
        context,
        source: std::io::Error::other(format!(
            "{cause}; check {key} and that the server is running"
        )),
    };
    if host.starts_with('/') {
        return unreachable(
            format!("cannot connect to the database of {key} through the socket in `{host}` (port {port})"),
            "no connection within the pool's timeout".to_owned(),
        );
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
    unreachable(
        format!("cannot connect to the database of {key} at {address}"),
        cause,
    )
}
