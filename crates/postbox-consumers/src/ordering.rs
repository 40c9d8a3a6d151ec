//! `ordering = "per_aggregate"`: retries that do not reorder an aggregate.
//!
//! Without it, an event whose handler fails waits in retry while later events
//! of its aggregate are handled; when it comes back the inbox skips it as
//! stale. With it, the consumer records a *hold* when an event goes to retry
//! — `(consumer_group, aggregate_id, event_id, aggregate_version)` in
//! `<inbox table>_holds`, in the inbox database so every process of the group
//! sees it — and a later version of that aggregate is not handled while the
//! hold stands: it goes to retry behind the held event, without counting an
//! attempt, and takes a hold of its own, so versions after it wait behind it
//! in turn. Only holds of lower versions block an event, so two holds never
//! wait on each other. The hold is released when its event is handled (or found a
//! duplicate or stale) or dead-lettered. A hold lapses on its own after the
//! event's retry delay plus `max_retry_delay` plus a minute, so a retry copy
//! lost outside postbox cannot block its aggregate for ever.
//!
//! Events without `aggregate_id` or `aggregate_version` are never held back.
//! Order across retries is what this keeps; several consumer processes on
//! one queue still handle first deliveries in parallel.

use async_trait::async_trait;
use postbox_core::Error;

use crate::inbox::Inbox;

/// Where the holds of per-aggregate ordering live (shared by every process of
/// a consumer group).
#[async_trait]
pub trait AggregateHolds: Send + Sync {
    /// The event holding `aggregate_id` back for an event at `version`: a
    /// live hold of another event with a lower version.
    async fn blocker(
        &self,
        consumer_group: &str,
        aggregate_id: &str,
        version: i64,
        event_id: &str,
        now_ms: i64,
    ) -> Result<Option<String>, Error>;

    /// Holds `aggregate_id` back behind `event_id` (at `version`) until
    /// `until_ms`, or moves the lapse time of an existing hold.
    async fn hold(
        &self,
        consumer_group: &str,
        aggregate_id: &str,
        event_id: &str,
        version: i64,
        until_ms: i64,
    ) -> Result<(), Error>;

    /// Releases the hold of `event_id` (and lapsed holds of the aggregate).
    async fn release(
        &self,
        consumer_group: &str,
        aggregate_id: &str,
        event_id: &str,
        now_ms: i64,
    ) -> Result<(), Error>;
}

/// The holds table beside an [`Inbox`]: `<inbox table>_holds`.
#[derive(Debug, Clone)]
pub struct Holds<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    sql: Statements,
}

#[derive(Debug, Clone)]
struct Statements {
    create: String,
    blocker: String,
    hold: String,
    release: String,
}

struct Dialect {
    create: &'static str,
    blocker: &'static str,
    hold: &'static str,
    release: &'static str,
}

impl Statements {
    fn render(table: &str, d: &Dialect) -> Self {
        let r = |s: &str| s.replace("{table}", table);
        Statements {
            create: r(d.create),
            blocker: r(d.blocker),
            hold: r(d.hold),
            release: r(d.release),
        }
    }
}

/// The holds table of PostgreSQL and MySQL, followed by `$options`.
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! create_holds {
    ($options:literal) => {
        concat!(
            "CREATE TABLE IF NOT EXISTS {table}_holds (
        consumer_group VARCHAR(128) NOT NULL,
        aggregate_id VARCHAR(128) NOT NULL,
        event_id VARCHAR(64) NOT NULL,
        aggregate_version BIGINT NOT NULL,
        until_ms BIGINT NOT NULL,
        PRIMARY KEY (consumer_group, aggregate_id, event_id)
    )",
            $options
        )
    };
}

#[cfg(feature = "postgres")]
const POSTGRES: Dialect = Dialect {
    create: create_holds!(""),
    // primary key prefix (consumer_group, aggregate_id)
    blocker: "SELECT event_id FROM {table}_holds WHERE consumer_group = $1 AND aggregate_id = $2 AND aggregate_version < $3 AND event_id <> $4 AND until_ms > $5 ORDER BY aggregate_version LIMIT 1",
    hold: "INSERT INTO {table}_holds (consumer_group, aggregate_id, event_id, aggregate_version, until_ms) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (consumer_group, aggregate_id, event_id) DO UPDATE SET aggregate_version = EXCLUDED.aggregate_version, until_ms = EXCLUDED.until_ms",
    // primary key prefix (consumer_group, aggregate_id)
    release: "DELETE FROM {table}_holds WHERE consumer_group = $1 AND aggregate_id = $2 AND (event_id = $3 OR until_ms < $4)",
};

