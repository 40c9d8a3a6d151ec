//! The RabbitMQ consumer against a real broker: retries with growing delays
//! into `<queue>.dead`, the inbox's duplicate and stale verdicts, shutdown.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use postbox_consumers::inbox::{Inbox, InboxHandler, TxHandler};
use postbox_consumers::rabbitmq::{ConsumeReport, RabbitMqConsumer};
use postbox_consumers::{Handled, Handler, HandlerError, Message};
use postbox_core::config::HumanDuration;
use tokio_util::sync::CancellationToken;

use common::*;
use postbox_testkit::consumer_fixtures::rabbitmqctl_list;

/// Fails every attempt at `poison`, succeeds otherwise; records when each
/// event was seen.
#[derive(Default)]
struct Recording {
    seen: Mutex<HashMap<String, Vec<(Instant, u32)>>>,
}

#[async_trait]
impl Handler for Recording {
    async fn handle(&self, m: &Message) -> Result<Handled, HandlerError> {
        self.seen
            .lock()
            .unwrap()
            .entry(m.event_id().to_owned())
            .or_default()
            .push((Instant::now(), m.attempt));
        if m.event_id() == "poison" {
            return Err(HandlerError::new("cannot digest poison"));
        }
        Ok(Handled::Ok)
    }
}

/// Runs `consumer` until the returned token is cancelled.
fn start(
    consumer: RabbitMqConsumer,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<ConsumeReport, postbox_core::Error>>,
) {
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(stop).await }
    });
    (stop, run)
}

/// Holds left in the ordering inbox's `<table>_holds`.
async fn holds_left(inbox: &Inbox<sqlx::Postgres>, table: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}_holds"))
        .fetch_one(inbox.pool())
        .await
        .unwrap()
}

/// Drops the ordering inbox's tables.
async fn drop_ordering_inbox(inbox: &Inbox<sqlx::Postgres>, table: &str) {
    for t in ["_holds", "_versions", ""] {
        let _ = sqlx::query(&format!("DROP TABLE {table}{t}"))
            .execute(inbox.pool())
            .await;
    }
}

/// A PostgreSQL inbox in a scratch table, with the table's name.
async fn ordering_inbox() -> (Inbox<sqlx::Postgres>, String) {
    use postbox_testkit::servers::{ensure_database, postgres_url, scratch_table};

    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let table = scratch_table("ordering_inbox");
    let inbox = Inbox::<sqlx::Postgres>::connect(&url, &table)
        .await
        .unwrap();
    (inbox, table)
}

