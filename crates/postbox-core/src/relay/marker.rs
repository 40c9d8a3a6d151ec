//! Stage 3: write each row's decided result, fenced by its claim.
//!
//! A write that finds the lease taken over is *fenced out* (another relay
//! delivers the row); a write the database failed is a *mark error* (the
//! lease expires and the row is tried again). The two are counted and
//! logged apart: a database outage never reads as a takeover.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use opentelemetry::KeyValue;
use tokio::sync::mpsc;

use super::publisher::Outcome;
use super::{spans, RelayReport};
use crate::event::{truncate_error, Fence};
use crate::retry::{Decision, RetryDelay};
use crate::store::{DeferUpdate, FailureUpdate, RelayStore};
use crate::{trace, Error, Result};

pub(super) struct Marker {
    pub store: Arc<dyn RelayStore>,
    /// Rows delivered and dead-lettered, for the heartbeat.
    pub tally: Arc<super::heartbeat::Tally>,
}

impl Marker {
    /// Marks every batch of outcomes until the publish stage is done.
    pub async fn run(self, mut input: mpsc::Receiver<Vec<Outcome>>) -> Result<RelayReport> {
        let mut report = RelayReport::default();
        while let Some(outcomes) = input.recv().await {
            let rows = held(&outcomes);
            let traced = trace::exporting().then(|| {
                let links = spans::links(outcomes.iter().map(|o| &o.event.record));
                (SystemTime::now(), links, outcomes.len())
            });
            let marked = super::releasing_on_failure(
                self.store.as_ref(),
                rows,
                &mut input,
                |queued| held(&queued),
                self.mark(outcomes, &mut report),
            )
            .await;
            if let Some((started, links, rows)) = traced {
                let attributes = vec![KeyValue::new("postbox.rows", rows as i64)];
                let error = marked.as_ref().err().map(ToString::to_string);
                spans::batch("postbox.mark", started, links, attributes, error);
            }
            marked?;
        }
        Ok(report)
    }

