//! The one ack / retry / dead path of every consumer.
//!
//! [`process`] takes one message from its broker's hands to the end:
//!
//! ```text
//! unreadable ─────────────────────────────────────────────► dead
//! readable ─► Transport::verdict ─► Handle ─► handler ─► Ok(h) ──► ack        (ok / duplicate / stale)
//!                │                                    ├► Err(permanent) ──────────► dead   (dead)
//!                │                                    └► Err ──┐
//!                ├─ Failed (an attempt was lost) ──────────────┴► RetryPolicy::decide
//!                │                                                 ├► retry after delay   (retry)
//!                │                                                 └► dead                (dead)
//!                ├─ Dead (no attempts left) ───────────────────────► dead                 (dead)
//!                ├─ HeldBack (ordering) ─────► retry, same attempt                        (retry, held)
//!                └─ Skip (another consumer owns it now)
//! ```
//!
//! A handler that panics has failed that attempt like one that returned an
//! error (`handler panicked: <message>`, [`Contained`]): the message takes
//! the retry path and the consumer goes on.
//!
//! The decision, the metric, the log line and the report are written here
//! once; a broker implements only the [`Transport`] actions, each of which
//! says whether it settled the message ([`Settled::Done`], counted) or left
//! it to the broker or another consumer ([`Settled::NotHere`], not counted;
//! the transport logged why).

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt as _;
use opentelemetry::context::FutureExt as _;
use opentelemetry::Context;
use tracing::Instrument;

use super::spans;
use super::state::ConsumerState;
use super::{ConsumeReport, Core, Counted};
use crate::{Handled, Handler, HandlerError, Message, RetryDecision, RetryPolicy};

/// Whether a transport action settled the message here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// The broker confirmed: the message is settled and counted.
    Done,
    /// Not settled by this consumer: another consumer owns the message now,
    /// or its dead copy could not be stored and the broker brings it back.
    /// The transport logged why; nothing is counted.
    NotHere,
}

/// What to do with a readable message before (or instead of) handling it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Run the handler.
    Handle,
    /// Attempt `attempt` failed without running the handler now (the broker
    /// redelivered a message whose consumer stopped, or a check failed): the
    /// retry decision takes it from there.
    Failed { attempt: u32, error: String },
    /// Dead-letter it without handling: it had all its attempts.
    Dead { attempt: u32, reason: String },
    /// It waits behind `blocker`, an earlier event of its aggregate in
    /// retry: delivered again after `delay` as the same attempt (being held
    /// back is not a failure).
    HeldBack { blocker: String, delay: Duration },
    /// Not this consumer's to settle (the transport logged why).
    Skip,
}

/// A handler's result, or `None` when the message is no longer this
/// consumer's (another consumer owns it now; logged): nothing to settle.
pub(crate) type Handling = Option<Result<Handled, HandlerError>>;

/// What a dead copy says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeadCopy<'a> {
    /// The message, when it was readable.
    pub message: Option<&'a Message>,
    /// The attempt that failed last.
    pub attempt: u32,
    /// Why (the handler's last error, or why the message was unreadable).
    pub last_error: &'a str,
}

/// A broker's actions on the one message in hand. Errors are a broken
/// connection or channel: the message stays unsettled and the broker
/// delivers it again.
pub(crate) trait Transport {
    /// Looks at a readable message before it is handled.
    async fn verdict(&mut self, _message: &Message) -> Verdict {
        Verdict::Handle
    }

    /// Runs `handler` on `message`, keeping the broker from handing the
    /// message to another consumer meanwhile (progress signals).
    async fn handle(&mut self, handler: &dyn Handler, message: &Message) -> Handling {
        Some(handler.handle(message).await)
    }

    /// Acknowledges the message after its handler succeeded.
    async fn ack(&mut self) -> Result<Settled, String>;

    /// Has the message delivered again after `delay`, as attempt
    /// `next_attempt`, and settles the original.
    async fn retry(&mut self, delay: Duration, next_attempt: u32) -> Result<Settled, String>;

