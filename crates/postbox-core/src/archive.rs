//! Archiving: moving delivered rows older than a cut-off out of the outbox
//! table, from `postbox archive` or on a schedule inside `postbox relay`.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::{ArchiveConfig, PartitionArchive};
use crate::store::{ArchiveReport, ArchiveRequest, OutboxStore};
use crate::Result;

/// One archive run: rows older than `older_than_ms` (on the database
/// clock) of `app_codes`. Counts `postbox_archived_total` per batch and
/// reports each batch's row count to `on_batch`.
pub async fn archive_once(
    store: &dyn OutboxStore,
    app_codes: &[String],
    older_than_ms: i64,
    batch_size: u32,
    max_batches: Option<u64>,
    partitions: PartitionArchive,
    on_batch: &(dyn Fn(u64) + Send + Sync),
) -> Result<ArchiveReport> {
    let now = store.now_ms().await?;
    let req = ArchiveRequest {
        app_codes: app_codes.to_vec(),
        before_ms: now - older_than_ms,
        batch_size,
        max_batches,
        partitions,
    };
    let counted = |n: u64| {
        metrics::counter!(crate::metrics::ARCHIVED_TOTAL).increment(n);
        on_batch(n);
    };
    store.archive(&req, &counted).await
}

/// Logs the rows one archive batch deleted without copying (`deleted −
/// copied`): live rows whose event the archive already held under another
/// id (enqueued again after archiving, with `--allow-archived` or by a
/// plain INSERT, and delivered again). The archived copy is kept and the
/// duplicate deleted, so they never stop the archiver.
pub fn log_archived_duplicates(table: &str, deleted: i64, copied: i64) {
    if deleted > copied {
        tracing::warn!(
            table,
            rows = deleted - copied,
            "delivered rows repeated events already archived: kept the archived copies, deleted the live duplicates"
        );
    }
}

/// Archives every `config.interval` (the first run one interval after
/// start) until `shutdown`; a run in progress is abandoned at shutdown (its
/// open batch rolls back).
pub async fn run_scheduled(
    store: Arc<dyn OutboxStore>,
    config: ArchiveConfig,
    app_codes: Vec<String>,
    shutdown: CancellationToken,
) {
    let older_than_ms = config.older_than.as_millis_i64();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(config.interval.get()) => {}
            _ = shutdown.cancelled() => return,
        }
        let run = archive_once(
            store.as_ref(),
            &app_codes,
            older_than_ms,
            config.batch_size,
            None,
            config.partitions,
            &|_| {},
        );
        tokio::select! {
            res = run => match res {
                Ok(r) if r.locked_out => {
                    tracing::info!("scheduled archive skipped: another archiver holds the lock");
                }
                Ok(r) => {
                    tracing::info!(rows = r.moved, batches = r.batches, "scheduled archive done");
                }
                Err(e) => tracing::error!(error = %e, "scheduled archive failed; retrying next interval"),
            },
            _ = shutdown.cancelled() => return,
        }
    }
}
