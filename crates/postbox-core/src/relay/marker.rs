//! Stage 3: write each row's result, fenced by its claim.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::RelayReport;
use crate::config::WorkerConfig;
use crate::event::{truncate_error, Fence};
use crate::publish::PublishError;
use crate::retry::{decide, AttemptResult, Decision, EXPIRED_ON_LAST_ATTEMPT};
use crate::store::{FailureUpdate, OutboxStore};
use crate::{ClaimedEvent, Result};

/// Why a claimed row is marked without being handed to any publisher.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Unpublished {
    /// Its last allowed lease expired (see `retry::publish_after_expired_lease`).
    ExpiredOnLastAttempt,
    /// Its payload is over `database.max_payload_bytes` (a row written by a
    /// plain INSERT, which `enqueue`'s check never saw): no broker would
    /// take it, so it is dead-lettered at once.
    PayloadTooLarge {
        /// Payload bytes.
        size: usize,
        /// `database.max_payload_bytes`.
        limit: usize,
    },
}

impl Unpublished {
    fn error(&self) -> String {
        match self {
            Unpublished::ExpiredOnLastAttempt => EXPIRED_ON_LAST_ATTEMPT.to_owned(),
            Unpublished::PayloadTooLarge { size, limit } => format!(
                "payload is {size} bytes, over database.max_payload_bytes ({limit}); dead-lettered without trying any publisher: shrink the event (or raise the limit if every broker takes it), then replay it"
            ),
        }
    }
}

/// What happened to one claimed row in one attempt.
pub(super) struct Outcome {
    pub event: ClaimedEvent,
    /// Why the row was not published at all, if it was not.
    pub unpublished: Option<Unpublished>,
    pub confirmed: Vec<String>,
    pub errors: Vec<(String, PublishError)>,
}

pub(super) struct Marker {
    pub store: Arc<dyn OutboxStore>,
    pub config: WorkerConfig,
}

impl Marker {
    pub async fn run(self, mut input: mpsc::Receiver<Vec<Outcome>>) -> RelayReport {
        let mut report = RelayReport::default();
        while let Some(outcomes) = input.recv().await {
            let rows = held(&outcomes);
            super::releasing_on_panic(
                self.store.as_ref(),
                rows,
                &mut input,
                |queued| held(&queued),
                self.mark(outcomes, &mut report),
            )
            .await;
        }
        report
    }

