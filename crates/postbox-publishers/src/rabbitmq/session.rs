//! The task that owns the connection: publishes each batch on a channel of
//! its own, awaits the batch's confirms together, and reconnects with
//! backoff. Batches that come while others await their confirms start at
//! once on other channels (the relay sends two at a time: the broker is
//! never idle while confirms travel); a channel is reused once its batch
//! is done.
//!
//! Callers talk to it through a queue and a reply channel on which each
//! message's result comes as soon as its confirm does, so a caller that
//! gives up (the relay's `publish_timeout` drops its future) keeps the
//! results that came and never leaves a connection half-updated: the
//! session sees the reply channel close, stops waiting, and retires the
//! channel, so late confirms and returns of the abandoned batch can never
//! be mistaken for a later batch's. A channel has one batch at a time
//! because lapin hands a returned message to whichever confirm of the
//! channel it resolves next.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::{poll_fn, BoxFuture};
use futures::stream::{FuturesUnordered, StreamExt};
use lapin::message::BasicReturnMessage;
use lapin::options::BasicPublishOptions;
use lapin::Channel;
use postbox_core::publish::PublishError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{timeout, Instant};

use super::backoff::reconnect_delay;
use super::connection::{Link, OpenError, Target, CONNECT_TIMEOUT};
use super::message::Outgoing;

/// How often an idle session looks for a connection that died.
const HEALTH_CHECK: Duration = Duration::from_secs(1);
/// How long closing a channel or connection may take in the background.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the results of a batch go, each as `(index in the batch, result)`
/// as soon as it is known; at most one per message.
pub(super) type Reply = mpsc::UnboundedSender<(usize, Result<(), PublishError>)>;

/// Runs `work` (a channel being opened, a reconnect: up to
/// [`CONNECT_TIMEOUT`] each) while the batches in flight go on, so each
/// one's results reach its caller as its confirms come rather than once
/// `work` is done, by when the caller's `publish_timeout` would have
/// counted confirmed messages as timed out (sent again, the breaker
/// tripped). The batches that end meanwhile go to `ended`, for
/// [`Session::finish`] once `work` has let go of the session.
async fn beside<T>(
    work: impl Future<Output = T>,
    in_flight: &mut FuturesUnordered<BoxFuture<'static, Done>>,
    ended: &mut Vec<Done>,
) -> T {
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            out = &mut work => return out,
            Some(done) = in_flight.next(), if !in_flight.is_empty() => ended.push(done),
        }
    }
}

/// What a [`super::RabbitMqPublisher`] asks of its session.
pub(super) enum Request {
    /// Publish these messages (or report why one could not be built).
    Publish {
        messages: Vec<Result<Outgoing, String>>,
        reply: Reply,
    },
    /// Close the connection and stop.
    Close { done: oneshot::Sender<()> },
}

pub(super) struct Session {
    target: Arc<Target>,
    link: Option<Link>,
    /// Counts the links: a batch's channel belongs to `link` only when
    /// the batch started on this one.
    generation: u64,
    /// Whether `link` is up, for [`super::RabbitMqPublisher`]'s `connected`.
    connected: Arc<AtomicBool>,
    /// Consecutive failed connection attempts.
    failures: u32,
    next_attempt: Instant,
    last_error: String,
    /// Routing keys the broker refused lately; shared with the batches.
    refused: Arc<RefusedKeys>,
}

impl Session {
    /// A session starting on the link opened at start.
    pub fn new(target: Arc<Target>, link: Link, connected: Arc<AtomicBool>) -> Self {
        connected.store(true, Ordering::Relaxed);
        Session {
            target,
            link: Some(link),
            generation: 0,
            connected,
            failures: 0,
            next_attempt: Instant::now(),
            last_error: String::new(),
            refused: Arc::default(),
        }
    }