#[tokio::test]
async fn poison_lands_in_dead_after_growing_delays_while_others_flow() {
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("poison");
    let mut config = consumer_config(&queue);
    config.max_attempts = 4;
    config.retry_delay = HumanDuration::millis(300);
    config.max_retry_delay = HumanDuration::millis(1000);
    declare(&ch, &queue).await;
    publish(&ch, &queue, "poison", None, r#"{"bad":true}"#).await;
    for i in 0..30 {
        publish(&ch, &queue, &format!("good-{i}"), None, "{}").await;
    }

    let handler = Arc::new(Recording::default());
    let consumer = RabbitMqConsumer::new(config, handler.clone()).unwrap();
    let (stop, run) = start(consumer);
    wait_until(
        "the poison message in .dead",
        Duration::from_secs(20),
        async || ready(&ch, &format!("{queue}.dead")).await == 1,
    )
    .await;
    stop.cancel();
    let report = run.await.unwrap().unwrap();

    let seen = handler.seen.lock().unwrap().clone();
    let poison = &seen["poison"];
    let attempts: Vec<u32> = poison.iter().map(|(_, a)| *a).collect();
    assert_eq!(
        attempts,
        [1, 2, 3, 4],
        "one handler call per attempt, counted"
    );
    let gaps: Vec<u128> = poison
        .windows(2)
        .map(|w| (w[1].0 - w[0].0).as_millis())
        .collect();
    println!("delays between attempts (ms): {gaps:?} (configured 300, 600, 1000)");
    for (gap, want) in gaps.iter().zip([300u128, 600, 1000]) {
        assert!(
            *gap >= want - 20,
            "gap {gap} ms shorter than the delay {want} ms"
        );
        assert!(
            *gap < want + 1500,
            "gap {gap} ms far longer than the delay {want} ms"
        );
    }
    // The good ones flowed while the poison waited out its delays.
    let last_good = (0..30)
        .map(|i| seen[&format!("good-{i}")][0].0)
        .max()
        .unwrap();
    assert!(
        last_good < poison[1].0,
        "good messages waited for the poison"
    );
    for i in 0..30 {
        assert_eq!(seen[&format!("good-{i}")].len(), 1, "good-{i} handled once");
    }
    assert_eq!(report.ok, 30);
    assert_eq!(report.retry, 3);
    assert_eq!(report.dead, 1);

    let dead = ch
        .basic_get(
            format!("{queue}.dead").as_str().into(),
            BasicGetOptions::default(),
        )
        .await
        .unwrap()
        .expect("the dead copy");
    let headers = dead.properties.headers().clone().unwrap();
    let error = headers
        .inner()
        .get("x-last-error")
        .expect("x-last-error header");
    let error = match error {
        lapin::types::AMQPValue::LongString(s) => s.to_string(),
        other => panic!("x-last-error is {other:?}"),
    };
    assert_eq!(error, "cannot digest poison");
    assert_eq!(
        dead.properties.message_id().as_ref().unwrap().as_str(),
        "poison"
    );
    assert_eq!(dead.data, br#"{"bad":true}"#);
    dead.acker.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(ready(&ch, &queue).await, 0);
    assert_eq!(ready(&ch, &format!("{queue}.retry")).await, 0);
    delete(&ch, &queue).await;
}

/// Panics on `e1`'s first `panics` attempts, handles everything else.
struct PanicsAtE1 {
    panics: u32,
    seen: Mutex<Vec<(String, u32)>>,
}

#[async_trait]
impl Handler for PanicsAtE1 {
    async fn handle(&self, m: &Message) -> Result<Handled, HandlerError> {
        self.seen
            .lock()
            .unwrap()
            .push((m.event_id().to_owned(), m.attempt));
        if m.event_id() == "e1" && m.attempt <= self.panics {
            panic!("e1 blew up at attempt {}", m.attempt);
        }
        Ok(Handled::Ok)
    }
}

/// A handler that panics has failed that attempt: e1 is retried (and
/// handled, or dead-lettered with the panic once its attempts are spent),
/// e2 is handled, and the consumer goes on.
#[tokio::test]
async fn a_panicking_handler_fails_the_attempt_and_the_consumer_goes_on() {
    let (_conn, ch) = broker().await;
    for (panics, max_attempts) in [(1, 5), (2, 2)] {
        let queue = scratch_queue("panic");
        declare(&ch, &queue).await;
        publish(&ch, &queue, "e1", None, "{}").await;
        publish(&ch, &queue, "e2", None, "{}").await;
        let mut config = consumer_config(&queue);
        config.max_attempts = max_attempts;
        let handler = Arc::new(PanicsAtE1 {
            panics,
            seen: Mutex::new(Vec::new()),
        });
        let consumer = RabbitMqConsumer::new(config, handler.clone()).unwrap();
        let state = consumer.state();
        let (stop, run) = start(consumer);
        wait_until("e1 settled", Duration::from_secs(15), async || {
            handler.seen.lock().unwrap().len() == 3
                && ready(&ch, &format!("{queue}.retry")).await == 0
                && ready(&ch, &queue).await == 0
        })
        .await;
        // Still consuming: what comes next is handled.
        publish(&ch, &queue, "e3", None, "{}").await;
        wait_until("e3 handled", Duration::from_secs(10), async || {
            handler.seen.lock().unwrap().len() == 4
        })
        .await;
        assert_eq!(state.snapshot().state, "consuming");
        stop.cancel();
        let report = run.await.unwrap().unwrap();
        let seen = handler.seen.lock().unwrap().clone();
        let seen: Vec<(&str, u32)> = seen.iter().map(|(e, a)| (e.as_str(), *a)).collect();
        assert_eq!(seen, [("e1", 1), ("e2", 1), ("e1", 2), ("e3", 1)]);
        if panics < max_attempts {
            assert_eq!((report.ok, report.retry, report.dead), (3, 1, 0));
        } else {
            assert_eq!((report.ok, report.retry, report.dead), (2, 1, 1));
            let dead = ch
                .basic_get(
                    format!("{queue}.dead").as_str().into(),
                    BasicGetOptions::default(),
                )
                .await
                .unwrap()
                .expect("e1's dead copy");
            let headers = dead.properties.headers().clone().unwrap();
            let error = match headers.inner().get("x-last-error") {
                Some(lapin::types::AMQPValue::LongString(s)) => s.to_string(),
                other => panic!("x-last-error is {other:?}"),
            };
            assert_eq!(error, "handler panicked: e1 blew up at attempt 2");
            dead.acker.ack(BasicAckOptions::default()).await.unwrap();
        }
        delete(&ch, &queue).await;
    }
}

/// A SQLite inbox `inbox` in `dir`, beside the table `effect` its
/// handler writes event ids to.
async fn sqlite_inbox_with_effect(dir: &std::path::Path) -> Inbox<sqlx::Sqlite> {
    let url = format!("sqlite://{}", dir.join("inbox.db").display());
    let inbox = Inbox::<sqlx::Sqlite>::connect(&url, "inbox").await.unwrap();
    sqlx::query("CREATE TABLE effect (event_id TEXT NOT NULL)")
        .execute(inbox.pool())
        .await
        .unwrap();
    inbox
}

#[tokio::test]
async fn inbox_counts_duplicates_and_skips_stale_versions() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = sqlite_inbox_with_effect(dir.path()).await;

    let (_conn, ch) = broker().await;
    let queue = scratch_queue("stale");
    declare(&ch, &queue).await;
    publish(&ch, &queue, "e1", Some(("room-1", 2)), "{}").await;
    publish(&ch, &queue, "e1", Some(("room-1", 2)), "{}").await; // redelivered
    publish(&ch, &queue, "e0", Some(("room-1", 1)), "{}").await; // older version
    publish(&ch, &queue, "e3", Some(("room-1", 3)), "{}").await;
    publish(&ch, &queue, "x1", None, "{}").await;

    let handler = Arc::new(InboxHandler::new(
        inbox.clone(),
        "console",
        EffectRow::new("effect"),
    ));
    let consumer = RabbitMqConsumer::new(consumer_config(&queue), handler).unwrap();
    let (stop, run) = start(consumer);
    wait_until(
        "five messages handled",
        Duration::from_secs(15),
        async || {
            ready(&ch, &queue).await == 0
                && sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM inbox")
                    .fetch_one(inbox.pool())
                    .await
                    .unwrap()
                    == 3
        },
    )
    .await;
    // The last message is acked after its commit; give the ack a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!(
        (
            report.ok,
            report.duplicate,
            report.stale,
            report.retry,
            report.dead
        ),
        (3, 1, 1, 0, 0),
        "{report:?}"
    );
    let effects: Vec<String> = sqlx::query_scalar("SELECT event_id FROM effect ORDER BY event_id")
        .fetch_all(inbox.pool())
        .await
        .unwrap();
    assert_eq!(effects, ["e1", "e3", "x1"]);
    let version: i64 = sqlx::query_scalar(
        "SELECT aggregate_version FROM inbox_versions WHERE consumer_group = 'console' AND aggregate_id = 'room-1'",
    )
    .fetch_one(inbox.pool())
    .await
    .unwrap();
    assert_eq!(version, 3);
    delete(&ch, &queue).await;
}

