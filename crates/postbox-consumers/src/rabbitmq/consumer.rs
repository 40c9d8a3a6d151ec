//! The consume loop: one message at a time per channel, ack after success,
//! retry and dead copies confirmed before the original is acked, reconnect
//! with backoff.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use postbox_core::config::{ConsumerConfig, ConsumerKind, Ordering};
use postbox_core::{BoxFuture, Error};
use tokio_util::sync::CancellationToken;

use super::message::{
    confirmed, copy_properties, delivery_count, message_from_delivery, noted_hold,
};
use super::topology::{check_topology, dead_queue, declare_topology, retry_queue, TopologyError};
use super::{lost, unless_lost};
use crate::consume::session::{run_sessions, Run, Session, SessionEnd};
use crate::consume::settle::{DeadCopy, Settled, Transport, Verdict};
use crate::consume::{consumer_basics, ConsumeReport, Core};
use crate::ordering::{wait_for, AggregateHolds, Hold, Wait};
use crate::{Handler, Message};

/// A RabbitMQ consumer driving one [`Handler`].
///
/// Its tag is its consumer tag (default `{queue}-{host}-{pid}`, with the
/// config's `name` after the queue when it is another), also its
/// AMQP connection name.
pub struct RabbitMqConsumer {
    core: Core,
    holds: Option<Arc<dyn AggregateHolds>>,
    /// Added to a hold's lapse time beyond the longest wait in
    /// `<queue>.retry` ([`HOLD_GRACE`] unless set).
    hold_grace: Duration,
    /// The node the next session tries first: the one after the node the
    /// last session lost.
    next_node: std::sync::atomic::AtomicUsize,
}

consumer_basics!(RabbitMqConsumer, ("queue", None, "tag"));

impl RabbitMqConsumer {
    /// A consumer of `config` (a `kind = "rabbitmq"` entry) calling `handler`
    /// for every message.
    pub fn new(config: ConsumerConfig, handler: Arc<dyn Handler>) -> Result<Self, Error> {
        Ok(RabbitMqConsumer {
            core: Core::new(config, handler, ConsumerKind::Rabbitmq, "RabbitMQ", |c| {
                &c.queue
            })?,
            holds: None,
            hold_grace: HOLD_GRACE,
            next_node: Default::default(),
        })
    }

    /// Where `ordering = "per_aggregate"` keeps its holds (required with
    /// that setting): [`crate::ordering::Holds::of`] the consumer's inbox.
    pub fn with_holds(mut self, holds: Arc<dyn AggregateHolds>) -> Self {
        self.holds = Some(holds);
        self
    }

    /// Replaces [`HOLD_GRACE`] (one minute), what a hold's lapse time adds
    /// to the longest its event's copy can wait in `<queue>.retry`. A later
    /// version that finds the hold lapsed starts checking whether the held
    /// event is gone ([`crate::ordering`]): too short a grace starts that
    /// check before the copy left `<queue>.retry`, too long one holds an
    /// aggregate whose event is gone back longer.
    pub fn with_hold_grace(mut self, grace: Duration) -> Self {
        self.hold_grace = grace;
        self
    }

