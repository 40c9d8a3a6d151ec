//! The reconnect loop every consumer shares: run a session (connect, set up,
//! consume) until shutdown; when the connection breaks, pause (0.5 s doubling
//! to 30 s) and start another. The pause starts over after a session that
//! got connected and then settled a message for good (handled, skipped or
//! dead-lettered) or lasted [`STEADY`]: one that breaks on the same message
//! each time (a dead copy the broker refuses: `<queue>.dead` full with
//! `overflow = reject-publish`; the message goes round through
//! `<queue>.retry` in between) backs off like a broker that cannot be
//! reached, instead of reconnecting about once a second for as long as the
//! message stays.

use std::future::Future;
use std::time::Duration;

use postbox_core::Error;
use tokio_util::sync::CancellationToken;

use super::state::ConsumerState;
use super::{ConsumeReport, Core};

/// A connected session that lasted this long counts as a working one,
/// even if it settled nothing (an idle queue).
const STEADY: Duration = Duration::from_secs(30);

/// How one session ended.
pub(crate) enum SessionEnd {
    /// Shutdown was asked for and done.
    Cancelled,
    /// The broker refused the setup (missing queue or stream, mismatched
    /// arguments, access): retrying cannot help.
    Fatal(Error),
    /// The connection or channel broke: reconnect.
    Broken(String),
}

/// What a session works with.
pub(crate) struct Run<'a> {
    /// Cancelled when the consumer is to stop.
    pub shutdown: &'a CancellationToken,
    /// What the consumer did, across its sessions.
    pub report: &'a mut ConsumeReport,
    /// Set by the session once the broker accepted the setup
    /// ([`Run::up`]).
    pub connected: bool,
    /// The consumer's live state (connected, paused).
    pub state: &'a ConsumerState,
}

impl Run<'_> {
    /// The broker accepted the setup: the session is consuming.
    pub fn up(&mut self) {
        self.connected = true;
        self.state.set_connected(true);
    }
}

/// One broker connection's worth of consuming.
pub(crate) trait Session: Sync {
    /// The consumer's core (its config and broker for log lines).
    fn core(&self) -> &Core;

    /// Connects, sets up and consumes until shutdown or a broken connection;
    /// sets `run.connected` once the broker accepted the setup.
    fn session(&self, run: &mut Run<'_>) -> impl Future<Output = SessionEnd> + Send;
}

/// Runs sessions of `consumer` until `shutdown` or a fatal setup error.
pub(crate) async fn run_sessions<S: Session>(
    consumer: &S,
    shutdown: CancellationToken,
) -> Result<ConsumeReport, Error> {
    let mut report = ConsumeReport::default();
    let mut pause = Duration::from_millis(500);
    loop {
        if shutdown.is_cancelled() {
            return Ok(report);
        }
        let state = consumer.core().state.clone();
        let done = report.done();
        let started = std::time::Instant::now();
        let mut run = Run {
            shutdown: &shutdown,
            report: &mut report,
            connected: false,
            state: &state,
        };
        let end = consumer.session(&mut run).await;
        let connected = run.connected;
        let worked = connected && (report.done() > done || started.elapsed() >= STEADY);
        state.set_connected(false);
        match end {
            SessionEnd::Cancelled => return Ok(report),
            SessionEnd::Fatal(e) => return Err(e),
            SessionEnd::Broken(reason) => {
                if worked {
                    pause = Duration::from_millis(500);
                }
                let core = consumer.core();
                tracing::warn!(
                    consumer = core.config.name(),
                    url = %core.config.url,
                    reason,
                    retry_in_ms = pause.as_millis() as u64,
                    "{} connection lost; reconnecting",
                    core.broker
                );
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(report),
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(30));
            }
        }
    }
}
