//! `postbox serve`: the admin API, `/metrics` and the dashboard until
//! SIGINT or SIGTERM. `postbox relay` runs the same server beside the relay
//! when `[admin]` is set.

use postbox_core::config::Uses;
use std::sync::Arc;

use postbox_admin::{AdminServer, AdminSettings};
use postbox_core::config::{AdminConfig, Config};
use postbox_core::relay::CancellationToken;
use postbox_core::store::OutboxStore;

use crate::cli::{Global, ServeArgs};
use crate::commands::relay::spawn_signal_handler;
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};

pub async fn run(g: &Global, args: ServeArgs) -> Result<(), CliError> {
    let config = load_config(
        g,
        Uses {
            admin: true,
            ..Uses::DATABASE
        },
    )?;
    config.validate()?;
    let store = open_store(&config).await?;
    require_schema(store.as_ref()).await?;
    let admin = config.admin.clone().unwrap_or_else(default_admin);
    let mut settings = settings(&config, &admin, args.app_codes);
    if let Some(listen) = args.listen {
        settings.listen = listen;
    }
    let server = AdminServer::bind(store, settings).await?;
    let addr = server.local_addr()?;
    crate::logging::notice(&format!(
        "postbox: admin API and dashboard on http://{addr}/"
    ));
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    server.run(shutdown).await?;
    Ok(())
}

/// Starts the admin server in the background when `[admin]` is set (for
/// `postbox relay`); it stops with `shutdown`.
pub async fn spawn_if_configured(
    config: &Config,
    store: Arc<dyn OutboxStore>,
    app_codes: Vec<String>,
    shutdown: CancellationToken,
) -> Result<Option<tokio::task::JoinHandle<()>>, CliError> {
    let Some(admin) = &config.admin else {
        return Ok(None);
    };
    let server = AdminServer::bind(store, settings(config, admin, app_codes)).await?;
    Ok(Some(tokio::spawn(async move {
        if let Err(e) = server.run(shutdown).await {
            tracing::error!(error = %e, "admin server stopped");
        }
    })))
}

fn settings(config: &Config, admin: &AdminConfig, app_codes: Vec<String>) -> AdminSettings {
    let app_codes = if app_codes.is_empty() {
        config.database.app_codes.clone()
    } else {
        app_codes
    };
    AdminSettings::from_config(admin, app_codes).with_publishers(
        config
            .publishers
            .iter()
            .map(|p| p.name().to_owned())
            .collect(),
    )
}

/// `[admin]` absent: the default address and no token (read-only).
fn default_admin() -> AdminConfig {
    AdminConfig {
        listen: "127.0.0.1:9464".to_owned(),
        token: Default::default(),
    }
}
