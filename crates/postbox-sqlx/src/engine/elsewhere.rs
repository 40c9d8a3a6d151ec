//! `<table>_archive` kept in another database (`[archive] url`).
//!
//! The store on the outbox's database (the *hot* store) holds a store
//! opened on the archive's database for the same table. Moving a batch
//! runs in one hot transaction that never commits before the archive has
//! the rows:
//!
//! 1. pick the batch's ids and lock them (`FOR UPDATE`; SQLite's write
//!    lock), read the rows;
//! 2. copy them into the archive (its own transaction, committed; rows
//!    already there by id or event are left alone);
//! 3. ask the archive which of the batch's events it holds;
//! 4. delete those from the outbox and commit.
//!
//! A crash before 2 commits leaves everything where it was; one after 2
//! and before 4 leaves rows in both, which the next run copies again (left
//! alone) and deletes. No row is lost, none ends up twice. A replay brings
//! archived rows back the other way: inserted into the outbox as pending
//! in the replay's transaction, deleted from the archive after it commits
//! (a crash in between leaves an archived copy of a live event, which a
//! replay skips while the event is live and archiving later keeps as the
//! archived copy).

use sqlx::Database;
use std::collections::{HashMap, HashSet};

use postbox_core::store::EventFilter;
use postbox_core::{Error, EventRecord, OutboxStore, Result};

use super::{finish, first_column, query, SqlOutbox};
use crate::dialect::{Dialect, Value};
use crate::{db_error, filter_query, records, FILTERS};

/// Rows per multi-row insert (18 binds each: well under every database's
/// limit on binds per statement).
const INSERT_CHUNK: usize = 500;

/// How long one call on the archive database may take. It runs inside a
/// transaction of the outbox's database, holding its batch's rows (and
/// SQLite's write lock, which every producer waits for): an archive
/// database gone silent held them for good.
pub(super) const FAR_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// `call` on the archive database, within [`FAR_WITHIN`].
pub(super) async fn far<T>(
    what: &'static str,
    call: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    Error::unless_silent(what, FAR_WITHIN, call).await
}

/// Where one archive batch is taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// Old delivered rows of the outbox table.
    Outbox,
    /// Rows archived beside the table before `[archive] url` was set: they
    /// move over first, so reads of the archive find every archived row.
    LocalArchive,
}

