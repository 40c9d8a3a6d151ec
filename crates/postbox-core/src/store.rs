//! The storage interface every database backend implements.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::event::Fence;
use crate::{ClaimSource, ClaimedEvent, EventRecord, NewEvent, Result, Status, TableName};

/// Parameters of one claim query.
#[derive(Debug, Clone)]
pub struct ClaimRequest<'a> {
    /// Tenant; every claim is scoped by one.
    pub app_code: &'a str,
    /// At most this many rows.
    pub limit: u32,
    /// Written into `worker_id`.
    pub worker_id: &'a str,
    /// Lease length; `lock_until_ms` = database now + this.
    pub lease_ms: i64,
    /// Per-aggregate ordering: claim only the head event of each aggregate.
    pub ordered: bool,
    /// Event types paused by a runtime control: the pending claims leave
    /// their rows alone (other claims ignore it).
    pub skip_types: &'a [String],
}

/// How often a relay writes its heartbeat into `<table>_relays`.
pub const RELAY_BEAT: std::time::Duration = std::time::Duration::from_secs(10);

/// Relays not heard from for this long are forgotten by the others'
/// heartbeats.
pub const RELAY_FORGOTTEN_AFTER_MS: i64 = 24 * 3_600_000;

/// A relay's heartbeat (`<table>_relays`, schema version 10): who it is
/// and what it did since it started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RelayBeat {
    /// Its worker id, written into the leases it takes.
    pub worker_id: String,
    /// The host it runs on.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// The app_codes it serves.
    pub app_codes: Vec<String>,
    /// Rows claimed since it started.
    pub claimed: u64,
    /// Rows marked delivered since it started.
    pub delivered: u64,
    /// Rows dead-lettered since it started.
    pub failed: u64,
    /// Rows delivered per minute over its last heartbeat interval.
    pub per_minute: u64,
    /// This is its last heartbeat: it stopped.
    pub stopped: bool,
}

/// A relay as the registry last heard of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RelaySeen {
    /// Its last heartbeat.
    #[serde(flatten)]
    pub beat: RelayBeat,
    /// When it started, epoch ms (the database's clock).
    pub started_at_ms: i64,
    /// Its last heartbeat, epoch ms.
    pub seen_at_ms: i64,
    /// When it stopped, if it said so.
    pub stopped_at_ms: Option<i64>,
    /// `running` (heard from within three heartbeats), `stopped` (said so)
    /// or `silent` (no heartbeat for longer: killed, hung or cut off; its
    /// leases expire and other relays take its rows over).
    pub state: &'static str,
}

impl RelaySeen {
    /// The state of a relay last seen at `seen_at_ms` when the database's
    /// clock reads `now_ms`.
    pub fn state_of(stopped: bool, seen_at_ms: i64, now_ms: i64) -> &'static str {
        if stopped {
            "stopped"
        } else if now_ms - seen_at_ms <= 3 * RELAY_BEAT.as_millis() as i64 {
            "running"
        } else {
            "silent"
        }
    }
}

/// How deferred rows are written (see [`RelayStore::defer`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeferUpdate {
    /// Delay before the rows are due again, ms.
    pub after_ms: i64,
    /// Publishers that have confirmed the rows so far.
    pub delivered_to: Vec<String>,
    /// Why (recorded as the rows' `last_error`).
    pub reason: String,
}

/// How a failed attempt is written (the fenced `retryable`/`failed` update).
/// Rows that failed alike share one: the relay groups a batch's failures
/// by it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FailureUpdate {
    /// `retryable` or `failed`.
    pub status: Status,
    /// New failed-attempt count.
    pub retry_count: i32,
    /// Delay from database now until due again, at the latest.
    pub retry_after_ms: i64,
    /// How much earlier a row may be due: the store spreads the rows of
    /// one write over `[retry_after_ms - retry_jitter_ms, retry_after_ms]`
    /// by id ([`crate::retry::RetryDelay`]).
    pub retry_jitter_ms: i64,
    /// Publishers confirmed so far (fanout progress).
    pub delivered_to: Vec<String>,
    /// Truncated error text.
    pub error: String,
    /// The publishers that failed this attempt (comma-separated when
    /// several); `None` when nothing was published (a lease that expired on
    /// the last allowed attempt). Written to the attempt history.
    pub publisher: Option<String>,
}

impl FailureUpdate {
    /// The history entry this update writes: `dead_lettered` when it makes
    /// the row `failed`, else `failed`.
    pub fn history_kind(&self) -> HistoryKind {
        match self.status {
            Status::Failed => HistoryKind::DeadLettered,
            Status::Dropped => HistoryKind::Dropped,
            _ => HistoryKind::Failed,
        }
    }
}

/// Filters shared by `events list`, `replay` and the admin API.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EventFilter {
    /// Only this tenant.
    pub app_code: Option<String>,
    /// Only this status.
    pub status: Option<Status>,
    /// Only this type.
    pub event_type: Option<String>,
    /// Only this aggregate (with an `app_code`: aggregate ids are a
    /// tenant's). Read through [`AGGREGATE_INDEX`], which is optional:
    /// without it the search is refused, never a scan of the table.
    pub aggregate_id: Option<String>,
    /// `created_at_ms >= since_ms`.
    pub since_ms: Option<i64>,
    /// `created_at_ms < until_ms`.
    pub until_ms: Option<i64>,
    /// Only ids below this (pagination cursor, newest first); lists only.
    pub before_id: Option<i64>,
    /// Only ids above this (a paced replay's cursor).
    pub after_id: Option<i64>,
    /// Only ids up to this one (the end of a paced replay's batch).
    pub through_id: Option<i64>,
    /// At most this many rows.
    pub limit: u32,
}

impl EventFilter {
    /// Whether a replay by this filter also takes archived rows: with a
    /// time range or an aggregate (a status or a type alone reads the live
    /// table).
    pub fn reaches_archive(&self) -> bool {
        self.since_ms.is_some() || self.until_ms.is_some() || self.aggregate_id.is_some()
    }
}

/// What `replay` acts on.
#[derive(Debug, Clone)]
pub enum ReplaySelector {
    /// These event ids (in any app_code unless one is given).
    EventIds {
        /// Scope, optional.
        app_code: Option<String>,
        /// Ids to replay.
        event_ids: Vec<String>,
    },
    /// Every row matching the filter (its `limit` is ignored).
    Filter(EventFilter),
}

