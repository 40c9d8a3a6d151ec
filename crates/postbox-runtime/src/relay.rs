//! The relay with what runs beside it: the admin server when `[admin]` is
//! set, and the archiver when `[archive] enabled`.

use std::sync::Arc;

use postbox_core::config::{RelaySettings, Settings};
use postbox_core::publish::Publisher;
use postbox_core::relay::{CancellationToken, Relay, RelayReport};
use postbox_core::store::OutboxStore;
use postbox_core::{BoxFuture, Error};

use crate::store::{self, Create};

/// How to start the relay, besides the configuration.
#[derive(Debug, Clone, Default)]
pub struct RelayOptions {
    /// Run the migrations first (and create a missing SQLite file).
    pub migrate: bool,
    /// Only these tenants (empty: `database.app_codes`).
    pub app_codes: Vec<String>,
}

fn check_enabled(settings: &Settings) -> Result<(), Error> {
    if settings.outbox_worker.enabled {
        return Ok(());
    }
    Err(Error::config(
        "outbox_worker.enabled",
        "is false; nothing to run",
    ))
}

/// A relay whose store and publishers are open, ready to [`run`].
///
/// [`run`]: RelayService::run
pub struct RelayService {
    settings: Settings,
    relay: RelaySettings,
    store: Arc<dyn OutboxStore>,
    publishers: Vec<Arc<dyn Publisher>>,
}

impl RelayService {
    /// Checks that the relay has something to do, opens the store (running
    /// the migrations when asked), checks its schema and connects every
    /// publisher. Errors name the config key at fault.
    pub fn start(settings: &Settings, options: RelayOptions) -> BoxFuture<'_, Result<Self, Error>> {
        Box::pin(Self::start_here(settings, options))
    }

    async fn start_here(settings: &Settings, options: RelayOptions) -> Result<Self, Error> {
        let relay = settings.relay(options.app_codes)?;
        check_enabled(settings)?;
        let create = if options.migrate {
            Create::IfMissing
        } else {
            Create::Never
        };
        let store = store::open(settings, create).await?;
        if options.migrate {
            store.migrate().await?;
        }
        Self::over_here(settings, relay, store).await
    }

    /// [`start`](Self::start) over a store the service already has open
    /// (its own `MySqlOutbox`, `SqliteOutbox` or `PgOutbox`, migrated): the
    /// relay then wakes in-process on every `enqueue` of that store, with
    /// no wait for the next poll, on every database.
    pub fn over(
        settings: &Settings,
        store: Arc<dyn OutboxStore>,
        app_codes: Vec<String>,
    ) -> BoxFuture<'_, Result<Self, Error>> {
        Box::pin(async move {
            let relay = settings.relay(app_codes)?;
            Self::over_here(settings, relay, store).await
        })
    }

    async fn over_here(
        settings: &Settings,
        relay: RelaySettings,
        store: Arc<dyn OutboxStore>,
    ) -> Result<Self, Error> {
        check_enabled(settings)?;
        store::require_schema(store.as_ref()).await?;
        let publishers = postbox_publishers::build_all(settings).await?;
        Ok(RelayService {
            settings: settings.clone(),
            relay,
            store,
            publishers,
        })
    }

    /// The open store.
    pub fn store(&self) -> &Arc<dyn OutboxStore> {
        &self.store
    }

    /// Runs the relay, and beside it the admin server and the archiver
    /// when configured, until `shutdown` is cancelled or the relay fails;
    /// the others stop with it. A failed relay stops only what this call
    /// started, never the caller's `shutdown` (a host service's own token).
    pub fn run(
        self,
        shutdown: CancellationToken,
    ) -> BoxFuture<'static, Result<RelayReport, Error>> {
        Box::pin(self.run_here(shutdown))
    }

    async fn run_here(self, shutdown: CancellationToken) -> Result<RelayReport, Error> {
        let shutdown = shutdown.child_token();
        let app_codes = self.relay.app_codes().to_vec();
        let relay = Relay::new(self.store.clone(), self.publishers, self.relay);
        let admin = crate::admin::spawn_if_configured(
            &self.settings,
            self.store.clone(),
            app_codes.clone(),
            relay.pulse(),
            shutdown.clone(),
        )
        .await?;
        if self.settings.database.partitioning.is_some() {
            tokio::spawn(keep_partitions(self.store.clone(), shutdown.clone()));
        }
        let archiver = self.settings.archive.enabled.then(|| {
            tokio::spawn(postbox_core::archive::run_scheduled(
                self.store.clone(),
                self.settings.archive.clone(),
                app_codes,
                shutdown.clone(),
            ))
        });
        let report = relay.run(shutdown.clone()).await;
        // The relay stops only on shutdown or error; the admin server and
        // the archiver stop with it.
        shutdown.cancel();
        if let Some(task) = archiver {
            let _ = task.await;
        }
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        report
    }
}

/// Inside `postbox relay` on a partitioned table: creates missing
/// partitions at start and every [`postbox_core::partition::KEEP_EVERY`] until `shutdown` (any
/// relay may; creating is idempotent). A failure is logged and tried again
/// next time; `doctor` fails when fewer than two are left ahead.
async fn keep_partitions(store: Arc<dyn OutboxStore>, shutdown: CancellationToken) {
    loop {
        match store.keep_partitions().await {
            Ok(created) if !created.is_empty() => {
                tracing::info!(table = %store.table(), partitions = ?created, "partitions created ahead");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!(error = %e, "could not create partitions ahead; trying again in 10 minutes")
            }
        }
        match store.partitions_ahead().await {
            Ok(Some(p)) => postbox_core::metrics::partitions_ahead(store.table().as_str(), p.ahead),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "could not count the partitions ahead"),
        }
        tokio::select! {
            _ = tokio::time::sleep(postbox_core::partition::KEEP_EVERY) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{key_of, settings};

    #[tokio::test]
    async fn a_relay_with_nothing_to_do_does_not_start() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("p.db").display());
        let none = settings(serde_json::json!({ "database": { "url": url } }));
        let start = RelayService::start(&none, RelayOptions::default());
        assert_eq!(key_of(start.await.err().unwrap()), "publishers");

        let disabled = settings(serde_json::json!({
            "database": { "url": url },
            "outbox_worker": { "enabled": false },
            "publishers": [{ "kind": "file", "path": "-" }],
        }));
        let start = RelayService::start(&disabled, RelayOptions::default());
        assert_eq!(key_of(start.await.err().unwrap()), "outbox_worker.enabled");
        assert!(!dir.path().join("p.db").exists(), "nothing was opened");
    }

    #[tokio::test]
    async fn migrate_creates_the_store_and_a_run_stops_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("p.db").display());
        let s = settings(serde_json::json!({
            "database": { "url": url },
            "publishers": [{ "kind": "file", "path": dir.path().join("out.jsonl") }],
        }));
        let missing = RelayService::start(&s, RelayOptions::default()).await;
        assert!(missing.is_err(), "a missing SQLite file is not created");
        let options = RelayOptions {
            migrate: true,
            ..RelayOptions::default()
        };
        let relay = RelayService::start(&s, options).await.unwrap();
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let report = relay.run(shutdown).await.unwrap();
        assert_eq!(report.claimed, 0);
    }
}
