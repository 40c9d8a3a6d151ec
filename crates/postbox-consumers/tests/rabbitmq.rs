//! The RabbitMQ consumer against a real broker: retries with growing delays
//! into `<queue>.dead`, the inbox's duplicate and stale verdicts, shutdown.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use postbox_consumers::inbox::{Inbox, InboxHandler, TxHandler};
use postbox_consumers::rabbitmq::RabbitMqConsumer;
use postbox_consumers::{Handled, Handler, HandlerError, Message};
use postbox_core::config::HumanDuration;
use tokio_util::sync::CancellationToken;

use common::*;

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

async fn wait_until(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(stop).await }
    });
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

/// Writes one effect row per event inside the inbox transaction.
struct Effect;

#[async_trait]
impl TxHandler<sqlx::Sqlite> for Effect {
    async fn handle(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
        m: &Message,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effect (event_id) VALUES (?)")
            .bind(m.event_id())
            .execute(&mut **tx)
            .await
            .map_err(HandlerError::new)?;
        Ok(())
    }
}

#[tokio::test]
async fn inbox_counts_duplicates_and_skips_stale_versions() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
    let inbox = Inbox::<sqlx::Sqlite>::connect(&url, "inbox").await.unwrap();
    sqlx::query("CREATE TABLE effect (event_id TEXT NOT NULL)")
        .execute(inbox.pool())
        .await
        .unwrap();

    let (_conn, ch) = broker().await;
    let queue = scratch_queue("stale");
    declare(&ch, &queue).await;
    publish(&ch, &queue, "e1", Some(("room-1", 2)), "{}").await;
    publish(&ch, &queue, "e1", Some(("room-1", 2)), "{}").await; // redelivered
    publish(&ch, &queue, "e0", Some(("room-1", 1)), "{}").await; // older version
    publish(&ch, &queue, "e3", Some(("room-1", 3)), "{}").await;
    publish(&ch, &queue, "x1", None, "{}").await;

    let handler = Arc::new(InboxHandler::new(inbox.clone(), "console", Effect));
    let consumer = RabbitMqConsumer::new(consumer_config(&queue), handler).unwrap();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(stop).await }
    });
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
    let consumer = RabbitMqConsumer::new(consumer_config(&queue), handler.clone()).unwrap();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(stop).await }
    });
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
    delete(&ch, &queue).await;
}

/// Closes the broker connection named `name` (this test's own, never others).
async fn close_connection_named(name: &str) -> bool {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "--no-table-headers",
            "list_connections",
            "pid",
            "client_properties",
        ])
        .output()
        .await
        .expect("rabbitmqctl on PATH");
    let listing = String::from_utf8_lossy(&out.stdout).to_string();
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
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(stop).await }
    });
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
