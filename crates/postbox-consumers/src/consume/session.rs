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
    // Once a session worked, the setup is right: a refusal later (a
    // cluster's queue whose node is down answers NOT_FOUND, a JetStream
    // between leaders, a Redis replica) is the broker's passing state.
    // It stopped every consumer of the process with exit 2, which the
    // systemd unit does not restart.
    let mut was_up = false;
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
        // Working, not only connected: a session is up before some brokers
        // answer for the setup (Redis reports a missing group at the first
        // read), and that refusal is the config's.
        let refused_before = !was_up;
        was_up |= worked;
        let end = match end {
            SessionEnd::Fatal(e) if !refused_before => {
                let core = consumer.core();
                tracing::error!(
                    consumer = core.config.name(),
                    error = %e,
                    "{} refused the consumer's setup after it had accepted it; trying again as after a lost connection",
                    core.broker
                );
                SessionEnd::Broken(e.to_string())
            }
            end => end,
        };
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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use postbox_core::config::{ConsumerConfig, ConsumerKind};

    use super::*;

    struct Nothing;

    #[async_trait::async_trait]
    impl crate::Handler for Nothing {
        async fn handle(&self, _: &crate::Message) -> Result<crate::Handled, crate::HandlerError> {
            Ok(crate::Handled::Ok)
        }
    }

    /// Sessions that end as scripted (whether it got set up, and how it
    /// ended); once the script is out, it stops the consumer.
    struct Scripted {
        core: Core,
        script: Mutex<VecDeque<(bool, SessionEnd)>>,
        stop: CancellationToken,
    }

    impl Session for Scripted {
        fn core(&self) -> &Core {
            &self.core
        }

        async fn session(&self, run: &mut Run<'_>) -> SessionEnd {
            let next = self.script.lock().unwrap().pop_front();
            let Some((up, end)) = next else {
                self.stop.cancel();
                return SessionEnd::Cancelled;
            };
            if up {
                run.up();
                // It settled a message: a working session.
                run.report.ok += 1;
            }
            end
        }
    }

    fn scripted(script: Vec<(bool, SessionEnd)>) -> (Scripted, CancellationToken) {
        let config: ConsumerConfig = serde_json::from_value(serde_json::json!({
            "kind": "rabbitmq", "url": "amqp://127.0.0.1", "queue": "q",
        }))
        .unwrap();
        let core = Core::new(
            config,
            Arc::new(Nothing),
            ConsumerKind::Rabbitmq,
            "RabbitMQ",
            |c| &c.queue,
        )
        .unwrap();
        let stop = CancellationToken::new();
        (
            Scripted {
                core,
                script: Mutex::new(script.into()),
                stop: stop.clone(),
            },
            stop,
        )
    }

    fn refused() -> SessionEnd {
        SessionEnd::Fatal(Error::config(
            "queue",
            "NOT_FOUND - home node of queue 'q' is down",
        ))
    }

    /// A refusal after the consumer had been set up (a cluster's queue
    /// whose node is down) is tried again; before it ever was, it stops
    /// the consumer (a wrong queue name). The refusal after a working
    /// session stopped every consumer of the process with exit 2.
    #[tokio::test(start_paused = true)]
    async fn only_a_refusal_before_the_first_setup_stops_the_consumer() {
        let (later, stop) = scripted(vec![
            (true, SessionEnd::Broken("connection reset".into())),
            (false, refused()),
            (true, SessionEnd::Broken("connection reset".into())),
        ]);
        let report = run_sessions(&later, stop).await;
        assert!(report.is_ok(), "{report:?}");
        assert!(later.script.lock().unwrap().is_empty(), "every session ran");

        let (first, stop) = scripted(vec![(false, refused()), (true, SessionEnd::Cancelled)]);
        let report = run_sessions(&first, stop).await;
        assert!(matches!(report, Err(Error::Config { .. })), "{report:?}");
    }
}