    /// Consumes until `shutdown` is cancelled, then stops taking messages,
    /// finishes (and acknowledges) the one in hand and returns. A broken
    /// connection is re-established with a growing pause (0.5 s to 30 s);
    /// messages it held unacknowledged are redelivered by the broker.
    pub fn run(&self, shutdown: CancellationToken) -> BoxFuture<'_, Result<ConsumeReport, Error>> {
        if self.core.config.ordering == Ordering::PerAggregate && self.holds.is_none() {
            return Box::pin(std::future::ready(Err(Error::config(
                "ordering",
                "`per_aggregate` needs the holds of an inbox: call with_holds(Holds::of(&inbox))",
            ))));
        }
        Box::pin(run_sessions(self, shutdown))
    }

    /// Handles one delivery to the end: acked, or copied and then acked. An
    /// error leaves it unacked (the broker redelivers it after reconnect).
    async fn process(
        &self,
        delivery: Delivery,
        connection: &Connection,
        publishing: &Channel,
        shutdown: &CancellationToken,
        report: &mut ConsumeReport,
    ) -> Result<(), String> {
        let read = message_from_delivery(
            &delivery.properties,
            delivery.routing_key.as_str(),
            &delivery.data,
            delivery.redelivered,
        );
        let mut in_hand = InHand {
            consumer: self,
            delivery: &delivery,
            connection,
            publishing,
            shutdown,
            ordered: None,
            noted: None,
        };
        self.core.settle(report, &mut in_hand, read, 1).await
    }

    /// `message` under `ordering = "per_aggregate"`, when it has an
    /// aggregate and a version.
    fn ordered(&self, message: &Message) -> Option<Ordered<'_>> {
        let holds = self.holds.as_deref()?;
        if self.core.config.ordering != Ordering::PerAggregate {
            return None;
        }
        let env = &message.envelope;
        Some(Ordered {
            holds,
            group: self.core.config.consumer_group(),
            aggregate_id: env.aggregate_id.clone()?,
            version: env.aggregate_version?,
            event_id: env.event_id.clone(),
        })
    }

    /// When a hold taken for a retry copy waiting `delay` lapses: by then
    /// the copy has surely left `<queue>.retry` for `<queue>` (it waits at
    /// most `max_retry_delay` behind copies with longer delays). A lapse
    /// only makes a later version check whether the copy is gone
    /// ([`crate::ordering`]), it never lets it through.
    fn hold_lapse(&self, delay: Duration) -> Duration {
        delay + self.core.policy.max_retry_delay + self.hold_grace
    }
}

/// The delivery in hand and what settles it: acks on the consuming
/// channel, retry and dead copies on the confirming channel, and the
/// aggregate's hold under per-aggregate ordering.
struct InHand<'a> {
    consumer: &'a RabbitMqConsumer,
    delivery: &'a Delivery,
    /// Every wait on the broker ends when it is lost ([`unless_lost`]).
    connection: &'a Connection,
    publishing: &'a Channel,
    /// A wait for a confirm ends [`CLOSE_TIMEOUT`] after the consumer was
    /// asked to stop.
    shutdown: &'a CancellationToken,
    ordered: Option<Ordered<'a>>,
    /// The lapsed hold a held-back copy of it goes round the queue behind,
    /// noted on the copy ([`crate::ordering`]).
    noted: Option<Hold>,
}

impl Transport for InHand<'_> {
    async fn verdict(&mut self, message: &Message) -> Verdict {
        self.ordered = self.consumer.ordered(message);
        if self.delivery.redelivered {
            // The broker gave it back unacknowledged: the consumer that had
            // it stopped (crash, OOM kill, lost connection) before its
            // ack. That was an attempt; counting it through a fresh copy is
            // the only way the count survives the next crash, so a message
            // that kills its consumer reaches `.dead` instead of looping.
            let lost = delivery_count(&self.delivery.properties).max(1);
            let failed = message.attempt.saturating_add(lost - 1);
            return Verdict::Failed {
                attempt: failed,
                error: format!(
                    "redelivered unacknowledged: the consumer handling attempt {failed} stopped before its ack (crash, kill or lost connection)"
                ),
            };
        }
        let Some(ordered) = &self.ordered else {
            return Verdict::Handle;
        };
        let noted = noted_hold(&self.delivery.properties);
        loop {
            let hold = match ordered.blocker().await {
                Ok(None) => return Verdict::Handle,
                Ok(Some(hold)) => hold,
                Err(e) => {
                    return Verdict::Failed {
                        attempt: message.attempt,
                        error: format!("per-aggregate ordering check: {e}"),
                    }
                }
            };
            match wait_for(&hold, postbox_core::time::now_ms(), noted.as_ref()) {
                Wait::Behind => {}
                Wait::Check => {
                    tracing::info!(
                        consumer = self.consumer.core.config.name(),
                        blocker = %hold.event_id,
                        "the hold of an earlier event of its aggregate lapsed: going round the queue once more behind it, to see whether it comes back"
                    );
                    self.noted = Some(hold.clone());
                }
                Wait::Gone => {
                    match ordered.drop_gone(&hold).await {
                        Ok(true) => tracing::warn!(
                            consumer = self.consumer.core.config.name(),
                            blocker = %hold.event_id,
                            aggregate_id = %ordered.aggregate_id,
                            "an earlier event of its aggregate did not come back while this one went round the queue behind its lapsed hold: it is gone (purged or moved outside postbox?); its hold is dropped and later versions go on"
                        ),
                        // Released or moved meanwhile: read it again.
                        Ok(false) => {}
                        Err(e) => {
                            return Verdict::Failed {
                                attempt: message.attempt,
                                error: format!("per-aggregate ordering check: {e}"),
                            }
                        }
                    }
                    continue;
                }
            }
            // Being held back is not a failure: a retry copy with the same
            // attempt number. It holds its aggregate in turn (in `retry`),
            // like a failed event: otherwise a later version arriving once
            // the blocker was handled, while this one still waits, would
            // find no hold, be handled first and make this one stale. The
            // blocker query only sees holds of lower versions, so this hold
            // never blocks the blocker.
            return Verdict::HeldBack {
                blocker: hold.event_id,
                delay: self.consumer.core.policy.retry_delay,
            };
        }
    }

    async fn ack(&mut self) -> Result<Settled, String> {
        // Any outcome ends the event's hold, if it has one: from a failed
        // attempt, from being held back (attempt 1 still), or from another
        // copy of it that is waiting in retry.
        if let Some(ordered) = &self.ordered {
            ordered.release().await;
        }
        self.acknowledge().await?;
        Ok(Settled::Done)
    }

    async fn retry(&mut self, delay: Duration, next_attempt: u32) -> Result<Settled, String> {
        if let Some(ordered) = &self.ordered {
            // Before the copy exists: later versions must find it.
            ordered.hold(self.consumer.hold_lapse(delay)).await;
        }
        self.copy(Some(delay), None, next_attempt).await?;
        self.acknowledge().await?;
        Ok(Settled::Done)
    }

    async fn dead(&mut self, copy: DeadCopy<'_>) -> Result<Settled, String> {
        self.copy(None, Some(copy.last_error), copy.attempt).await?;
        self.acknowledge().await?;
        if let Some(ordered) = &self.ordered {
            ordered.release().await;
        }
        Ok(Settled::Done)
    }

    fn dead_letters(&self) -> String {
        dead_queue(&self.consumer.core.config.queue)
    }
}