    /// Serves requests until `Close` or until every sender is gone; the
    /// batches in flight then end first.
    pub async fn run(mut self, mut requests: mpsc::Receiver<Request>) {
        let mut health = tokio::time::interval(HEALTH_CHECK);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut in_flight: FuturesUnordered<BoxFuture<'static, Done>> = FuturesUnordered::new();
        let done = loop {
            let disconnected = self.link.is_none();
            tokio::select! {
                request = requests.recv() => match request {
                    Some(Request::Publish { messages, reply }) => {
                        let mut ended = Vec::new();
                        let batch = beside(self.publish(messages, reply), &mut in_flight, &mut ended).await;
                        for done in ended {
                            self.finish(done);
                        }
                        if let Some(batch) = batch {
                            in_flight.push(batch);
                        }
                    }
                    Some(Request::Close { done }) => break Some(done),
                    None => break None,
                },
                Some(batch) = in_flight.next(), if !in_flight.is_empty() => self.finish(batch),
                _ = tokio::time::sleep_until(self.next_attempt), if disconnected => {
                    let mut ended = Vec::new();
                    beside(self.reconnect(), &mut in_flight, &mut ended).await;
                    for done in ended {
                        self.finish(done);
                    }
                }
                _ = health.tick() => self.check_health(),
            }
        };
        while let Some(batch) = in_flight.next().await {
            self.finish(batch);
        }
        self.close().await;
        if let Some(done) = done {
            let _ = done.send(());
        }
    }

