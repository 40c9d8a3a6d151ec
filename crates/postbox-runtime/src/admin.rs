//! The admin server (API, `/metrics`, dashboard) of checked settings.

use std::sync::Arc;

use postbox_admin::{AdminServer, AdminSettings};
use postbox_core::config::Settings;
use postbox_core::relay::CancellationToken;
use postbox_core::store::OutboxStore;
use postbox_core::{BoxFuture, Error};
use tokio::task::JoinHandle;

/// Binds the admin server on `admin.listen` (or `listen` when given),
/// serving `app_codes` (empty: `database.app_codes`).
pub fn bind(
    settings: &Settings,
    store: Arc<dyn OutboxStore>,
    app_codes: Vec<String>,
    listen: Option<String>,
) -> BoxFuture<'static, Result<AdminServer, Error>> {
    let mut admin = AdminSettings::from_settings(settings, app_codes);
    if let Some(listen) = listen {
        admin.listen = listen;
        admin.listen_from = "--listen";
    }
    let source = Arc::new(Topology {
        settings: settings.clone(),
        store: store.clone(),
    });
    Box::pin(async move { Ok(AdminServer::bind(store, admin).await?.with_topology(source)) })
}

/// `/api/topology` of these settings.
struct Topology {
    settings: Settings,
    store: Arc<dyn OutboxStore>,
}

impl postbox_admin::TopologySource for Topology {
    fn topology(&self) -> BoxFuture<'_, Result<serde_json::Value, String>> {
        Box::pin(async move {
            let t = crate::topology::gather(&self.settings, self.store.as_ref())
                .await
                .map_err(|e| e.to_string())?;
            serde_json::to_value(t).map_err(|e| e.to_string())
        })
    }
}

/// Starts the admin server in the background when `[admin]` is set (beside
/// the relay, whose `pulse` its `/healthz` reports); it stops with
/// `shutdown`.
pub async fn spawn_if_configured(
    settings: &Settings,
    store: Arc<dyn OutboxStore>,
    app_codes: Vec<String>,
    pulse: postbox_core::relay::Pulse,
    shutdown: CancellationToken,
) -> Result<Option<JoinHandle<()>>, Error> {
    if settings.admin.is_none() {
        return Ok(None);
    }
    let server = bind(settings, store, app_codes, None)
        .await?
        .with_relay_pulse(pulse);
    Ok(Some(tokio::spawn(async move {
        if let Err(e) = server.run(shutdown).await {
            tracing::error!(error = %e, "admin server stopped");
        }
    })))
}
