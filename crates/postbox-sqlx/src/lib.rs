//! The postbox SQL engine: the outbox store written once ([`SqlOutbox`]),
//! generic over a [`Dialect`] (a database's statement set and the hooks
//! for what really differs), plus reading rows by column name and
//! classifying driver errors. The PostgreSQL, MySQL and SQLite backends are
//! dialects of it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod dialect;
#[macro_use]
mod engine;
mod adopt;
mod list;
mod script;
mod store;
mod wake;

#[doc(hidden)]
pub mod __private {
    pub use async_trait::async_trait;
    pub use postbox_core;
}

pub use adopt::Adopt;
pub use dialect::{
    Connect, Dialect, Migration, PartitionSql, ReplayStep, Statements, Value, DELIVERED_COUNT_CAP,
    PARTIAL_ARCHIVE_INDEX, PARTIAL_CLAIM_INDEXES, V10_DESCRIPTION, V11_DESCRIPTION, V5_DESCRIPTION,
    V6_DESCRIPTION, V6_PENDING_INDEX, V7_DESCRIPTION, V7_HEAD_INDEX, V8_DESCRIPTION,
    V8_PENDING_INDEX, V9_DESCRIPTION,
};
pub use engine::{
    finish, query, OpenOptions, Opened, ReplayProbe, ReplayProbeArgs, SqlOutbox, MIGRATIONS_LEDGER,
};
pub use list::{filter_query, ids_query, list_query, ListArg, ListQuery, Placeholders, FILTERS};
pub use script::{inline, migration_script, ScriptVersion};
pub use wake::due_union;

use postbox_core::event::parse_delivered_to;
use postbox_core::naming::Naming;
use postbox_core::{Error, EventRecord, Result, Status};
use sqlx::{ColumnIndex, Decode, Row, Type};

/// Wraps a driver error, telling deadlocks and serialization failures apart
/// ([`Error::Transient`]) by their SQLSTATE or SQLite result code.
pub fn db_error(operation: &'static str, e: sqlx::Error) -> Error {
    let code = e
        .as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned());
    Error::from_driver(operation, e, code.as_deref())
}

/// A pool of `max_connections` to a database server (10 s acquire
/// timeout), with options parsed from `parse_from` (`url`, or the dialect's
/// normalised form of it); a bad URL is a `database.url` error showing
/// `url` redacted, a failed connection a database error of `operation`.
pub async fn connect_server<DB: sqlx::Database>(
    url: &str,
    parse_from: &str,
    max_connections: u32,
    how: Connect,
    operation: &'static str,
    tune: impl FnOnce(
        <DB::Connection as sqlx::Connection>::Options,
    ) -> <DB::Connection as sqlx::Connection>::Options,
) -> Result<sqlx::Pool<DB>> {
    let opts: <DB::Connection as sqlx::Connection>::Options = parse_from.parse().map_err(|e| {
        Error::config(
            how.key,
            format!("{}: {e}", postbox_core::redact::redact_url(url)),
        )
    })?;
    let pool = released_within(
        sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(max_connections)
            .acquire_timeout(std::time::Duration::from_secs(10)),
    );
    if how.lazy {
        return Ok(pool.connect_lazy_with(tune(opts)));
    }
    pool.connect_with(tune(opts))
        .await
        .map_err(|e| db_error(operation, e))
}

/// How long a connection handed back to its pool may take to answer a
/// ping.
const RELEASE_PING_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// `options` with a bound on the check of a connection handed back: one
/// whose statement was abandoned (a relay call past its bound, on a
/// database gone silent) is dropped within [`RELEASE_PING_WITHIN`]. sqlx
/// pings each connection handed back, with no bound: the ping of a silent
/// connection held its pool slot until the kernel gave up on the socket
/// (15 minutes), and a relay's two-connection pool was used up by two such
/// calls.
pub fn released_within<DB: sqlx::Database>(
    options: sqlx::pool::PoolOptions<DB>,
) -> sqlx::pool::PoolOptions<DB> {
    options.after_release(|conn, _| {
        Box::pin(async move {
            match tokio::time::timeout(RELEASE_PING_WITHIN, sqlx::Connection::ping(conn)).await {
                Ok(Ok(())) => Ok(true),
                Ok(Err(e)) => Err(e),
                // Dropped at once, not closed politely.
                Err(_) => Err(sqlx::Error::PoolTimedOut),
            }
        })
    })
}