/// A handled message whose ack was lost (its consumer stopped after the
/// inbox committed, before the ack) comes back redelivered on its last
/// attempt: it is acknowledged as a duplicate, where it was dead-lettered
/// although handled.
#[tokio::test]
async fn a_handled_message_back_on_its_last_attempt_is_a_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = sqlite_inbox_with_effect(dir.path()).await;
    let (conn, ch) = broker().await;
    let queue = scratch_queue("lost_ack");
    declare(&ch, &queue).await;
    publish(&ch, &queue, "e1", None, "{}").await;
    let handler = Arc::new(InboxHandler::new(
        inbox.clone(),
        "console",
        EffectRow::new("effect"),
    ));

    // The first consumer takes it, handles it (the inbox commits) and stops
    // before its ack: its channel closes, the broker gives the message back.
    let first = conn.create_channel().await.unwrap();
    let taken = first
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("the message");
    assert!(!taken.delivery.redelivered);
    let mut message = Message {
        envelope: postbox_core::envelope::Envelope {
            event_id: "e1".into(),
            app_code: "test".into(),
            event_type: "TestEvent".into(),
            aggregate_id: None,
            aggregate_version: None,
            created_at_ms: 0,
            headers: Default::default(),
            payload: postbox_core::envelope::Envelope::payload_of("{}"),
        },
        attempt: 1,
        redelivered: false,
    };
    assert_eq!(handler.handle(&message).await, Ok(Handled::Ok));
    first.close(200, "stopped".into()).await.unwrap();
    message.attempt = 2;
    assert_eq!(handler.handle(&message).await, Ok(Handled::Duplicate));

    // The next consumer allows one attempt: the redelivery is that attempt's
    // end without a result, but the inbox has the event.
    let mut config = consumer_config(&queue);
    config.max_attempts = 1;
    let consumer = RabbitMqConsumer::new(config, handler).unwrap();
    let (stop, run) = start(consumer);
    wait_until(
        "the redelivered message settled",
        Duration::from_secs(15),
        async || ready(&ch, &queue).await == 0 && ready(&ch, &format!("{queue}.dead")).await == 0,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!(
        (report.ok, report.duplicate, report.retry, report.dead),
        (0, 1, 0, 0),
        "{report:?}"
    );
    assert_eq!(ready(&ch, &format!("{queue}.dead")).await, 0);
    let effects: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effect")
        .fetch_one(inbox.pool())
        .await
        .unwrap();
    assert_eq!(effects, 1);
    delete(&ch, &queue).await;
}

/// Takes `hold` per message and counts calls.
struct Slow {
    hold: Duration,
    calls: Mutex<u32>,
}

#[async_trait]
impl Handler for Slow {
    async fn handle(&self, _m: &Message) -> Result<Handled, HandlerError> {
        *self.calls.lock().unwrap() += 1;
        tokio::time::sleep(self.hold).await;
        Ok(Handled::Ok)
    }
}

/// Shutdown finishes the message in hand; the rest go back to the queue,
/// those the broker had already pushed (prefetch 3) as they were: not
/// `redelivered`, which the next consumer would count as a failed attempt
/// of a consumer that stopped while handling them.
#[tokio::test]
async fn shutdown_finishes_the_message_in_hand_and_leaves_the_rest() {
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("shutdown");
    declare(&ch, &queue).await;
    for i in 0..5 {
        publish(&ch, &queue, &format!("s-{i}"), None, "{}").await;
    }
    let handler = Arc::new(Slow {
        hold: Duration::from_millis(800),
        calls: Mutex::new(0),
    });
    let mut config = consumer_config(&queue);
    config.prefetch = 3;
    let consumer = RabbitMqConsumer::new(config, handler.clone()).unwrap();
    let (stop, run) = start(consumer);
    wait_until(
        "the first message in hand",
        Duration::from_secs(10),
        async || *handler.calls.lock().unwrap() == 1,
    )
    .await;
    stop.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!(report.ok, 1, "the message in hand was finished and acked");
    assert_eq!(*handler.calls.lock().unwrap(), 1, "nothing new was started");
    wait_until(
        "the other four back in the queue",
        Duration::from_secs(5),
        async || ready(&ch, &queue).await == 4,
    )
    .await;
    let mut back = Vec::new();
    for _ in 0..4 {
        let m = ch
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("a message back in the queue");
        let id = m.properties.message_id().as_ref().unwrap().to_string();
        back.push((id, m.delivery.redelivered));
    }
    back.sort();
    let expected: Vec<(String, bool)> = (1..5).map(|i| (format!("s-{i}"), false)).collect();
    assert_eq!(back, expected, "each back once, none as a redelivery");
    delete(&ch, &queue).await;
}

/// Closes the broker connection named `name` (this test's own, never others).
async fn close_connection_named(name: &str) -> bool {
    let listing = rabbitmqctl_list("connections", &["pid", "client_properties"]).await;
    let Some(pid) = listing
        .lines()
        .find(|l| l.contains(&format!("\"{name}\"")))
        .and_then(|l| l.split('\t').next())
    else {
        return false;
    };
    tokio::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "close_connection",
            pid,
            "postbox test: simulated drop",
        ])
        .status()
        .await
        .unwrap()
        .success()
}