impl ReplaySelector {
    /// Event ids given without an app_code that `rows` (what the selector
    /// found, e.g. by a dry run) hold in more than one app_code, each with
    /// those app_codes, sorted. Event ids are unique per app_code only, so
    /// such an id names several events: replaying them all re-sends events
    /// of tenants the operator did not mean, and the caller asks for the
    /// app_code instead.
    pub fn ambiguous_ids(&self, rows: &[EventRecord]) -> Vec<(String, Vec<String>)> {
        let Self::EventIds {
            app_code: None,
            event_ids,
        } = self
        else {
            return Vec::new();
        };
        event_ids
            .iter()
            .filter_map(|id| {
                let mut apps: Vec<String> = rows
                    .iter()
                    .filter(|r| &r.event_id == id)
                    .map(|r| r.app_code.clone())
                    .collect();
                apps.sort();
                apps.dedup();
                (apps.len() > 1).then(|| (id.clone(), apps))
            })
            .collect()
    }
}

/// Which publishers a replay sends to. Fanout progress lives in the row's
/// `delivered_to` (publishers that confirmed it); the relay sends a row only
/// to the publishers *not* listed there. So a replay picks its targets by
/// what it leaves in, or writes into, that column.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ReplayPick {
    /// The default: a `delivered` row goes to every publisher (backtracking);
    /// any other row only to the publishers that have not confirmed it
    /// (its `delivered_to` is kept).
    #[default]
    Unconfirmed,
    /// Every publisher, whatever confirmed before (`delivered_to` cleared).
    All,
    /// Only these publishers: every other configured one is written into
    /// `delivered_to` as if it had confirmed.
    Only(Vec<String>),
}

/// The targets of a replay and the configured publishers they are chosen
/// from (in configuration order; used to write the other publishers into
/// `delivered_to` and to name the targets in the history).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayTargets {
    /// What the operator asked for.
    pub pick: ReplayPick,
    /// Every configured publisher name; empty when unknown (then the
    /// history does not name targets).
    pub publishers: Vec<String>,
}

impl ReplayTargets {
    /// Targets `pick` among `publishers`; a name of `Only` that is not
    /// configured is an error naming every such name.
    pub fn new(pick: ReplayPick, publishers: Vec<String>) -> std::result::Result<Self, String> {
        if let ReplayPick::Only(names) = &pick {
            if names.is_empty() {
                return Err("no publisher named: give at least one".to_owned());
            }
            let unknown: Vec<&str> = names
                .iter()
                .filter(|n| !publishers.contains(n))
                .map(String::as_str)
                .collect();
            if !unknown.is_empty() {
                return Err(format!(
                    "unknown publisher(s): {} (configured: {})",
                    unknown.join(", "),
                    if publishers.is_empty() {
                        "none".to_owned()
                    } else {
                        publishers.join(", ")
                    }
                ));
            }
        }
        Ok(ReplayTargets { pick, publishers })
    }

    /// The value every replayed row's `delivered_to` is set to after the
    /// backend's replay update, or `None` to leave what that update wrote
    /// (the [`ReplayPick::Unconfirmed`] rule, applied in SQL).
    pub fn delivered_to_override(&self) -> Option<Option<String>> {
        match &self.pick {
            ReplayPick::Unconfirmed => None,
            ReplayPick::All => Some(None),
            ReplayPick::Only(names) => {
                let others: Vec<&str> = self
                    .publishers
                    .iter()
                    .filter(|p| !names.contains(p))
                    .map(String::as_str)
                    .collect();
                Some(Some(others.join(",")).filter(|s| !s.is_empty()))
            }
        }
    }

    /// For [`ReplayPick::Only`]: the rows (as they are before the replay)
    /// that a publisher left out of the targets has not confirmed, one line
    /// each naming the event and those publishers. Replaying such a row to
    /// the chosen publishers alone would end it `delivered` without them,
    /// so it is refused. A `delivered` row has been confirmed by all.
    pub fn unconfirmed_left_out(&self, rows: &[crate::EventRecord]) -> Vec<String> {
        let ReplayPick::Only(names) = &self.pick else {
            return Vec::new();
        };
        rows.iter()
            .filter(|r| !matches!(r.status, Status::Delivered))
            .filter_map(|r| {
                let missing: Vec<&str> = self
                    .publishers
                    .iter()
                    .filter(|p| !names.contains(p) && !r.delivered_to.contains(p))
                    .map(String::as_str)
                    .collect();
                (!missing.is_empty()).then(|| {
                    format!(
                        "event {} ({}) has not been confirmed by {}",
                        r.event_id,
                        r.status.as_str(),
                        missing.join(", ")
                    )
                })
            })
            .collect()
    }

    /// Applies [`Self::delivered_to_override`] to rows read back before it
    /// was written.
    pub fn apply(&self, rows: &mut [crate::EventRecord]) {
        if let Some(v) = self.delivered_to_override() {
            let list = crate::event::parse_delivered_to(v.as_deref());
            for r in rows {
                r.delivered_to = list.clone();
            }
        }
    }

    /// The publishers a replayed row (as written) will be sent to,
    /// comma-separated; `None` when the configured publishers are unknown.
    pub fn targets_of(&self, row: &crate::EventRecord) -> Option<String> {
        if self.publishers.is_empty() {
            return None;
        }
        let t: Vec<&str> = self
            .publishers
            .iter()
            .filter(|p| !row.delivered_to.contains(p))
            .map(String::as_str)
            .collect();
        Some(t.join(","))
    }

    /// Replayed rows grouped by [`Self::targets_of`], for one history write
    /// per group.
    pub fn history_groups(&self, rows: &[crate::EventRecord]) -> Vec<(Option<String>, Vec<i64>)> {
        let mut groups: Vec<(Option<String>, Vec<i64>)> = Vec::new();
        for r in rows {
            let t = self.targets_of(r);
            match groups.iter_mut().find(|(k, _)| *k == t) {
                Some((_, ids)) => ids.push(r.id),
                None => groups.push((t, vec![r.id])),
            }
        }
        groups
    }
}

/// The publishers that confirmed a `delivered` row on its last attempt:
/// every configured publisher not in its `delivered_to` (those confirmed on
/// earlier attempts and were not sent it again). Empty when the configured
/// publishers are unknown.
pub fn confirmed_on_delivery(record: &EventRecord, publishers: &[String]) -> Vec<String> {
    publishers
        .iter()
        .filter(|p| !record.delivered_to.contains(p))
        .cloned()
        .collect()
}