    /// Stores a dead copy and settles the original only once the broker
    /// confirmed the copy.
    async fn dead(&mut self, copy: DeadCopy<'_>) -> Result<Settled, String>;

    /// Where dead copies go, for log lines.
    fn dead_letters(&self) -> String;
}

/// One consumer's side of settling: its name, its retry policy, its report.
pub(crate) struct Settler<'a> {
    pub consumer: &'a str,
    pub policy: &'a RetryPolicy,
    pub report: &'a mut ConsumeReport,
    /// The live counts (`/api/consumers`), `None` in tests.
    pub state: Option<&'a ConsumerState>,
}

impl Settler<'_> {
    /// Counts one settled message in the report, the metric and the live
    /// state.
    fn count(&mut self, what: Counted) {
        self.report.count(self.consumer, what);
        if let Some(state) = self.state {
            state.count(what);
        }
    }

    /// Takes one message to the end: `read` is the message (or why it is
    /// unreadable), `delivered` the attempt number the broker gives even an
    /// unreadable message.
    pub(crate) async fn process<T: Transport>(
        &mut self,
        handler: &dyn Handler,
        transport: &mut T,
        read: Result<Message, String>,
        delivered: u32,
    ) -> Result<(), String> {
        let message = match read {
            Ok(m) => m,
            Err(reason) => {
                tracing::warn!(
                    consumer = self.consumer,
                    reason,
                    "unreadable message: dead-lettered"
                );
                return self.dead(transport, None, delivered, &reason).await;
            }
        };
        let span =
            tracing::info_span!("event", event_id = %message.event_id(), attempt = message.attempt);
        let consume = spans::consume(self.consumer, &message);
        let settled = (self.settle(handler, transport, &message, consume.as_ref()))
            .instrument(span)
            .await;
        if let Some(cx) = &consume {
            spans::end(cx, settled.as_ref().err().map(String::as_str));
        }
        settled
    }

    /// `consume`: the message's `consume` span, when it is traced.
    async fn settle<T: Transport>(
        &mut self,
        handler: &dyn Handler,
        transport: &mut T,
        message: &Message,
        consume: Option<&Context>,
    ) -> Result<(), String> {
        match transport.verdict(message).await {
            Verdict::Handle => {}
            Verdict::Failed { attempt, error } => {
                if self.handled_before(handler, transport, message).await? {
                    return Ok(());
                }
                return self.failed(transport, message, attempt, &error).await;
            }
            Verdict::Dead { attempt, reason } => {
                if self.handled_before(handler, transport, message).await? {
                    return Ok(());
                }
                return self.dead(transport, Some(message), attempt, &reason).await;
            }
            Verdict::HeldBack { blocker, delay } => {
                if transport.retry(delay, message.attempt).await? == Settled::Done {
                    self.count(Counted::Held);
                    tracing::info!(
                        consumer = self.consumer,
                        blocker,
                        retry_in_ms = delay.as_millis() as u64,
                        "held back behind an earlier event of its aggregate waiting in retry"
                    );
                }
                return Ok(());
            }
            Verdict::Skip => return Ok(()),
        }
        let started = std::time::Instant::now();
        let handler = &Contained(handler);
        let handling = match consume {
            None => transport.handle(handler, message).await,
            Some(consume) => {
                let cx = spans::handler(consume);
                let handling = (transport.handle(handler, message))
                    .with_context(cx.clone())
                    .await;
                let error = match &handling {
                    Some(Err(e)) => Some(e.message()),
                    _ => None,
                };
                spans::end(&cx, error);
                handling
            }
        };
        if handling.is_some() {
            crate::metrics::handler_took(self.consumer, started.elapsed());
        }
        match handling {
            None => Ok(()),
            Some(Ok(handled)) => {
                if transport.ack().await? == Settled::Done {
                    self.count(Counted::Handled(handled));
                    tracing::debug!(
                        consumer = self.consumer,
                        result = handled.as_str(),
                        "handled"
                    );
                }
                Ok(())
            }
            Some(Err(e)) if e.is_permanent() => {
                // The handler says no retry can mend it.
                self.dead(transport, Some(message), message.attempt, e.message())
                    .await
            }
            Some(Err(e)) => {
                self.failed(transport, message, message.attempt, e.message())
                    .await
            }
        }
    }

    /// A message back without a result (its consumer stopped mid-message,
    /// or its ack was lost) whose effect the handler has recorded (an
    /// inbox): acknowledged as a duplicate, where it would be retried or,
    /// on its last attempt, dead-lettered although handled. `true` when so.
    /// A failure to ask is logged, and the message goes on as unhandled.
    async fn handled_before<T: Transport>(
        &mut self,
        handler: &dyn Handler,
        transport: &mut T,
        message: &Message,
    ) -> Result<bool, String> {
        match handler.handled_before(message).await {
            Ok(true) => {}
            Ok(false) => return Ok(false),
            Err(e) => {
                tracing::warn!(
                    consumer = self.consumer,
                    error = %e,
                    "could not ask the inbox whether the message came back handled; taken as unhandled"
                );
                return Ok(false);
            }
        }
        if transport.ack().await? == Settled::Done {
            self.count(Counted::Handled(Handled::Duplicate));
            tracing::info!(
                consumer = self.consumer,
                "came back without a result, but its handler had recorded it (its ack was lost): acknowledged as a duplicate"
            );
        }
        Ok(true)
    }

    /// Attempt `attempt` failed with `error`: retried after a delay, or
    /// dead-lettered on the last attempt.
    async fn failed<T: Transport>(
        &mut self,
        transport: &mut T,
        message: &Message,
        attempt: u32,
        error: &str,
    ) -> Result<(), String> {
        match self.policy.decide(attempt) {
            RetryDecision::Retry {
                delay,
                next_attempt,
            } => {
                if transport.retry(delay, next_attempt).await? == Settled::Done {
                    self.count(Counted::Retry);
                    tracing::warn!(
                        consumer = self.consumer,
                        error,
                        retry_in_ms = delay.as_millis() as u64,
                        next_attempt,
                        "attempt failed; retrying later"
                    );
                }
                Ok(())
            }
            RetryDecision::Dead => self.dead(transport, Some(message), attempt, error).await,
        }
    }

    async fn dead<T: Transport>(
        &mut self,
        transport: &mut T,
        message: Option<&Message>,
        attempt: u32,
        error: &str,
    ) -> Result<(), String> {
        let copy = DeadCopy {
            message,
            attempt,
            last_error: error,
        };
        if transport.dead(copy).await? == Settled::Done {
            self.count(Counted::Dead);
            tracing::error!(
                consumer = self.consumer,
                error,
                attempt,
                dead_letters = %transport.dead_letters(),
                "dead-lettered"
            );
        }
        Ok(())
    }
}