#[tokio::test]
async fn reconnects_after_the_broker_drops_the_connection() {
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("reconnect");
    declare(&ch, &queue).await;
    let handler = Arc::new(Recording::default());
    let consumer = RabbitMqConsumer::new(consumer_config(&queue), handler.clone()).unwrap();
    let name = consumer.tag().to_owned();
    let (stop, run) = start(consumer);
    for i in 0..5 {
        publish(&ch, &queue, &format!("r-{i}"), None, "{}").await;
    }
    let seen = |h: &Recording| h.seen.lock().unwrap().len();
    wait_until("five handled", Duration::from_secs(10), async || {
        seen(&handler) == 5
    })
    .await;
    let mut closed = false;
    for _ in 0..10 {
        if close_connection_named(&name).await {
            closed = true;
            break;
        }
    }
    assert!(closed, "could not find the consumer's connection `{name}`");
    for i in 5..10 {
        publish(&ch, &queue, &format!("r-{i}"), None, "{}").await;
    }
    wait_until(
        "ten handled after the reconnect",
        Duration::from_secs(20),
        async || seen(&handler) == 10,
    )
    .await;
    stop.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!(report.ok, 10);
    delete(&ch, &queue).await;
}

/// Fails `e1` on its first attempt; writes nothing itself (the inbox rows
/// tell what was applied).
struct FailsFirstE1;

#[async_trait]
impl TxHandler<sqlx::Postgres> for FailsFirstE1 {
    async fn handle(&self, _tx: &mut Tx<sqlx::Postgres>, m: &Message) -> Result<(), HandlerError> {
        if m.event_id() == "e1" && m.attempt == 1 {
            return Err(HandlerError::new("e1 fails once"));
        }
        Ok(())
    }
}

/// Logs `event_id:outcome` for every handler call, in order.
struct Outcomes<H> {
    inner: H,
    log: Mutex<Vec<String>>,
}

#[async_trait]
impl<H: Handler> Handler for Outcomes<H> {
    async fn handle(&self, m: &Message) -> Result<Handled, HandlerError> {
        let result = self.inner.handle(m).await;
        let outcome = match &result {
            Ok(h) => h.as_str(),
            Err(_) => "error",
        };
        self.log
            .lock()
            .unwrap()
            .push(format!("{}:{outcome}", m.event_id()));
        result
    }
}

/// A declared scratch queue holding e1 and e2 (versions 1 and 2 of
/// `room-1`) and x (version 1 of `room-2`), published in `order`.
async fn ordering_queue(
    prefix: &str,
    order: [&str; 3],
) -> (lapin::Connection, lapin::Channel, String) {
    let (conn, ch) = broker().await;
    let queue = scratch_queue(prefix);
    declare(&ch, &queue).await;
    for event_id in order {
        let aggregate = match event_id {
            "e1" => ("room-1", 1),
            "e2" => ("room-1", 2),
            _ => ("room-2", 1),
        };
        publish(&ch, &queue, event_id, Some(aggregate), "{}").await;
    }
    (conn, ch, queue)
}

