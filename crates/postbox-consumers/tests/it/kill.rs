//! SIGKILL a consumer between its effect and its ack, several times: every
//! killed event is redelivered, found in the PostgreSQL inbox, and the effect
//! table holds each event exactly once.
//!
//! The test binary re-runs itself as the consumer process (`child_consumer`
//! with `POSTBOX_KILL_CHILD=1`). The child holds chosen events for a while
//! after their transaction committed and before returning to the consumer
//! (which acks on return), and says so on stdout: the parent kills it then.
//!
//! And a message whose handler kills the consumer (`crash_child_consumer`)
//! counts one attempt per crash and ends in `<queue>.dead` instead of looping.

use crate::common;

use std::collections::HashSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use postbox_consumers::inbox::{Inbox, InboxHandler};
use postbox_consumers::rabbitmq::RabbitMqConsumer;
use postbox_consumers::{Handled, Handler, HandlerError, Message};
use postbox_testkit::servers::{ensure_database, postgres_url, scratch_table};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_util::sync::CancellationToken;

use common::*;

const EVENTS: usize = 200;
const KILL_AT: [&str; 4] = ["ev-20", "ev-60", "ev-110", "ev-170"];

/// Reports every outcome on stdout and holds the chosen events after their
/// commit, before the ack.
struct Reporting<H> {
    inner: H,
    hold: HashSet<String>,
}

#[async_trait]
impl<H: Handler> Handler for Reporting<H> {
    async fn handle(&self, m: &Message) -> Result<Handled, HandlerError> {
        let handled = self.inner.handle(m).await?;
        println!("{} {}", handled.as_str(), m.event_id());
        if handled == Handled::Ok && self.hold.contains(m.event_id()) {
            println!("hold {}", m.event_id());
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        Ok(handled)
    }
}

/// The consumer process; does nothing unless started by the test below.
#[tokio::test]
async fn child_consumer() {
    if std::env::var("POSTBOX_KILL_CHILD").is_err() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap();
    let inbox = Inbox::<sqlx::Postgres>::connect(&postgres_url(), &var("KILL_INBOX"))
        .await
        .unwrap();
    let handler = Reporting {
        inner: InboxHandler::new(inbox, "kill-test", EffectRow::new(var("KILL_EFFECT"))),
        hold: var("KILL_AT").split(',').map(str::to_owned).collect(),
    };
    let consumer =
        RabbitMqConsumer::new(consumer_config(&var("KILL_QUEUE")), Arc::new(handler)).unwrap();
    consumer.run(CancellationToken::new()).await.unwrap();
}

#[tokio::test]
async fn sigkill_between_effect_and_ack_has_no_second_effect() {
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let inbox = scratch_table("kill_inbox");
    let effect = scratch_table("kill_effect");
    sqlx::query(&format!("CREATE TABLE {effect} (event_id TEXT NOT NULL)"))
        .execute(&pool)
        .await
        .unwrap();

    let (_conn, ch) = broker().await;
    let queue = scratch_queue("kill");
    declare(&ch, &queue).await;
    for i in 0..EVENTS {
        publish(&ch, &queue, &format!("ev-{i}"), None, "{}").await;
    }

    let start = Instant::now();
    let mut kills = Vec::new();
    let mut duplicates = Vec::new();
    loop {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "kill::child_consumer",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("POSTBOX_KILL_CHILD", "1")
            .env("KILL_INBOX", &inbox)
            .env("KILL_EFFECT", &effect)
            .env("KILL_QUEUE", &queue)
            .env("KILL_AT", KILL_AT.join(","))
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut killed = false;
        loop {
            let line = tokio::select! {
                line = lines.next_line() => line.unwrap(),
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    // A killed event comes back through `.retry` (its
                    // redelivery counts as an attempt): wait for all of them.
                    let back = KILL_AT.iter().all(|id| duplicates.iter().any(|d| d == id));
                    if kills.len() == KILL_AT.len() && back && ready(&ch, &queue).await == 0 {
                        let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(DISTINCT event_id) FROM {effect}"))
                            .fetch_one(&pool).await.unwrap();
                        if n == EVENTS as i64 { break; }
                    }
                    assert!(start.elapsed() < Duration::from_secs(50), "run did not finish; kills {kills:?}");
                    continue;
                }
            };
            let Some(line) = line else { break };
            // libtest prints `test child_consumer ... ` before the first line.
            let line = line.rsplit("... ").next().unwrap_or(&line).to_owned();
            if let Some(id) = line.strip_prefix("duplicate ") {
                duplicates.push(id.to_owned());
            }
            if let Some(id) = line.strip_prefix("hold ") {
                if !kills.iter().any(|k| k == id) {
                    // Committed, not acked: kill now.
                    child.start_kill().unwrap();
                    child.wait().await.unwrap();
                    kills.push(id.to_owned());
                    killed = true;
                    break;
                }
            }
        }
        if !killed {
            child.start_kill().unwrap();
            child.wait().await.unwrap();
            break;
        }
    }

