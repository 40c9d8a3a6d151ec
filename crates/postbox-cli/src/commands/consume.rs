//! `postbox consume`: runs every `[[consumers]]` entry until SIGINT/SIGTERM,
//! bridging each queue to its HTTP handler.

use postbox_core::relay::CancellationToken;
use postbox_runtime::signals::spawn_signal_handler;

use crate::cli::Global;
use crate::error::CliError;
use crate::logging;
use crate::open::{load_config, CONSUME};

pub async fn run(g: &Global) -> Result<(), CliError> {
    let settings = load_config(g, CONSUME)?;
    let spans = postbox_runtime::spans::start(&settings.tracing)?;
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone(), logging::flush);
    let ran = postbox_runtime::consumers::run(&settings, shutdown).await;
    if let Some(spans) = spans {
        spans.shutdown().await;
    }
    Ok(ran?)
}