    async fn mark(&self, outcomes: Vec<Outcome>, report: &mut RelayReport) -> Result<()> {
        let mut delivered: HashMap<Fence, Vec<i64>> = HashMap::new();
        // Deferred rows, one write per fence and update (a batch's rows
        // deferred for the same publishers share one).
        let mut deferred: HashMap<(Fence, DeferUpdate), Vec<i64>> = HashMap::new();
        // Failed attempts, likewise one write per fence and update.
        let mut failures: HashMap<(Fence, FailureUpdate), Vec<FailedRow>> = HashMap::new();
        // Row id → created_at_ms, for the delivery lag histogram.
        let mut created_at: HashMap<i64, i64> = HashMap::new();
        // Row id → event_id, to read a row back after a lost answer.
        let mut event_ids: HashMap<i64, String> = HashMap::new();
        // Events to name in the log: their first failed attempt, and their
        // dead-lettering (each once, not once per attempt).
        let (mut first_failures, mut dead_letters) = (Vec::new(), Vec::new());
        for o in outcomes {
            let r = &o.event.record;
            let fence = o.event.fence();
            // A failed attempt: its status, count, delay, progress, error.
            let failed = match o.decision {
                Decision::Publish => {
                    // The publish stage decides every row it hands over.
                    return Err(Error::Internal(format!(
                        "event `{}` reached the mark stage undecided",
                        r.event_id
                    )));
                }
                Decision::Delivered => {
                    created_at.insert(r.id, r.created_at_ms);
                    event_ids.insert(r.id, r.event_id.clone());
                    delivered.entry(fence).or_default().push(r.id);
                    continue;
                }
                Decision::Retry {
                    retry_count,
                    after,
                    delivered_to,
                    error,
                } => {
                    if retry_count == 1 {
                        first_failures.push(Logged::of(r, retry_count, &error));
                    } else {
                        tracing::debug!(event_id = %r.event_id, attempt = retry_count, retry_in = ?after.after, error = %error, "publish failed again");
                    }
                    (
                        crate::Status::Retryable,
                        retry_count,
                        after,
                        delivered_to,
                        error,
                    )
                }
                Decision::Defer {
                    after,
                    delivered_to,
                    behind,
                } => {
                    let update = DeferUpdate {
                        after_ms: after.as_millis() as i64,
                        delivered_to,
                        // Short: it is written into every deferred row.
                        reason: truncate_error(&format!(
                            "deferred for {} (behind; no attempt)",
                            behind.join(", ")
                        )),
                    };
                    deferred.entry((fence, update)).or_default().push(r.id);
                    continue;
                }
                Decision::Dropped { reason } => {
                    // No attempt: the count and the progress stay.
                    (
                        crate::Status::Dropped,
                        r.retry_count,
                        RetryDelay::default(),
                        r.delivered_to.clone(),
                        reason,
                    )
                }
                Decision::Failed {
                    retry_count,
                    delivered_to,
                    error,
                } => {
                    dead_letters.push(Logged::of(r, retry_count, &error));
                    // Never due again: a replay makes it due.
                    (
                        crate::Status::Failed,
                        retry_count,
                        RetryDelay::default(),
                        delivered_to,
                        error,
                    )
                }
            };
            let (status, retry_count, delay, delivered_to, error) = failed;
            let update = failure(
                status,
                retry_count,
                delay,
                delivered_to,
                &error,
                o.failed_publishers,
            );
            failures
                .entry((fence, update))
                .or_default()
                .push(FailedRow::of(r));
        }
        Logged::log(
            &first_failures,
            "publish failed; will retry",
            "events failed their first attempt; will retry",
        );
        Logged::log(
            &dead_letters,
            "event dead-lettered (status failed); replay it with `postbox replay`",
            "events dead-lettered (status failed); replay them with `postbox replay`",
        );
        // Delivered rows first: the failures' and defers' writes may each
        // take their retries, and a delivered mark that slipped past the
        // lease was taken over and sent again (dead-lettered, when it was
        // a row's last attempt, although delivered).
        for (fence, ids) in delivered {
            let rows = ids.len() as u64;
            let (n, unknown) = match super::retrying("mark delivered", || {
                self.store.mark_delivered(&fence, &ids)
            })
            .await
            {
                Ok((n, false)) => (n, 0),
                // A try that failed may have committed before its answer
                // was lost: rows it marked are ours, not taken over. The
                // read-back counts every row delivered under our worker id,
                // the `n` the last try marked included.
                Ok((n, true)) if n < rows => {
                    match self.already_delivered(&fence, &ids, &event_ids).await {
                        Ok(ours) => (n.max(ours), 0),
                        Err(e) => {
                            // Marked by the lost try, or taken over: the
                            // database cannot tell us now.
                            tracing::error!(rows = rows - n, worker_id = %fence.worker_id, error = %e, "could not read back rows whose delivered mark lost its answer (database error); if unmarked, their leases expire and they are delivered again");
                            (n, rows - n)
                        }
                    }
                }
                Ok((n, true)) => (n, 0),
                Err(e) => {
                    report.mark_errors += rows;
                    tracing::error!(rows, worker_id = %fence.worker_id, error = %e, "could not mark rows delivered (database error); their leases expire and they are delivered again");
                    continue;
                }
            };
            report.delivered += n;
            super::heartbeat::Tally::add(&self.tally.delivered, n);
            report.mark_errors += unknown;
            record_delivery_lag(&ids, n, &created_at);
            let lost = rows - n - unknown;
            if lost > 0 {
                report.fenced_out += lost;
                tracing::warn!(rows = lost, worker_id = %fence.worker_id, "late result dropped: the lease was taken over by another relay, which will deliver again");
            }
        }
        // Failed attempts: one write per fence and update (a batch's rows
        // that failed alike, e.g. every row a target refused, share one).
        for ((fence, update), rows) in failures {
            let dead = update.status == crate::Status::Failed;
            let dropped = update.status == crate::Status::Dropped;
            for (row, written) in self.write_failures(&fence, &update, rows).await {
                report.count(written, |report| {
                    if dropped {
                        report.dropped += 1;
                        metrics::counter!(crate::metrics::DROPPED_TOTAL, "app_code" => row.app_code)
                            .increment(1);
                    } else if dead {
                        report.failed += 1;
                        super::heartbeat::Tally::add(&self.tally.failed, 1);
                        metrics::counter!(crate::metrics::DEAD_LETTERED_TOTAL, "app_code" => row.app_code)
                            .increment(1);
                    } else {
                        report.retried += 1;
                    }
                });
            }
        }
        for ((fence, update), ids) in deferred {
            match super::retrying("defer rows", || self.store.defer(&fence, &ids, &update)).await {
                // Rows a lost answer hid are not counted; their write is
                // no attempt, so nothing more is needed.
                Ok((n, _)) => {
                    report.deferred += n;
                    tracing::debug!(rows = n, reason = %update.reason, "rows deferred for a publisher behind");
                }
                Err(e) => {
                    report.mark_errors += ids.len() as u64;
                    tracing::error!(rows = ids.len(), worker_id = %fence.worker_id, error = %e, "could not defer rows (database error); their leases expire and they are tried again");
                }
            }
        }
        Ok(())
    }

