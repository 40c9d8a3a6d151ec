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
        }
    }

    /// The latest snapshot.
    pub fn snapshot(&self) -> Snapshot {
        self.latest
            .read()
            .map(|s| s.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Polls once: updates the gauges and the snapshot.
    pub async fn poll_once(&self) {
        let result = self.query().await;
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
                _ = tick.tick() => self.poll_once().await,
                _ = shutdown.cancelled() => return,
            }
        }
    }

    async fn query(&self) -> postbox_core::Result<Snapshot> {
        let now = self.store.now_ms().await?;
        let apps = self.store.stats(&self.app_codes).await?;
        let mut per_minute = BTreeMap::new();
        for app in &self.app_codes {
            let since = now - CHART_SPAN_MS;
            let counts = self.store.delivered_per_minute(app, since).await?;
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
