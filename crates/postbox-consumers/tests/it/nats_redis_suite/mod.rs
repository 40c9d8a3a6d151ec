//! The consumer cases every stream broker (NATS JetStream, Redis Streams)
//! must pass, written once. Each broker's test file implements [`Broker`]
//! (publish in the postbox publisher's wire format, sample the server, read
//! the dead letters) and runs [`stream_consumer_suite!`].

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use postbox_consumers::consume::state::ConsumerState;
use postbox_consumers::rabbitmq::ConsumeReport;
use postbox_consumers::{Handled, Handler, HandlerError, Message};
use postbox_core::config::ConsumerConfig;
use postbox_core::envelope::Envelope;
use tokio::task::JoinHandle;

use crate::common::EffectRow;
use tokio_util::sync::CancellationToken;

/// Event `n` as a test publishes it, read from its SPEC §4 envelope: also
/// the envelope a consumer must hand over (the publishers add `x-attempt` =
/// 1 to the headers).
pub fn test_event(n: usize) -> Envelope {
    let envelope = serde_json::json!({
        "event_id": format!("{}-{n}", uuid::Uuid::now_v7()),
        "app_code": "room",
        "event_type": "RoomCreated",
        "aggregate_id": format!("room-{n}"),
        "aggregate_version": n as i64 + 1,
        "created_at_ms": 1_700_000_000_000 + n as i64,
        "headers": { "tenant": "acme" },
        "payload": { "n": n },
    });
    serde_json::from_str(&envelope.to_string()).unwrap()
}

/// Publishes [`test_event`] `n` for each `n` of `numbers`; returns them.
pub async fn publish_events(b: &dyn Broker, numbers: std::ops::Range<usize>) -> Vec<Envelope> {
    let events: Vec<Envelope> = numbers.map(test_event).collect();
    for e in &events {
        b.publish(e).await;
    }
    events
}

/// A consumer entry: the broker's `settings`, with `overrides` set over them.
pub fn config_with(
    mut settings: serde_json::Value,
    overrides: serde_json::Value,
) -> ConsumerConfig {
    for (k, v) in overrides.as_object().unwrap() {
        settings[k] = v.clone();
    }
    serde_json::from_value(settings).unwrap()
}

/// What the server says about unacknowledged messages of a group.
#[derive(Debug, Default)]
pub struct Unacked {
    /// Per consumer where the server tells them apart (Redis).
    pub per_consumer: Option<HashMap<String, u64>>,
    pub total: u64,
}

/// A dead copy as read back from the broker.
#[derive(Debug, Clone)]
pub struct DeadCopy {
    pub event_id: String,
    pub last_error: String,
}

/// A running consumer.
pub type ConsumerTask = JoinHandle<Result<ConsumeReport, postbox_core::Error>>;

/// What a consumer is started with.
pub struct Start {
    pub config: ConsumerConfig,
    pub handler: Arc<dyn Handler>,
    pub tag: String,
    pub cancel: CancellationToken,
}

/// A `$consumer` (type) built from `$start` (a [`Start`]), run on a task:
/// the task and the consumer's state.
macro_rules! started {
    ($consumer:ty, $start:expr) => {{
        let s: Start = $start;
        let consumer = <$consumer>::new(s.config, s.handler)
            .unwrap()
            .with_tag(s.tag);
        let state = consumer.state();
        (
            tokio::spawn(async move { consumer.run(s.cancel).await }),
            state,
        )
    }};
}
pub(crate) use started;

