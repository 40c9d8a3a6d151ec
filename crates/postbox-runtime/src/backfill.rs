//! A paced replay (backfill): a filter's rows, live and archived, put back
//! to `pending` in id order, a batch at a time, at most `rate` rows a
//! second, and never more than one batch ahead of the relay: the next batch
//! waits until the relay has taken the last one. Its cursor is written to a
//! state file after every batch, so a stopped run resumes where it stopped.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use postbox_core::relay::CancellationToken;
use postbox_core::store::{EventFilter, OutboxStore, ReplayRequest, ReplaySelector, ReplayTargets};
use postbox_core::{Error, Result, Status};
use serde::{Deserialize, Serialize};

/// What to replay and how fast.
#[derive(Debug)]
pub struct Backfill<'a> {
    /// The rows (its `limit`, `before_id`, `after_id` and `through_id` are
    /// the backfill's own).
    pub filter: EventFilter,
    /// Rows per batch.
    pub batch: NonZeroU32,
    /// At most this many rows a second (`None`: as fast as the relay takes
    /// them).
    pub rate: Option<Rate>,
    /// The publishers to send to.
    pub targets: &'a ReplayTargets,
    /// Who asked, for the events' history.
    pub origin: &'a str,
    /// Where the cursor is kept.
    pub state: PathBuf,
}

/// A pace: rows a second, finite and above 0 (`--rate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate(f64);

impl Rate {
    /// Rows a second.
    pub fn per_second(self) -> f64 {
        self.0
    }
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Rate(r)),
            _ => Err(format!("`{s}` is not a number of rows a second above 0")),
        }
    }
}

/// Where a backfill is: written to its state file after every batch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Progress {
    /// The filter the run started with (a resume replays it).
    pub filter: EventFilter,
    /// Every row with an id up to this one is done.
    pub after_id: i64,
    /// Rows put back to pending so far, over every run.
    pub replayed: u64,
    /// `created_at_ms` of the last row replayed.
    pub last_created_at_ms: Option<i64>,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ended {
    /// Every row was replayed; the state file is gone.
    Done(Progress),
    /// Stopped by the token after a batch; the state file holds the cursor.
    Stopped(Progress),
}

/// How often the relay's progress on the last batch is read.
const RELAY_POLL: Duration = Duration::from_millis(50);

/// After this long waiting for the relay (none running?), it is said once.
const SAY_WAITING_AFTER: Duration = Duration::from_secs(10);

/// Runs `b` on `store` until every row is replayed or `stop` is cancelled
/// (the batch in hand is finished first). `resume` continues from the
/// state file, which must exist and name the same filter; without it, a
/// state file already there is an error (a stopped run would be replayed
/// again from the start). `on_batch` sees the progress after each batch.
pub async fn run(
    store: &dyn OutboxStore,
    b: &Backfill<'_>,
    resume: bool,
    stop: &CancellationToken,
    on_batch: &(dyn Fn(&Progress) + Send + Sync),
) -> Result<Ended> {
    let mut filter = b.filter.clone();
    if filter.since_ms.is_some() && filter.until_ms.is_none() && !resume {
        // A time range open at its end ends now, on the database's clock:
        // events written while the backfill runs (ids above it) are not
        // its rows, and the range is what a replay without pacing takes.
        filter.until_ms = Some(store.now_ms().await? + 1);
    }
    let mut progress = start(&b.state, &filter, resume)?;
    // A resumed run replays the filter it started with: times given as
    // `2h` ago resolve to another instant on every run.
    let filter = progress.filter.clone();
    let started = Instant::now();
    let mut replayed_here = 0u64;
    loop {
        if stop.is_cancelled() {
            return Ok(Ended::Stopped(progress));
        }
        let ids = store
            .replay_ids_after(&filter, progress.after_id, b.batch.get())
            .await?;
        let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
            remove(&b.state)?;
            return Ok(Ended::Done(progress));
        };
        let batch = EventFilter {
            after_id: Some(progress.after_id),
            through_id: Some(last),
            ..filter.clone()
        };
        let rows = store
            .replay_to(ReplayRequest {
                selector: &ReplaySelector::Filter(batch),
                dry_run: false,
                origin: b.origin,
                targets: b.targets,
            })
            .await?;
        progress.after_id = last;
        progress.replayed += rows.len() as u64;
        progress.last_created_at_ms = rows
            .iter()
            .map(|r| r.created_at_ms)
            .max()
            .or(progress.last_created_at_ms);
        replayed_here += rows.len() as u64;
        save(&b.state, &progress)?;
        on_batch(&progress);
        // One batch ahead of the relay at most: its own rows (not another
        // type's or aggregate's, held back by a pause or a retrying head).
        let waiting = EventFilter {
            app_code: filter.app_code.clone(),
            event_type: filter.event_type.clone(),
            aggregate_id: filter.aggregate_id.clone(),
            status: Some(Status::Pending),
            after_id: Some(first - 1),
            through_id: Some(last),
            limit: 1,
            ..EventFilter::default()
        };
        let since = Instant::now();
        let mut said = false;
        while !store.list(&waiting).await?.is_empty() {
            if !said && since.elapsed() >= SAY_WAITING_AFTER {
                tracing::info!(
                    through_id = last,
                    "waiting for a relay to take the last batch"
                );
                said = true;
            }
            if pause(stop, RELAY_POLL).await {
                return Ok(Ended::Stopped(progress));
            }
        }
        if let Some(rate) = b.rate {
            let due = Duration::from_secs_f64(replayed_here as f64 / rate.per_second());
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                if pause(stop, wait).await {
                    return Ok(Ended::Stopped(progress));
                }
            }
        }
    }
}