impl InHand<'_> {
    /// Acknowledges the delivery in hand.
    async fn acknowledge(&self) -> Result<(), String> {
        let acked = self.delivery.acker.ack(BasicAckOptions::default());
        match unless_lost(self.connection, acked).await {
            Some(Ok(true)) => Ok(()),
            // lapin sends nothing for a delivery of a channel that ended.
            Some(Ok(false)) => {
                Err("ack: the channel is closed; the broker redelivers the message".to_owned())
            }
            Some(Err(e)) => Err(format!("ack: {e}")),
            None => Err("ack: the connection was lost".to_owned()),
        }
    }

    /// Gives a delivery no handler started back at shutdown: a copy at the
    /// end of the queue with the same attempt, then the ack. Left to the
    /// channel's close, the broker would requeue it `redelivered`, which
    /// the next consumer counts as a failed attempt (a consumer that
    /// stopped while handling it): every restart would charge the
    /// messages prefetched then, and send them to `.dead` at
    /// `max_attempts = 1` unhandled.
    async fn give_back(&self, attempt: u32) -> Result<(), String> {
        let queue = self.consumer.core.config.queue.clone();
        self.copy_to(&queue, None, None, attempt).await?;
        self.acknowledge().await
    }

    /// Publishes a retry copy (with `delay`) or a dead copy (with
    /// `last_error`) and waits for the broker's confirm.
    async fn copy(
        &self,
        delay: Option<Duration>,
        last_error: Option<&str>,
        attempt: u32,
    ) -> Result<(), String> {
        let queue = match delay {
            Some(_) => retry_queue(&self.consumer.core.config.queue),
            None => dead_queue(&self.consumer.core.config.queue),
        };
        self.copy_to(&queue, delay, last_error, attempt).await
    }

    /// Publishes a copy of the delivery to `queue` and waits for the
    /// broker's confirm.
    async fn copy_to(
        &self,
        queue: &str,
        delay: Option<Duration>,
        last_error: Option<&str>,
        attempt: u32,
    ) -> Result<(), String> {
        let props = copy_properties(
            &self.delivery.properties,
            attempt,
            delay.map(|d| d.as_millis()),
            last_error,
            delay.and(self.noted.as_ref()),
        );
        let published = async {
            self.publishing
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &self.delivery.data,
                    props,
                )
                .await
                .map_err(|e| format!("publishing to {queue}: {e}"))?
                .await
                .map_err(|e| format!("confirm from {queue}: {e}"))
        };
        // A broker under a memory or disk alarm blocks a connection that
        // publishes: it reads nothing more from it, so the confirm waits
        // for the alarm to clear, and the connection is not lost (the
        // broker's heartbeats still come). Waiting is right, until the
        // consumer is asked to stop: then the copy is given up and the
        // message left unacked, for the broker to deliver again.
        let stopped = async {
            self.shutdown.cancelled().await;
            tokio::time::sleep(CLOSE_TIMEOUT).await;
        };
        let confirm = tokio::select! {
            confirm = unless_lost(self.connection, published) => confirm
                .unwrap_or_else(|| Err(format!("publishing to {queue}: the connection was lost")))?,
            _ = stopped => {
                let why = if self.connection.status().blocked() {
                    "the broker blocked the connection (a memory or disk alarm)"
                } else {
                    "no answer from the broker"
                };
                return Err(format!(
                    "publishing to {queue}: no confirm {}s after the consumer was asked to stop: {why}",
                    CLOSE_TIMEOUT.as_secs()
                ));
            }
        };
        confirmed(confirm, queue)
    }
}

