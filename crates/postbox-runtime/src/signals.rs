//! Shutting down on SIGINT or SIGTERM.

use postbox_core::relay::CancellationToken;
use tokio::signal::unix::{signal, SignalKind};

/// Exit status of a process stopped by a second signal (128 + SIGINT).
pub const SECOND_SIGNAL_EXIT_CODE: i32 = 130;

/// Cancels `token` on the first SIGINT or SIGTERM, so the relay finishes
/// its in-flight publishes and releases the rest; a second signal calls
/// `before_exit` (flush the logs) and exits the process at once with
/// [`SECOND_SIGNAL_EXIT_CODE`] (held leases then expire by themselves).
pub fn spawn_signal_handler(token: CancellationToken, before_exit: fn()) {
    tokio::spawn(async move {
        let mut term = match signal(SignalKind::terminate()) {
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
                before_exit();
                std::process::exit(SECOND_SIGNAL_EXIT_CODE);
            }
        }
    });
}