/// A handler whose panics are contained: a panic fails the attempt with
/// `handler panicked: <message>` (retried, then dead-lettered), where it
/// would otherwise end the consumer's task mid-message (the broker
/// redelivers the message, which panics the next consumer in turn) and,
/// under `postbox consume`, stop every other consumer of the process.
///
/// Inside the transport's `handle`, so a transport's progress signals and
/// keep-alives around the handler go on as for any other failure.
struct Contained<'a>(&'a dyn Handler);

#[async_trait]
impl Handler for Contained<'_> {
    async fn handle(&self, message: &Message) -> Result<Handled, HandlerError> {
        // Unwind safety: what the unwound future leaves behind is the
        // handler's own state, which after a panic is no worse than after an
        // error it returned midway (an inbox handler's transaction is rolled
        // back as it is dropped); the consumer's state is not touched in
        // there.
        AssertUnwindSafe(self.0.handle(message))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                Err(HandlerError::new(format!(
                    "handler panicked: {}",
                    panic_message(panic.as_ref())
                )))
            })
    }
}

/// What a panic said: its `&str` or `String` payload (what `panic!` gives).
fn panic_message(panic: &(dyn Any + Send)) -> &str {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s,
        (_, Some(s)) => s,
        _ => "(a payload that is not text)",
    }
}