    /// Starts a batch on a channel of its own: the future sends it and
    /// awaits its confirms ([`Session::finish`] takes its end).
    async fn publish(
        &mut self,
        messages: Vec<Result<Outgoing, String>>,
        reply: Reply,
    ) -> Option<BoxFuture<'static, Done>> {
        if reply.is_closed() {
            return None; // the caller gave up while this waited in the queue
        }
        let channel = match self.ready_channel().await {
            Ok(channel) => channel,
            Err(reason) => {
                // Nothing was sent: the broker is unreachable (or blocks
                // this connection), which is not the events' fault. A
                // message that cannot be built fails on its own.
                for (i, m) in messages.iter().enumerate() {
                    let error = match m {
                        Ok(_) => PublishError::Unreachable(reason.clone()),
                        Err(own) => PublishError::failed(own.clone()),
                    };
                    let _ = reply.send((i, Err(error)));
                }
                return None;
            }
        };
        let target = self.target.clone();
        let refused = self.refused.clone();
        let generation = self.generation;
        Some(Box::pin(async move {
            let mut messages = messages;
            let sent = tokio::select! {
                biased;
                sent = send_and_confirm(&channel, &target, &refused, &mut messages, &reply) => Some(sent),
                _ = reply.closed() => None,
            };
            Done {
                channel,
                generation,
                sent,
            }
        }))
    }

    /// What a batch's end says about its channel: back to the idle ones,
    /// retired, or the connection lost.
    fn finish(&mut self, batch: Done) {
        let Done {
            channel,
            generation,
            sent,
        } = batch;
        if generation != self.generation || self.link.is_none() {
            // Its connection was replaced meanwhile.
            return retire(&self.target.name, channel, "its connection was replaced");
        }
        match sent {
            // The relay stopped waiting (its publish_timeout, or shutdown).
            // What was sent may still be confirmed and routed: the rows are
            // retried, so a consumer may see those events twice.
            None => retire(
                &self.target.name,
                channel,
                "a publish was abandoned before all confirms arrived",
            ),
            Some(Sent {
                broken: Some(reason),
                ..
            }) => self.lose_channel(channel, &reason),
            // A channel whose messages a queue refused may hold a stale
            // view of it: a quorum queue whose leader moved while the
            // channel was opened (RabbitMQ 3.10 nacks every later message
            // of that channel). The next batch gets a fresh channel.
            Some(Sent { nacked: true, .. }) => retire(
                &self.target.name,
                channel,
                "the broker nacked messages on this channel",
            ),
            Some(Sent { .. }) => {
                if let Some(link) = &mut self.link {
                    if channel.status().connected() {
                        link.idle.push(channel);
                    }
                }
            }
        }
    }

    /// An idle publishing channel, or a new one, reconnecting when needed.
    async fn ready_channel(&mut self) -> Result<Channel, String> {
        self.check_health();
        if self.link.is_none() && Instant::now() >= self.next_attempt {
            self.reconnect().await;
        }
        let Some(link) = &mut self.link else {
            let wait = self.next_attempt.saturating_duration_since(Instant::now());
            return Err(format!(
                "not connected to RabbitMQ ({}); next attempt in {} ms",
                self.last_error,
                wait.as_millis()
            ));
        };
        if link.connection.status().blocked() {
            let reason = link
                .blocked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_else(|| "resource alarm".to_owned());
            return Err(format!(
                "the broker blocks publishing on this connection ({reason}); the event is retried once the alarm clears"
            ));
        }
        while let Some(channel) = link.idle.pop() {
            if channel.status().connected() {
                return Ok(channel);
            }
        }
        match timeout(CONNECT_TIMEOUT, self.target.open_channel(&link.connection)).await {
            Ok(Ok(channel)) => Ok(channel),
            Ok(Err(reason)) => {
                self.lose_connection(&reason);
                Err(reason)
            }
            Err(_) => {
                let reason = format!("opening a channel on {} timed out", self.target.url());
                self.lose_connection(&reason);
                Err(reason)
            }
        }
    }

    /// One round of connection attempts, each node once, each bounded by
    /// [`CONNECT_TIMEOUT`]; on failure the next round waits out the
    /// backoff.
    async fn reconnect(&mut self) {
        let result = match self.target.open().await {
            Ok(link) => Ok(link),
            Err(OpenError::MissingExchange) => Err(self.target.missing_exchange().to_string()),
            Err(OpenError::Other(reason)) => Err(reason),
        };
        match result {
            Ok(link) => {
                tracing::info!(
                    publisher = %self.target.name,
                    url = %self.target.url(),
                    failed_attempts = self.failures,
                    "reconnected to RabbitMQ"
                );
                self.link = Some(link);
                self.generation += 1;
                self.connected.store(true, Ordering::Relaxed);
                self.failures = 0;
            }
            Err(reason) => {
                self.failures = self.failures.saturating_add(1);
                let delay = reconnect_delay(self.failures, rand::random::<f64>());
                self.next_attempt = Instant::now() + delay;
                tracing::warn!(
                    publisher = %self.target.name,
                    error = %reason,
                    failed_attempts = self.failures,
                    retry_in_ms = delay.as_millis() as u64,
                    "could not reconnect to RabbitMQ"
                );
                self.last_error = reason;
            }
        }
    }

    /// Drops a connection the broker or the network closed, so the next
    /// attempt starts at once.
    fn check_health(&mut self) {
        let Some(link) = &self.link else { return };
        let status = link.connection.status();
        if !status.connected() {
            let state = if status.blocked() { "blocked, " } else { "" };
            let state = match (status.closing(), status.closed(), status.errored()) {
                (true, _, _) => format!("{state}closing"),
                (_, true, _) => format!("{state}closed"),
                (_, _, true) => format!("{state}failed"),
                _ => format!("{state}not connected"),
            };
            let reason = format!("connection to {} lost ({state})", self.target.url());
            self.lose_connection(&reason);
        }
    }

    /// After a failed publish: a dead connection is replaced, a channel the
    /// broker closed (e.g. a deleted exchange) is not used again.
    fn lose_channel(&mut self, channel: Channel, reason: &str) {
        match &self.link {
            Some(link) if link.connection.status().connected() => {
                retire(&self.target.name, channel, reason)
            }
            _ => self.lose_connection(reason),
        }
    }

    fn lose_connection(&mut self, reason: &str) {
        let Some(link) = self.link.take() else { return };
        self.connected.store(false, Ordering::Relaxed);
        tracing::warn!(publisher = %self.target.name, error = %reason, "lost the RabbitMQ connection; reconnecting");
        self.target.skip_node();
        self.last_error = reason.to_owned();
        self.next_attempt = Instant::now();
        close_in_background(link);
    }

    async fn close(&mut self) {
        self.connected.store(false, Ordering::Relaxed);
        if let Some(link) = self.link.take() {
            let _ = timeout(
                Duration::from_secs(2),
                link.connection
                    .close(200, "postbox publisher closing".into()),
            )
            .await;
        }
    }
}

