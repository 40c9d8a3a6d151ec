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
                    if self.write_failure(&fence, r.id, &update, &r.event_id).await {
                        report.retried += 1;
                    } else {
                        report.fenced_out += 1;
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
                    if self.write_failure(&fence, r.id, &update, &r.event_id).await {
                        report.failed += 1;
                        metrics::counter!(crate::metrics::DEAD_LETTERED_TOTAL, "app_code" => r.app_code.clone())
                            .increment(1);
                    } else {
                        report.fenced_out += 1;
                    }
                }
            }
        }
        for (fence, ids) in delivered {
            let n = retrying("mark delivered", || self.store.mark_delivered(&fence, &ids)).await;
            let n = n.unwrap_or(0);
            report.delivered += n;
            record_delivery_lag(&ids, n, &created_at);
            if n < ids.len() as u64 {
                let lost = ids.len() as u64 - n;
                report.fenced_out += lost;
                tracing::warn!(rows = lost, worker_id = %fence.worker_id, "late result dropped: the lease was taken over by another relay, which will deliver again");
            }
        }
    }

    async fn write_failure(
        &self,
        fence: &Fence,
        id: i64,
        update: &FailureUpdate,
        event_id: &str,
    ) -> bool {
        match retrying("mark failed attempt", || {
            self.store.mark_failed(fence, id, update)
        })
        .await
        {
            Ok(true) => true,
            Ok(false) => {
                tracing::warn!(
                    event_id,
                    "late result dropped: the lease was taken over by another relay"
                );
                false
            }
            Err(_) => false,
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

/// Retries a result write a few times: losing it only means the lease
/// expires and the row is delivered again, but that is worth avoiding.
async fn retrying<T, F, Fut>(what: &'static str, mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut delay = Duration::from_millis(20);
    let mut tries = 0;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if tries < 5 => {
                tries += 1;
                tracing::warn!(error = %e, tries, "{what} failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => {
                tracing::error!(error = %e, "{what} failed; the lease will expire and the rows be delivered again");
                return Err(e);
            }
        }
    }
}