/// A row read by column name, as the types postbox's columns have: any
/// row of the three backends.
pub trait OutboxRow {
    /// A text column.
    fn text(&self, column: &str) -> std::result::Result<String, sqlx::Error>;
    /// A text column that may be NULL.
    fn text_or_null(&self, column: &str) -> std::result::Result<Option<String>, sqlx::Error>;
    /// A 64-bit integer column.
    fn int(&self, column: &str) -> std::result::Result<i64, sqlx::Error>;
    /// A 64-bit integer column that may be NULL.
    fn int_or_null(&self, column: &str) -> std::result::Result<Option<i64>, sqlx::Error>;
    /// A 32-bit integer column (`retry_count`, `attempt`).
    fn int32(&self, column: &str) -> std::result::Result<i32, sqlx::Error>;
}

impl<R> OutboxRow for R
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
{
    fn text(&self, column: &str) -> std::result::Result<String, sqlx::Error> {
        self.try_get(column)
    }
    fn text_or_null(&self, column: &str) -> std::result::Result<Option<String>, sqlx::Error> {
        self.try_get(column)
    }
    fn int(&self, column: &str) -> std::result::Result<i64, sqlx::Error> {
        self.try_get(column)
    }
    fn int_or_null(&self, column: &str) -> std::result::Result<Option<i64>, sqlx::Error> {
        self.try_get(column)
    }
    fn int32(&self, column: &str) -> std::result::Result<i32, sqlx::Error> {
        self.try_get(column)
    }
}

/// A row of an adopted table, read by postbox's column names: each is
/// looked up under the table's own ([`Naming::column`]; statements name
/// their result columns as the table does, see [`Naming::rewrite`]).
pub struct Renamed<'r, R>(pub &'r R, pub &'r Naming);

impl<R: OutboxRow> OutboxRow for Renamed<'_, R> {
    fn text(&self, column: &str) -> std::result::Result<String, sqlx::Error> {
        self.0.text(self.1.column(column))
    }
    fn text_or_null(&self, column: &str) -> std::result::Result<Option<String>, sqlx::Error> {
        self.0.text_or_null(self.1.column(column))
    }
    fn int(&self, column: &str) -> std::result::Result<i64, sqlx::Error> {
        self.0.int(self.1.column(column))
    }
    fn int_or_null(&self, column: &str) -> std::result::Result<Option<i64>, sqlx::Error> {
        self.0.int_or_null(self.1.column(column))
    }
    fn int32(&self, column: &str) -> std::result::Result<i32, sqlx::Error> {
        self.0.int32(self.1.column(column))
    }
}

/// The status a row holds, a legacy value read as its postbox status.
fn status_of<R: OutboxRow>(row: &Renamed<'_, R>) -> std::result::Result<Status, sqlx::Error> {
    let stored = row.text("status")?;
    row.1
        .status(&stored)
        .map_err(|e: Error| sqlx::Error::Decode(e.into()))
}

/// Reads one outbox row by column name (the table's, through `naming`).
pub fn record<R: OutboxRow>(
    row: &R,
    naming: &Naming,
) -> std::result::Result<EventRecord, sqlx::Error> {
    let row = &Renamed(row, naming);
    Ok(EventRecord {
        id: row.int("id")?,
        app_code: row.text("app_code")?,
        event_id: row.text("event_id")?,
        event_type: row.text("event_type")?,
        aggregate_id: row.text_or_null("aggregate_id")?,
        aggregate_version: row.int_or_null("aggregate_version")?,
        payload: row.text("payload")?,
        headers: row.text_or_null("headers")?,
        status: status_of(row)?,
        retry_count: row.int32("retry_count")?,
        next_retry_at_ms: row.int("next_retry_at_ms")?,
        lock_until_ms: row.int("lock_until_ms")?,
        worker_id: row.text_or_null("worker_id")?,
        last_error: row.text_or_null("last_error")?,
        delivered_to: parse_delivered_to(row.text_or_null("delivered_to")?.as_deref()),
        replay_count: row.int32("replay_count")?,
        created_at_ms: row.int("created_at_ms")?,
        updated_at_ms: row.int("updated_at_ms")?,
    })
}

/// Reads every row; `op` names the operation in the error.
pub fn records<R: OutboxRow>(
    rows: Vec<R>,
    naming: &Naming,
    op: &'static str,
) -> Result<Vec<EventRecord>> {
    rows.iter()
        .map(|row| record(row, naming))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| db_error(op, e))
}

