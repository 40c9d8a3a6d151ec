//! `ordering = "per_aggregate"`: retries that do not reorder an aggregate.
//!
//! Without it, an event whose handler fails waits in retry while later events
//! of its aggregate are handled; when it comes back the inbox skips it as
//! stale. With it, the consumer records a *hold* when an event goes to retry
//! — `(consumer_group, aggregate_id, event_id, aggregate_version, until_ms)`
//! in `<inbox table>_holds`, in the inbox database so every process of the
//! group sees it — and a later version of that aggregate is not handled
//! while the hold stands: it goes to retry behind the held event, without
//! counting an attempt, and takes a hold of its own, so versions after it
//! wait behind it in turn. Only holds of lower versions block an event, so
//! two holds never wait on each other. The hold is released when its event
//! is handled (or found a duplicate or stale) or dead-lettered, and moved on
//! when its event goes to retry again.
//!
//! # When the held event does not come back
//!
//! A clock cannot tell a retry copy that is gone (purged, moved or
//! dead-lettered by hand) from one still on its way: a retry copy returns
//! to the *tail* of the queue, behind however long a backlog. So a hold
//! never lets a later version through because of a timer (but the purge:
//! a hold that lapsed the inbox's retention ago is deleted with the inbox's
//! rows, when the inbox has forgotten the versions too). Its lapse time,
//! `until_ms` (the copy's retry delay + `max_retry_delay` + a grace of a
//! minute), is only the moment by which the copy has surely left the retry
//! queue (which expires copies at its head only, so one waits at most
//! `max_retry_delay` behind longer ones) and entered the main queue. A later
//! version that finds the hold *lapsed* ([`wait_for`]):
//!
//! 1. goes round the queue once more, behind the held event, noting the
//!    hold as it found it (event and lapse time) on its copy: if the held
//!    copy still exists it is now ahead in the queue;
//! 2. comes back. Every delivery of the held event releases its hold, or
//!    moves it (a new lapse time): a hold still there as noted means the
//!    held event did not come by while this copy went round behind it. It
//!    is gone; the hold is dropped ([`AggregateHolds::drop_gone`], only as
//!    noted) and the later version goes on.
//!
//! An aggregate whose held event is gone is so held back for one lapse plus
//! one round of the queue, not for ever. Holding on while later versions
//! keep coming (renewing the hold from the events parked behind it) would
//! instead hold such an aggregate back for as long as it has traffic, and
//! would still miss a later version that comes only after the lapse.
//!
//! Residual risk: the held event's copy sits, unsettled, in another
//! consumer's hands (a slow handler, or `prefetch > 1` keeping it in that
//! consumer's buffer) for the whole round the later version takes; the later
//! version is then handled first and the held event skipped as stale by the
//! inbox (counted `stale`, logged). And the retry queue taking longer than
//! the grace to expire a copy (a backlog of copies expiring at once) makes
//! the round start too early in the same way: raise the grace
//! (`RabbitMqConsumer::with_hold_grace`).
//!
//! Events without `aggregate_id` or `aggregate_version` are never held back.
//! Order across retries is what this keeps; several consumer processes on
//! one queue still handle first deliveries in parallel.

use async_trait::async_trait;
use postbox_core::Error;

use crate::inbox::Inbox;

/// A hold of an aggregate: the event that holds it back, and when the hold
/// lapses (see the module docs for what a lapse means).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The held event.
    pub event_id: String,
    /// When its copy has surely left the retry queue, in ms since the epoch.
    pub until_ms: i64,
}

/// What a later version of an aggregate does about the hold before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// The hold stands: wait behind it (go to retry, unhandled).
    Behind,
    /// The hold lapsed: go round the queue once more behind the held event,
    /// noting the hold on the copy, to learn whether the held event is gone.
    Check,
    /// The hold lapsed and has not changed while this copy went round
    /// behind it: the held event is gone; drop the hold and go on.
    Gone,
}

/// What an event does about `hold`, the earliest hold before it, at
/// `now_ms`; `noted` is the lapsed hold its copy noted when it went round
/// the queue last (see the module docs).
pub fn wait_for(hold: &Hold, now_ms: i64, noted: Option<&Hold>) -> Wait {
    if hold.until_ms > now_ms {
        Wait::Behind
    } else if noted == Some(hold) {
        Wait::Gone
    } else {
        Wait::Check
    }
}