/// A row as inspection shows it: from the outbox table, or from
/// `<table>_archive` (`archived`).
#[derive(Debug, Clone, Serialize)]
pub struct Inspected {
    /// The row.
    #[serde(flatten)]
    pub record: EventRecord,
    /// True when the row lives in `<table>_archive`.
    pub archived: bool,
}

/// What one entry of an event's attempt history records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HistoryKind {
    /// A publisher refused, failed or timed out.
    Failed,
    /// A lease expired before the result was written (counted as an attempt).
    LeaseExpired,
    /// The attempt that made the row `failed` (dead letter).
    DeadLettered,
    /// An operator put the row back to `pending`.
    Replayed,
    /// Sampling left the row out (`dropped`).
    Dropped,
}

/// One entry of an event's attempt history (bounded per event). Together
/// with the row's `created_at_ms` and its delivered time it gives the
/// timeline `events show` and the admin API display.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HistoryEntry {
    /// Database time of the entry, epoch ms.
    pub at_ms: i64,
    /// What happened.
    pub kind: HistoryKind,
    /// The attempt number it concerns (1 for the first delivery attempt);
    /// 0 for a replay, which is not a delivery attempt.
    pub attempt: i32,
    /// The publisher that failed, when one did.
    pub publisher: Option<String>,
    /// Error text (failures) or origin (replays: `cli`, `api 10.0.0.7`, …).
    pub detail: Option<String>,
}

/// Rows of one tenant delivered in one minute (the dashboard's chart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MinuteCount {
    /// Start of the minute, epoch ms (database clock).
    pub minute_ms: i64,
    /// Rows marked delivered in that minute (by `updated_at_ms`).
    pub delivered: i64,
}

/// Most history entries kept per `(app_code, event_id)`; writing one more
/// deletes the oldest.
pub const HISTORY_LIMIT: i64 = 20;

impl HistoryKind {
    /// The stored name (`failed`, `lease_expired`, `dead_lettered`, `replayed`).
    pub fn as_str(self) -> &'static str {
        match self {
            HistoryKind::Failed => "failed",
            HistoryKind::LeaseExpired => "lease_expired",
            HistoryKind::DeadLettered => "dead_lettered",
            HistoryKind::Replayed => "replayed",
            HistoryKind::Dropped => "dropped",
        }
    }

    /// Reads a stored name; `None` for one this version does not know.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "failed" => HistoryKind::Failed,
            "lease_expired" => HistoryKind::LeaseExpired,
            "dead_lettered" => HistoryKind::DeadLettered,
            "replayed" => HistoryKind::Replayed,
            "dropped" => HistoryKind::Dropped,
            _ => return None,
        })
    }
}

/// An aggregate whose head event (`ordering = "per_aggregate"`) has not
/// moved for long while later events of it wait: the head keeps failing
/// (`retryable`) or is held by a lease (`delivering`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StuckAggregate {
    /// Tenant.
    pub app_code: String,
    /// The aggregate held back.
    pub aggregate_id: String,
    /// The head event everything later in the aggregate waits for.
    pub head_event_id: String,
    /// `retryable` or `delivering`.
    pub head_status: Status,
    /// Failed attempts of the head so far.
    pub head_retry_count: i32,
    /// The head's last error, if any.
    pub head_last_error: Option<String>,
    /// Seconds since the head was enqueued.
    pub head_age_seconds: f64,
    /// Later events of the aggregate waiting behind the head.
    pub waiting: i64,
}

/// How many delivered rows a store counts one by one: above it, it
/// reports the database's estimate ([`AppStats::delivered_estimated`]), so
/// that monitoring costs the same at 10 million delivered rows as at 0.
pub const DELIVERED_COUNT_CAP: i64 = 25_000;

/// Counts of one tenant.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct AppStats {
    /// Tenant.
    pub app_code: String,
    /// Rows by status.
    pub pending: i64,
    /// Claimed now.
    pub delivering: i64,
    /// Confirmed (including legacy `published`): exact up to 25,000, then
    /// the database's estimate (see `delivered_estimated`).
    pub delivered: i64,
    /// `delivered` is the database's estimate (from its statistics), not a
    /// count: counting millions of delivered rows on every poll is the
    /// monitoring load postbox exists to avoid.
    pub delivered_estimated: bool,
    /// Waiting for a retry.
    pub retryable: i64,
    /// Dead letters.
    pub failed: i64,
    /// Sampled out (`sample_percent`): terminal, never delivered. Counted
    /// up to one past [`DELIVERED_COUNT_CAP`] (more is shown as that).
    pub dropped: i64,
    /// Age of the oldest pending row, in seconds (0 when none).
    pub oldest_pending_age_seconds: f64,
    /// Retryable rows already due.
    pub retryable_due: i64,
}

impl AppStats {
    /// Zero counts for `app_code`.
    pub fn new(app_code: &str) -> Self {
        AppStats {
            app_code: app_code.to_owned(),
            ..Default::default()
        }
    }

    /// Sets the backlog figures from the oldest pending `created_at_ms`, the
    /// due retries and the database clock.
    pub fn backlog(&mut self, oldest_pending_ms: Option<i64>, retryable_due: i64, now_ms: i64) {
        self.retryable_due = retryable_due;
        self.oldest_pending_age_seconds =
            oldest_pending_ms.map_or(0.0, |t| (now_ms - t).max(0) as f64 / 1000.0);
    }
}

/// What one archive run moves: `delivered` (and legacy `published`) rows of
/// these app_codes last updated before `before_ms`.
#[derive(Debug, Clone)]
pub struct ArchiveRequest {
    /// Tenants to archive, one after another (the archive query is scoped
    /// by app_code so that it reads its index in order).
    pub app_codes: Vec<String>,
    /// Cut-off on the database clock, epoch ms: rows with
    /// `updated_at_ms < before_ms` move.
    pub before_ms: i64,
    /// Rows per batch (one transaction each).
    pub batch_size: u32,
    /// Stop after this many batches (`None`: until done).
    pub max_batches: Option<u64>,
    /// A partitioned table's partitions whose rows are all done: moved
    /// into the archive or dropped.
    pub partitions: crate::config::PartitionArchive,
}

