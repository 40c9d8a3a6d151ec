//! The gauge poller: one `stats` query round per interval feeds both the
//! Prometheus gauges and `/api/stats`, so a scrape never touches the
//! database.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use postbox_core::metrics as m;
use postbox_core::store::{AppStats, MinuteCount, OutboxStore};
use postbox_core::Status;

/// How far back the delivered-per-minute chart reaches.
const CHART_SPAN_MS: i64 = 60 * 60 * 1000;

/// How long one stats poll may wait for the database.
const POLL_WITHIN: Duration = Duration::from_secs(30);

/// The latest poll's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Snapshot {
    /// Database time of the poll, epoch ms (0 before the first poll).
    pub taken_at_ms: i64,
    /// Counts per app_code.
    pub apps: Vec<AppStats>,
    /// Rows delivered per minute over the last hour, per app_code.
    pub delivered_per_minute: BTreeMap<String, Vec<MinuteCount>>,
    /// Why the last poll failed (the figures are then the previous ones).
    pub error: Option<String>,
}

/// Polls `store.stats(app_codes)` every interval.
#[derive(Clone)]
pub struct StatsPoller {
    store: Arc<dyn OutboxStore>,
    app_codes: Vec<String>,
    interval: Duration,
    latest: Arc<RwLock<Snapshot>>,
    prometheus: Option<PrometheusHandle>,
    /// Asks [`StatsPoller::run`] for a poll before the next tick.
    soon: Arc<tokio::sync::Notify>,
}

impl StatsPoller {
    /// A poller over `app_codes`; `prometheus` (when given) gets its
    /// histogram upkeep on every round.
    pub fn new(
        store: Arc<dyn OutboxStore>,
        app_codes: Vec<String>,
        interval: Duration,
        prometheus: Option<PrometheusHandle>,
    ) -> Self {
        StatsPoller {
            store,
            app_codes,
            interval,
            latest: Arc::default(),
            prometheus,
            soon: Arc::default(),
        }
    }

    /// Asks for a poll now (after a replay, for the dashboard that made
    /// it), without waiting for it: the call that asked answers at once
    /// (a slow poll held a committed replay's answer, which a client that
    /// gave up on it would send again), and any number of asks while one
    /// is pending make one poll.
    pub fn poll_soon(&self) {
        self.soon.notify_one();
    }

    /// The latest snapshot.
    pub fn snapshot(&self) -> Snapshot {
        self.latest
            .read()
            .map(|s| s.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Polls once: updates the gauges and the snapshot. A poll the
    /// database does not answer within [`POLL_WITHIN`] is a failed one (the
    /// figures served say so): a database gone silent held the poller for
    /// good, the dashboard showing old figures as current.
    pub async fn poll_once(&self) {
        let result =
            postbox_core::Error::unless_silent("admin stats poll", POLL_WITHIN, self.query()).await;
        let mut latest = self.latest.write().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(fresh) => {
                set_gauges(&fresh.apps);
                *latest = fresh;
            }
            Err(e) => {
                tracing::warn!(error = %e, "admin stats poll failed; serving the previous figures");
                latest.error = Some(e.to_string());
            }
        }
        if let Some(p) = &self.prometheus {
            p.run_upkeep();
        }
    }

    /// Polls every interval until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = async {
                    tokio::select! {
                        _ = tick.tick() => {}
                        () = self.soon.notified() => {}
                    }
                } => tokio::select! {
                    () = self.poll_once() => {}
                    // A poll in flight does not hold the stop.
                    _ = shutdown.cancelled() => return,
                },
                _ = shutdown.cancelled() => return,
            }
        }
    }

    async fn query(&self) -> postbox_core::Result<Snapshot> {
        let now = self.store.now_ms().await?;
        let apps = self.store.stats(&self.app_codes).await?;
        let previous = self.snapshot();
        let mut per_minute = BTreeMap::new();
        for app in &self.app_codes {
            let kept = previous.delivered_per_minute.get(app);
            let since = chart_since(previous.taken_at_ms, kept.is_some(), now);
            let fresh = self.store.delivered_per_minute(app, since).await?;
            let counts = match kept {
                Some(kept) => merged(kept, fresh, since, now),
                None => fresh,
            };
            per_minute.insert(app.clone(), counts);
        }
        Ok(Snapshot {
            taken_at_ms: now,
            apps,
            delivered_per_minute: per_minute,
            error: None,
        })
    }
}