/// Where the holds of per-aggregate ordering live (shared by every process of
/// a consumer group).
#[async_trait]
pub trait AggregateHolds: Send + Sync {
    /// The hold before an event at `version` of `aggregate_id`: the hold of
    /// another event with the lowest lower version, lapsed or not.
    async fn blocker(
        &self,
        consumer_group: &str,
        aggregate_id: &str,
        version: i64,
        event_id: &str,
    ) -> Result<Option<Hold>, Error>;

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

    /// Releases the hold of `event_id` (only its own: a lapsed hold of
    /// another event is that event's until it comes back or is found gone).
    async fn release(
        &self,
        consumer_group: &str,
        aggregate_id: &str,
        event_id: &str,
    ) -> Result<(), Error>;

    /// Drops `hold` of `aggregate_id`, its event found gone, if it is still
    /// as noted (not released, nor moved by its event coming back); whether
    /// it did.
    async fn drop_gone(
        &self,
        consumer_group: &str,
        aggregate_id: &str,
        hold: &Hold,
    ) -> Result<bool, Error>;
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
    drop_gone: String,
    purge: String,
}

struct Dialect {
    create: &'static str,
    blocker: &'static str,
    hold: &'static str,
    release: &'static str,
    drop_gone: &'static str,
    /// Binds cut-off ms, batch size.
    purge: &'static str,
}