engine_impl! {
impl SqlOutbox<D> {
    /// `[archive] url`'s store, for one archive-reading call.
    pub(super) fn elsewhere(&self) -> Option<&dyn OutboxStore> {
        self.elsewhere.as_deref()
    }

    /// Moves one batch of `app_code`'s rows from `source` into the archive
    /// database `to` (see the module's steps); `(deleted, copied)`.
    pub(super) async fn archive_batch_elsewhere(
        &self,
        to: &dyn OutboxStore,
        source: Source,
        app_code: &str,
        before_ms: i64,
        size: u32,
    ) -> Result<(u64, u64)> {
        let db = |e| db_error("archive", e);
        let from = match source {
            Source::Outbox => "{table}",
            Source::LocalArchive => "{archive}",
        };
        let mut tx = self.begin_relay(true).await.map_err(db)?;
        let res = async {
            let ids: Vec<i64> = {
                let local_pick;
                let (sql, binds) = match source {
                    Source::Outbox => D::archive_pick_lock(self, app_code, before_ms, size),
                    Source::LocalArchive => {
                        // Nobody else changes these rows: with the archive
                        // elsewhere, replays read only there.
                        let p = D::PLACEHOLDERS;
                        local_pick = self.table.render(&format!(
                            "SELECT id FROM {{archive}} WHERE app_code = {} LIMIT {}",
                            p.nth(1),
                            p.nth(2)
                        ));
                        (local_pick.as_str(), vec![app_code.into(), i64::from(size).into()])
                    }
                };
                let rows = query::<D>(sql, binds).fetch_all(&mut *tx).await.map_err(db)?;
                first_column(rows).map_err(db)?
            };
            if ids.is_empty() {
                return Ok((0, 0, Vec::new()));
            }
            let select = self.rows_by_ids(from);
            let rows = self.fetch_expanded(&mut tx, &select, vec![Value::Ids(&ids)]).await.map_err(db)?;
            let rows = records(rows, self.table.naming(), "archive")?;
            let copied = far("archive: copy into the archive database", to.put_archived(&rows)).await?;
            let event_ids: Vec<String> = rows.iter().map(|r| r.event_id.clone()).collect();
            let held = far("archive: check the archive database", to.archived_event_ids(app_code, &event_ids)).await?;
            let held: HashSet<String> = held.into_iter().collect();
            let (done, left): (Vec<&EventRecord>, Vec<&EventRecord>) =
                rows.iter().partition(|r| held.contains(&r.event_id));
            let done: Vec<i64> = done.iter().map(|r| r.id).collect();
            let left: Vec<i64> = left.iter().map(|r| r.id).collect();
            let delete = self.table.render(&format!("DELETE FROM {from} WHERE {}", D::ID_LIST));
            let deleted = self.execute_expanded(&mut tx, &delete, vec![Value::Ids(&done)]).await.map_err(db)?;
            Ok((deleted, copied, left))
        }
        .await;
        let (deleted, copied, left) = finish(tx, res, "archive").await?;
        if !left.is_empty() {
            // Copying left them alone and the archive does not hold their
            // events: its ids belong to other events. The rows stay.
            return Err(Error::Schema(format!(
                "the archive database's `{}` holds other events under the ids of rows {:?} of app_code `{app_code}`: \
                 they stay in `{}`. Each outbox table needs an archive of its own",
                self.table.archive(),
                &left[..left.len().min(5)],
                self.table.as_str(),
            )));
        }
        Ok((deleted, copied))
    }

    /// `SELECT <columns> FROM <from> WHERE id IN (…)`, rendered.
    fn rows_by_ids(&self, from: &str) -> String {
        self.table
            .render(&format!("SELECT {} FROM {from} WHERE {}", crate::columns!(), D::ID_LIST))
    }

    /// Archived rows of one app_code a replay by `f` brings back from the
    /// archive database `to`, inside the replay's transaction `conn`: each
    /// inserted into the outbox table as pending (keeping its id), unless
    /// its event is live. Returns the rows as the outbox now holds them;
    /// their ids go to `forget`, deleted from the archive once the replay
    /// commits. A dry run only reads.
    pub(super) async fn unarchive_elsewhere(
        &self,
        to: &dyn OutboxStore,
        conn: &mut <D::DB as Database>::Connection,
        f: &EventFilter,
        dry_run: bool,
        forget: &mut Vec<i64>,
    ) -> Result<Vec<EventRecord>> {
        let db = |e| db_error("replay from archive", e);
        let archived = far("replay: read the archive database", to.archived_rows(f)).await?;
        let Some(app_code) = f.app_code.as_deref().filter(|_| !archived.is_empty()) else {
            return Ok(Vec::new());
        };
        if dry_run {
            let event_ids: Vec<String> = archived.iter().map(|r| r.event_id.clone()).collect();
            let live_sql = self
                .table
                .render(&D::STATEMENTS.archived_event_ids.replace("{archive}", "{table}"));
            let binds = vec![app_code.into(), Value::Texts(&event_ids)];
            let rows = self.fetch_expanded(&mut *conn, &live_sql, binds).await.map_err(db)?;
            let live: HashSet<String> = first_column(rows).map_err(db)?.into_iter().collect();
            return Ok(archived.into_iter().filter(|r| !live.contains(&r.event_id)).collect());
        }
        let now: i64 = sqlx::query_scalar(&self.sql.now_ms).fetch_one(&mut *conn).await.map_err(db)?;
        let when = self.created_when_back().await?;
        let created = |r: &EventRecord| when.as_ref().map_or(r.created_at_ms, |w| w.of(r.created_at_ms));
        for chunk in archived.chunks(INSERT_CHUNK) {
            let values = chunk.iter().map(|r| pending_values(r, created(r), now));
            let (sql, binds) = self.insert_rows("{table}", values);
            query::<D>(&sql, binds).execute(&mut *conn).await.map_err(db)?;
        }
        // What the outbox now holds under those ids with the same events:
        // rows inserted here, or by a replay whose archive delete never ran.
        let wanted: HashMap<i64, &str> = archived.iter().map(|r| (r.id, r.event_id.as_str())).collect();
        let ids: Vec<i64> = wanted.keys().copied().collect();
        let rows = self
            .fetch_expanded(&mut *conn, &self.rows_by_ids("{table}"), vec![Value::Ids(&ids)])
            .await
            .map_err(db)?;
        let mut back: Vec<EventRecord> = records(rows, self.table.naming(), "replay from archive")?
            .into_iter()
            .filter(|r| wanted.get(&r.id) == Some(&r.event_id.as_str()))
            .collect();
        back.sort_by_key(|r| r.id);
        forget.extend(back.iter().map(|r| r.id));
        Ok(back)
    }

    /// Deletes from the archive database the rows a committed replay
    /// brought back. A failure is logged, not returned: the replay
    /// happened (an error would have it run again), and an archived copy of
    /// a live event is harmless (see the module).
    pub(super) async fn forget_unarchived(&self, to: &dyn OutboxStore, ids: &[i64]) {
        if ids.is_empty() {
            return;
        }
        if let Err(e) = far("replay: delete from the archive database", to.delete_archived(ids)).await {
            tracing::warn!(
                table = self.table.as_str(),
                rows = ids.len(),
                error = %e,
                "replayed rows stay in the archive database too; archiving them again keeps one copy"
            );
        }
    }

    /// A multi-row insert into `into` (`{table}` or `{archive}`), each
    /// row's 18 values in [`crate::columns!`] order, leaving alone rows
    /// whose key is there.
    fn insert_rows<'r>(
        &self,
        into: &str,
        rows: impl Iterator<Item = [Value<'r>; 18]>,
    ) -> (String, Vec<Value<'r>>) {
        let (head, tail) = D::INSERT_IGNORE;
        let mut sql = format!("{head} {into} ({}) VALUES ", crate::columns!());
        let mut binds = Vec::new();
        for (i, row) in rows.enumerate() {
            sql.push_str(if i == 0 { "(" } else { ", (" });
            for (j, value) in row.into_iter().enumerate() {
                if j > 0 {
                    sql.push_str(", ");
                }
                binds.push(value);
                sql.push_str(&D::PLACEHOLDERS.nth(binds.len()));
            }
            sql.push(')');
        }
        sql.push_str(tail);
        (self.table.render(&sql), binds)
    }

    /// [`postbox_core::ArchiveStore::put_archived`]: on the archive's own
    /// database.
    pub async fn put_archived(&self, rows: &[EventRecord]) -> Result<u64> {
        let db = |e| db_error("copy into the archive database (archive.url)", e);
        let delivered_to: Vec<Option<String>> = rows.iter().map(joined_delivered_to).collect();
        let mut tx = self.pool.begin().await.map_err(db)?;
        let res = async {
            let mut copied = 0;
            for (chunk, targets) in rows.chunks(INSERT_CHUNK).zip(delivered_to.chunks(INSERT_CHUNK)) {
                let values = chunk.iter().zip(targets).map(|(r, t)| archived_values(r, t.as_deref()));
                let (sql, binds) = self.insert_rows("{archive}", values);
                let done = query::<D>(&sql, binds).execute(&mut *tx).await.map_err(db)?;
                copied += D::rows_affected(&done);
            }
            Ok(copied)
        }
        .await;
        finish(tx, res, "copy into the archive database (archive.url)").await
    }

    /// [`postbox_core::ArchiveStore::archived_rows`].
    pub async fn archived_rows(&self, f: &EventFilter) -> Result<Vec<EventRecord>> {
        if f.aggregate_id.is_some() {
            self.require_aggregate_index(&[&self.table.archive()]).await?;
        }
        let select = format!("SELECT {} FROM {{archive}} WHERE 1 = 1{FILTERS} ORDER BY id", crate::columns!());
        let q = filter_query(&select, f, crate::list::ARCHIVED_STATUS, D::PLACEHOLDERS);
        let sql = self.table.render(&q.sql);
        let rows = query::<D>(&sql, super::list_values(&q.args))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("read the archive database (archive.url)", e))?;
        records(rows, self.table.naming(), "read the archive database (archive.url)")
    }

    /// [`postbox_core::ArchiveStore::archived_ids`].
    pub async fn archived_ids(&self, f: &EventFilter) -> Result<Vec<i64>> {
        if f.aggregate_id.is_some() {
            self.require_aggregate_index(&[&self.table.archive()]).await?;
        }
        let q = crate::ids_query("{archive}", f, crate::list::ARCHIVED_STATUS, D::PLACEHOLDERS);
        let sql = self.table.render(&q.sql);
        let rows = query::<D>(&sql, super::list_values(&q.args))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("read the archive database (archive.url)", e))?;
        first_column(rows).map_err(|e| db_error("read the archive database (archive.url)", e))
    }

    /// [`postbox_core::ArchiveStore::delete_archived`].
    pub async fn delete_archived(&self, ids: &[i64]) -> Result<u64> {
        let db = |e| db_error("delete from the archive database (archive.url)", e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        self.execute_expanded(&mut conn, &self.sql.delete_unarchived, vec![Value::Ids(ids)])
            .await
            .map_err(db)
    }
}
}