/// A claimed row that cannot be read as an event: a producer wrote a value
/// of another type than the column's (SQLite keeps what it is given: a
/// BLOB payload, a version as text), or a status postbox does not know
/// that the claim still matched (MySQL's case-insensitive `'PENDING'`).
/// The claim fails it ([`SqlOutbox::fail_unreadable`]) instead of handing
/// it out: refusing the whole claim for it stopped every new event of its
/// tenant for good, since the row came back first in every claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    /// The row.
    pub id: i64,
    /// Its failed attempts so far, where they can be read.
    pub retry_count: i32,
    /// Its lease end, where the claim wrote it and it can be read.
    pub lock_until_ms: Option<i64>,
    /// What could not be read.
    pub reason: String,
}

/// Reads the rows a claim took: the events, and the rows that cannot be
/// read as one ([`Unreadable`]). Only a row whose id cannot be read fails
/// the claim.
pub fn claimed_records<R: OutboxRow>(
    rows: Vec<R>,
    naming: &Naming,
) -> Result<(Vec<EventRecord>, Vec<Unreadable>)> {
    let mut good = Vec::with_capacity(rows.len());
    let mut bad = Vec::new();
    for row in &rows {
        match record(row, naming) {
            Ok(r) => good.push(r),
            Err(e) => {
                let named = Renamed(row, naming);
                bad.push(Unreadable {
                    id: named.int("id").map_err(|e| db_error("claim", e))?,
                    retry_count: named.int32("retry_count").unwrap_or(0),
                    lock_until_ms: named.int("lock_until_ms").ok(),
                    reason: e.to_string(),
                })
            }
        }
    }
    Ok((good, bad))
}

/// Reads `minute_ms, delivered` rows of the deliveries-per-minute query.
pub fn minute_counts<R: OutboxRow>(rows: Vec<R>) -> Result<Vec<postbox_core::store::MinuteCount>> {
    rows.iter()
        .map(|r| {
            Ok(postbox_core::store::MinuteCount {
                minute_ms: r.int("minute_ms")?,
                delivered: r.int("delivered")?,
            })
        })
        .collect::<std::result::Result<_, sqlx::Error>>()
        .map_err(|e| db_error("delivered per minute", e))
}

/// Rows of a backend's `STUCK_AGGREGATES` query (aggregate_id, event_id,
/// status, retry_count, last_error, age_ms, waiting).
pub fn stuck_aggregates<R: OutboxRow>(
    app_code: &str,
    rows: Vec<R>,
    naming: &Naming,
) -> Result<Vec<postbox_core::store::StuckAggregate>> {
    let db = |e| db_error("find stuck aggregates", e);
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let row = &Renamed(row, naming);
        out.push(postbox_core::store::StuckAggregate {
            app_code: app_code.to_owned(),
            aggregate_id: row.text("aggregate_id").map_err(db)?,
            head_event_id: row.text("event_id").map_err(db)?,
            head_status: status_of(row).map_err(db)?,
            head_retry_count: row.int32("retry_count").map_err(db)?,
            head_last_error: row.text_or_null("last_error").map_err(db)?,
            head_age_seconds: row.int("age_ms").map_err(db)? as f64 / 1000.0,
            waiting: row.int("waiting").map_err(db)?,
        });
    }
    Ok(out)
}

/// Reads control rows selected as `app_code, event_type, paused, delivery,
/// max_retry_count (-1: none), updated_at_ms, updated_by`.
pub fn controls_of<R: OutboxRow>(
    rows: Vec<R>,
    naming: &Naming,
) -> Result<Vec<postbox_core::control::Control>> {
    use postbox_core::config::Delivery;
    let db = |e| db_error("read controls", e);
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let row = &Renamed(row, naming);
        let delivery = match row.text_or_null("delivery").map_err(db)?.as_deref() {
            None => None,
            Some("at_most_once") => Some(Delivery::AtMostOnce),
            Some("at_least_once") => Some(Delivery::AtLeastOnce),
            Some(other) => {
                tracing::warn!(delivery = other, "control with an unknown delivery ignored");
                None
            }
        };
        out.push(postbox_core::control::Control {
            app_code: row.text("app_code").map_err(db)?,
            event_type: row.text("event_type").map_err(db)?,
            paused: row.int32("paused").map_err(db)? != 0,
            delivery,
            max_retry_count: u32::try_from(row.int32("max_retry_count").map_err(db)?).ok(),
            sample_percent: u8::try_from(row.int32("sample_percent").map_err(db)?).ok(),
            updated_at_ms: row.int("updated_at_ms").map_err(db)?,
            updated_by: row.text("updated_by").map_err(db)?,
        });
    }
    Ok(out)
}

