//! The reconnect loop every consumer shares: run a session (connect, set up,
//! consume) until shutdown; when the connection breaks, pause (0.5 s doubling
//! to 30 s, reset after a session that got connected) and start another.

use std::time::Duration;

use async_trait::async_trait;
use postbox_core::config::ConsumerConfig;
use postbox_core::Error;
use tokio_util::sync::CancellationToken;

use super::ConsumeReport;

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

/// One broker connection's worth of consuming.
#[async_trait]
pub(crate) trait Session: Sync {
    /// The broker's name in log lines ("RabbitMQ", "NATS", "Redis").
    const BROKER: &'static str;

    /// The consumer's config (name and URL for log lines).
    fn config(&self) -> &ConsumerConfig;

    /// Connects, sets up and consumes until shutdown or a broken connection;
    /// sets `connected` once the broker accepted the setup.
    async fn session(
        &self,
        shutdown: &CancellationToken,
        report: &mut ConsumeReport,
        connected: &mut bool,
    ) -> SessionEnd;
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
        let mut connected = false;
        match consumer
            .session(&shutdown, &mut report, &mut connected)
            .await
        {
            SessionEnd::Cancelled => return Ok(report),
            SessionEnd::Fatal(e) => return Err(e),
            SessionEnd::Broken(reason) => {
                if connected {
                    pause = Duration::from_millis(500);
                }
                tracing::warn!(
                    consumer = consumer.config().name(),
                    url = %consumer.config().url,
                    reason,
                    retry_in_ms = pause.as_millis() as u64,
                    "{} connection lost; reconnecting",
                    S::BROKER
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