impl Statements {
    fn render(table: &str, d: &Dialect) -> Self {
        let r = |s: &str| s.replace("{table}", table);
        Statements {
            create: r(d.create),
            blocker: r(d.blocker),
            hold: r(d.hold),
            release: r(d.release),
            drop_gone: r(d.drop_gone),
            purge: r(d.purge),
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
    blocker: "SELECT event_id, until_ms FROM {table}_holds WHERE consumer_group = $1 AND aggregate_id = $2 AND aggregate_version < $3 AND event_id <> $4 ORDER BY aggregate_version LIMIT 1",
    hold: "INSERT INTO {table}_holds (consumer_group, aggregate_id, event_id, aggregate_version, until_ms) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (consumer_group, aggregate_id, event_id) DO UPDATE SET aggregate_version = EXCLUDED.aggregate_version, until_ms = EXCLUDED.until_ms",
    // primary key prefix (consumer_group, aggregate_id)
    // primary key
    release: "DELETE FROM {table}_holds WHERE consumer_group = $1 AND aggregate_id = $2 AND event_id = $3",
    // primary key
    drop_gone: "DELETE FROM {table}_holds WHERE consumer_group = $1 AND aggregate_id = $2 AND event_id = $3 AND until_ms = $4",
    purge: "DELETE FROM {table}_holds WHERE ctid IN (SELECT ctid FROM {table}_holds WHERE until_ms < $1 LIMIT $2)",
};

#[cfg(feature = "mysql")]
const MYSQL: Dialect = Dialect {
    create: create_holds!(" ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"),
    // primary key prefix (consumer_group, aggregate_id); the cast because a
    // `_bin` collation reads back as VARBINARY
    blocker: "SELECT CAST(event_id AS CHAR CHARACTER SET utf8mb4), until_ms FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND aggregate_version < ? AND event_id <> ? ORDER BY aggregate_version LIMIT 1",
    hold: "INSERT INTO {table}_holds (consumer_group, aggregate_id, event_id, aggregate_version, until_ms) VALUES (?, ?, ?, ?, ?) ON DUPLICATE KEY UPDATE aggregate_version = VALUES(aggregate_version), until_ms = VALUES(until_ms)",
    // primary key prefix (consumer_group, aggregate_id)
    // primary key
    release: "DELETE FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND event_id = ?",
    // primary key
    drop_gone: "DELETE FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND event_id = ? AND until_ms = ?",
    purge: "DELETE FROM {table}_holds WHERE until_ms < ? LIMIT ?",
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
    blocker: "SELECT event_id, until_ms FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND aggregate_version < ? AND event_id <> ? ORDER BY aggregate_version LIMIT 1",
    hold: "INSERT INTO {table}_holds (consumer_group, aggregate_id, event_id, aggregate_version, until_ms) VALUES (?, ?, ?, ?, ?) ON CONFLICT (consumer_group, aggregate_id, event_id) DO UPDATE SET aggregate_version = excluded.aggregate_version, until_ms = excluded.until_ms",
    // primary key prefix (consumer_group, aggregate_id)
    // primary key
    release: "DELETE FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND event_id = ?",
    // primary key
    drop_gone: "DELETE FROM {table}_holds WHERE consumer_group = ? AND aggregate_id = ? AND event_id = ? AND until_ms = ?",
    purge: "DELETE FROM {table}_holds WHERE rowid IN (SELECT rowid FROM {table}_holds WHERE until_ms < ? LIMIT ?)",
};

/// Runs the holds' statement `$sql` with `$arg`s bound in order: the rows
/// it affected; `$what` says what failed.
macro_rules! execute {
    ($holds:ident, $sql:ident, $what:literal, $($arg:expr),+) => {
        bounded($what, sqlx::query(&$holds.sql.$sql)
            $(.bind($arg))+
            .execute(&$holds.pool))
            .await
            .map(|done| done.rows_affected())
    };
}

/// A statement on the holds' database within the inbox's bound
/// ([`crate::inbox::INBOX_WITHIN`]): one the database never answers (it
/// went silent) would hold the message in hand for good.
async fn bounded<T>(
    what: &'static str,
    statement: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, Error> {
    use futures::TryFutureExt;
    let statement = statement.map_err(|e| Error::database(what, e));
    Error::unless_silent(what, crate::inbox::INBOX_WITHIN, statement).await
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

            /// Deletes the holds that lapsed before `before_ms` (the inbox's
            /// retention ago), `batch_size` a statement; how many went. A
            /// hold whose event never came back and that no later version
            /// found is otherwise kept for ever (a crash between a dead
            /// letter and its release, a release that failed).
            pub async fn purge(&self, before_ms: i64, batch_size: u32) -> Result<u64, Error> {
                let mut total = 0;
                loop {
                    let n = sqlx::query(&self.sql.purge)
                        .bind(before_ms)
                        .bind(i64::from(batch_size))
                        .execute(&self.pool)
                        .await
                        .map_err(|e| Error::database("purging ordering holds", e))?
                        .rows_affected();
                    total += n;
                    if n < u64::from(batch_size) {
                        return Ok(total);
                    }
                }
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
            ) -> Result<Option<Hold>, Error> {
                let read = sqlx::query_as::<_, (String, i64)>(&self.sql.blocker)
                    .bind(consumer_group)
                    .bind(aggregate_id)
                    .bind(version)
                    .bind(event_id)
                    .fetch_optional(&self.pool);
                let row = bounded("reading ordering holds", read).await?;
                Ok(row.map(|(event_id, until_ms)| Hold { event_id, until_ms }))
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
                .map(drop)
            }

            async fn release(
                &self,
                consumer_group: &str,
                aggregate_id: &str,
                event_id: &str,
            ) -> Result<(), Error> {
                execute!(
                    self,
                    release,
                    "releasing an ordering hold",
                    consumer_group,
                    aggregate_id,
                    event_id
                )
                .map(drop)
            }

            async fn drop_gone(
                &self,
                consumer_group: &str,
                aggregate_id: &str,
                hold: &Hold,
            ) -> Result<bool, Error> {
                execute!(
                    self,
                    drop_gone,
                    "dropping the ordering hold of a gone event",
                    consumer_group,
                    aggregate_id,
                    &hold.event_id,
                    hold.until_ms
                )
                .map(|dropped| dropped > 0)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(event_id: &str, until_ms: i64) -> Hold {
        Hold {
            event_id: event_id.to_owned(),
            until_ms,
        }
    }

    #[test]
    fn a_standing_hold_is_waited_behind() {
        let e1 = hold("e1", 1_000);
        assert_eq!(wait_for(&e1, 999, None), Wait::Behind);
        // Noted or not: a hold that stands is never dropped.
        assert_eq!(wait_for(&e1, 999, Some(&e1)), Wait::Behind);
    }

    #[test]
    fn a_lapsed_hold_is_checked_by_a_round_of_the_queue_first() {
        let e1 = hold("e1", 1_000);
        assert_eq!(wait_for(&e1, 1_000, None), Wait::Check);
        assert_eq!(wait_for(&e1, 5_000, None), Wait::Check);
        // Moved since it was noted: its event came back and went to retry
        // again, so it is on its way.
        assert_eq!(wait_for(&e1, 5_000, Some(&hold("e1", 900))), Wait::Check);
        // Another event's hold was noted (that one was released meanwhile).
        assert_eq!(wait_for(&e1, 5_000, Some(&hold("e0", 1_000))), Wait::Check);
    }

    #[test]
    fn a_lapsed_hold_unchanged_after_a_round_is_gone() {
        let e1 = hold("e1", 1_000);
        assert_eq!(wait_for(&e1, 5_000, Some(&e1)), Wait::Gone);
    }
}