/// Statement statistics from rows with the columns `query`, `calls`,
/// `total_us`, `rows_returned`, `rows_examined` and `blocks` (NULL where
/// the database does not count it): `doctor --scans`.
pub fn statement_stats_of<R: OutboxRow>(
    rows: Vec<R>,
    source: &'static str,
) -> Result<postbox_core::store::StatementStats> {
    let stat = |row: &R| -> std::result::Result<_, sqlx::Error> {
        Ok(postbox_core::store::StatementStat {
            text: row.text_or_null("query")?.unwrap_or_default(),
            calls: row.int("calls")?,
            total_ms: row.int("total_us")? as f64 / 1000.0,
            rows: row.int("rows_returned")?,
            rows_examined: row.int_or_null("rows_examined")?,
            blocks: row.int_or_null("blocks")?,
        })
    };
    let statements = rows
        .iter()
        .map(stat)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| db_error("read statement statistics", e))?;
    Ok(postbox_core::store::StatementStats {
        source,
        statements,
        unrecorded: 0,
    })
}

/// Relays from rows of `RELAY_SELECT` (`relay_statements!`).
pub fn relays_of<R: OutboxRow>(
    rows: Vec<R>,
    naming: &Naming,
) -> Result<Vec<postbox_core::store::RelaySeen>> {
    use postbox_core::store::{RelayBeat, RelaySeen};
    let db = |e| db_error("read the relays", e);
    let count = |row: &Renamed<'_, R>, column: &str| row.int(column).map(|n| n.max(0) as u64);
    rows.iter()
        .map(|row| {
            let row = &Renamed(row, naming);
            let stopped_at_ms = row.int_or_null("stopped_at_ms").map_err(db)?;
            let seen_at_ms = row.int("seen_at_ms").map_err(db)?;
            let app_codes = row.text("app_codes").map_err(db)?;
            let beat = RelayBeat {
                worker_id: row.text("worker_id").map_err(db)?,
                host: row.text("host").map_err(db)?,
                pid: u32::try_from(row.int("pid").map_err(db)?).unwrap_or(0),
                app_codes: app_codes
                    .split(',')
                    .filter(|a| !a.is_empty())
                    .map(str::to_owned)
                    .collect(),
                claimed: count(row, "claimed").map_err(db)?,
                delivered: count(row, "delivered").map_err(db)?,
                failed: count(row, "failed").map_err(db)?,
                per_minute: count(row, "per_minute").map_err(db)?,
                stopped: stopped_at_ms.is_some(),
            };
            let now_ms = row.int("now_ms").map_err(db)?;
            Ok(RelaySeen {
                state: RelaySeen::state_of(beat.stopped, seen_at_ms, now_ms),
                beat,
                started_at_ms: row.int("started_at_ms").map_err(db)?,
                seen_at_ms,
                stopped_at_ms,
            })
        })
        .collect()
}

/// Reads control log rows selected as `at_ms, actor, app_code, event_type,
/// detail`.
pub fn control_log_of<R: OutboxRow>(
    rows: Vec<R>,
    naming: &Naming,
) -> Result<Vec<postbox_core::control::ControlLogEntry>> {
    let db = |e| db_error("read the control log", e);
    rows.iter()
        .map(|row| {
            let row = &Renamed(row, naming);
            Ok(postbox_core::control::ControlLogEntry {
                at_ms: row.int("at_ms").map_err(db)?,
                by: row.text("actor").map_err(db)?,
                app_code: row.text("app_code").map_err(db)?,
                event_type: row.text("event_type").map_err(db)?,
                change: row.text("detail").map_err(db)?,
            })
        })
        .collect()
}

/// Reads history rows selected as `at_ms, kind, attempt, publisher, detail`.
/// An entry of a kind this version does not know is skipped with a warning.
pub fn history_entries<R: OutboxRow>(
    rows: Vec<R>,
) -> Result<Vec<postbox_core::store::HistoryEntry>> {
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let read = || -> std::result::Result<_, sqlx::Error> {
            let kind = row.text("kind")?;
            Ok((
                kind,
                row.int("at_ms")?,
                row.int32("attempt")?,
                row.text_or_null("publisher")?,
                row.text_or_null("detail")?,
            ))
        };
        let (kind, at_ms, attempt, publisher, detail) =
            read().map_err(|e| db_error("read history", e))?;
        match postbox_core::store::HistoryKind::parse(&kind) {
            Some(kind) => out.push(postbox_core::store::HistoryEntry {
                at_ms,
                kind,
                attempt,
                publisher,
                detail,
            }),
            None => tracing::warn!(kind, "history entry of an unknown kind skipped"),
        }
    }
    Ok(out)
}