/// `delivered_to` as the column holds it (comma-separated, NULL when
/// empty).
fn joined_delivered_to(r: &EventRecord) -> Option<String> {
    Some(r.delivered_to.join(",")).filter(|s| !s.is_empty())
}

/// The state a row is written with, beside its event's own columns.
struct State<'r> {
    status: &'r str,
    retry_count: i32,
    next_retry_at_ms: i64,
    lock_until_ms: i64,
    worker_id: Option<&'r str>,
    last_error: Option<&'r str>,
    delivered_to: Option<&'r str>,
    replay_count: i32,
    created_at_ms: i64,
    updated_at_ms: i64,
}

/// A row's 18 values in [`crate::columns!`] order: `r`'s event, in `state`.
fn row_values<'r>(r: &'r EventRecord, state: State<'r>) -> [Value<'r>; 18] {
    [
        r.id.into(),
        r.app_code.as_str().into(),
        r.event_id.as_str().into(),
        r.event_type.as_str().into(),
        r.aggregate_id.as_deref().into(),
        r.aggregate_version.into(),
        r.payload.as_str().into(),
        r.headers.as_deref().into(),
        state.status.into(),
        Value::Int32(state.retry_count),
        state.next_retry_at_ms.into(),
        state.lock_until_ms.into(),
        state.worker_id.into(),
        state.last_error.into(),
        state.delivered_to.into(),
        Value::Int32(state.replay_count),
        state.created_at_ms.into(),
        state.updated_at_ms.into(),
    ]
}

/// A row's values as the archive keeps them.
fn archived_values<'r>(r: &'r EventRecord, delivered_to: Option<&'r str>) -> [Value<'r>; 18] {
    let state = State {
        status: r.status.as_str(),
        retry_count: r.retry_count,
        next_retry_at_ms: r.next_retry_at_ms,
        lock_until_ms: r.lock_until_ms,
        worker_id: r.worker_id.as_deref(),
        last_error: r.last_error.as_deref(),
        delivered_to,
        replay_count: r.replay_count,
        created_at_ms: r.created_at_ms,
        updated_at_ms: r.updated_at_ms,
    };
    row_values(r, state)
}

/// An archived row's values as a replay puts it back: pending, its
/// attempts and progress cleared, one more replay, created at `created`
/// (see `SqlOutbox::created_when_back`), changed `now`.
fn pending_values(r: &EventRecord, created: i64, now: i64) -> [Value<'_>; 18] {
    let state = State {
        status: "pending",
        retry_count: 0,
        next_retry_at_ms: 0,
        lock_until_ms: 0,
        worker_id: None,
        last_error: None,
        delivered_to: None,
        replay_count: r.replay_count + 1,
        created_at_ms: created,
        updated_at_ms: now,
    };
    row_values(r, state)
}