/// Added to a hold's lapse time beyond the longest wait in `<queue>.retry`:
/// room for the broker to expire a backlog of copies there, and for clocks
/// of the group's processes that disagree.
pub const HOLD_GRACE: Duration = Duration::from_secs(60);

/// One event's view of the ordering holds.
struct Ordered<'a> {
    holds: &'a dyn AggregateHolds,
    group: &'a str,
    aggregate_id: String,
    version: i64,
    event_id: String,
}

impl Ordered<'_> {
    /// The hold before this event, lapsed or not.
    async fn blocker(&self) -> Result<Option<Hold>, Error> {
        self.holds
            .blocker(self.group, &self.aggregate_id, self.version, &self.event_id)
            .await
    }

    /// Drops `hold`, its event found gone, if it is still as noted.
    async fn drop_gone(&self, hold: &Hold) -> Result<bool, Error> {
        self.holds
            .drop_gone(self.group, &self.aggregate_id, hold)
            .await
    }

    /// Records the hold; a failure only weakens ordering, so it is logged.
    async fn hold(&self, lapse: Duration) {
        let until = postbox_core::time::now_ms()
            .saturating_add(i64::try_from(lapse.as_millis()).unwrap_or(i64::MAX));
        if let Err(e) = self
            .holds
            .hold(
                self.group,
                &self.aggregate_id,
                &self.event_id,
                self.version,
                until,
            )
            .await
        {
            tracing::error!(error = %e, aggregate_id = %self.aggregate_id, "could not hold the aggregate back: later events of it may overtake this one");
        }
    }

    /// Releases the hold; a failure leaves it to lapse, so it is logged.
    async fn release(&self) {
        if let Err(e) = self
            .holds
            .release(self.group, &self.aggregate_id, &self.event_id)
            .await
        {
            tracing::warn!(error = %e, aggregate_id = %self.aggregate_id, "could not release the aggregate's hold: its later events wait until it lapses and they have gone round the queue once more");
        }
    }
}

/// A session's end when its connection was lost while `doing`.
fn lost_during(doing: &str) -> SessionEnd {
    SessionEnd::Broken(format!("the connection was lost while {doing}"))
}

/// How long closing the channels and the connection may take at shutdown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a stopping consumer keeps giving back what was prefetched
/// (well within [`CLOSE_TIMEOUT`], so a give-back is not cut short).
const GIVE_BACK_WITHIN: Duration = Duration::from_secs(2);