    /// How many of `ids` are `delivered` under this relay's `worker_id`:
    /// marked by an earlier try whose answer was lost (a takeover would
    /// have written another worker id).
    async fn already_delivered(
        &self,
        fence: &Fence,
        ids: &[i64],
        event_ids: &HashMap<i64, String>,
    ) -> Result<u64> {
        let mut ours = 0;
        for id in ids {
            let Some(event_id) = event_ids.get(id) else {
                continue;
            };
            let rows = self.store.find(event_id).await?;
            ours += rows.iter().any(|row| {
                row.id == *id
                    && row.status == crate::Status::Delivered
                    && row.worker_id.as_deref() == Some(fence.worker_id.as_str())
            }) as u64;
        }
        Ok(ours)
    }

    /// Writes one failed attempt of each of `rows` (one statement); what
    /// became of each. When fewer rows than asked held the fence, or a
    /// lost answer hides what an earlier try wrote, each row is read back.
    async fn write_failures(
        &self,
        fence: &Fence,
        update: &FailureUpdate,
        rows: Vec<FailedRow>,
    ) -> Vec<(FailedRow, Written)> {
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let all = |rows: Vec<FailedRow>, written: fn() -> Written| {
            rows.into_iter().map(|r| (r, written())).collect()
        };
        match super::retrying("mark failed attempts", || {
            self.store.mark_failed(fence, &ids, update)
        })
        .await
        {
            Ok((n, _)) if n == ids.len() as u64 => all(rows, || Written::Yes),
            // Nothing held the fence and no try was lost: all taken over.
            Ok((0, false)) => {
                tracing::warn!(rows = ids.len(), worker_id = %fence.worker_id, "late result dropped: the lease was taken over by another relay");
                all(rows, || Written::FencedOut)
            }
            // Some rows were taken over, or a try whose answer was lost
            // wrote them: the rows say which (rare; one read each).
            Ok(_) => {
                let mut out = Vec::with_capacity(rows.len());
                for row in rows {
                    let written = match self
                        .failure_applied(fence, row.id, update, &row.event_id)
                        .await
                    {
                        Ok(true) => Written::Yes,
                        Ok(false) => {
                            tracing::warn!(event_id = %row.event_id, "late result dropped: the lease was taken over by another relay");
                            Written::FencedOut
                        }
                        Err(e) => {
                            tracing::error!(event_id = %row.event_id, error = %e, "could not read back a failed attempt whose mark lost its answer (database error); if unrecorded, the lease expires and the event is tried again");
                            Written::DatabaseError
                        }
                    };
                    out.push((row, written));
                }
                out
            }
            Err(e) => {
                tracing::error!(rows = ids.len(), worker_id = %fence.worker_id, error = %e, "could not record failed attempts (database error); their leases expire and the events are tried again");
                all(rows, || Written::DatabaseError)
            }
        }
    }

    /// True when the row already holds `update`, written under this relay's
    /// `worker_id`, or has moved on from it: a retryable row this relay
    /// claimed again once its retry fell due (the due claim keeps
    /// `retry_count`, and sets a new lease, so the row is `delivering`
    /// under this worker with another `lock_until_ms`). Without the update
    /// the row would still hold `fence`, or have been taken over after its
    /// lease expired, which cannot happen while its holder is marking it
    /// (the lease budget keeps the mark inside the lease).
    async fn failure_applied(
        &self,
        fence: &Fence,
        id: i64,
        update: &FailureUpdate,
        event_id: &str,
    ) -> Result<bool> {
        let rows = self.store.find(event_id).await?;
        Ok(rows.iter().any(|row| {
            let ours = row.id == id
                && row.retry_count == update.retry_count
                && row.worker_id.as_deref() == Some(fence.worker_id.as_str());
            let reclaimed = update.status == crate::Status::Retryable
                && row.status == crate::Status::Delivering
                && row.lock_until_ms != fence.lock_until_ms;
            ours && (row.status == update.status || reclaimed)
        }))
    }
}

