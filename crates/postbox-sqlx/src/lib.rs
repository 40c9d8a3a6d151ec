//! What the PostgreSQL, MySQL and SQLite backends share: reading an outbox
//! row into an [`EventRecord`] and classifying driver errors. Every backend
//! selects the columns in the same order (its `columns!()` macro).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod list;

pub use list::{list_query, ListArg, ListQuery, Placeholders};

use postbox_core::event::parse_delivered_to;
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

/// Reads one row selected with the backend's column list.
pub fn record<R>(row: &R) -> std::result::Result<EventRecord, sqlx::Error>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
{
    let status: String = row.try_get(8)?;
    Ok(EventRecord {
        id: row.try_get(0)?,
        app_code: row.try_get(1)?,
        event_id: row.try_get(2)?,
        event_type: row.try_get(3)?,
        aggregate_id: row.try_get(4)?,
        aggregate_version: row.try_get(5)?,
        payload: row.try_get(6)?,
        headers: row.try_get(7)?,
        status: status
            .parse::<Status>()
            .map_err(|e: Error| sqlx::Error::Decode(e.into()))?,
        retry_count: row.try_get(9)?,
        next_retry_at_ms: row.try_get(10)?,
        lock_until_ms: row.try_get(11)?,
        worker_id: row.try_get(12)?,
        last_error: row.try_get(13)?,
        delivered_to: parse_delivered_to(row.try_get::<Option<String>, _>(14)?.as_deref()),
        replay_count: row.try_get(15)?,
        created_at_ms: row.try_get(16)?,
        updated_at_ms: row.try_get(17)?,
    })
}

/// Reads every row; `op` names the operation in the error.
pub fn records<R>(rows: Vec<R>, op: &'static str) -> Result<Vec<EventRecord>>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
{
    rows.iter()
        .map(record)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| db_error(op, e))
}

/// Reads `(minute_ms, count)` rows of the deliveries-per-minute query.
pub fn minute_counts<R>(rows: Vec<R>) -> Result<Vec<postbox_core::store::MinuteCount>>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    rows.iter()
        .map(|r| {
            Ok(postbox_core::store::MinuteCount {
                minute_ms: r.try_get(0)?,
                delivered: r.try_get(1)?,
            })
        })
        .collect::<std::result::Result<_, sqlx::Error>>()
        .map_err(|e| db_error("delivered per minute", e))
}

/// Rows of a backend's `STUCK_AGGREGATES` query (aggregate_id, event_id,
/// status, retry_count, last_error, age_ms, waiting).
pub fn stuck_aggregates<R>(
    app_code: &str,
    rows: Vec<R>,
) -> Result<Vec<postbox_core::store::StuckAggregate>>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
{
    let db = |e| db_error("find stuck aggregates", e);
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let status: String = row.try_get(2).map_err(db)?;
        out.push(postbox_core::store::StuckAggregate {
            app_code: app_code.to_owned(),
            aggregate_id: row.try_get(0).map_err(db)?,
            head_event_id: row.try_get(1).map_err(db)?,
            head_status: status.parse()?,
            head_retry_count: row.try_get(3).map_err(db)?,
            head_last_error: row.try_get(4).map_err(db)?,
            head_age_seconds: row.try_get::<i64, _>(5).map_err(db)? as f64 / 1000.0,
            waiting: row.try_get(6).map_err(db)?,
        });
    }
    Ok(out)
}

/// Reads history rows selected as `at_ms, kind, attempt, publisher, detail`.
/// An entry of a kind this version does not know is skipped with a warning.
pub fn history_entries<R>(rows: Vec<R>) -> Result<Vec<postbox_core::store::HistoryEntry>>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
{
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let read = || -> std::result::Result<_, sqlx::Error> {
            let kind: String = row.try_get(1)?;
            Ok((
                kind,
                row.try_get::<i64, _>(0)?,
                row.try_get::<i32, _>(2)?,
                row.try_get::<Option<String>, _>(3)?,
                row.try_get::<Option<String>, _>(4)?,
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
