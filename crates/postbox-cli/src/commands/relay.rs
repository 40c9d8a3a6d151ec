//! `postbox relay`: runs until SIGINT or SIGTERM.

use postbox_core::config::Uses;
use postbox_core::relay::{CancellationToken, Relay};

use crate::cli::{Global, RelayArgs};
use crate::error::CliError;
use crate::open::{load_config, open_store, open_store_creating, require_schema};
use crate::output;

pub async fn run(g: &Global, args: RelayArgs) -> Result<(), CliError> {
    let config = load_config(
        g,
        Uses {
            publishers: true,
            admin: true,
            consumers: false,
        },
    )?;
    config.validate_for_relay()?;
    if !config.outbox_worker.enabled {
        return Err(CliError::usage(
            "config key `outbox_worker.enabled` is false; nothing to run",
        ));
    }
    let store = if args.migrate {
        open_store_creating(&config).await?
    } else {
        open_store(&config).await?
    };
    if args.migrate {
        store.migrate().await?;
    }
    require_schema(store.as_ref()).await?;
    let publishers = postbox_publishers::build_all(&config.publishers).await?;
    let app_codes = if args.app_codes.is_empty() {
        config.database.app_codes.clone()
    } else {
        args.app_codes
    };

    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let admin = crate::commands::serve::spawn_if_configured(
        &config,
        store.clone(),
        app_codes.clone(),
        shutdown.clone(),
    )
    .await?;
    let archiver = config.archive.enabled.then(|| {
        tokio::spawn(postbox_core::archive::run_scheduled(
            store.clone(),
            config.archive.clone(),
            app_codes.clone(),
            shutdown.clone(),
        ))
    });
    let relay = Relay::new(store, publishers, config.outbox_worker.clone(), app_codes)
        .with_max_payload_bytes(config.database.max_payload_bytes);
    let report = relay.run(shutdown.clone()).await;
    // The relay stops only on shutdown or error; the admin server and the
    // archiver stop with it.
    shutdown.cancel();
    if let Some(task) = archiver {
        let _ = task.await;
    }
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    let report = report?;
    if g.json {
        output::json(&report)?;
    }
    Ok(())
}

/// Cancels `token` on the first SIGINT or SIGTERM; a second one exits at once.
pub fn spawn_signal_handler(token: CancellationToken) {
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    return;
                }
            };
        for round in 0..2 {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            if round == 0 {
                tracing::info!("shutting down: finishing in-flight publishes, releasing the rest (signal again to exit now)");
                token.cancel();
            } else {
                tracing::warn!("second signal: exiting now; held leases expire by themselves");
                crate::logging::flush();
                std::process::exit(130);
            }
        }
    });
}