impl Core {
    /// Takes one message to the end through `transport` (see
    /// [`Settler::process`]), counting it in `report`.
    pub(crate) async fn settle<T: Transport>(
        &self,
        report: &mut ConsumeReport,
        transport: &mut T,
        read: Result<Message, String>,
        delivered: u32,
    ) -> Result<(), String> {
        Settler {
            consumer: self.config.name(),
            policy: &self.policy,
            report,
            state: Some(&self.state),
        }
        .process(self.handler.as_ref(), transport, read, delivered)
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use async_trait::async_trait;
    use postbox_core::envelope::Envelope;

    use super::*;

    /// Records the transport actions asked for.
    #[derive(Default)]
    struct Recorder {
        verdict: Option<Verdict>,
        actions: Vec<String>,
        refuse_dead: bool,
    }

    impl Transport for Recorder {
        async fn verdict(&mut self, _message: &Message) -> Verdict {
            self.verdict.take().unwrap_or(Verdict::Handle)
        }
        async fn ack(&mut self) -> Result<Settled, String> {
            self.actions.push("ack".into());
            Ok(Settled::Done)
        }
        async fn retry(&mut self, delay: Duration, next: u32) -> Result<Settled, String> {
            self.actions
                .push(format!("retry {}ms as {next}", delay.as_millis()));
            Ok(Settled::Done)
        }
        async fn dead(&mut self, copy: DeadCopy<'_>) -> Result<Settled, String> {
            self.actions.push(format!(
                "dead {} {} {}",
                copy.message.map_or("-", |m| m.event_id()),
                copy.attempt,
                copy.last_error
            ));
            Ok(if self.refuse_dead {
                Settled::NotHere
            } else {
                Settled::Done
            })
        }
        fn dead_letters(&self) -> String {
            "q.dead".into()
        }
    }

    struct Answer(Mutex<Option<Result<Handled, HandlerError>>>);

    #[async_trait]
    impl Handler for Answer {
        async fn handle(&self, _: &Message) -> Result<Handled, HandlerError> {
            self.0.lock().unwrap().take().unwrap()
        }
    }

    fn message(attempt: u32) -> Message {
        Message {
            envelope: Envelope {
                event_id: "e1".into(),
                app_code: "a".into(),
                event_type: "T".into(),
                aggregate_id: None,
                aggregate_version: None,
                created_at_ms: 0,
                headers: Default::default(),
                payload: Envelope::payload_of("{}"),
            },
            attempt,
            redelivered: false,
        }
    }

    const POLICY: RetryPolicy = RetryPolicy {
        max_attempts: 3,
        retry_delay: Duration::from_millis(100),
        max_retry_delay: Duration::from_secs(1),
    };

    async fn run(
        t: &mut Recorder,
        read: Result<Message, String>,
        answer: Result<Handled, HandlerError>,
    ) -> ConsumeReport {
        settle_with(&Answer(Mutex::new(Some(answer))), t, read, 1).await
    }

    /// Takes `read` to the end through `t` with `handler`; the report.
    async fn settle_with(
        handler: &dyn Handler,
        t: &mut Recorder,
        read: Result<Message, String>,
        delivered: u32,
    ) -> ConsumeReport {
        let mut report = ConsumeReport::default();
        Settler {
            consumer: "c",
            policy: &POLICY,
            report: &mut report,
            state: None,
        }
        .process(handler, t, read, delivered)
        .await
        .unwrap();
        report
    }

    #[tokio::test]
    async fn success_acks_and_counts_the_handler_s_result() {
        let mut t = Recorder::default();
        let r = run(&mut t, Ok(message(1)), Ok(Handled::Duplicate)).await;
        assert_eq!(t.actions, ["ack"]);
        assert_eq!(r.duplicate, 1);
    }

    #[tokio::test]
    async fn failure_retries_with_a_growing_delay_then_dead_letters() {
        let mut t = Recorder::default();
        let r = run(&mut t, Ok(message(2)), Err(HandlerError::new("boom"))).await;
        assert_eq!(t.actions, ["retry 200ms as 3"]);
        assert_eq!(r.retry, 1);
        let mut t = Recorder::default();
        let r = run(&mut t, Ok(message(3)), Err(HandlerError::new("boom"))).await;
        assert_eq!(t.actions, ["dead e1 3 boom"]);
        assert_eq!(r.dead, 1);
    }

    /// A handler that says no retry can mend a message sends it to the
    /// dead letters on its first attempt.
    #[tokio::test]
    async fn a_permanent_failure_is_dead_lettered_at_once() {
        let mut t = Recorder::default();
        let r = run(
            &mut t,
            Ok(message(1)),
            Err(HandlerError::permanent("422 no such room")),
        )
        .await;
        assert_eq!(t.actions, ["dead e1 1 422 no such room"]);
        assert_eq!((r.dead, r.retry), (1, 0));
    }

    #[tokio::test]
    async fn unreadable_messages_are_dead_lettered_unhandled() {
        let mut t = Recorder::default();
        let r = run(&mut t, Err("no id".into()), Ok(Handled::Ok)).await;
        assert_eq!(t.actions, ["dead - 1 no id"]);
        assert_eq!(r.dead, 1);
    }

    #[tokio::test]
    async fn verdicts_skip_the_handler() {
        let mut t = Recorder {
            verdict: Some(Verdict::HeldBack {
                blocker: "e0".into(),
                delay: Duration::from_millis(100),
            }),
            ..Recorder::default()
        };
        let r = run(&mut t, Ok(message(1)), Ok(Handled::Ok)).await;
        assert_eq!(t.actions, ["retry 100ms as 1"]);
        assert_eq!((r.held, r.retry, r.ok), (1, 0, 0));

        let mut t = Recorder {
            verdict: Some(Verdict::Failed {
                attempt: 3,
                error: "lost".into(),
            }),
            ..Recorder::default()
        };
        run(&mut t, Ok(message(1)), Ok(Handled::Ok)).await;
        assert_eq!(t.actions, ["dead e1 3 lost"]);

        let mut t = Recorder {
            verdict: Some(Verdict::Skip),
            ..Recorder::default()
        };
        let r = run(&mut t, Ok(message(1)), Ok(Handled::Ok)).await;
        assert!(t.actions.is_empty());
        assert_eq!(r, ConsumeReport::default());
    }

    /// A handler whose inbox has recorded every message.
    struct Recorded;

    #[async_trait]
    impl Handler for Recorded {
        async fn handle(&self, _: &Message) -> Result<Handled, HandlerError> {
            panic!("a recorded message is not handled again");
        }
        async fn handled_before(&self, _: &Message) -> Result<bool, HandlerError> {
            Ok(true)
        }
    }

    /// A message back without a result after its attempts ran out (its ack
    /// was lost after the handler's writes committed) is acknowledged as a
    /// duplicate when the inbox has it, not dead-lettered; one with attempts
    /// left is acknowledged too, not retried.
    #[tokio::test]
    async fn a_message_back_unacknowledged_that_the_inbox_has_is_a_duplicate() {
        let verdicts = [
            Verdict::Dead {
                attempt: 4,
                reason: "delivered 4 times without a result".into(),
            },
            Verdict::Failed {
                attempt: 3,
                error: "redelivered unacknowledged".into(),
            },
            Verdict::Failed {
                attempt: 1,
                error: "redelivered unacknowledged".into(),
            },
        ];
        for verdict in verdicts {
            let mut t = Recorder {
                verdict: Some(verdict),
                ..Recorder::default()
            };
            let report = settle_with(&Recorded, &mut t, Ok(message(3)), 3).await;
            assert_eq!(t.actions, ["ack"]);
            assert_eq!((report.duplicate, report.dead, report.retry), (1, 0, 0));
        }
    }

    /// Panics instead of answering.
    struct Panics;

    #[async_trait]
    impl Handler for Panics {
        async fn handle(&self, m: &Message) -> Result<Handled, HandlerError> {
            panic!("no room for {}", m.event_id());
        }
    }

    /// A handler that panics has failed that attempt: the message takes the
    /// retry path (then the dead letters) with the panic as its error, and
    /// the consumer is still there for the next message.
    #[tokio::test]
    async fn a_panicking_handler_fails_the_attempt() {
        let settle = async |t: &mut Recorder, attempt: u32| {
            settle_with(&Panics, t, Ok(message(attempt)), attempt).await
        };
        let mut t = Recorder::default();
        let r = settle(&mut t, 1).await;
        assert_eq!(t.actions, ["retry 100ms as 2"]);
        assert_eq!(r.retry, 1);
        let mut t = Recorder::default();
        let r = settle(&mut t, 3).await;
        assert_eq!(t.actions, ["dead e1 3 handler panicked: no room for e1"]);
        assert_eq!(r.dead, 1);
    }

    #[tokio::test]
    async fn a_dead_copy_not_stored_here_is_not_counted() {
        let mut t = Recorder {
            refuse_dead: true,
            ..Recorder::default()
        };
        let r = run(&mut t, Ok(message(3)), Err(HandlerError::new("boom"))).await;
        assert_eq!(t.actions, ["dead e1 3 boom"]);
        assert_eq!(r.dead, 0);
    }
}