/// e1 and e2 of one aggregate, and x of another: e1 fails once.
async fn run_ordering(
    ordering: postbox_core::config::Ordering,
    inbox: &Inbox<sqlx::Postgres>,
) -> (Vec<String>, ConsumeReport) {
    use postbox_consumers::ordering::Holds;

    let (_conn, ch, queue) = ordering_queue("ordering", ["e1", "e2", "x"]).await;

    let handler = Arc::new(Outcomes {
        inner: InboxHandler::new(inbox.clone(), queue.clone(), FailsFirstE1),
        log: Mutex::new(Vec::new()),
    });
    let mut config = consumer_config(&queue);
    config.ordering = ordering;
    let consumer = RabbitMqConsumer::new(config, handler.clone())
        .unwrap()
        .with_holds(Arc::new(Holds::<sqlx::Postgres>::of(inbox).await.unwrap()));
    let (stop, run) = start(consumer);
    // Done when e1 was handled a second time (applied, or skipped as stale).
    wait_until("e1 back from retry", Duration::from_secs(15), async || {
        let log = handler.log.lock().unwrap();
        log.iter().filter(|l| l.starts_with("e1:")).count() == 2
            && log.iter().any(|l| l.starts_with("e2:"))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!(ready(&ch, &queue).await, 0);
    assert_eq!(ready(&ch, &format!("{queue}.retry")).await, 0);
    delete(&ch, &queue).await;
    let log = handler.log.lock().unwrap().clone();
    (log, report)
}

#[tokio::test]
async fn per_aggregate_ordering_holds_later_events_behind_a_retry() {
    use postbox_core::config::Ordering;

    let (inbox, table) = ordering_inbox().await;

    // Without the setting: e2 overtakes e1, and e1 is skipped as stale.
    let (log, report) = run_ordering(Ordering::None, &inbox).await;
    println!("ordering = none: {log:?} {report:?}");
    assert_eq!(log, ["e1:error", "e2:ok", "x:ok", "e1:stale"]);
    assert_eq!((report.stale, report.held), (1, 0));

    // With it: e2 waits behind e1 in retry, the other aggregate flows.
    let (log, report) = run_ordering(Ordering::PerAggregate, &inbox).await;
    println!("ordering = per_aggregate: {log:?} {report:?}");
    assert_eq!(log, ["e1:error", "x:ok", "e1:ok", "e2:ok"]);
    assert_eq!(report.stale, 0);
    assert!(report.held >= 1, "{report:?}");
    assert_eq!(report.retry, 1, "only e1's failure counted as an attempt");
    let holds = holds_left(&inbox, &table).await;
    assert_eq!(holds, 0, "the hold was released");

    drop_ordering_inbox(&inbox, &table).await;
}

/// Fails `e1`'s first attempt like [`FailsFirstE1`]; takes `work` over
/// each event of another aggregate (a backlog between e1 and e2).
struct SlowBacklog {
    work: Duration,
}

#[async_trait]
impl TxHandler<sqlx::Postgres> for SlowBacklog {
    async fn handle(&self, tx: &mut Tx<sqlx::Postgres>, m: &Message) -> Result<(), HandlerError> {
        FailsFirstE1.handle(tx, m).await?;
        if m.event_id().starts_with("backlog-") {
            tokio::time::sleep(self.work).await;
        }
        Ok(())
    }
}

/// e1 fails; the backlog between e1 and e2 takes longer than e1's hold
/// stands (retry delay + max_retry_delay + grace), so e2 comes after the
/// hold lapsed, while e1's retry copy still waits in the queue behind it.
/// A lapsed hold does not let e2 through: e2 goes round the queue once,
/// behind e1's copy, and e1 is handled before it, not skipped as stale.
#[tokio::test]
async fn per_aggregate_ordering_outlasts_a_backlog_longer_than_the_hold() {
    use postbox_consumers::ordering::Holds;
    use postbox_core::config::Ordering;

    let (inbox, table) = ordering_inbox().await;
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("ordering_backlog");
    declare(&ch, &queue).await;
    publish(&ch, &queue, "e1", Some(("room-1", 1)), "{}").await;
    let backlog = 6;
    for i in 0..backlog {
        let id = format!("backlog-{i}");
        publish(&ch, &queue, &id, Some(("room-2", i + 1)), "{}").await;
    }
    publish(&ch, &queue, "e2", Some(("room-1", 2)), "{}").await;

    let handler = Arc::new(Outcomes {
        inner: InboxHandler::new(
            inbox.clone(),
            queue.clone(),
            SlowBacklog {
                work: Duration::from_millis(150),
            },
        ),
        log: Mutex::new(Vec::new()),
    });
    let mut config = consumer_config(&queue);
    config.ordering = Ordering::PerAggregate;
    config.retry_delay = HumanDuration::millis(200);
    config.max_retry_delay = HumanDuration::millis(300);
    // e1's hold stands 200 + 300 + 100 ms; the backlog takes 6 × 150 ms.
    let consumer = RabbitMqConsumer::new(config, handler.clone())
        .unwrap()
        .with_holds(Arc::new(Holds::<sqlx::Postgres>::of(&inbox).await.unwrap()))
        .with_hold_grace(Duration::from_millis(100));
    let (stop, run) = start(consumer);
    wait_until("e1 and e2 settled", Duration::from_secs(15), async || {
        let log = handler.log.lock().unwrap();
        log.iter().filter(|l| l.starts_with("e1:")).count() == 2
            && log.iter().any(|l| l.starts_with("e2:"))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    let report = run.await.unwrap().unwrap();
    let log = handler.log.lock().unwrap().clone();
    println!("{log:?} {report:?}");
    let room_1: Vec<&str> = log
        .iter()
        .map(String::as_str)
        .filter(|l| !l.starts_with("backlog-"))
        .collect();
    assert_eq!(room_1, ["e1:error", "e1:ok", "e2:ok"], "{log:?}");
    assert_eq!(
        (report.ok, report.stale),
        (backlog as u64 + 2, 0),
        "{report:?}"
    );
    assert!(report.held >= 1, "e2 went round behind e1: {report:?}");
    assert_eq!(ready(&ch, &queue).await, 0);
    assert_eq!(ready(&ch, &format!("{queue}.retry")).await, 0);
    let holds = holds_left(&inbox, &table).await;
    assert_eq!(holds, 0, "every hold was released");
    delete(&ch, &queue).await;
    drop_ordering_inbox(&inbox, &table).await;
}

/// The hold of an event whose copy is gone (purged by hand): a later
/// version waits behind it until it lapses, goes round the queue once more
/// to see that the event does not come back, then drops the hold and is
/// handled; its aggregate is not blocked for good.
#[tokio::test]
async fn a_hold_whose_event_is_gone_holds_its_aggregate_one_round_past_its_lapse() {
    use postbox_consumers::ordering::{AggregateHolds, Holds};
    use postbox_core::config::Ordering;

    let (inbox, table) = ordering_inbox().await;
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("ordering_gone");
    declare(&ch, &queue).await;
    let holds = Arc::new(Holds::<sqlx::Postgres>::of(&inbox).await.unwrap());
    let lapse = postbox_core::time::now_ms() + 600;
    holds.hold(&queue, "room-1", "e1", 1, lapse).await.unwrap();
    publish(&ch, &queue, "e2", Some(("room-1", 2)), "{}").await;
    let handler = Arc::new(Outcomes {
        inner: InboxHandler::new(inbox.clone(), queue.clone(), FailsFirstE1),
        log: Mutex::new(Vec::new()),
    });
    let mut config = consumer_config(&queue);
    config.ordering = Ordering::PerAggregate;
    config.retry_delay = HumanDuration::millis(200);
    let consumer = RabbitMqConsumer::new(config, handler.clone())
        .unwrap()
        .with_holds(holds);
    let (stop, run) = start(consumer);
    wait_until("e2 handled", Duration::from_secs(10), async || {
        !handler.log.lock().unwrap().is_empty()
    })
    .await;
    let handled_at = postbox_core::time::now_ms();
    stop.cancel();
    let report = run.await.unwrap().unwrap();
    let log = handler.log.lock().unwrap().clone();
    println!("{log:?} {report:?}");
    assert_eq!(log, ["e2:ok"]);
    assert!(
        handled_at >= lapse + 200,
        "handled before a round past the lapse"
    );
    // Behind the standing hold every 200 ms, then once round to check.
    assert!(report.held >= 2, "{report:?}");
    let left = holds_left(&inbox, &table).await;
    assert_eq!(left, 0, "the gone event's hold was dropped, e2's released");
    delete(&ch, &queue).await;
    drop_ordering_inbox(&inbox, &table).await;
}

/// The holds' SQL on each inbox database: a hold blocks later versions of
/// its aggregate only, still stands when lapsed (the consumer decides what
/// a lapse means), moves, is released only by its own event, and is
/// dropped as gone only as it was noted.
macro_rules! holds_case {
    ($name:ident, $db:ty, $setup:expr) => {
        #[tokio::test]
        async fn $name() {
            use postbox_consumers::ordering::{AggregateHolds, Hold, Holds};
            use postbox_testkit::servers::scratch_table;

            let (url, _dir): (String, Option<tempfile::TempDir>) = $setup.await;
            let table = scratch_table("holds");
            let inbox = Inbox::<$db>::connect(&url, &table).await.unwrap();
            let holds = Holds::<$db>::of(&inbox).await.unwrap();
            Holds::<$db>::of(&inbox).await.unwrap(); // a second process starting
            let now = postbox_core::time::now_ms();
            let blocker = async |version: i64, event: &str| {
                holds.blocker("g", "a", version, event).await.unwrap()
            };
            let held = |event: &str, until_ms: i64| Hold {
                event_id: event.to_owned(),
                until_ms,
            };
            assert_eq!(blocker(2, "e2").await, None);
            holds.hold("g", "a", "e1", 1, now + 10_000).await.unwrap();
            assert_eq!(blocker(2, "e2").await, Some(held("e1", now + 10_000)));
            assert_eq!(blocker(1, "e1").await, None, "not behind itself");
            assert_eq!(blocker(0, "e0").await, None, "earlier versions pass");
            assert_eq!(
                holds.blocker("g", "b", 2, "b2").await.unwrap(),
                None,
                "other aggregates pass"
            );
            assert_eq!(
                holds.blocker("h", "a", 2, "e2").await.unwrap(),
                None,
                "other groups pass"
            );
            holds.hold("g", "a", "e1", 1, now - 1).await.unwrap();
            assert_eq!(
                blocker(2, "e2").await,
                Some(held("e1", now - 1)),
                "moved, and still there once lapsed"
            );
            // A later version's own hold does not block the earlier one.
            holds.hold("g", "a", "e2", 2, now + 30_000).await.unwrap();
            assert_eq!(blocker(1, "e1").await, None);
            assert_eq!(blocker(3, "e3").await, Some(held("e1", now - 1)));
            // Releasing e2 leaves e1's lapsed hold: it is e1's.
            holds.release("g", "a", "e2").await.unwrap();
            assert_eq!(blocker(3, "e3").await, Some(held("e1", now - 1)));
            holds.hold("g", "a", "e2", 2, now + 30_000).await.unwrap();
            // Dropped as gone only as noted.
            let noted_before_it_moved = held("e1", now - 2);
            let gone = holds.drop_gone("g", "a", &noted_before_it_moved);
            assert!(!gone.await.unwrap(), "moved since it was noted");
            assert!(holds
                .drop_gone("g", "a", &held("e1", now - 1))
                .await
                .unwrap());
            assert_eq!(blocker(3, "e3").await, Some(held("e2", now + 30_000)));
            holds.release("g", "a", "e2").await.unwrap();
            assert_eq!(blocker(3, "e3").await, None);
            // The purge takes the holds that lapsed before its cut-off (the
            // inbox's retention ago), and only those: kept for ever before.
            holds
                .hold("g", "old", "o1", 1, now - 100_000)
                .await
                .unwrap();
            holds.hold("g", "new", "n1", 1, now - 10).await.unwrap();
            assert_eq!(holds.purge(now - 50_000, 1).await.unwrap(), 1);
            assert_eq!(holds.blocker("g", "old", 2, "o2").await.unwrap(), None);
            assert!(holds.blocker("g", "new", 2, "n2").await.unwrap().is_some());
            for t in ["_holds", "_versions", ""] {
                let _ = sqlx::query(&format!("DROP TABLE {table}{t}"))
                    .execute(inbox.pool())
                    .await;
            }
        }
    };
}

holds_case!(holds_on_postgres, sqlx::Postgres, async {
    let url = postbox_testkit::servers::postgres_url();
    postbox_testkit::servers::ensure_database("postgres", &url).await;
    (url, None)
});

holds_case!(holds_on_mariadb, sqlx::MySql, async {
    let url = postbox_testkit::servers::mysql_url();
    postbox_testkit::servers::ensure_database("mysql", &url).await;
    (url, None)
});

holds_case!(holds_on_sqlite, sqlx::Sqlite, async {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
    (url, Some(dir))
});

/// e1 fails once; `x` (another aggregate) takes a while, so e2 is held back
/// well after e1 went to retry; when e1 comes back its handler publishes e3
/// and notes whether e2 was still waiting in `.retry` at that moment; fails
/// `e1`'s first attempt like [`FailsFirstE1`].
struct E3WhileE2Waits {
    ch: lapin::Channel,
    queue: String,
    e2_waiting_when_e3_sent: Arc<Mutex<Option<bool>>>,
}

#[async_trait]
impl TxHandler<sqlx::Postgres> for E3WhileE2Waits {
    async fn handle(&self, tx: &mut Tx<sqlx::Postgres>, m: &Message) -> Result<(), HandlerError> {
        FailsFirstE1.handle(tx, m).await?;
        match (m.event_id(), m.attempt) {
            ("e1", _) => {
                publish(&self.ch, &self.queue, "e3", Some(("room-1", 3)), "{}").await;
                let waiting = ready(&self.ch, &format!("{}.retry", self.queue)).await == 1;
                *self.e2_waiting_when_e3_sent.lock().unwrap() = Some(waiting);
            }
            ("x", _) => tokio::time::sleep(Duration::from_millis(700)).await,
            _ => {}
        }
        Ok(())
    }
}

#[tokio::test]
async fn per_aggregate_ordering_holds_later_events_behind_a_held_back_one() {
    use postbox_consumers::ordering::Holds;
    use postbox_core::config::Ordering;

    let (inbox, table) = ordering_inbox().await;
    let (_conn, ch, queue) = ordering_queue("ordering_held", ["e1", "x", "e2"]).await;

    let e2_waiting = Arc::new(Mutex::new(None));
    let handler = Arc::new(Outcomes {
        inner: InboxHandler::new(
            inbox.clone(),
            queue.clone(),
            E3WhileE2Waits {
                ch: ch.clone(),
                queue: queue.clone(),
                e2_waiting_when_e3_sent: e2_waiting.clone(),
            },
        ),
        log: Mutex::new(Vec::new()),
    });
    let mut config = consumer_config(&queue);
    config.ordering = Ordering::PerAggregate;
    config.retry_delay = HumanDuration::millis(1000);
    let consumer = RabbitMqConsumer::new(config, handler.clone())
        .unwrap()
        .with_holds(Arc::new(Holds::<sqlx::Postgres>::of(&inbox).await.unwrap()));
    let (stop, run) = start(consumer);
    wait_until("e2 and e3 handled", Duration::from_secs(20), async || {
        let log = handler.log.lock().unwrap();
        log.iter().any(|l| l.starts_with("e2:")) && log.iter().any(|l| l.starts_with("e3:"))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    let report = run.await.unwrap().unwrap();
    let log = handler.log.lock().unwrap().clone();
    println!("{log:?} {report:?}");
    assert_eq!(
        *e2_waiting.lock().unwrap(),
        Some(true),
        "the interleaving did not happen: e3 must be published while e2 waits in .retry"
    );
    assert_eq!(log, ["e1:error", "x:ok", "e1:ok", "e2:ok", "e3:ok"]);
    assert_eq!((report.ok, report.stale), (4, 0), "{report:?}");
    assert!(report.held >= 2, "e2 and e3 were held back: {report:?}");
    assert_eq!(ready(&ch, &queue).await, 0);
    assert_eq!(ready(&ch, &format!("{queue}.retry")).await, 0);
    let holds = holds_left(&inbox, &table).await;
    assert_eq!(holds, 0, "every hold was released");
    delete(&ch, &queue).await;
    drop_ordering_inbox(&inbox, &table).await;
}

/// A TCP relay between a consumer and the broker whose connections can be
/// reset (RST, as when a broker node is killed) at any moment.
struct ResettableLink {
    url: String,
    open: Arc<Mutex<Vec<CancellationToken>>>,
}

impl ResettableLink {
    async fn start() -> ResettableLink {
        use tokio::net::{TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (url, server) = postbox_testkit::amqp::through_proxy(listener.local_addr().unwrap());
        let open: Arc<Mutex<Vec<CancellationToken>>> = Arc::default();
        let links = open.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut upstream = TcpStream::connect(&server).await.unwrap();
                let cut = CancellationToken::new();
                links.lock().unwrap().push(cut.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                        _ = cut.cancelled() => {
                            // Closing with a zero linger sends RST.
                            #[allow(deprecated)]
                            let _ = client.set_linger(Some(Duration::ZERO));
                        }
                    }
                });
            }
        });
        ResettableLink { url, open }
    }

    /// Resets the connections open now: their clients read ECONNRESET.
    fn reset(&self) {
        for cut in self.open.lock().unwrap().drain(..) {
            cut.cancel();
        }
    }
}

/// Counts the distinct events handled; handles at once.
#[derive(Default)]
struct Counting {
    seen: Mutex<std::collections::HashSet<String>>,
}

impl Counting {
    fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

#[async_trait]
impl Handler for Counting {
    async fn handle(&self, m: &Message) -> Result<Handled, HandlerError> {
        self.seen.lock().unwrap().insert(m.event_id().to_owned());
        Ok(Handled::Ok)
    }
}

/// The connection is reset (a broker node killed) again and again while
/// the consumer acknowledges at full speed: each time it must notice,
/// reconnect and go on, however its acknowledgement in flight ends. An
/// acknowledgement sent as the connection failed could wait forever (lapin
/// drops it unanswered), and the consumer with it: a 3-node cluster's
/// node-death test stopped at 429 of 1,200 events for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goes_on_through_connection_resets_while_acknowledging() {
    const EVENTS: usize = 3_000;
    const RESETS: usize = 12;
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("reset");
    declare(&ch, &queue).await;
    for i in 0..EVENTS {
        publish(&ch, &queue, &format!("x-{i}"), None, "{}").await;
    }
    let link = ResettableLink::start().await;
    let handler = Arc::new(Counting::default());
    let mut config = consumer_config(&queue);
    config.url = postbox_core::redact::SecretUrl::new(link.url.clone());
    config.prefetch = 20;
    let consumer = RabbitMqConsumer::new(config, handler.clone()).unwrap();
    let (stop, run) = start(consumer);
    for r in 1..=RESETS {
        let at = r * EVENTS / (RESETS + 2);
        wait_until(
            &format!("{at} handled before reset {r}"),
            Duration::from_secs(30),
            async || handler.count() >= at,
        )
        .await;
        link.reset();
    }
    wait_until(
        "every event handled after the resets",
        Duration::from_secs(30),
        async || handler.count() == EVENTS,
    )
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the consumer stops")
        .unwrap()
        .unwrap();
    delete(&ch, &queue).await;
}

/// Fails every event for good.
struct Refuses;

#[async_trait]
impl Handler for Refuses {
    async fn handle(&self, _m: &Message) -> Result<Handled, HandlerError> {
        Err(HandlerError::permanent("never"))
    }
}

/// `<queue>.dead` full and refusing (`max-length = 1`, `overflow =
/// reject-publish`): the second event's dead copy is refused, the session
/// breaks on it, and the next one meets it again. The consumer backs off
/// (0.5 s doubling) instead of reconnecting about once a second for as long as
/// the dead queue stays full.
#[tokio::test]
async fn a_refused_dead_copy_backs_off_instead_of_reconnecting_every_second() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("refused");
    declare(&ch, &queue).await;
    let policy = format!("{queue}-full");
    let set = tokio::process::Command::new("rabbitmqctl")
        .args(["-q", "set_policy", "--apply-to", "queues", &policy])
        .arg(format!("^{}$", regex_escape(&format!("{queue}.dead"))))
        .arg(r#"{"max-length":1,"overflow":"reject-publish"}"#)
        .status()
        .await
        .expect("rabbitmqctl on PATH");
    assert!(set.success());
    for i in 0..2 {
        publish(&ch, &queue, &format!("r-{i}"), None, "{}").await;
    }
    // Count the consumer's connections through a proxy.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (url, upstream) = postbox_testkit::amqp::through_proxy(listener.local_addr().unwrap());
    let opened = Arc::new(AtomicU64::new(0));
    let count = opened.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let mut client = client;
                if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    let mut config = consumer_config(&queue);
    config.url = postbox_core::redact::SecretUrl::new(url);
    let consumer = RabbitMqConsumer::new(config, Arc::new(Refuses)).unwrap();
    let (stop, run) = start(consumer);
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.cancel();
    let _ = run.await.unwrap();
    let _ = tokio::process::Command::new("rabbitmqctl")
        .args(["-q", "clear_policy", &policy])
        .status()
        .await;
    let sessions = opened.load(Ordering::SeqCst);
    // Backing off: sessions at about 0, 0.5, 1.5, 3.5, 7.5 s; without, one
    // about every second (the message goes round through `.retry`).
    assert!(
        (2..=6).contains(&sessions),
        "{sessions} connections in 10 s"
    );
    assert_eq!(
        ready(&ch, &format!("{queue}.dead")).await,
        1,
        "the first dead copy"
    );
    delete(&ch, &queue).await;
}

/// `text` with the regular expression's special characters escaped.
fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| match c {
            '.' | '*' | '+' | '?' | '(' | ')' | '[' | ']' | '{' | '}' | '^' | '$' | '|' | '\\' => {
                vec!['\\', c]
            }
            c => vec![c],
        })
        .collect()
}