/// Outcome of one archive run.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ArchiveReport {
    /// Rows moved into `<table>_archive`.
    pub moved: u64,
    /// Batches that moved rows.
    pub batches: u64,
    /// False when `max_batches` stopped the run before it was done.
    pub complete: bool,
    /// Another archiver held the lock; nothing was done.
    pub locked_out: bool,
}

/// The name `doctor` gives the archive query (delivered and legacy
/// `published` rows older than the cut-off, through the index each
/// backend names beside it).
pub const ARCHIVE_QUERY: &str = "archive_delivered";

/// The name `doctor` gives replay by event id (per app_code, through
/// `_event_uq`).
pub const REPLAY_BY_ID_QUERY: &str = "replay_by_event_id";

/// The name `doctor` gives replay of an app_code's `failed` rows
/// (`replay --status failed`, through the index each backend names).
pub const REPLAY_FAILED_QUERY: &str = "replay_failed";

/// The name `doctor` gives the archived half of a time-range replay
/// (through `_archive_created_idx`).
pub const REPLAY_ARCHIVED_QUERY: &str = "replay_archived_range";

/// What `doctor` found in the database catalog.
#[derive(Debug, Clone, Serialize)]
pub struct SchemaReport {
    /// Highest migration applied to this table (0: none).
    pub version: u32,
    /// The version this build migrates to.
    pub latest_version: u32,
    /// Every table and index this build expects, and whether it exists.
    pub objects: Vec<SchemaObject>,
    /// [`AGGREGATE_INDEX`] is on the outbox table and on its archive:
    /// events can be searched by aggregate.
    pub aggregate_search: bool,
}

impl SchemaReport {
    /// The report for `table`: every expected table and index (plus the
    /// backend's `extra_indexes` suffixes), present when the catalog's
    /// `names` list it.
    pub fn from_catalog(
        table: &str,
        version: u32,
        latest_version: u32,
        names: &[String],
        extra_indexes: &[&str],
    ) -> Self {
        let tables = EXPECTED_TABLES.iter().map(|s| ("table", *s));
        let indexes = EXPECTED_INDEXES
            .iter()
            .chain(extra_indexes)
            .map(|s| ("index", *s));
        let objects = tables
            .chain(indexes)
            .map(|(kind, suffix)| {
                let name = format!("{table}{suffix}");
                SchemaObject {
                    kind,
                    present: names.contains(&name),
                    name,
                }
            })
            .collect();
        let aggregate_index = |t: &str| names.contains(&format!("{t}{AGGREGATE_INDEX}"));
        SchemaReport {
            version,
            latest_version,
            objects,
            aggregate_search: aggregate_index(table)
                && aggregate_index(&format!("{table}_archive")),
        }
    }
}

/// Statement statistics read by `doctor --scans`
/// ([`SchemaStore::statement_stats`]).
#[derive(Debug, Clone, Serialize)]
pub struct StatementStats {
    /// Where they come from (`pg_stat_statements`, …).
    pub source: &'static str,
    /// The statements, the most total time first.
    pub statements: Vec<StatementStat>,
    /// Statements run since the statistics filled up, not recorded one by
    /// one (MariaDB/MySQL's digest table holds
    /// `performance_schema_digests_size` of them, then counts every new one
    /// in a single row): a scan among them cannot be seen. 0 when all are.
    pub unrecorded: i64,
}

/// One normalised statement's totals since the statistics were reset.
#[derive(Debug, Clone, Serialize)]
pub struct StatementStat {
    /// Its text, constants replaced by placeholders.
    pub text: String,
    /// Executions.
    pub calls: i64,
    /// Total execution time, ms.
    pub total_ms: f64,
    /// Rows returned or written.
    pub rows: i64,
    /// Rows the server read for it (MariaDB/MySQL).
    pub rows_examined: Option<i64>,
    /// Buffer pages it read, cached or not (PostgreSQL).
    pub blocks: Option<i64>,
}

/// One expected table or index.
#[derive(Debug, Clone, Serialize)]
pub struct SchemaObject {
    /// `table`, `index` or `trigger` (PostgreSQL's wake-up trigger).
    pub kind: &'static str,
    /// Its name.
    pub name: String,
    /// Found in the catalog.
    pub present: bool,
}

/// The optional index (a suffix, on the outbox table and on its archive)
/// that search by aggregate reads: `(app_code, aggregate_id, id)` over
/// every row. `migrate` leaves it out: on the outbox table it costs every
/// event an index entry per write (its insert, and on PostgreSQL each
/// status change), which only deployments that search by aggregate should
/// pay. `postbox migrate --aggregate-index` adds it (without blocking
/// writes where the database can), `--drop-aggregate-index` removes it.
pub const AGGREGATE_INDEX: &str = "_agg_idx";

/// The index names (suffixes after the table name) every backend creates
/// under that name; each backend adds the outbox table's own (its
/// `Dialect::EXTRA_INDEXES`: one per status on PostgreSQL and SQLite, one
/// for every status on MySQL).
pub const EXPECTED_INDEXES: [&str; 4] = [
    "_event_uq",
    "_archive_event_uq",
    "_archive_created_idx",
    "_history_event_idx",
];

/// The tables (suffixes after the table name).
pub const EXPECTED_TABLES: [&str; 6] = [
    "",
    "_archive",
    "_history",
    "_controls",
    "_control_log",
    "_relays",
];

/// Outcome of `migrate`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MigrateReport {
    /// Versions applied by this run (empty when already up to date).
    pub applied: Vec<u32>,
    /// Schema version after the run.
    pub version: u32,
    /// What `migrate` found in the database that disagreed with its ledger,
    /// and what it did about it (one sentence each; empty when they agree).
    pub notes: Vec<String>,
}

/// A partitioned table's partitions after the one holding the database
/// clock's now ([`SchemaStore::partitions_ahead`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PartitionsAhead {
    /// Ready after the current one (0 also when no partition holds now:
    /// an insert would fail).
    pub ahead: u32,
    /// The last partition's name.
    pub through: Option<String>,
}

