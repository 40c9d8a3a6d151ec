//! Stage 1: the three claim queries, pending first, and the idle sleep.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Batch;
use crate::config::{Ordering, WorkerConfig};
use crate::store::{ClaimRequest, RelayStore};
use crate::{ClaimSource, Result};

pub(super) struct Claimer {
    pub store: Arc<dyn RelayStore>,
    pub config: WorkerConfig,
    pub app_codes: Vec<String>,
    pub worker_id: String,
}

impl Claimer {
    /// Returns the number of rows claimed. A failed claim is no failure of
    /// the stage: it is logged and tried again after a pause that grows
    /// with the streak (the database may be restarting).
    pub async fn run(self, out: mpsc::Sender<Batch>, shutdown: CancellationToken) -> Result<u64> {
        let poll = self.config.poll_interval.get();
        let batch_size = self.config.batch_size;
        // Due retries and expired leases are looked for once per poll
        // interval, not on every claim: while a backlog drains, the pending
        // query alone runs back to back.
        let mut last_sweep: Vec<Option<Instant>> = vec![None; self.app_codes.len()];
        let mut claimed = 0u64;
        let mut db_errors = 0u32;
        while !shutdown.is_cancelled() {
            let mut any_full = false;
            let mut any_error = false;
            for (i, app_code) in self.app_codes.iter().enumerate() {
                let sweep = last_sweep[i].is_none_or(|t| t.elapsed() >= poll);
                let mut sources = Vec::with_capacity(3);
                if sweep {
                    sources.extend([ClaimSource::ExpiredLease, ClaimSource::DueRetry]);
                    last_sweep[i] = Some(Instant::now());
                }
                sources.push(ClaimSource::Pending);
                for source in sources {
                    // Claim only when the publish stage can take the batch:
                    // a claimed batch waits behind at most the one in flight
                    // (the wait LeaseBudget allows for).
                    let permit = tokio::select! {
                        permit = out.reserve() => permit,
                        _ = shutdown.cancelled() => return Ok(claimed),
                    };
                    let Ok(permit) = permit else {
                        // The publish stage is gone (it failed, and says
                        // so itself).
                        return Ok(claimed);
                    };
                    if shutdown.is_cancelled() {
                        return Ok(claimed);
                    }
                    let req = ClaimRequest {
                        app_code,
                        limit: batch_size,
                        worker_id: &self.worker_id,
                        lease_ms: self.config.lease.as_millis_i64(),
                        ordered: self.config.ordering == Ordering::PerAggregate,
                    };
                    // The lease starts on the database while the claim
                    // runs: count the batch's age from before it.
                    let claim_started = Instant::now();
                    match self.store.claim(source, &req).await {
                        Ok(events) if events.is_empty() => {}
                        Ok(events) => {
                            db_errors = 0;
                            claimed += events.len() as u64;
                            if source == ClaimSource::ExpiredLease {
                                metrics::counter!(crate::metrics::LEASE_EXPIRED_TOTAL)
                                    .increment(events.len() as u64);
                                tracing::warn!(
                                    app_code,
                                    rows = events.len(),
                                    "took over expired leases; counted as failed attempts"
                                );
                            }
                            if events.len() as u32 == batch_size {
                                any_full = true;
                            }
                            // A reserved slot cannot refuse: a publish stage
                            // that stops drains and releases what is queued.
                            permit.send(Batch {
                                events,
                                claimed_at: claim_started,
                            });
                        }
                        Err(e) if e.is_transient() => {
                            // A deadlock with a producer or another relay:
                            // the claim was rolled back; claim again soon.
                            tracing::debug!(app_code, ?source, error = %e, "claim hit a transient conflict");
                        }
                        Err(e) => {
                            any_error = true;
                            db_errors += 1;
                            // One line per streak of failures, not per poll.
                            if db_errors == 1 || db_errors.is_power_of_two() {
                                tracing::error!(app_code, ?source, error = %e, consecutive = db_errors, "claim failed");
                            }
                        }
                    }
                }
            }
            if any_full && !any_error {
                continue;
            }
            let pause = if any_error {
                (poll * db_errors.min(10)).min(Duration::from_secs(30))
            } else {
                poll
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = shutdown.cancelled() => {}
            }
        }
        Ok(claimed)
    }
}