#[cfg(feature = "mysql")]
const MYSQL: Dialect = Dialect {
    create: create_holds!(" ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"),
    // primary key prefix (consumer_group, aggregate_id); the cast because a
    // `_bin` collation reads back as VARBINARY
    blocker: "SELECT CAST(event_id AS CHAR CHARACTER SET utf8mb4) FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND aggregate_version < ? AND event_id <> ? AND until_ms > ? ORDER BY aggregate_version LIMIT 1",
    hold: "INSERT INTO {table}_holds (consumer_group, aggregate_id, event_id, aggregate_version, until_ms) VALUES (?, ?, ?, ?, ?) ON DUPLICATE KEY UPDATE aggregate_version = VALUES(aggregate_version), until_ms = VALUES(until_ms)",
    // primary key prefix (consumer_group, aggregate_id)
    release: "DELETE FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND (event_id = ? OR until_ms < ?)",
};

#[cfg(feature = "sqlite")]
const SQLITE: Dialect = Dialect {
    create: "CREATE TABLE IF NOT EXISTS {table}_holds (
        consumer_group TEXT NOT NULL,
        aggregate_id TEXT NOT NULL,
        event_id TEXT NOT NULL,
        aggregate_version INTEGER NOT NULL,
        until_ms INTEGER NOT NULL,
        PRIMARY KEY (consumer_group, aggregate_id, event_id)
    )",
    // primary key prefix (consumer_group, aggregate_id)
    blocker: "SELECT event_id FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND aggregate_version < ? AND event_id <> ? AND until_ms > ? ORDER BY aggregate_version LIMIT 1",
    hold: "INSERT INTO {table}_holds (consumer_group, aggregate_id, event_id, aggregate_version, until_ms) VALUES (?, ?, ?, ?, ?) ON CONFLICT (consumer_group, aggregate_id, event_id) DO UPDATE SET aggregate_version = excluded.aggregate_version, until_ms = excluded.until_ms",
    // primary key prefix (consumer_group, aggregate_id)
    release: "DELETE FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND (event_id = ? OR until_ms < ?)",
};

/// Runs the holds' statement `$sql` with `$arg`s bound in order; `$what`
/// says what failed.
macro_rules! execute {
    ($holds:ident, $sql:ident, $what:literal, $($arg:expr),+) => {
        sqlx::query(&$holds.sql.$sql)
            $(.bind($arg))+
            .execute(&$holds.pool)
            .await
            .map(drop)
            .map_err(|e| Error::database($what, e))
    };
}

macro_rules! holds_backend {
    ($db:ty, $dialect:expr) => {
        impl Holds<$db> {
            /// The holds beside `inbox` (its pool, `<inbox table>_holds`),
            /// creating the table when missing.
            pub async fn of(inbox: &Inbox<$db>) -> Result<Self, Error> {
                let holds = Holds {
                    pool: inbox.pool().clone(),
                    sql: Statements::render(inbox.table().as_str(), &$dialect),
                };
                sqlx::query(&holds.sql.create)
                    .execute(&holds.pool)
                    .await
                    .map_err(|e| Error::database("creating the ordering holds table", e))?;
                Ok(holds)
            }
        }

        #[async_trait]
        impl AggregateHolds for Holds<$db> {
            async fn blocker(
                &self,
                consumer_group: &str,
                aggregate_id: &str,
                version: i64,
                event_id: &str,
                now_ms: i64,
            ) -> Result<Option<String>, Error> {
                sqlx::query_scalar::<_, String>(&self.sql.blocker)
                    .bind(consumer_group)
                    .bind(aggregate_id)
                    .bind(version)
                    .bind(event_id)
                    .bind(now_ms)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(|e| Error::database("reading ordering holds", e))
            }

            async fn hold(
                &self,
                consumer_group: &str,
                aggregate_id: &str,
                event_id: &str,
                version: i64,
                until_ms: i64,
            ) -> Result<(), Error> {
                execute!(
                    self,
                    hold,
                    "recording an ordering hold",
                    consumer_group,
                    aggregate_id,
                    event_id,
                    version,
                    until_ms
                )
            }

            async fn release(
                &self,
                consumer_group: &str,
                aggregate_id: &str,
                event_id: &str,
                now_ms: i64,
            ) -> Result<(), Error> {
                execute!(
                    self,
                    release,
                    "releasing an ordering hold",
                    consumer_group,
                    aggregate_id,
                    event_id,
                    now_ms
                )
            }
        }
    };
}

#[cfg(feature = "postgres")]
holds_backend!(sqlx::Postgres, POSTGRES);
#[cfg(feature = "mysql")]
holds_backend!(sqlx::MySql, MYSQL);
#[cfg(feature = "sqlite")]
holds_backend!(sqlx::Sqlite, SQLITE);