/// What `postbox adopt` found on a table a team already has, and what it
/// runs (or ran, with `--apply`) so postbox can work on it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AdoptReport {
    /// The table.
    pub table: String,
    /// postbox's column names the table calls differently, and its names.
    pub renamed: Vec<(String, String)>,
    /// Legacy status values, each with the status it reads as.
    pub legacy_statuses: Vec<(String, String)>,
    /// Columns postbox adds (the table's names).
    pub missing_columns: Vec<String>,
    /// Indexes postbox adds.
    pub missing_indexes: Vec<String>,
    /// The table's own indexes postbox never reads (each still costs a
    /// write on every change of its columns): candidates to drop once the
    /// old worker is gone.
    pub unread_indexes: Vec<String>,
    /// What stops the adoption until fixed (an event column the table
    /// lacks); nothing is applied while there is one.
    pub blockers: Vec<String>,
    /// The DDL, in order: `ADD COLUMN`s, then the indexes, each in the
    /// database's online form; `migrate` runs after them.
    pub statements: Vec<String>,
    /// Whether the statements and `migrate` ran.
    pub applied: bool,
    /// What `migrate` did after them.
    pub migrated: Option<MigrateReport>,
}

/// A step of `postbox adopt --apply`, as it happens.
#[derive(Debug, Clone, Copy)]
pub enum AdoptStep<'a> {
    /// A statement starts.
    Running(&'a str),
    /// It ended, after this long.
    Done(&'a str, std::time::Duration),
}

/// The tables of [`EXPECTED_TABLES`] and the migration version that creates
/// each of them.
pub const TABLE_VERSIONS: [(&str, u32); 7] = [
    ("", 1),
    ("_archive", 1),
    ("_history", 2),
    ("_controls", 9),
    ("_control_log", 9),
    ("_relays", 10),
    // 11 adds a column to it.
    ("_controls", 11),
];

/// What `migrate` must do before applying pending versions, when its ledger
/// (`postbox_schema_migrations`) disagrees with the tables that exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LedgerCheck {
    /// The outbox table is gone: delete the table's ledger rows and apply
    /// every migration, as for a new table.
    pub forget_ledger: bool,
    /// Recorded versions to run again because a table they create is
    /// missing (every statement of those versions is `IF NOT EXISTS`).
    pub rerun: Vec<u32>,
    /// One sentence per finding, for the log and the `migrate` output.
    pub notes: Vec<String>,
}

/// Compares the versions the ledger records for `table` with the tables of
/// [`EXPECTED_TABLES`] that exist (`existing`, full names).
pub fn check_ledger(table: &str, applied: &[u32], existing: &[String]) -> LedgerCheck {
    let mut check = LedgerCheck::default();
    let Some(recorded) = applied.iter().copied().max() else {
        return check;
    };
    let has = |suffix: &str| existing.iter().any(|n| *n == format!("{table}{suffix}"));
    if !has("") {
        check.forget_ledger = true;
        check.notes.push(format!(
            "outbox table `{table}` does not exist although postbox_schema_migrations records \
             schema version {recorded} for it (dropped or restored by hand?): forgot those \
             records and created the table as new"
        ));
        return check;
    }
    for (suffix, version) in TABLE_VERSIONS {
        if !suffix.is_empty() && applied.contains(&version) && !has(suffix) {
            check.notes.push(format!(
                "table `{table}{suffix}` was missing although schema version {version} created \
                 it: ran version {version} again (it only creates what does not exist)"
            ));
            if !check.rerun.contains(&version) {
                check.rerun.push(version);
            }
        }
    }
    check.rerun.sort_unstable();
    check
}

/// How the database runs one claim query, measured by running it inside a
/// transaction that is rolled back (PostgreSQL `EXPLAIN ANALYZE`, MariaDB
/// `ANALYZE`) or by asking the planner (SQLite `EXPLAIN QUERY PLAN`).
#[derive(Debug, Clone, Serialize)]
pub struct QueryPlan {
    /// `claim_pending`, `claim_due_retries` or `claim_expired_leases`.
    pub query: &'static str,
    /// The index the query is written for.
    pub expected_index: String,
    /// Indexes the plan reads the outbox table through.
    pub indexes_used: Vec<String>,
    /// True when the plan scans the whole table or a whole index.
    pub full_scan: bool,
    /// Outbox rows the execution read (where the database reports it).
    pub rows_examined: Option<u64>,
    /// The database's own plan output.
    pub plan: String,
    /// The table holds too few rows for the planner to prefer one fitting
    /// index over another (PostgreSQL: under [`SMALL_TABLE_ROWS`] by its
    /// statistics), where every index scan costs the same: a read through
    /// another index than the expected one tells nothing yet.
    pub too_small_to_tell: bool,
}

/// Below this many rows a table is too small for a plan to show which
/// index a query can use ([`QueryPlan::too_small_to_tell`]).
pub const SMALL_TABLE_ROWS: f64 = 10_000.0;

impl QueryPlan {
    /// The query reads through the index it was written for (or, on a
    /// table too small to tell, through any index) and scans nothing whole.
    pub fn is_good(&self) -> bool {
        !self.full_scan && (self.uses_expected() || self.too_small_to_tell)
    }

    /// The plan reads through the index the query was written for.
    pub fn uses_expected(&self) -> bool {
        self.indexes_used.iter().any(|i| i == &self.expected_index)
    }
}

/// Outcome of enqueueing one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnqueueOutcome {
    /// Written, with this row id.
    Inserted(i64),
    /// `(app_code, event_id)` already existed; nothing written.
    Duplicate,
}

impl EnqueueOutcome {
    /// Classifies one insert of a batch: a duplicate is an outcome, not an
    /// error, so one known event does not spoil the batch.
    pub fn from_insert(result: Result<i64>) -> Result<Self> {
        match result {
            Ok(id) => Ok(EnqueueOutcome::Inserted(id)),
            Err(crate::Error::DuplicateEvent { .. }) => Ok(EnqueueOutcome::Duplicate),
            Err(e) => Err(e),
        }
    }
}

