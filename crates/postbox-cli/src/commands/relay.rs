//! `postbox relay`: runs until SIGINT or SIGTERM.

use postbox_core::config::Uses;
use postbox_core::relay::CancellationToken;
use postbox_runtime::relay::{RelayOptions, RelayService};
use postbox_runtime::signals::spawn_signal_handler;

use crate::cli::{Global, RelayArgs};
use crate::error::CliError;
use crate::open::load_config;
use crate::{logging, output};

pub async fn run(g: &Global, args: RelayArgs) -> Result<(), CliError> {
    let settings = load_config(
        g,
        Uses {
            publishers: true,
            admin: true,
            consumers: false,
        },
    )?;
    let options = RelayOptions {
        migrate: args.migrate,
        app_codes: args.only.app_codes,
    };
    let spans = postbox_runtime::spans::start(&settings.tracing)?;
    let relay = RelayService::start(&settings, options).await?;
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone(), logging::flush);
    let report = relay.run(shutdown).await;
    if let Some(spans) = spans {
        spans.shutdown().await;
    }
    let report = report?;
    if g.json {
        output::json(&report)?;
    }
    Ok(())
}