/// The broker goes silent while a consumer with `declare = false` checks
/// the queues it was given: the connection is found dead, and the consumer
/// reconnects, checks again and consumes.
#[tokio::test]
async fn a_broker_gone_silent_while_checking_the_queues_is_reconnected() {
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("checkreset");
    declare(&ch, &queue).await;
    publish(&ch, &queue, "c-1", None, "{}").await;
    let (proxy, url) = postbox_testkit::proxy::to_amqp().await;
    let url = format!("{url}?heartbeat=1");
    // `queue.declare` (class 50, method 10): the check's first passive one.
    proxy.silence_on(&[0, 50, 0, 10]);
    let mut config = consumer_config(&queue);
    config.declare = false;
    config.url = postbox_core::redact::SecretUrl::new(url);
    let handler = Arc::new(Counting::default());
    let (stop, run) = start(RabbitMqConsumer::new(config, handler.clone()).unwrap());
    wait_until("the message handled", Duration::from_secs(30), async || {
        handler.count() == 1
    })
    .await;
    stop.cancel();
    let report = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the consumer stops")
        .unwrap()
        .unwrap();
    assert_eq!(report.ok, 1, "{report:?}");
    delete(&ch, &queue).await;
}

/// A broker under a memory or disk alarm blocks a connection that
/// publishes: it reads nothing more from it, while its heartbeats still
/// come, so the connection is not lost. A consumer waiting there for the
/// confirm of a dead copy stops when asked (a deploy during the alarm),
/// leaving the message unacked; it waited for the alarm to clear before.
#[tokio::test]
async fn a_consumer_blocked_by_a_broker_alarm_stops_when_asked() {
    let (_conn, ch) = broker().await;
    let queue = scratch_queue("alarm");
    declare(&ch, &queue).await;
    let (proxy, url) = postbox_testkit::proxy::to_amqp().await;
    // `basic.publish` (class 60, method 40): the dead copy. From it on the
    // broker reads nothing from the consumer's connection.
    proxy.deafen_on(&[0, 60, 0, 40]);
    let mut config = consumer_config(&queue);
    config.url = postbox_core::redact::SecretUrl::new(url);
    let (stop, run) = start(RabbitMqConsumer::new(config, Arc::new(Refuses)).unwrap());
    publish(&ch, &queue, "alarm-1", None, "{}").await;
    wait_until(
        "the dead copy sent into the alarm",
        Duration::from_secs(30),
        async || proxy.silenced() == 1,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    let report = tokio::time::timeout(Duration::from_secs(15), run)
        .await
        .expect("the consumer stops")
        .unwrap()
        .unwrap();
    assert_eq!((report.ok, report.dead), (0, 0), "{report:?}");
    delete(&ch, &queue).await;
}