/// What the relay needs of an outbox table: claim rows, write results,
/// give rows back, read the database clock. The relay depends on nothing
/// else (apalis-style capability traits: the other operations are
/// [`EnqueueStore`], [`InspectStore`], [`ReplayStore`], [`ArchiveStore`]
/// and [`SchemaStore`]; [`OutboxStore`] is all of them).
///
/// Every result write is fenced by the claim's [`Fence`]: a row whose lease
/// was taken over is left alone and the call reports fewer rows.
#[async_trait]
pub trait RelayStore: Send + Sync + 'static {
    /// `postgres`, `mysql` or `sqlite`.
    fn backend(&self) -> &'static str;

    /// Writes a relay's heartbeat into `<table>_relays`; a relay's first
    /// also forgets relays not heard from for [`RELAY_FORGOTTEN_AFTER_MS`].
    async fn beat(&self, beat: &RelayBeat) -> Result<()>;

    /// The outbox table.
    fn table(&self) -> &TableName;

    /// Runs one of the three claim queries.
    async fn claim(&self, source: ClaimSource, req: &ClaimRequest<'_>)
        -> Result<Vec<ClaimedEvent>>;

    /// Marks rows `delivered`; returns how many still held `fence`.
    async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64>;

    /// Records one failed attempt of each of `ids`, all with `update`, in
    /// one transaction (a batch's rows that failed alike: one write, not
    /// one per row), with an attempt-history entry for each row written.
    /// Returns how many still held `fence`.
    async fn mark_failed(&self, fence: &Fence, ids: &[i64], update: &FailureUpdate) -> Result<u64>;

    /// Gives claimed rows back without an attempt (shutdown).
    async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64>;

    /// Gives claimed rows back without an attempt as `retryable`, due
    /// `after_ms` from now, keeping their fanout progress (`delivered_to`)
    /// and saying why in `last_error` (`reason`): a publisher was behind
    /// ([`crate::retry::Decision::Defer`]). Returns how many still held
    /// `fence`.
    async fn defer(&self, fence: &Fence, ids: &[i64], update: &DeferUpdate) -> Result<u64>;

    /// The database clock, epoch ms.
    async fn now_ms(&self) -> Result<i64>;

    /// Rows with this event id (one per app_code at most). The relay reads
    /// a row back to recognise its own mark when a mark's answer was lost.
    async fn find(&self, event_id: &str) -> Result<Vec<EventRecord>>;

    /// The idle probe: per app_code, in one statement for all of them,
    /// whether a `pending` row exists and how long until the earliest
    /// retryable row is due and the earliest lease ends (database clock),
    /// each an index probe on the claim indexes. The relay runs it instead
    /// of the claim queries when idle, and claims only what is due. The
    /// default answers "anything may be due" without asking the database
    /// (the relay then runs every claim query, as a store that cannot
    /// probe must).
    async fn due(&self, app_codes: &[String]) -> Result<Vec<crate::wake::Due>> {
        Ok(app_codes
            .iter()
            .map(|a| crate::wake::Due::anything(a))
            .collect())
    }

    /// The runtime controls (`<table>_controls`, [`crate::control`]); the
    /// relay reads them at most every [`crate::control::REFRESH`] while it
    /// claims. None by default.
    async fn controls(&self) -> Result<Vec<crate::control::Control>> {
        Ok(Vec::new())
    }

    /// The in-process wake handle the store signals after writing events
    /// (`enqueue`); the relay wakes on it. `None`: the store signals
    /// nothing (the relay polls).
    fn wake(&self) -> Option<crate::wake::Wake> {
        None
    }

    /// The database's push wake-up (PostgreSQL: `LISTEN` on the table's
    /// channel, on a connection of its own): a future that signals `wake`
    /// on every notification, and after re-establishing a lost connection
    /// (notifications may have been missed), until `shutdown`. `None` when
    /// the database pushes nothing.
    fn listen(
        &self,
        _wake: crate::wake::Wake,
        _shutdown: tokio_util::sync::CancellationToken,
    ) -> Option<crate::BoxFuture<'static, ()>> {
        None
    }
}

/// Writing events outside a service's own transaction (CLI and tools).
#[async_trait]
pub trait EnqueueStore: Send + Sync + 'static {
    /// Writes events in their own transaction (CLI and tools; services use
    /// the backend's `enqueue` inside their own transaction).
    async fn enqueue_batch(
        &self,
        events: &[NewEvent],
        max_payload_bytes: usize,
    ) -> Result<Vec<EnqueueOutcome>>;
}

/// Reading the outbox: counts, lists, single events and their history,
/// live and archived (the CLI's `events`, `status` and the admin API).
#[async_trait]
pub trait InspectStore: RelayStore {
    /// Counts per tenant.
    async fn stats(&self, app_codes: &[String]) -> Result<Vec<AppStats>>;

    /// Every app_code that has rows in the outbox table, sorted. Read by a
    /// loose index scan of an `(app_code, …)` index (one probe per
    /// app_code), never a full scan, so it is cheap on a big table.
    async fn present_app_codes(&self) -> Result<Vec<String>>;

    /// Rows matching a filter, newest first.
    async fn list(&self, filter: &EventFilter) -> Result<Vec<EventRecord>>;

    /// Rows of `app_code` delivered per minute since `since_ms`, oldest
    /// minute first; minutes without deliveries are absent. Reads only the
    /// delivered rows of that range, through the `(app_code, status,
    /// updated_at_ms)` index.
    async fn delivered_per_minute(&self, app_code: &str, since_ms: i64)
        -> Result<Vec<MinuteCount>>;

    /// [`RelayStore::find`], then [`InspectStore::find_archived`] in
    /// `app_codes`: every row of the event, live ones first.
    async fn find_inspected(&self, event_id: &str, app_codes: &[String]) -> Result<Vec<Inspected>> {
        let live = self.find(event_id).await?;
        let archived = self.find_archived(event_id, app_codes).await?;
        Ok(tag(live, false).chain(tag(archived, true)).collect())
    }

    /// [`InspectStore::list`] and, unless the filter asks for a status no
    /// archived row has (only `delivered` and `dropped` rows are archived),
    /// [`InspectStore::list_archived`], merged newest first (by id) and cut
    /// to `filter.limit`.
    async fn list_inspected(&self, filter: &EventFilter) -> Result<Vec<Inspected>> {
        let live = self.list(filter).await?;
        let mut all: Vec<Inspected> = tag(live, false).collect();
        if filter
            .status
            .is_none_or(|s| matches!(s, Status::Delivered | Status::Dropped))
        {
            let archived = self.list_archived(filter).await?;
            all.extend(tag(archived, true));
            all.sort_by_key(|r| std::cmp::Reverse(r.record.id));
            all.truncate(filter.limit as usize);
        }
        Ok(all)
    }

    /// Rows of `<table>_archive` with this event id in one of `app_codes`
    /// (read through the archive's `(app_code, event_id)` index; the
    /// archive only holds rows of the app_codes a relay archived).
    async fn find_archived(&self, event_id: &str, app_codes: &[String])
        -> Result<Vec<EventRecord>>;