    assert_eq!(kills, KILL_AT, "every planned kill happened");
    for id in KILL_AT {
        assert!(
            duplicates.iter().any(|d| d == id),
            "{id} was redelivered after the kill and found in the inbox (duplicates seen: {duplicates:?})"
        );
    }
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT event_id, COUNT(*) FROM {effect} GROUP BY event_id HAVING COUNT(*) <> 1"
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(rows.is_empty(), "effects not exactly once: {rows:?}");
    let total: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {effect}"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(total, EVENTS as i64);
    println!(
        "{} kills, {} redeliveries found in the inbox, {total} effects",
        kills.len(),
        duplicates.len()
    );
    for t in [effect, format!("{inbox}_versions"), inbox] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(&pool)
            .await;
    }
    delete(&ch, &queue).await;
}

/// Kills its own process (SIGKILL, no unwinding, no ack) on `crash`, after
/// printing the attempt; prints every other event it handles.
struct Crashing;

#[async_trait]
impl Handler for Crashing {
    async fn handle(&self, m: &Message) -> Result<Handled, HandlerError> {
        if m.event_id() == "crash" {
            println!("crash {}", m.attempt);
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &std::process::id().to_string()])
                .status();
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        println!("ok {}", m.event_id());
        Ok(Handled::Ok)
    }
}

/// The crashing consumer process; does nothing unless started by the test
/// below.
#[tokio::test]
async fn crash_child_consumer() {
    if std::env::var("POSTBOX_CRASH_CHILD").is_err() {
        return;
    }
    let mut config = consumer_config(&std::env::var("CRASH_QUEUE").unwrap());
    config.max_attempts = 3;
    config.retry_delay = postbox_core::config::HumanDuration::millis(100);
    let consumer = RabbitMqConsumer::new(config, Arc::new(Crashing)).unwrap();
    consumer.run(CancellationToken::new()).await.unwrap();
}

#[tokio::test]
async fn a_message_that_kills_its_consumer_is_dead_after_max_attempts() {
    use lapin::options::{BasicAckOptions, BasicGetOptions};

    let (_conn, ch) = broker().await;
    let queue = scratch_queue("crash");
    declare(&ch, &queue).await;
    publish(&ch, &queue, "before", None, "{}").await;
    publish(&ch, &queue, "crash", None, "{}").await;
    publish(&ch, &queue, "after", None, "{}").await;

    let dead = format!("{queue}.dead");
    let start = Instant::now();
    let mut crashes = Vec::new();
    let mut handled = Vec::new();
    while ready(&ch, &dead).await == 0 {
        // max_attempts = 3: a fourth start would mean the count was lost.
        assert!(
            crashes.len() <= 3,
            "the message crashed its consumer {} times without reaching {dead} (attempts seen: {crashes:?})",
            crashes.len()
        );
        assert!(start.elapsed() < Duration::from_secs(40), "timed out");
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "kill::crash_child_consumer",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("POSTBOX_CRASH_CHILD", "1")
            .env("CRASH_QUEUE", &queue)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        loop {
            let line = tokio::select! {
                line = lines.next_line() => line.unwrap(),
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if ready(&ch, &dead).await > 0 {
                        break;
                    }
                    assert!(start.elapsed() < Duration::from_secs(40), "timed out; crashes {crashes:?}");
                    continue;
                }
            };
            // The child died (it killed itself).
            let Some(line) = line else { break };
            let line = line.rsplit("... ").next().unwrap_or(&line).to_owned();
            if let Some(a) = line.strip_prefix("crash ") {
                crashes.push(a.parse::<u32>().unwrap());
            }
            if let Some(id) = line.strip_prefix("ok ") {
                handled.push(id.to_owned());
            }
        }
        let _ = child.start_kill();
        child.wait().await.unwrap();
    }
    assert_eq!(crashes, [1, 2, 3], "one handler call per attempt, counted");
    let got = ch
        .basic_get(dead.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("the dead copy");
    got.delivery
        .acker
        .ack(BasicAckOptions::default())
        .await
        .unwrap();
    let props = &got.delivery.properties;
    assert_eq!(props.message_id().as_ref().unwrap().as_str(), "crash");
    let headers = props.headers().as_ref().unwrap().inner();
    assert_eq!(
        headers["x-consume-attempt"],
        lapin::types::AMQPValue::LongLongInt(3)
    );
    let lapin::types::AMQPValue::LongString(error) = &headers["x-last-error"] else {
        panic!("x-last-error is not a string: {headers:?}");
    };
    let error = String::from_utf8_lossy(error.as_bytes());
    assert!(error.contains("redelivered"), "{error}");
    assert!(handled.contains(&"before".to_owned()), "{handled:?}");
    assert!(handled.contains(&"after".to_owned()), "{handled:?}");
    assert_eq!(ready(&ch, &queue).await, 0);
    delete(&ch, &queue).await;
}