/// The write of a failed attempt, due after `delay` when `retryable`.
fn failure(
    status: crate::Status,
    retry_count: i32,
    delay: RetryDelay,
    delivered_to: Vec<String>,
    error: &str,
    publisher: Option<String>,
) -> FailureUpdate {
    FailureUpdate {
        status,
        retry_count,
        retry_after_ms: delay.after.as_millis() as i64,
        retry_jitter_ms: delay.jitter.as_millis() as i64,
        delivered_to,
        error: truncate_error(error),
        publisher,
    }
}

/// A row whose attempt failed, as its failure write needs it.
struct FailedRow {
    id: i64,
    event_id: String,
    app_code: String,
}

impl FailedRow {
    fn of(r: &crate::EventRecord) -> FailedRow {
        FailedRow {
            id: r.id,
            event_id: r.event_id.clone(),
            app_code: r.app_code.clone(),
        }
    }
}

/// Whether a result write took effect.
enum Written {
    Yes,
    /// The lease had been taken over.
    FencedOut,
    /// The database failed: the write on every try, or the read-back that
    /// would have told a lost answer from a takeover.
    DatabaseError,
}

impl RelayReport {
    /// Counts one row's failure write: `on_written` when it took effect,
    /// else as fenced out or as a mark error, never one for the other.
    fn count(&mut self, written: Written, on_written: impl FnOnce(&mut Self)) {
        match written {
            Written::Yes => on_written(self),
            Written::FencedOut => self.fenced_out += 1,
            Written::DatabaseError => self.mark_errors += 1,
        }
    }
}

fn held(outcomes: &[Outcome]) -> Vec<(Fence, i64)> {
    outcomes
        .iter()
        .map(|o| (o.event.fence(), o.event.record.id))
        .collect()
}

/// One `postbox_delivery_lag_seconds` sample per delivered row. When the
/// fence dropped some rows (`n` < ids) it is unknown which: none is recorded,
/// the relay that took them over records them.
fn record_delivery_lag(ids: &[i64], n: u64, created_at: &HashMap<i64, i64>) {
    if n != ids.len() as u64 {
        return;
    }
    let now = crate::time::now_ms();
    let lag = metrics::histogram!(crate::metrics::DELIVERY_LAG_SECONDS);
    for id in ids {
        if let Some(created) = created_at.get(id) {
            lag.record((now - created).max(0) as f64 / 1000.0);
        }
    }
}

/// An event the log names (a first failed attempt, a dead letter).
struct Logged {
    event_id: String,
    app_code: String,
    event_type: String,
    attempt: i32,
    error: String,
}

impl Logged {
    /// More of them in one batch (a broker outage fails every event of
    /// it) are one line, each event at DEBUG: the log names a poison
    /// event without flooding when everything fails.
    const ONE_BY_ONE: usize = 10;

    fn of(r: &crate::EventRecord, attempt: i32, error: &str) -> Self {
        Logged {
            event_id: r.event_id.clone(),
            app_code: r.app_code.clone(),
            event_type: r.event_type.clone(),
            attempt,
            error: error.to_owned(),
        }
    }

    /// One WARN line per event (`one`), or one for the batch (`many`)
    /// with the count, the first events and the first error.
    fn log(events: &[Logged], one: &str, many: &str) {
        if events.len() <= Self::ONE_BY_ONE {
            for e in events {
                tracing::warn!(event_id = %e.event_id, app_code = %e.app_code, event_type = %e.event_type, attempt = e.attempt, error = %e.error, "{one}");
            }
            return;
        }
        for e in events {
            tracing::debug!(event_id = %e.event_id, app_code = %e.app_code, event_type = %e.event_type, attempt = e.attempt, error = %e.error, "{one}");
        }
        let mut app_codes: Vec<&str> = events.iter().map(|e| e.app_code.as_str()).collect();
        app_codes.sort_unstable();
        app_codes.dedup();
        let first: Vec<&str> = events.iter().take(3).map(|e| e.event_id.as_str()).collect();
        tracing::warn!(
            events = events.len(),
            app_codes = %app_codes.join(","),
            first = %first.join(","),
            error = %events[0].error,
            "{} {many} (each at debug)",
            events.len()
        );
    }
}