    /// Rows of `<table>_archive` matching a filter, newest first (the same
    /// keyset pagination by `id` as [`InspectStore::list`]; archived rows
    /// keep their id).
    async fn list_archived(&self, filter: &EventFilter) -> Result<Vec<EventRecord>>;

    /// The attempt history of an event (every app_code), oldest first: at
    /// most [`HISTORY_LIMIT`] entries per `(app_code, event_id)`. Kept in
    /// `<table>_history`, keyed by event id, so it outlives archiving.
    async fn history(&self, event_id: &str) -> Result<Vec<HistoryEntry>>;

    /// Which of `event_ids` of `app_code` are in `<table>_archive`: events
    /// already delivered and archived. The outbox's unique key covers the
    /// live table only, so `postbox enqueue` asks this before writing an
    /// event id again. Index: `<table>_archive_event_uq (app_code, event_id)`.
    async fn archived_event_ids(&self, app_code: &str, event_ids: &[String])
        -> Result<Vec<String>>;

    /// Every relay the registry knows (`<table>_relays`), the newest first.
    async fn relays(&self) -> Result<Vec<RelaySeen>>;

    /// Aggregates of `app_code` whose head (the first event in the
    /// per-aggregate order still pending, delivering or retryable) is
    /// `retryable` or `delivering`, was enqueued more than `older_than_ms`
    /// ago, and has later events waiting behind it; oldest head first, at
    /// most `limit`. One query: heads through the retryable and delivering rows' index,
    /// their siblings through the aggregate index.
    async fn stuck_aggregates(
        &self,
        app_code: &str,
        older_than_ms: i64,
        limit: u32,
    ) -> Result<Vec<StuckAggregate>>;
}

/// Putting rows back to `pending` (`postbox replay`, the admin API).
#[async_trait]
pub trait ReplayStore: Send + Sync + 'static {
    /// [`ReplayStore::replay_to`] with the default targets
    /// ([`ReplayPick::Unconfirmed`]; the history names no targets).
    async fn replay(
        &self,
        selector: &ReplaySelector,
        dry_run: bool,
        origin: &str,
    ) -> Result<Vec<EventRecord>> {
        let targets = ReplayTargets::default();
        self.replay_to(ReplayRequest {
            selector,
            dry_run,
            origin,
            targets: &targets,
        })
        .await
    }

    /// The ids, in order, of at most `size` rows after `after_id` that a
    /// replay by `filter` would take, live or archived (the archive as a
    /// filtered replay reads it: with a time range or an aggregate): a
    /// paced replay's next batch, which then replays `filter` with
    /// `after_id` and `through_id` set to its ends.
    async fn replay_ids_after(
        &self,
        filter: &EventFilter,
        after_id: i64,
        size: u32,
    ) -> Result<Vec<i64>>;

    /// Puts the rows of `request.selector` back to `pending` with
    /// `retry_count` 0, keeping `event_id`, to be sent to `request.targets`
    /// (fanout progress in `delivered_to`, see [`ReplayPick`]). Returns the
    /// rows affected, as written (or as they are, with `dry_run`). Each
    /// replayed row gets a [`HistoryKind::Replayed`] history entry whose
    /// detail is `origin` and whose publisher names the targets, written in
    /// the same transaction.
    async fn replay_to(&self, request: ReplayRequest<'_>) -> Result<Vec<EventRecord>>;
}

/// One replay: which rows, to which publishers, asked by whom.
#[derive(Debug, Clone, Copy)]
pub struct ReplayRequest<'a> {
    /// The rows.
    pub selector: &'a ReplaySelector,
    /// Only read what would be replayed; change nothing.
    pub dry_run: bool,
    /// Who asked (`cli`, `api 10.0.0.7:51234`, …), for the rows' history.
    pub origin: &'a str,
    /// The publishers to send the rows to again.
    pub targets: &'a ReplayTargets,
}

/// Moving delivered rows into `<table>_archive`.
#[async_trait]
pub trait ArchiveStore: Send + Sync + 'static {
    /// Moves old `delivered`/`published` rows into `<table>_archive` in
    /// batches, each one transaction that inserts what the archive lacks
    /// (unique `id`) and deletes from the outbox only rows present in the
    /// archive, so a crash at any point loses and duplicates nothing.
    /// Only one archiver runs at a time per table: when another holds the
    /// lock this returns at once with `locked_out`. `on_batch` is called
    /// with the rows each batch moved.
    async fn archive(
        &self,
        req: &ArchiveRequest,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ArchiveReport>;

    // What a store whose archive is kept in another database
    // (`[archive] url`) asks of the store opened on that database: the
    // archive's own table is read and written, never the outbox table.

    /// Copies `rows` into `<table>_archive` as they are; a row whose id or
    /// event the archive already holds is left alone (a run that crashed
    /// after copying copies again). Returns the rows copied.
    async fn put_archived(&self, rows: &[EventRecord]) -> Result<u64>;

    /// The archived rows a filter takes (its `app_code` is set; `limit`
    /// is not applied), in id order, as a replay brings them back.
    async fn archived_rows(&self, filter: &EventFilter) -> Result<Vec<EventRecord>>;

    /// The ids of at most `filter.limit` archived rows the filter takes,
    /// in id order (a paced replay's next batch).
    async fn archived_ids(&self, filter: &EventFilter) -> Result<Vec<i64>>;

    /// Every app_code with archived rows, sorted (one index probe per
    /// app_code). A replay without an app_code visits these too: a
    /// tenant whose rows are all archived has none in the outbox table.
    async fn archived_app_codes(&self) -> Result<Vec<String>>;

    /// Deletes archived rows by id (rows a replay brought back into the
    /// outbox table). Returns the rows deleted.
    async fn delete_archived(&self, ids: &[i64]) -> Result<u64>;
}