/// One broker's scratch set-up.
#[async_trait]
pub trait Broker: Send + Sync + 'static {
    /// A consumer entry for `group` on this scratch stream.
    fn config(&self, group: &str, overrides: serde_json::Value) -> ConsumerConfig;
    /// Publishes `e` exactly as the postbox publisher does.
    async fn publish(&self, e: &Envelope);
    /// Unacknowledged messages of `group`.
    async fn unacked(&self, group: &str) -> Unacked;
    /// Messages of `group` not yet delivered or not yet acknowledged.
    async fn outstanding(&self, group: &str) -> u64;
    /// The dead copies of `group`.
    async fn dead(&self, group: &str) -> Vec<DeadCopy>;
    /// Starts the broker's consumer on a task; returns it with the
    /// consumer's state (its pause switch).
    fn start_controlled(&self, start: Start) -> (ConsumerTask, Arc<ConsumerState>);
    /// Starts the broker's consumer on a task.
    fn start(&self, start: Start) -> ConsumerTask {
        self.start_controlled(start).0
    }
    /// Starts a consumer named `tag`.
    fn spawn(
        &self,
        config: ConsumerConfig,
        handler: Arc<dyn Handler>,
        tag: &str,
        cancel: CancellationToken,
    ) -> ConsumerTask {
        self.start(Start {
            config,
            handler,
            tag: tag.to_owned(),
            cancel,
        })
    }
    /// Removes the scratch streams.
    async fn cleanup(&self);
}

/// One handler call.
#[derive(Debug, Clone)]
pub struct Call {
    pub who: String,
    pub message: Message,
    pub at: Instant,
}

pub type Calls = Arc<Mutex<Vec<Call>>>;

/// Records every call, sleeps `work`, and fails events whose id is in
/// `poison`.
pub struct Recording {
    pub who: String,
    pub calls: Calls,
    pub work: Duration,
    pub poison: Vec<String>,
    /// Never returns for the first message (a consumer that hangs, to be
    /// killed).
    pub hang: bool,
}

#[async_trait]
impl Handler for Recording {
    async fn handle(&self, message: &Message) -> Result<Handled, HandlerError> {
        self.calls.lock().unwrap().push(Call {
            who: self.who.clone(),
            message: message.clone(),
            at: Instant::now(),
        });
        if self.hang {
            futures::future::pending::<()>().await;
        }
        tokio::time::sleep(self.work).await;
        if self.poison.iter().any(|p| p == message.event_id()) {
            return Err(HandlerError::new(format!("poison {}", message.event_id())));
        }
        Ok(Handled::Ok)
    }
}

impl Recording {
    /// Records as `who`, taking `work` for each message.
    pub fn new(who: &str, calls: &Calls, work: Duration) -> Self {
        Recording {
            who: who.into(),
            calls: calls.clone(),
            work,
            poison: Vec::new(),
            hang: false,
        }
    }
}

pub fn recording(who: &str, calls: &Calls, work: Duration) -> Arc<dyn Handler> {
    Arc::new(Recording::new(who, calls, work))
}

/// Records as `a` and fails every attempt at `poison`.
pub fn poisoned(calls: &Calls, poison: &Envelope) -> Arc<dyn Handler> {
    Arc::new(Recording {
        poison: vec![poison.event_id.clone()],
        ..Recording::new("a", calls, Duration::ZERO)
    })
}