    async fn mark(&self, outcomes: Vec<Outcome>, report: &mut RelayReport) {
        let mut delivered: HashMap<Fence, Vec<i64>> = HashMap::new();
        // Row id → created_at_ms, for the delivery lag histogram.
        let mut created_at: HashMap<i64, i64> = HashMap::new();
        // Row id → event_id, to read a row back after a lost answer.
        let mut event_ids: HashMap<i64, String> = HashMap::new();
        for o in outcomes {
            let r = &o.event.record;
            let attempt = AttemptResult {
                retry_count: r.retry_count,
                delivered_before: r.delivered_to.clone(),
                confirmed_now: o.confirmed.clone(),
                errors: if let Some(why) = &o.unpublished {
                    vec![("relay".to_owned(), why.error())]
                } else {
                    o.errors
                        .iter()
                        .map(|(p, e)| (p.clone(), e.to_string()))
                        .collect()
                },
                never_deliverable: matches!(
                    o.unpublished,
                    Some(Unpublished::PayloadTooLarge { .. })
                ),
            };
            let asked_delay = o.errors.iter().filter_map(|(_, e)| e.retry_after()).max();
            let backoff = self.config.backoff();
            let decision = decide(
                &attempt,
                self.config.max_retry_count_for(&r.event_type),
                self.config.delivery_for(&r.event_type),
                |n| {
                    let d = backoff.delay(n, &mut rand::rng());
                    asked_delay.map_or(d, |a| a.max(d))
                },
            );
            let fence = o.event.fence();
            let failed_publishers = (o.unpublished.is_none() && !o.errors.is_empty()).then(|| {
                o.errors
                    .iter()
                    .map(|(p, _)| p.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            });
            match decision {
                Decision::Delivered => {
                    created_at.insert(r.id, r.created_at_ms);
                    event_ids.insert(r.id, r.event_id.clone());
                    delivered.entry(fence).or_default().push(r.id)
                }
                Decision::Retry {
                    retry_count,
                    after,
                    delivered_to,
                    error,
                } => {
                    if retry_count == 1 {
                        tracing::warn!(event_id = %r.event_id, app_code = %r.app_code, event_type = %r.event_type, attempt = retry_count, retry_in = ?after, error = %error, "publish failed; will retry");
                    } else {
                        tracing::debug!(event_id = %r.event_id, attempt = retry_count, retry_in = ?after, error = %error, "publish failed again");
                    }
                    let update = FailureUpdate {
                        status: crate::Status::Retryable,
                        retry_count,
                        retry_after_ms: after.as_millis() as i64,
                        delivered_to,
                        error: truncate_error(&error),
                        publisher: failed_publishers.clone(),
                    };
                    match self.write_failure(&fence, r.id, &update, &r.event_id).await {
                        Written::Yes => report.retried += 1,
                        Written::FencedOut => report.fenced_out += 1,
                        Written::DatabaseError => report.mark_errors += 1,
                    }
                }
                Decision::Failed {
                    retry_count,
                    delivered_to,
                    error,
                } => {
                    tracing::warn!(event_id = %r.event_id, app_code = %r.app_code, event_type = %r.event_type, attempts = retry_count, error = %error, "event dead-lettered (status failed); replay it with `postbox replay`");
                    let update = FailureUpdate {
                        status: crate::Status::Failed,
                        retry_count,
                        retry_after_ms: 0,
                        delivered_to,
                        error: truncate_error(&error),
                        publisher: failed_publishers.clone(),
                    };
                    match self.write_failure(&fence, r.id, &update, &r.event_id).await {
                        Written::Yes => {
                            report.failed += 1;
                            metrics::counter!(crate::metrics::DEAD_LETTERED_TOTAL, "app_code" => r.app_code.clone())
                                .increment(1);
                        }
                        Written::FencedOut => report.fenced_out += 1,
                        Written::DatabaseError => report.mark_errors += 1,
                    }
                }
            }
        }
        for (fence, ids) in delivered {
            let n = match retrying("mark delivered", || self.store.mark_delivered(&fence, &ids))
                .await
            {
                Ok((n, false)) => n,
                // A try that failed may have committed before its answer
                // was lost: rows it marked are ours, not taken over. The
                // read-back counts every row delivered under our worker id,
                // the `n` the last try marked included.
                Ok((n, true)) if n < ids.len() as u64 => {
                    n.max(self.already_delivered(&fence, &ids, &event_ids).await)
                }
                Ok((n, true)) => n,
                Err(e) => {
                    report.mark_errors += ids.len() as u64;
                    tracing::error!(rows = ids.len(), worker_id = %fence.worker_id, error = %e, "could not mark rows delivered (database error); their leases expire and they are delivered again");
                    continue;
                }
            };
            report.delivered += n;
            record_delivery_lag(&ids, n, &created_at);
            if n < ids.len() as u64 {
                let lost = ids.len() as u64 - n;
                report.fenced_out += lost;
                tracing::warn!(rows = lost, worker_id = %fence.worker_id, "late result dropped: the lease was taken over by another relay, which will deliver again");
            }
        }
    }

    /// How many of `ids` are `delivered` under this relay's `worker_id`:
    /// marked by an earlier try whose answer was lost (a takeover would
    /// have written another worker id).
    async fn already_delivered(
        &self,
        fence: &Fence,
        ids: &[i64],
        event_ids: &HashMap<i64, String>,
    ) -> u64 {
        let mut ours = 0;
        for id in ids {
            let Some(event_id) = event_ids.get(id) else {
                continue;
            };
            if let Ok(rows) = self.store.find(event_id).await {
                ours += rows.iter().any(|row| {
                    row.id == *id
                        && row.status == crate::Status::Delivered
                        && row.worker_id.as_deref() == Some(fence.worker_id.as_str())
                }) as u64;
            }
        }
        ours
    }

    async fn write_failure(
        &self,
        fence: &Fence,
        id: i64,
        update: &FailureUpdate,
        event_id: &str,
    ) -> Written {
        match retrying("mark failed attempt", || {
            self.store.mark_failed(fence, id, update)
        })
        .await
        {
            Ok((true, _)) => Written::Yes,
            // A try that failed may have committed before its answer was
            // lost: the row then holds exactly this update, under our id.
            Ok((false, true)) if self.failure_applied(fence, id, update, event_id).await => {
                Written::Yes
            }
            Ok((false, _)) => {
                tracing::warn!(
                    event_id,
                    "late result dropped: the lease was taken over by another relay"
                );
                Written::FencedOut
            }
            Err(e) => {
                tracing::error!(event_id, error = %e, "could not record the failed attempt (database error); the lease expires and the event is tried again");
                Written::DatabaseError
            }
        }
    }

    /// True when the row already holds `update`, written under this relay's
    /// `worker_id`.
    async fn failure_applied(
        &self,
        fence: &Fence,
        id: i64,
        update: &FailureUpdate,
        event_id: &str,
    ) -> bool {
        match self.store.find(event_id).await {
            Ok(rows) => rows.iter().any(|row| {
                row.id == id
                    && row.status == update.status
                    && row.retry_count == update.retry_count
                    && row.worker_id.as_deref() == Some(fence.worker_id.as_str())
            }),
            Err(_) => false,
        }
    }
}

/// Whether a result write took effect.
enum Written {
    Yes,
    /// The lease had been taken over.
    FencedOut,
    /// The database failed on every try.
    DatabaseError,
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

/// Retries a result write a few times: losing it only means the lease
/// expires and the row is delivered again, but that is worth avoiding.
/// Returns the value and whether an earlier try failed (and so may have
/// committed before its answer was lost).
async fn retrying<T, F, Fut>(what: &'static str, mut op: F) -> Result<(T, bool)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut delay = Duration::from_millis(20);
    let mut tries = 0;
    loop {
        match op().await {
            Ok(v) => return Ok((v, tries > 0)),
            Err(e) if tries < 5 => {
                tries += 1;
                tracing::warn!(error = %e, tries, "{what} failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => return Err(e),
        }
    }
}