const MINUTE_MS: i64 = 60_000;

/// Where a poll at `now` reads the chart from. The whole hour on the first
/// poll (or after a gap); after a poll a minute ago or less, only from the
/// minute before that poll's: older minutes are closed and kept from it.
/// Read whole every 5 s, the hour's delivered rows cost the database more
/// the busier the outbox (about 150 ms at 100 events/s).
fn chart_since(previous_at: i64, kept: bool, now: i64) -> i64 {
    let window = now - CHART_SPAN_MS;
    if !kept || previous_at <= 0 || now - previous_at > MINUTE_MS {
        return window;
    }
    (previous_at - previous_at.rem_euclid(MINUTE_MS) - MINUTE_MS).max(window)
}

/// The chart: the minutes of `kept` before `since` and still within the
/// hour, then `fresh` (read from `since`).
fn merged(kept: &[MinuteCount], fresh: Vec<MinuteCount>, since: i64, now: i64) -> Vec<MinuteCount> {
    let window = now - CHART_SPAN_MS;
    let first = window - window.rem_euclid(MINUTE_MS);
    kept.iter()
        .filter(|m| m.minute_ms >= first && m.minute_ms < since)
        .copied()
        .chain(fresh)
        .collect()
}

fn set_gauges(apps: &[AppStats]) {
    for a in apps {
        for status in Status::ALL {
            let n = match status {
                // Counted as they happen (`postbox_dropped_total`), not
                // read from the table.
                Status::Dropped => continue,
                Status::Pending => a.pending,
                Status::Delivering => a.delivering,
                Status::Delivered => a.delivered,
                Status::Retryable => a.retryable,
                Status::Failed => a.failed,
            };
            metrics::gauge!(m::OUTBOX_EVENTS, "app_code" => a.app_code.clone(), "status" => status.as_str())
                .set(n as f64);
        }
        metrics::gauge!(m::OUTBOX_OLDEST_PENDING_AGE_SECONDS, "app_code" => a.app_code.clone())
            .set(a.oldest_pending_age_seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minute(minute_ms: i64, delivered: i64) -> MinuteCount {
        MinuteCount {
            minute_ms,
            delivered,
        }
    }

    /// After a poll 5 s ago, the chart is read from the minute before
    /// that poll's, not the whole hour again; the first poll, or one after
    /// a gap, reads the hour.
    #[test]
    fn a_poll_reads_only_the_minutes_still_open() {
        let now = 10 * CHART_SPAN_MS + 30_000;
        let previous = now - 5_000;
        let since = chart_since(previous, true, now);
        assert_eq!(
            since,
            now - 30_000 - MINUTE_MS,
            "the minute before the last poll's"
        );
        assert_eq!(chart_since(0, true, now), now - CHART_SPAN_MS);
        assert_eq!(chart_since(previous, false, now), now - CHART_SPAN_MS);
        assert_eq!(
            chart_since(now - 2 * MINUTE_MS, true, now),
            now - CHART_SPAN_MS
        );
    }

    #[test]
    fn the_chart_keeps_closed_minutes_and_takes_the_fresh_ones() {
        let now = 10 * CHART_SPAN_MS + 30_000;
        let open = now - 30_000 - MINUTE_MS;
        let too_old = now - CHART_SPAN_MS - 2 * MINUTE_MS;
        let kept = [
            minute(too_old - too_old.rem_euclid(MINUTE_MS), 9),
            minute(open - 3 * MINUTE_MS, 1),
            minute(open - MINUTE_MS, 2),
            minute(open, 3),
        ];
        let fresh = vec![minute(open, 4), minute(open + MINUTE_MS, 5)];
        let chart = merged(&kept, fresh, open, now);
        let counts: Vec<i64> = chart.iter().map(|m| m.delivered).collect();
        assert_eq!(counts, [1, 2, 4, 5], "{chart:?}");
    }
}