/// Polls the dead copies of `group` until there is one, panicking with
/// `what` after `limit`.
pub async fn first_dead(b: &dyn Broker, group: &str, limit: Duration, what: &str) -> Vec<DeadCopy> {
    let start = Instant::now();
    loop {
        let d = b.dead(group).await;
        if !d.is_empty() {
            return d;
        }
        assert!(start.elapsed() < limit, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `done` holds, panicking with `what` after `limit`.
pub async fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    crate::common::wait_until(what, limit, async || done()).await;
}

pub fn group(prefix: &str) -> String {
    let r = uuid::Uuid::now_v7().simple().to_string();
    format!("{prefix}_{}_{}", std::process::id(), &r[r.len() - 6..])
}

pub async fn stop(cancel: &CancellationToken, task: ConsumerTask) -> ConsumeReport {
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the consumer stops within 10 s of shutdown")
        .expect("consumer task")
        .expect("consumer run")
}

/// Waits for `n` handled messages, stops the consumer (whose report must
/// count `n` handled), and returns the calls.
async fn handled_then_stopped(
    calls: &Calls,
    n: usize,
    cancel: &CancellationToken,
    task: ConsumerTask,
) -> Vec<Call> {
    wait_until(
        Duration::from_secs(20),
        &format!("{n} messages handled"),
        || calls.lock().unwrap().len() >= n,
    )
    .await;
    let report = stop(cancel, task).await;
    assert_eq!(report.ok, n as u64, "{report:?}");
    calls.lock().unwrap().clone()
}

/// (1) N messages reach the handler with the right envelope and are acked.
pub async fn delivers_every_message_with_its_envelope(b: &dyn Broker) {
    let g = group("all");
    let events = publish_events(b, 0..20).await;
    let calls = Calls::default();
    let cancel = CancellationToken::new();
    let task = b.spawn(
        b.config(&g, serde_json::json!({})),
        recording("a", &calls, Duration::ZERO),
        "a",
        cancel.clone(),
    );
    let calls = handled_then_stopped(&calls, 20, &cancel, task).await;
    assert_eq!(calls.len(), 20, "each message handled once");
    let by_id: HashMap<&str, &Message> = calls
        .iter()
        .map(|c| (c.message.event_id(), &c.message))
        .collect();
    for e in &events {
        let m = by_id.get(e.event_id.as_str()).expect("every event arrives");
        let mut want = e.clone();
        want.headers
            .insert("x-attempt".into(), m.envelope.headers["x-attempt"].clone());
        assert_eq!(m.envelope, want);
        assert_eq!(
            m.envelope.headers["x-attempt"]
                .to_string()
                .trim_matches('"'),
            "1"
        );
        assert_eq!((m.attempt, m.redelivered), (1, false));
    }
    assert_eq!(b.outstanding(&g).await, 0, "nothing left pending");
}

/// (2) Two consumers share the work; with prefetch 1 neither ever holds
/// more than one unacked message.
pub async fn two_consumers_share_the_work_one_unacked_each(b: &dyn Broker) {
    let g = group("share");
    let n = 60;
    publish_events(b, 0..n).await;
    let calls = Calls::default();
    let cancel = CancellationToken::new();
    let config = b.config(&g, serde_json::json!({ "prefetch": 1 }));
    let t1 = b.spawn(
        config.clone(),
        recording("one", &calls, Duration::from_millis(20)),
        &format!("{g}-one"),
        cancel.clone(),
    );
    let t2 = b.spawn(
        config,
        recording("two", &calls, Duration::from_millis(20)),
        &format!("{g}-two"),
        cancel.clone(),
    );
    let start = Instant::now();
    let mut samples = 0;
    let mut max_total = 0;
    while calls.lock().unwrap().len() < n {
        assert!(start.elapsed() < Duration::from_secs(30), "timed out");
        let u = b.unacked(&g).await;
        samples += 1;
        max_total = max_total.max(u.total);
        if let Some(per) = &u.per_consumer {
            for (consumer, held) in per {
                assert!(*held <= 1, "{consumer} held {held} unacked messages");
            }
        }
        assert!(u.total <= 2, "{} unacked in the group", u.total);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r1 = stop(&cancel, t1).await;
    let r2 = stop(&cancel, t2).await;
    assert_eq!(r1.ok + r2.ok, n as u64);
    assert!(
        r1.ok > 0 && r2.ok > 0,
        "both did work: {} and {}",
        r1.ok,
        r2.ok
    );
    assert!(
        samples > 10 && max_total >= 1,
        "sampled {samples} times, max {max_total}"
    );
    assert_eq!(b.outstanding(&g).await, 0);
}

/// (3) A poison message is retried with growing delays while the others
/// flow, then lands in the dead letters with its last error.
pub async fn poison_goes_dead_after_growing_delays(b: &dyn Broker) {
    let g = group("poison");
    let poison = test_event(0);
    b.publish(&poison).await;
    let good = publish_events(b, 1..11).await;
    let calls = Calls::default();
    let cancel = CancellationToken::new();
    let config = b.config(
        &g,
        serde_json::json!({ "max_attempts": 4, "retry_delay": "200ms", "max_retry_delay": "2s" }),
    );
    let task = b.spawn(config, poisoned(&calls, &poison), "a", cancel.clone());
    let dead = first_dead(b, &g, Duration::from_secs(20), "no dead copy after 20 s").await;
    let report = stop(&cancel, task).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].event_id, poison.event_id);
    assert!(dead[0].last_error.contains("poison"), "{dead:?}");
    let calls = calls.lock().unwrap().clone();
    let tries: Vec<&Call> = calls
        .iter()
        .filter(|c| c.message.event_id() == poison.event_id)
        .collect();
    let attempts: Vec<u32> = tries.iter().map(|c| c.message.attempt).collect();
    assert_eq!(attempts, [1, 2, 3, 4]);
    assert_eq!(
        tries
            .iter()
            .map(|c| c.message.redelivered)
            .collect::<Vec<_>>(),
        [false, true, true, true]
    );
    let gaps: Vec<Duration> = tries.windows(2).map(|w| w[1].at - w[0].at).collect();
    eprintln!("poison retry gaps: {gaps:?}");
    for (gap, want_ms) in gaps.iter().zip([200u64, 400, 800]) {
        let want = Duration::from_millis(want_ms);
        assert!(
            *gap >= want.mul_f64(0.9),
            "gap {gap:?} shorter than {want:?}"
        );
        assert!(
            *gap < want + Duration::from_millis(1500),
            "gap {gap:?} much longer than {want:?}"
        );
    }
    // The others flowed while the poison waited.
    let last_good = calls
        .iter()
        .filter(|c| c.message.event_id() != poison.event_id)
        .map(|c| c.at)
        .max()
        .unwrap();
    assert_eq!(
        calls.len() - tries.len(),
        good.len(),
        "every good message handled once"
    );
    assert!(
        last_good < tries[1].at,
        "good messages were held back by the poison"
    );
    assert_eq!(
        (report.ok, report.retry, report.dead),
        (10, 3, 1),
        "{report:?}"
    );
    assert_eq!(b.outstanding(&g).await, 0);
}

/// Panics on the first attempt at `e1`, handles everything else.
pub struct PanicsOnce {
    pub e1: String,
    pub calls: Calls,
}

#[async_trait]
impl Handler for PanicsOnce {
    async fn handle(&self, message: &Message) -> Result<Handled, HandlerError> {
        self.calls.lock().unwrap().push(Call {
            who: "a".into(),
            message: message.clone(),
            at: Instant::now(),
        });
        if message.event_id() == self.e1 && message.attempt == 1 {
            panic!("e1 blew up");
        }
        Ok(Handled::Ok)
    }
}

/// A handler that panics has failed that attempt: the message is retried
/// after its delay and handled, the other message is handled, and the
/// consumer goes on (it does not stop, nor take the process down).
pub async fn a_panicking_handler_fails_the_attempt(b: &dyn Broker) {
    let g = group("panic");
    let events = publish_events(b, 0..2).await;
    let calls = Calls::default();
    let handler = Arc::new(PanicsOnce {
        e1: events[0].event_id.clone(),
        calls: calls.clone(),
    });
    let cancel = CancellationToken::new();
    let config = b.config(&g, serde_json::json!({ "retry_delay": "200ms" }));
    let (task, state) = b.start_controlled(Start {
        config,
        handler,
        tag: "a".into(),
        cancel: cancel.clone(),
    });
    wait_until(Duration::from_secs(20), "e1 handled on its retry", || {
        calls.lock().unwrap().len() >= 3
    })
    .await;
    // The consumer is still up, and takes what comes next.
    let e3 = publish_events(b, 2..3).await;
    wait_until(Duration::from_secs(10), "a message after the panic", || {
        calls.lock().unwrap().len() >= 4
    })
    .await;
    assert_eq!(state.snapshot().state, "consuming");
    let report = stop(&cancel, task).await;
    let seen: Vec<(String, u32)> = calls
        .lock()
        .unwrap()
        .iter()
        .map(|c| (c.message.event_id().to_owned(), c.message.attempt))
        .collect();
    let (e1, e2, e3) = (&events[0].event_id, &events[1].event_id, &e3[0].event_id);
    assert_eq!(
        seen,
        [
            (e1.clone(), 1),
            (e2.clone(), 1),
            (e1.clone(), 2),
            (e3.clone(), 1)
        ]
    );
    assert_eq!(
        (report.ok, report.retry, report.dead),
        (3, 1, 0),
        "{report:?}"
    );
    assert_eq!(b.outstanding(&g).await, 0);
}

/// (4) A consumer that dies mid-message: the message goes to the other.
pub async fn a_killed_consumers_message_is_redelivered(b: &dyn Broker, extra: serde_json::Value) {
    let g = group("kill");
    let e = test_event(0);
    b.publish(&e).await;
    let calls = Calls::default();
    let config = b.config(&g, extra);
    let hang = Arc::new(Recording {
        hang: true,
        ..Recording::new("doomed", &calls, Duration::ZERO)
    });
    let doomed_cancel = CancellationToken::new();
    let doomed = b.spawn(config.clone(), hang, &format!("{g}-doomed"), doomed_cancel);
    wait_until(
        Duration::from_secs(10),
        "the doomed consumer took the message",
        || !calls.lock().unwrap().is_empty(),
    )
    .await;
    doomed.abort();
    let _ = doomed.await;
    let cancel = CancellationToken::new();
    let survivor = b.spawn(
        config,
        recording("survivor", &calls, Duration::ZERO),
        &format!("{g}-survivor"),
        cancel.clone(),
    );
    wait_until(
        Duration::from_secs(20),
        "redelivery to the survivor",
        || calls.lock().unwrap().iter().any(|c| c.who == "survivor"),
    )
    .await;
    let report = stop(&cancel, survivor).await;
    let calls = calls.lock().unwrap().clone();
    let again = calls.iter().find(|c| c.who == "survivor").unwrap();
    assert_eq!(again.message.event_id(), e.event_id);
    assert_eq!(
        (again.message.attempt, again.message.redelivered),
        (2, true)
    );
    assert_eq!(report.ok, 1);
    assert_eq!(b.outstanding(&g).await, 0);
}

/// Graceful shutdown: cancelled while a message is in hand, the consumer
/// finishes it, acks it and returns without taking another.
pub async fn shutdown_finishes_the_message_in_hand(b: &dyn Broker) {
    let g = group("stop");
    publish_events(b, 0..3).await;
    let calls = Calls::default();
    let cancel = CancellationToken::new();
    let task = b.spawn(
        b.config(&g, serde_json::json!({})),
        recording("a", &calls, Duration::from_millis(700)),
        "a",
        cancel.clone(),
    );
    wait_until(Duration::from_secs(10), "a message in hand", || {
        !calls.lock().unwrap().is_empty()
    })
    .await;
    let report = stop(&cancel, task).await;
    assert_eq!(
        calls.lock().unwrap().len(),
        1,
        "nothing taken after the shutdown"
    );
    assert_eq!(report.ok, 1, "{report:?}");
    assert_eq!(
        b.unacked(&g).await.total,
        0,
        "the message in hand was acked"
    );
    assert_eq!(
        b.outstanding(&g).await,
        2,
        "the others wait for the next consumer"
    );
}

/// (5) With the inbox, a duplicate is counted `duplicate` and an older
/// version `stale`; each effect happens once.
pub async fn inbox_counts_duplicates_and_stale_versions(b: &dyn Broker) {
    use postbox_consumers::inbox::{Inbox, InboxHandler};
    let g = group("inbox");
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("inbox.db").display()
    );
    let inbox = Inbox::<sqlx::Sqlite>::connect(&url, "postbox_inbox")
        .await
        .unwrap();
    sqlx::query("CREATE TABLE effects (event_id TEXT NOT NULL)")
        .execute(inbox.pool())
        .await
        .unwrap();
    let pool = inbox.pool().clone();
    let mut v1 = test_event(1);
    v1.aggregate_id = Some("room-x".into());
    v1.aggregate_version = Some(1);
    let mut v2 = test_event(2);
    v2.aggregate_id = Some("room-x".into());
    v2.aggregate_version = Some(2);
    let mut old = test_event(3);
    old.aggregate_id = Some("room-x".into());
    old.aggregate_version = Some(1);
    b.publish(&v1).await;
    b.publish(&v2).await;
    b.publish(&v1).await; // a redelivered or republished copy
    b.publish(&old).await;
    let handler = Arc::new(InboxHandler::new(
        inbox,
        g.clone(),
        EffectRow::new("effects"),
    ));
    let cancel = CancellationToken::new();
    let task = b.spawn(
        b.config(&g, serde_json::json!({})),
        handler,
        "a",
        cancel.clone(),
    );
    let start = Instant::now();
    let report = loop {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM postbox_inbox")
            .fetch_one(&pool)
            .await
            .unwrap();
        if n >= 2 && b.outstanding(&g).await == 0 {
            break stop(&cancel, task).await;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "timed out");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (report.ok, report.duplicate, report.stale),
        (2, 1, 1),
        "{report:?}"
    );
    let effects: Vec<String> = sqlx::query_scalar("SELECT event_id FROM effects ORDER BY rowid")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(effects, [v1.event_id.clone(), v2.event_id.clone()]);
}

