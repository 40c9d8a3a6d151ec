//! The relay: claim → publish → mark, as three overlapping stages.
//!
//! ```text
//!  claimer ──batch──▶ publisher ──results──▶ marker
//!  (claim queries)    (all publishers,       (one fenced UPDATE for the
//!                      concurrently)          delivered rows, one per failure)
//! ```
//!
//! The stages are joined by small bounded channels, so while one batch is
//! being published the next is already claimed and the previous one is being
//! marked. On shutdown the claimer stops, batches not yet started are
//! released, the batch in flight finishes and is marked, and `run` returns.

mod claimer;
mod marker;
mod publisher;

use std::sync::Arc;

use serde::Serialize;
use tokio::sync::mpsc;
pub use tokio_util::sync::CancellationToken;

use crate::config::WorkerConfig;
use crate::publish::Publisher;
use crate::store::OutboxStore;
use crate::{ClaimedEvent, Result};

/// Counters of one relay run, returned when it stops.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct RelayReport {
    /// Rows claimed.
    pub claimed: u64,
    /// Rows marked delivered.
    pub delivered: u64,
    /// Rows marked retryable.
    pub retried: u64,
    /// Rows dead-lettered.
    pub failed: u64,
    /// Rows given back at shutdown.
    pub released: u64,
    /// Results dropped because the lease had been taken over.
    pub fenced_out: u64,
}

/// A batch claimed by one query.
pub(crate) struct Batch {
    events: Vec<ClaimedEvent>,
    /// When the claim returned, on this host's monotonic clock.
    claimed_at: std::time::Instant,
}

/// Moves committed outbox rows to every publisher.
pub struct Relay {
    store: Arc<dyn OutboxStore>,
    publishers: Vec<Arc<dyn Publisher>>,
    config: WorkerConfig,
    app_codes: Vec<String>,
    worker_id: String,
}

impl Relay {
    /// A relay over `store` for `app_codes`, publishing to every publisher.
    pub fn new(
        store: Arc<dyn OutboxStore>,
        publishers: Vec<Arc<dyn Publisher>>,
        config: WorkerConfig,
        app_codes: Vec<String>,
    ) -> Self {
        Relay {
            store,
            publishers,
            config,
            app_codes,
            worker_id: default_worker_id(),
        }
    }

    /// Overrides the worker id written into leases (default
    /// `{host}-{pid}-{random}`).
    pub fn with_worker_id(mut self, worker_id: impl Into<String>) -> Self {
        self.worker_id = worker_id.into();
        self
    }

    /// This relay's worker id.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Runs until `shutdown` is cancelled, then finishes in-flight publishes,
    /// releases unstarted leases and returns the counters.
    pub async fn run(self, shutdown: CancellationToken) -> Result<RelayReport> {
        // With no publisher every row would count as confirmed by all.
        if self.publishers.is_empty() {
            return Err(crate::Error::config(
                "publishers",
                "the relay needs at least one publisher",
            ));
        }
        if self.app_codes.is_empty() {
            return Err(crate::Error::config(
                "database.app_codes",
                "the relay needs at least one app_code",
            ));
        }
        let (claimed_tx, claimed_rx) = mpsc::channel::<Batch>(1);
        let (results_tx, results_rx) = mpsc::channel(2);
        tracing::info!(
            worker_id = %self.worker_id,
            backend = self.store.backend(),
            table = %self.store.table(),
            app_codes = ?self.app_codes,
            publishers = ?self.publishers.iter().map(|p| p.name().to_owned()).collect::<Vec<_>>(),
            "relay started"
        );

        let claimer = claimer::Claimer {
            store: self.store.clone(),
            config: self.config.clone(),
            app_codes: self.app_codes.clone(),
            worker_id: self.worker_id.clone(),
        };
        let publishing = publisher::PublishStage {
            store: self.store.clone(),
            publishers: self.publishers.clone(),
            config: self.config.clone(),
        };
        let marking = marker::Marker {
            store: self.store.clone(),
            config: self.config.clone(),
        };

        let claim_task = tokio::spawn(claimer.run(claimed_tx, shutdown.clone()));
        let publish_task = tokio::spawn(publishing.run(claimed_rx, results_tx, shutdown.clone()));
        let mark_task = tokio::spawn(marking.run(results_rx));

        let claimed = join(claim_task).await;
        let released = join(publish_task).await;
        let mut report = join(mark_task).await;
        report.claimed = claimed;
        report.released = released;
        for p in &self.publishers {
            p.close().await;
        }
        tracing::info!(worker_id = %self.worker_id, ?report, "relay stopped");
        Ok(report)
    }
}

async fn join<T: Default>(task: tokio::task::JoinHandle<T>) -> T {
    match task.await {
        Ok(v) => v,
        Err(e) => {
            tracing::error!(error = %e, "relay stage panicked");
            T::default()
        }
    }
}

/// `{host}-{pid}-{4 hex}`: tells relays apart in `worker_id` and in logs.
pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    let suffix: u16 = rand::random();
    let mut id = format!("{host}-{}-{suffix:04x}", std::process::id());
    id.truncate(120);
    id
}