/// The schema and its diagnostics (`postbox migrate`, `postbox doctor`).
#[async_trait]
pub trait SchemaStore: Send + Sync + 'static {
    /// Creates or upgrades the tables; idempotent.
    async fn migrate(&self) -> Result<MigrateReport>;

    /// The schema version and which expected tables and indexes exist, read
    /// from the catalog.
    async fn inspect_schema(&self) -> Result<SchemaReport>;

    /// A partitioned table (`[database] partitioning`): creates the
    /// current partition and those ahead that are missing, returning their
    /// names (nothing on a plain table).
    async fn keep_partitions(&self) -> Result<Vec<String>>;

    /// Refuses a `database.partitioning` that is not how the table was
    /// made (a config error naming the key): unset on a partitioned table,
    /// set on a plain one, or `daily` where its partitions are weeks (or
    /// the reverse). The table exists.
    async fn check_partitioning(&self) -> Result<()> {
        Ok(())
    }

    /// A partitioned table: how many partitions are ready after the
    /// current one, and the last (`None` on a plain table).
    async fn partitions_ahead(&self) -> Result<Option<PartitionsAhead>>;

    /// The database's own statistics of the statements whose text names
    /// the outbox table (PostgreSQL `pg_stat_statements`, MariaDB/MySQL
    /// `performance_schema` digests), the most time first, at most 500.
    /// Where they are not kept, an [`Error::Schema`] says how to turn them
    /// on.
    async fn statement_stats(&self) -> Result<StatementStats>;

    /// Creates (`wanted`) or drops [`AGGREGATE_INDEX`] on the outbox table
    /// and its archive, without blocking writes where the database can
    /// (PostgreSQL `CONCURRENTLY`, MySQL `LOCK=NONE`). Returns the names of
    /// the indexes it created or dropped (none: already as wanted).
    async fn aggregate_index(&self, wanted: bool) -> Result<Vec<String>>;

    /// Compares a table the team already has with what postbox needs
    /// (`[database.columns]` and `[database.statuses]` name its own
    /// columns and statuses) and, with `apply`, adds what is missing
    /// without blocking its writes where the database can, then migrates.
    async fn adopt(&self, apply: bool) -> Result<AdoptReport> {
        self.adopt_with(apply, &|_| {}).await
    }

    /// [`SchemaStore::adopt`], telling `progress` as each statement of
    /// `--apply` starts and ends (an index build on a large table takes
    /// minutes).
    async fn adopt_with(
        &self,
        apply: bool,
        progress: &(dyn for<'s> Fn(AdoptStep<'s>) + Send + Sync),
    ) -> Result<AdoptReport>;

    /// Plans of the three claim queries for `app_code`, taking up to `limit`
    /// rows. Nothing is changed: executions are rolled back.
    async fn explain_claims(&self, app_code: &str, limit: u32) -> Result<Vec<QueryPlan>>;

    /// Whether every claim query ([`CLAIM_QUERIES`]) and archive query
    /// ([`ARCHIVE_QUERIES`]) *can* read through the index it is written for,
    /// whatever the table's size: PostgreSQL plans with sequential and
    /// bitmap scans, sorts, hash and merge joins disabled, MariaDB reports
    /// the candidate keys, SQLite plans without statistics. Nothing is
    /// changed.
    async fn explain_index_use(&self, app_code: &str) -> Result<Vec<QueryPlan>>;
}

/// An outbox table in one database with every capability: what the relay,
/// the admin server and the CLI hold as `Arc<dyn OutboxStore>`.
/// Implemented for every type that implements all the capability traits.
pub trait OutboxStore:
    RelayStore + EnqueueStore + InspectStore + ReplayStore + ArchiveStore + SchemaStore + ControlStore
{
}

/// What [`change_control`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changed {
    /// The control as stored now.
    Set(crate::control::Control),
    /// The control was removed (false: there was none).
    Cleared(bool),
}

/// Applies `change` (or, with `clear`, removal) to the control of
/// `(app_code, event_type)` in `store`, logged as made `by`: the stored
/// control merged with the change, checked, and cleared when it then sets
/// nothing. A bad control is [`crate::Error::InvalidEvent`] naming why.
pub async fn change_control(
    store: &dyn OutboxStore,
    app_code: &str,
    event_type: &str,
    change: &crate::control::ControlChange,
    clear: bool,
    by: &str,
) -> crate::Result<Changed> {
    let current = store.controls().await?;
    let now = current
        .iter()
        .find(|c| c.app_code == app_code && c.event_type == event_type);
    let next = change.apply(app_code, event_type, now);
    next.validate()
        .map_err(|e| crate::Error::InvalidEvent(format!("control: {e}")))?;
    if clear || crate::control::sets_nothing(&next) {
        return Ok(Changed::Cleared(
            store.clear_control(app_code, event_type, by).await?,
        ));
    }
    Ok(Changed::Set(store.set_control(&next, by).await?))
}

/// Setting the runtime controls ([`crate::control`]); reading them is
/// [`RelayStore::controls`].
#[async_trait]
pub trait ControlStore: Send + Sync + 'static {
    /// Stores `control` (replacing the one of its key) and logs the change
    /// as made `by`, in one transaction; returns it as stored.
    async fn set_control(
        &self,
        control: &crate::control::Control,
        by: &str,
    ) -> Result<crate::control::Control>;

    /// Removes the control of `(app_code, event_type)` and logs it; false
    /// when there was none.
    async fn clear_control(&self, app_code: &str, event_type: &str, by: &str) -> Result<bool>;

    /// The newest `limit` changes, newest first.
    async fn control_log(&self, limit: u32) -> Result<Vec<crate::control::ControlLogEntry>>;
}

impl<T> OutboxStore for T where
    T: RelayStore
        + EnqueueStore
        + InspectStore
        + ReplayStore
        + ArchiveStore
        + SchemaStore
        + ControlStore
        + ?Sized
{
}

fn tag(rows: Vec<EventRecord>, archived: bool) -> impl Iterator<Item = Inspected> {
    rows.into_iter()
        .map(move |record| Inspected { record, archived })
}

#[cfg(test)]
mod tests {
    use super::{RelaySeen, RELAY_BEAT};

    /// A relay heard from within three heartbeats runs; one that said it
    /// stopped is stopped; one silent for longer is `silent`.
    #[test]
    fn a_relay_is_running_stopped_or_silent() {
        let beat = RELAY_BEAT.as_millis() as i64;
        assert_eq!(
            RelaySeen::state_of(false, 1_000, 1_000 + 3 * beat),
            "running"
        );
        assert_eq!(
            RelaySeen::state_of(false, 1_000, 1_001 + 3 * beat),
            "silent"
        );
        assert_eq!(RelaySeen::state_of(true, 1_000, 1_000), "stopped");
    }
}