/// `work` on the broker ([`unless_lost`]), or the session's end when it
/// fails or the connection is lost while `doing`.
async fn on_broker<T>(
    connection: &Connection,
    doing: &str,
    work: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, SessionEnd> {
    match unless_lost(connection, work).await {
        Some(Ok(done)) => Ok(done),
        Some(Err(e)) => Err(SessionEnd::Broken(e.to_string())),
        None => Err(lost_during(doing)),
    }
}

impl RabbitMqConsumer {
    /// [`InHand::give_back`] for a delivery read at shutdown. Left to the
    /// close instead (requeued where it was, and counted): one already
    /// redelivered (its count stands as it came), one that cannot be read,
    /// and an event of an aggregate, whose copy at the end of the queue
    /// would come after its later versions (an inbox would then skip it
    /// as stale).
    async fn give_back(
        &self,
        delivery: &Delivery,
        connection: &Connection,
        publishing: &Channel,
        shutdown: &CancellationToken,
    ) -> Result<(), String> {
        if delivery.redelivered {
            return Ok(());
        }
        let Ok(message) = super::message_from_delivery(
            &delivery.properties,
            delivery.routing_key.as_str(),
            &delivery.data,
            false,
        ) else {
            return Ok(());
        };
        if message.envelope.aggregate_id.is_some() {
            return Ok(());
        }
        let attempt = message.attempt;
        let in_hand = InHand {
            consumer: self,
            delivery,
            connection,
            publishing,
            shutdown,
            ordered: None,
            noted: None,
        };
        in_hand.give_back(attempt).await
    }

    /// `basic.consume` of the queue under this consumer's tag.
    async fn start_consuming(&self, channel: &Channel) -> Result<lapin::Consumer, lapin::Error> {
        channel
            .basic_consume(
                self.core.config.queue.as_str().into(),
                self.core.tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
    }
}

impl Session for RabbitMqConsumer {
    fn core(&self) -> &Core {
        &self.core
    }

    async fn session(&self, run: &mut Run<'_>) -> SessionEnd {
        let broken = |e: lapin::Error| SessionEnd::Broken(e.to_string());
        let props =
            ConnectionProperties::default().with_connection_name(self.core.tag.clone().into());
        let nodes = self.core.config.nodes();
        let first = self.next_node.load(std::sync::atomic::Ordering::Relaxed);
        let conn = match super::connect(nodes, first, props).await {
            Ok((c, node)) => {
                // When this connection is lost, the next session starts at
                // the next node: this one is likely down.
                let next = (node + 1) % nodes.len();
                self.next_node
                    .store(next, std::sync::atomic::Ordering::Relaxed);
                if nodes.len() > 1 {
                    tracing::info!(consumer = self.core.config.name(), url = %nodes[node], "connected to a node of the cluster");
                }
                c
            }
            Err(reason) => return SessionEnd::Broken(reason),
        };
        let setup = async {
            let consuming = conn.create_channel().await?;
            let publishing = conn.create_channel().await?;
            publishing
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>((consuming, publishing))
        };
        let (consuming, publishing) = match on_broker(&conn, "setting up", setup).await {
            Ok(c) => c,
            Err(end) => return end,
        };
        if !self.core.config.declare {
            // Nothing else checks a hand-made topology: a retry queue that does
            // not dead-letter back to the queue drops every retried message.
            // Bounded: an answer lapin never hands over (its connection
            // alive) held the consumer at "connecting" for good.
            let check = unless_lost(&conn, check_topology(&conn, &self.core.config.queue));
            match tokio::time::timeout(super::STEP_WITHIN, check).await {
                Err(_) => {
                    return SessionEnd::Broken(format!(
                        "checking the queues: no answer from the broker within {:?}",
                        super::STEP_WITHIN
                    ))
                }
                Ok(None) => return lost_during("checking the queues"),
                Ok(Some(Ok(()))) => {}
                Ok(Some(Err(TopologyError::Refused(reason)))) => {
                    let closing = conn.close(200, "setup refused".into());
                    let _ = tokio::time::timeout(CLOSE_TIMEOUT, closing).await;
                    return SessionEnd::Fatal(Error::config("queue", reason));
                }
                Ok(Some(Err(TopologyError::Broken(e)))) => return broken(e),
            }
        }
        let topology = async {
            if self.core.config.declare {
                declare_topology(&consuming, &self.core.config).await?;
            }
            // Not global: the limit is per consumer, which is what prefetch = 1
            // promises (one unacked message per consumer).
            consuming
                .basic_qos(self.core.config.prefetch, BasicQosOptions { global: false })
                .await?;
            self.start_consuming(&consuming).await
        };
        let Some(topology) = unless_lost(&conn, topology).await else {
            return lost_during("declaring the queues");
        };
        let mut consumer = match topology {
            Ok(c) => c,
            Err(e) if e.is_amqp_soft_error() => {
                let closing = conn.close(200, "setup refused".into());
                let _ = tokio::time::timeout(CLOSE_TIMEOUT, closing).await;
                let hint = if self.core.config.declare {
                    "check that the queue was not declared before with other arguments, and the user's permissions"
                } else {
                    "declare the queue, or set declare = true"
                };
                return SessionEnd::Fatal(Error::config(
                    "queue",
                    format!(
                        "RabbitMQ refused consuming `{}`: {e} ({hint})",
                        self.core.config.queue
                    ),
                ));
            }
            Err(e) => return broken(e),
        };
        run.up();
        tracing::info!(
            consumer = self.core.config.name(),
            queue = %self.core.config.queue,
            tag = %self.core.tag,
            prefetch = self.core.config.prefetch,
            "consuming"
        );
        // Set while paused: the consumer was cancelled, and what the
        // broker had already pushed is being finished.
        let mut pausing = false;
        loop {
            let next = tokio::select! {
                biased;
                _ = run.shutdown.cancelled() => {
                    // Stop taking, and give back what the broker pushed
                    // before the cancel and no handler started, uncounted
                    // (`InHand::give_back`); the stream ends once they are
                    // all read.
                    let closing = async {
                        let _ = consuming.basic_cancel(self.core.tag.as_str().into(), BasicCancelOptions::default()).await;
                        // Each give-back runs to its end (a copy whose
                        // original is not acked is a duplicate); past
                        // GIVE_BACK_WITHIN the rest are left to the close.
                        let started = tokio::time::Instant::now();
                        let giving_back = async {
                            while let Some(Ok(delivery)) = consumer.next().await {
                                if started.elapsed() >= GIVE_BACK_WITHIN
                                    || self.give_back(&delivery, &conn, &publishing, run.shutdown).await.is_err()
                                {
                                    break;
                                }
                            }
                        };
                        // A stream the broker does not end (no cancel-ok)
                        // does not hold the close.
                        let _ = tokio::time::timeout(2 * GIVE_BACK_WITHIN, giving_back).await;
                        let _ = consuming.close(200, "shutdown".into()).await;
                        let _ = publishing.close(200, "shutdown".into()).await;
                        let _ = conn.close(200, "shutdown".into()).await;
                    };
                    // Closing ends the connection: bounded by time, not by
                    // its loss.
                    let _ = tokio::time::timeout(CLOSE_TIMEOUT, closing).await;
                    tracing::info!(consumer = self.core.config.name(), "consumer stopped");
                    return SessionEnd::Cancelled;
                }
                _ = self.core.state.paused(), if !pausing => {
                    // Stop the pushes; the deliveries already pushed are
                    // finished below, then the stream ends.
                    let cancel = consuming.basic_cancel(self.core.tag.as_str().into(), BasicCancelOptions::default());
                    if let Err(end) = on_broker(&conn, "pausing", cancel).await {
                        return end;
                    }
                    pausing = true;
                    continue;
                }
                // Before the stream, which may still hold prefetched
                // deliveries after the loss (their acks could not be sent;
                // the broker redelivers them), and ends with an error only
                // once lapin has noticed it.
                _ = lost(&conn) => return lost_during("waiting for messages"),
                next = consumer.next() => next,
            };
            let delivery = match next {
                Some(Ok(d)) => d,
                Some(Err(e)) => return broken(e),
                None if pausing => {
                    // Paused with nothing in hand: the queue's other
                    // consumers get its messages until this one resumes.
                    if !self.core.state.unless_paused(run.shutdown).await {
                        continue; // shutdown: the branch above closes
                    }
                    consumer = match on_broker(&conn, "resuming", self.start_consuming(&consuming))
                        .await
                    {
                        Ok(c) => c,
                        Err(end) => return end,
                    };
                    pausing = false;
                    continue;
                }
                None => return SessionEnd::Broken("the broker cancelled the consumer".to_owned()),
            };
            if let Err(reason) = self
                .process(delivery, &conn, &publishing, run.shutdown, run.report)
                .await
            {
                if run.shutdown.is_cancelled() {
                    tracing::warn!(
                        consumer = self.core.config.name(),
                        reason,
                        "consumer stopped with a message unsettled: it stays unacked, and the broker delivers it again"
                    );
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        conn.close(200, "shutdown".into()),
                    )
                    .await;
                    return SessionEnd::Cancelled;
                }
                return SessionEnd::Broken(reason);
            }
        }
    }
}