/// Publishes every message, queued in order at once (each `basic.publish`
/// only waits for its frames to be written), then awaits all confirms
/// together, sending each message's result on `reply` as soon as its
/// confirm arrives. Says whether the channel or connection broke, and
/// whether the broker nacked.
async fn send_and_confirm(
    channel: &Channel,
    target: &Target,
    refused: &RefusedKeys,
    messages: &mut [Result<Outgoing, String>],
    reply: &Reply,
) -> Sent {
    let mandatory = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let fail = |i: usize, reason: &str| {
        let _ = reply.send((i, Err(PublishError::failed(reason))));
    };
    let mut broken: Option<String> = None;
    let mut nacked = false;
    // Every publish at once: lapin queues a message's frames on the first
    // poll of its `basic_publish` (polled here in batch order) and answers
    // once its IO loop wrote them, so its IO thread writes the batch in a
    // few large writes and this task wakes a few times, not once per
    // message.
    let mut sends = Vec::with_capacity(messages.len());
    // One look at the refused keys per batch (almost always none).
    let held = refused.held(Instant::now());
    for (i, m) in messages.iter_mut().enumerate() {
        match m {
            Ok(m) if held.iter().any(|k| k == m.routing_key.as_str()) => fail(
                i,
                &refused_message(target.exchange.as_str(), m.routing_key.as_str()),
            ),
            Ok(m) => sends.push((
                i,
                futures::future::maybe_done(Box::pin(channel.basic_publish(
                    target.exchange.clone(),
                    m.routing_key.clone(),
                    mandatory,
                    &m.body,
                    std::mem::take(&mut m.properties),
                ))),
            )),
            Err(reason) => fail(i, reason),
        }
    }
    poll_fn(|cx| {
        let mut done = true;
        for (_, send) in &mut sends {
            done &= Pin::new(send).poll(cx).is_ready();
        }
        if done {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    let mut pending = Vec::with_capacity(sends.len());
    for (i, mut send) in sends {
        match Pin::new(&mut send).take_output() {
            Some(Ok(confirm)) => pending.push((i, confirm)),
            Some(Err(e)) => {
                refused.learn(&e, Instant::now());
                let reason = target.describe("publishing", &e);
                fail(i, &reason);
                broken.get_or_insert(reason);
            }
            // Not possible: the poll above ended once every publish had.
            None => fail(i, "not sent"),
        }
    }

    // lapin hands a returned (unroutable) message to whichever confirm it
    // resolves next, so returns are matched to events by message_id, and
    // every confirm resolved is taken (`settled`) before any is recorded.
    let mut returned: HashMap<String, BasicReturnMessage> = HashMap::new();
    while !pending.is_empty() {
        let resolved = settled(&mut pending).await;
        let mut confirmed = Vec::with_capacity(resolved.len());
        for (i, c) in resolved {
            match c {
                Ok(confirmation) => {
                    let acked = confirmation.is_ack();
                    if let Some(r) = confirmation.take_message() {
                        let id = r
                            .delivery
                            .properties
                            .message_id()
                            .as_ref()
                            .map(|s| s.to_string())
                            .unwrap_or_default();
                        returned.insert(id, r);
                    }
                    confirmed.push((i, Ok(acked)));
                }
                Err(e) => {
                    refused.learn(&e, Instant::now());
                    let reason = target.describe("waiting for the confirm", &e);
                    broken.get_or_insert_with(|| reason.clone());
                    confirmed.push((i, Err(reason)));
                }
            }
        }
        for (i, c) in confirmed {
            let Ok(m) = &messages[i] else { continue };
            let result = match (returned.get(&m.event_id), c) {
                (Some(r), _) => Err(PublishError::failed(format!(
                    "unroutable: exchange {}, routing key {} ({} {}); bind a queue to the exchange for this routing key",
                    target.exchange, m.routing_key, r.reply_code, r.reply_text
                ))),
                (None, Ok(true)) => Ok(()),
                (None, Ok(false)) => {
                    nacked = true;
                    Err(PublishError::failed(format!(
                        "the broker refused the message on exchange {} (basic.nack: a queue rejected it or the broker failed to store it)",
                        target.exchange
                    )))
                }
                (None, Err(reason)) => Err(PublishError::failed(format!(
                    "not confirmed: {reason}"
                ))),
            };
            let _ = reply.send((i, result));
        }
    }
    Sent { broken, nacked }
}

/// Closes a publishing channel in the background; it is not used again.
/// Closing waits for the broker (a blocked connection sends nothing until
/// the alarm clears), so nothing here blocks.
fn retire(publisher: &str, channel: Channel, reason: &str) {
    tracing::debug!(publisher, %reason, "retiring a publishing channel");
    if !channel.status().connected() {
        return;
    }
    tokio::spawn(async move {
        let _ = timeout(
            CLOSE_TIMEOUT,
            channel.close(200, "postbox: channel retired".into()),
        )
        .await;
    });
}

/// A batch whose sending ended, with the channel it took.
struct Done {
    channel: Channel,
    /// The session's `generation` when the batch started.
    generation: u64,
    /// `None`: the caller stopped waiting first.
    sent: Option<Sent>,
}

/// How a batch's sending ended.
struct Sent {
    /// The connection or channel broke: why.
    broken: Option<String>,
    /// The broker nacked at least one message.
    nacked: bool,
}

/// How long messages with a routing key the broker refused are failed
/// without being sent; then one batch tries the key again, in case the
/// permission was granted.
const REFUSED_FOR: Duration = Duration::from_secs(60);

/// Routing keys the broker refused from this publisher's user lately
/// (topic permissions: `ACCESS_REFUSED - access to topic '<key>' in
/// exchange …`). The broker closes the channel at such a message, so
/// every message of its batch not yet confirmed fails with it: one event
/// type without write access would fail every batch it is in, and its
/// neighbours would use up their retries for nothing. For [`REFUSED_FOR`]
/// after a refusal, messages with that key fail at once, unsent, and the
/// rest of their batch is published.
#[derive(Default)]
struct RefusedKeys(std::sync::Mutex<HashMap<String, Instant>>);

impl RefusedKeys {
    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The keys whose messages are held back at `now`; the expired ones
    /// are forgotten.
    fn held(&self, now: Instant) -> Vec<String> {
        let mut keys = self.keys();
        keys.retain(|_, until| now < *until);
        keys.keys().cloned().collect()
    }

    /// Remembers the key `error` says the broker refused, if it does.
    fn learn(&self, error: &lapin::Error, now: Instant) {
        let text = error.to_string();
        let Some(key) = refused_topic(&text) else {
            return;
        };
        // Every message of the batch fails with the same error: one line.
        if self
            .keys()
            .insert(key.to_owned(), now + REFUSED_FOR)
            .is_none()
        {
            tracing::warn!(routing_key = key, "the broker refuses this routing key (topic permissions); its messages fail unsent for {REFUSED_FOR:?}");
        }
    }
}

/// The routing key of a topic-permission refusal in a broker's error text.
fn refused_topic(error: &str) -> Option<&str> {
    let (_, rest) = error.split_once("ACCESS_REFUSED - access to topic '")?;
    Some(rest.split_once('\'')?.0)
}

/// Why a message with a refused routing key was not sent.
fn refused_message(exchange: &str, key: &str) -> String {
    format!(
        "refused: the broker does not let this user write routing key '{key}' to exchange {exchange} (ACCESS_REFUSED, topic permissions); not sent for {} s after a refusal, so the rest of the batch goes through; grant write access to this routing key",
        REFUSED_FOR.as_secs()
    )
}

/// Waits until some confirms of `pending` resolved, then takes them and
/// every other confirm resolved before the wait ends, with their batch
/// indexes.
///
/// lapin gives a message's return to the next confirm it resolves, which
/// may be another message's (the first of a `multiple` ack, or an ack
/// arriving between the return and the message's own ack): that confirm
/// resolves no later than the returned message's. lapin resolves them on
/// its IO thread while this task looks, so one look can find the message's
/// confirm resolved and miss the earlier one, looked at a moment before it
/// resolved. The looks go on until one finds nothing new: a confirm that
/// resolved before one look found another then resolved before the next
/// look began, and that look took it. So the return of every message taken
/// is in hand.
async fn settled<F: Future + Unpin>(pending: &mut Vec<(usize, F)>) -> Vec<(usize, F::Output)> {
    let mut resolved = poll_fn(|cx| match take_resolved(pending, cx) {
        r if r.is_empty() => Poll::Pending,
        r => Poll::Ready(r),
    })
    .await;
    loop {
        let more = poll_fn(|cx| Poll::Ready(take_resolved(pending, cx))).await;
        if more.is_empty() {
            return resolved;
        }
        resolved.extend(more);
    }
}

/// Takes the confirms of `pending` that have resolved, with their batch
/// index; the others stay, registered to wake `cx`.
fn take_resolved<F: Future + Unpin>(
    pending: &mut Vec<(usize, F)>,
    cx: &mut Context<'_>,
) -> Vec<(usize, F::Output)> {
    let mut resolved = Vec::new();
    let mut k = 0;
    while k < pending.len() {
        match Pin::new(&mut pending[k].1).poll(cx) {
            Poll::Ready(c) => {
                let (i, _) = pending.swap_remove(k);
                resolved.push((i, c));
            }
            Poll::Pending => k += 1,
        }
    }
    resolved
}

/// Closes a replaced connection without waiting for it (a blocked or
/// half-dead connection may take long to answer).
fn close_in_background(link: Link) {
    tokio::spawn(async move {
        if link.connection.status().connected() {
            let _ = timeout(
                CLOSE_TIMEOUT,
                link.connection.close(200, "postbox: reconnecting".into()),
            )
            .await;
        }
    });
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A confirm that lapin's IO thread resolves at a given moment, the
    /// moments counted in looks at any confirm of the batch.
    struct Resolves {
        at: usize,
        clock: Arc<AtomicUsize>,
    }

    impl Future for Resolves {
        type Output = ();

        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            if self.clock.fetch_add(1, Ordering::SeqCst) >= self.at {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }
    }

    #[test]
    fn a_topic_refusal_names_its_routing_key() {
        let error = "protocol error: AMQP soft error: ACCESS-REFUSED: ACCESS_REFUSED - access to topic 'room.GiftSent' in exchange 'events' in vhost '/' refused for user 'app'";
        assert_eq!(refused_topic(error), Some("room.GiftSent"));
        assert_eq!(
            refused_topic("ACCESS_REFUSED - access to exchange 'events' refused"),
            None
        );
        let keys = RefusedKeys::default();
        let now = Instant::now();
        keys.keys()
            .insert("room.GiftSent".into(), now + REFUSED_FOR);
        let holds = |key: &str, at| keys.held(at).iter().any(|k| k == key);
        assert!(holds("room.GiftSent", now));
        assert!(!holds("room.Other", now));
        assert!(
            !holds("room.GiftSent", now + REFUSED_FOR),
            "tried again after"
        );
        assert!(keys.keys().is_empty());
    }

    /// Message 1 was returned; lapin gave its return to message 0's
    /// confirm and resolved both just after the second look passed
    /// message 0 and before it reached message 1. Message 1 is taken only
    /// with message 0, whose confirm carries its return.
    #[tokio::test]
    async fn a_confirm_is_taken_with_every_confirm_resolved_before_it() {
        let clock = Arc::new(AtomicUsize::new(0));
        let confirm = |at| Resolves {
            at,
            clock: clock.clone(),
        };
        // Looks: 1st at 0 (message 0), 1 (1), 2 (2, resolved); 2nd at 3
        // (message 0, not yet), 4 (1, resolved with 0 at 4).
        let mut pending = vec![(0, confirm(4)), (1, confirm(4)), (2, confirm(0))];
        let taken: Vec<usize> = settled(&mut pending)
            .await
            .into_iter()
            .map(|(i, _)| i)
            .collect();
        assert!(taken.contains(&1), "message 1 resolved: {taken:?}");
        assert!(
            taken.contains(&0),
            "message 1 taken without the confirm carrying its return: {taken:?}"
        );
        assert!(pending.is_empty());
    }
}