/// Sleeps `d`; true when `stop` was cancelled meanwhile.
async fn pause(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

/// The progress a run starts from. A resume must give the same filter,
/// but for the instants of its time range.
fn start(state: &Path, filter: &EventFilter, resume: bool) -> Result<Progress> {
    let kept = match std::fs::read_to_string(state) {
        Ok(text) => Some(serde_json::from_str::<Progress>(&text).map_err(|e| {
            Error::config(
                "--state",
                format!("{}: not a replay state file: {e}", state.display()),
            )
        })?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io(state, e)),
    };
    let untimed = |f: &EventFilter| EventFilter {
        since_ms: None,
        until_ms: None,
        ..f.clone()
    };
    match (kept, resume) {
        (Some(p), true) if untimed(&p.filter) == untimed(filter) => Ok(p),
        (Some(p), true) => Err(Error::config(
            "--resume",
            format!(
                "{} is the state of another replay ({:?}): give the same filters, or another --state",
                state.display(),
                p.filter
            ),
        )),
        (None, true) => Err(Error::config(
            "--resume",
            format!("no replay to resume: {} does not exist", state.display()),
        )),
        (Some(p), false) => Err(Error::config(
            "--resume",
            format!(
                "{} holds a replay stopped after id {} ({} rows): add --resume to continue it, or delete the file to start again",
                state.display(),
                p.after_id,
                p.replayed
            ),
        )),
        (None, false) => Ok(Progress {
            filter: filter.clone(),
            after_id: 0,
            replayed: 0,
            last_created_at_ms: None,
        }),
    }
}

/// Writes `p` to `state` (a new file, then renamed over the old one).
fn save(state: &Path, p: &Progress) -> Result<()> {
    let tmp = state.with_extension("tmp");
    let text = serde_json::to_string_pretty(p).map_err(|e| Error::Internal(e.to_string()))?;
    std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, state).map_err(|e| io(state, e))
}

fn remove(state: &Path) -> Result<()> {
    match std::fs::remove_file(state) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(state, e)),
        _ => Ok(()),
    }
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        context: format!("replay state {}", path.display()),
        source: e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use postbox_core::store::ReplayPick;
    use postbox_core::NewEvent;

    /// A backfill of one event type waits for its own batch only: pending
    /// rows of another type in the batch's id range (a paused type, a
    /// follower behind a retrying head) held it for good.
    #[tokio::test]
    async fn a_backfill_waits_for_its_own_rows_only() {
        let o = postbox_sqlite::SqliteOutbox::connect("sqlite::memory:", "room_outbox", 1)
            .await
            .unwrap();
        o.migrate().await.unwrap();
        let events: Vec<NewEvent> = (0..20)
            .map(|i| NewEvent::new("room", if i % 2 == 0 { "A" } else { "B" }, "{}"))
            .collect();
        o.enqueue_batch(&events, 1 << 20).await.unwrap();
        sqlx::query("UPDATE room_outbox SET status = 'delivered' WHERE event_type = 'A'")
            .execute(o.pool())
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let targets = ReplayTargets::new(ReplayPick::Unconfirmed, Vec::new()).unwrap();
        let b = Backfill {
            filter: EventFilter {
                event_type: Some("A".into()),
                since_ms: Some(0),
                ..EventFilter::default()
            },
            batch: NonZeroU32::new(4).unwrap(),
            rate: None,
            targets: &targets,
            origin: "test",
            state: dir.path().join("s.json"),
        };
        // The relay takes type A's rows; B's stay pending (B is paused).
        let relay = {
            let pool = o.pool().clone();
            tokio::spawn(async move {
                loop {
                    sqlx::query(
                        "UPDATE room_outbox SET status = 'delivered' \
                         WHERE event_type = 'A' AND status = 'pending'",
                    )
                    .execute(&pool)
                    .await
                    .unwrap();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        let stop = CancellationToken::new();
        let ended =
            tokio::time::timeout(Duration::from_secs(20), run(&o, &b, false, &stop, &|_| {})).await;
        relay.abort();
        match ended {
            Ok(Ok(Ended::Done(p))) => assert_eq!(p.replayed, 10),
            other => panic!("the backfill did not end with its 10 rows: {other:?}"),
        }
    }
}