/// (7) Paused, a consumer finishes what it holds and takes nothing more
/// (the messages wait, unacknowledged by no one); resumed, it takes what
/// came meanwhile, each message once, no attempt counted for the pause.
pub async fn a_paused_consumer_takes_nothing_until_resumed(b: &dyn Broker) {
    let g = group("pause");
    let calls = Calls::default();
    let cancel = CancellationToken::new();
    let (task, state) = b.start_controlled(Start {
        config: b.config(&g, serde_json::json!({})),
        handler: recording("a", &calls, Duration::ZERO),
        tag: "a".to_owned(),
        cancel: cancel.clone(),
    });
    let before = publish_events(b, 0..3).await;
    wait_until(Duration::from_secs(20), "3 messages handled", || {
        calls.lock().unwrap().len() >= 3
    })
    .await;
    assert!(state.pause());
    // A pull or read under way ends first (at most its wait).
    let start = Instant::now();
    while state.snapshot().state != "paused" {
        assert!(start.elapsed() < Duration::from_secs(20), "never paused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during = publish_events(b, 3..6).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(calls.lock().unwrap().len(), 3, "nothing taken while paused");
    assert_eq!(b.unacked(&g).await.total, 0, "nothing held while paused");
    assert_eq!(b.outstanding(&g).await, 3, "the new messages wait");
    assert!(state.resume());
    let calls = handled_then_stopped(&calls, 6, &cancel, task).await;
    for e in before.iter().chain(&during) {
        let got: Vec<&Call> = calls
            .iter()
            .filter(|c| c.message.event_id() == e.event_id)
            .collect();
        assert_eq!(got.len(), 1, "{} handled once", e.event_id);
        assert_eq!(
            got[0].message.attempt, 1,
            "no attempt counted for the pause"
        );
    }
    assert_eq!(state.snapshot().ok, 6);
}

/// (8) Dead letters listed, replayed and purged (`postbox dead`): the
/// scenario of [`crate::dead_letters::scenario`] on this broker.
pub async fn dead_letters_are_listed_replayed_and_purged(b: &dyn Broker) {
    let g = group("deadtool");
    let events = publish_events(b, 0..6).await;
    let published: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
    let poison = published[..4].to_vec();
    let config = b.config(&g, serde_json::json!({ "max_attempts": 1 }));
    let start: crate::dead_letters::Starter<'_> = Box::new(move |config, handler| {
        let cancel = CancellationToken::new();
        let task = b.start(Start {
            config,
            handler,
            tag: "a".to_owned(),
            cancel: cancel.clone(),
        });
        (cancel, task)
    });
    crate::dead_letters::scenario(config, &published, &poison, start).await;
}

/// Runs every case against a broker built by `$new` (an async expression).
#[macro_export]
macro_rules! stream_consumer_suite {
    ($new:expr, kill_config = $kill:expr) => {
        stream_consumer_suite!(
            $new;
            delivers_every_message_with_its_envelope(),
            two_consumers_share_the_work_one_unacked_each(),
            poison_goes_dead_after_growing_delays(),
            a_killed_consumers_message_is_redelivered($kill),
            shutdown_finishes_the_message_in_hand(),
            inbox_counts_duplicates_and_stale_versions(),
            a_paused_consumer_takes_nothing_until_resumed(),
            dead_letters_are_listed_replayed_and_purged(),
            a_panicking_handler_fails_the_attempt()
        );
    };
    ($new:expr; $($case:ident($($arg:expr)?)),+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let b = $new.await;
                nats_redis_suite::$case(&b $(, $arg)?).await;
                b.cleanup().await;
            }
        )+
    };
}
