//! `postbox dead` (issue 14.4) on every broker: letters dead-lettered by a
//! real consumer are listed with their attempts, error and time, filtered,
//! replayed into the consumer's queue (same event id, marked replayed,
//! attempts afresh, handled once more) and purged; a dry run changes
//! nothing. The NATS and Redis runs are cases of the stream suite
//! (`nats_redis_suite::dead_letters_are_listed_replayed_and_purged`).

use crate::common;
use crate::nats_redis_suite::{self, Calls, ConsumerTask, Recording};

use std::sync::Arc;
use std::time::Duration;

use postbox_consumers::dead::{self, DeadAction, DeadFilter, DeadReport};
use postbox_consumers::rabbitmq::RabbitMqConsumer;
use postbox_consumers::Handler;
use postbox_core::config::ConsumerConfig;
use tokio_util::sync::CancellationToken;

/// Starts a consumer of `config` with `handler`; returns its stop token and
/// task.
pub type Starter<'a> = Box<
    dyn Fn(ConsumerConfig, Arc<dyn Handler>) -> (CancellationToken, ConsumerTask)
        + Send
        + Sync
        + 'a,
>;

/// How many dead letters of `config` `filter` matches.
async fn matched(config: &ConsumerConfig, filter: DeadFilter) -> u64 {
    pass(config, DeadAction::List(100), filter, false)
        .await
        .matched
}

async fn pass(
    config: &ConsumerConfig,
    action: DeadAction,
    filter: DeadFilter,
    dry_run: bool,
) -> DeadReport {
    let seen = std::sync::Mutex::new(Vec::new());
    let report = dead::run(config, action, &filter, dry_run, &|scanned, done| {
        seen.lock().unwrap().push((scanned, done));
    })
    .await
    .expect("a pass over the dead letters");
    let seen = seen.into_inner().unwrap();
    assert_eq!(
        seen.last().copied(),
        Some((report.scanned, report.done)),
        "the last progress report is the pass's total"
    );
    report
}

fn by_id(id: &str) -> DeadFilter {
    DeadFilter {
        event_id: Some(id.to_owned()),
        ..DeadFilter::default()
    }
}

/// `config` (with `max_attempts = 1`) holds `published` event ids of which
/// `poison` fail: after the consumer ran, the poison are dead letters; then
/// list, dry run, replay, purge, and the replayed one is handled again.
pub async fn scenario(
    config: ConsumerConfig,
    published: &[String],
    poison: &[String],
    start: Starter<'_>,
) {
    assert_eq!(config.max_attempts, 1);
    let calls = Calls::default();
    let handler = Arc::new(Recording {
        poison: poison.to_vec(),
        ..Recording::new("a", &calls, Duration::ZERO)
    });
    let started = std::time::Instant::now();
    let (cancel, task) = start(config.clone(), handler);
    loop {
        let listed = pass(&config, DeadAction::List(100), DeadFilter::default(), false).await;
        if listed.matched as usize == poison.len() && calls.lock().unwrap().len() >= published.len()
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the poison never all reached the dead letters: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = nats_redis_suite::stop(&cancel, task).await;
    assert_eq!(report.dead, poison.len() as u64, "{report:?}");

    // List: every poison, once, with what the consumer knew.
    let all = pass(&config, DeadAction::List(100), DeadFilter::default(), false).await;
    let mut ids: Vec<String> = all
        .letters
        .iter()
        .filter_map(|l| l.event_id.clone())
        .collect();
    ids.sort();
    let mut want = poison.to_vec();
    want.sort();
    assert_eq!(ids, want);
    let now = postbox_core::time::now_ms();
    for l in &all.letters {
        assert_eq!(l.attempts, Some(1), "{l:?}");
        assert!(
            l.last_error
                .as_deref()
                .is_some_and(|e| e.contains("poison")),
            "{l:?}"
        );
        let at = l.dead_at_ms.expect("a dead time");
        assert!(at <= now && at > now - 120_000, "dead at {at}, now {now}");
        assert!(!l.event_type.is_empty() && !l.app_code.is_empty(), "{l:?}");
    }
    // A limit, and filters that take nothing.
    let first = pass(&config, DeadAction::List(1), DeadFilter::default(), false).await;
    assert_eq!(
        (first.letters.len(), first.complete),
        (1, false),
        "a list stops at its limit"
    );
    assert!(all.complete);
    let none = DeadFilter {
        error: Some("no such error".into()),
        ..DeadFilter::default()
    };
    assert_eq!(pass(&config, DeadAction::Purge, none, false).await.done, 0);
    let later = DeadFilter {
        since_ms: Some(now + 60_000),
        ..DeadFilter::default()
    };
    assert_eq!(matched(&config, later).await, 0);
    let by_error = DeadFilter {
        error: Some("POISON".into()),
        ..DeadFilter::default()
    };
    assert_eq!(
        matched(&config, by_error).await,
        poison.len() as u64,
        "the error filter ignores case"
    );

    // A dry run counts and changes nothing.
    let dry = pass(&config, DeadAction::Replay, by_id(&poison[0]), true).await;
    assert_eq!((dry.matched, dry.done), (1, 0));
    assert_eq!(
        pass(&config, DeadAction::Purge, DeadFilter::default(), true)
            .await
            .done,
        0
    );
    assert_eq!(
        matched(&config, DeadFilter::default()).await,
        poison.len() as u64,
        "nothing changed by dry runs"
    );

    // Replay one, purge one.
    let replayed = pass(&config, DeadAction::Replay, by_id(&poison[0]), false).await;
    assert_eq!((replayed.matched, replayed.done), (1, 1));
    let purged = pass(&config, DeadAction::Purge, by_id(&poison[1]), false).await;
    assert_eq!((purged.matched, purged.done), (1, 1));
    let left = pass(&config, DeadAction::List(100), DeadFilter::default(), false).await;
    let left: Vec<String> = left
        .letters
        .iter()
        .filter_map(|l| l.event_id.clone())
        .collect();
    assert_eq!(left.len(), poison.len() - 2, "{left:?}");
    assert!(!left.contains(&poison[0]) && !left.contains(&poison[1]));

    // The replayed letter is handled again: once, same event id, marked,
    // its attempts counted afresh; nothing else comes back.
    let again = Calls::default();
    let (cancel, task) = start(
        config.clone(),
        nats_redis_suite::recording("b", &again, Duration::ZERO),
    );
    nats_redis_suite::wait_until(
        Duration::from_secs(20),
        "the replayed letter handled",
        || !again.lock().unwrap().is_empty(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = nats_redis_suite::stop(&cancel, task).await;
    let again = again.lock().unwrap().clone();
    assert_eq!(again.len(), 1, "{again:?}");
    let m = &again[0].message;
    assert_eq!(m.event_id(), poison[0]);
    assert_eq!(m.attempt, 1);
    let replayed_flag = &m.envelope.headers["x-replayed"];
    assert!(
        replayed_flag == true || replayed_flag == "true",
        "{:?}",
        m.envelope.headers
    );
    assert!(!m.envelope.headers.contains_key("x-last-error"));
    assert_eq!(report.ok, 1);

    // Purge the rest.
    let rest = pass(&config, DeadAction::Purge, DeadFilter::default(), false).await;
    assert_eq!(rest.done as usize, poison.len() - 2);
    assert_eq!(matched(&config, DeadFilter::default()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_dead_letters_are_listed_replayed_and_purged() {
    let (_conn, ch) = common::broker().await;
    let queue = common::scratch_queue("deadtool");
    let mut config = common::consumer_config(&queue);
    config.max_attempts = 1;
    common::declare(&ch, &queue).await;
    let published: Vec<String> = (0..6).map(|i| format!("ev-{i}")).collect();
    for id in &published {
        common::publish(&ch, &queue, id, None, r#"{"n":1}"#).await;
    }
    let poison = published[..4].to_vec();
    let start: Starter = Box::new(|config, handler| {
        let consumer = RabbitMqConsumer::new(config, handler).unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn({
            let cancel = cancel.clone();
            async move { consumer.run(cancel).await }
        });
        (cancel, task)
    });
    scenario(config, &published, &poison, start).await;
    assert_eq!(common::ready(&ch, &format!("{queue}.dead")).await, 0);
    common::delete(&ch, &queue).await;
}

/// Passes over one consumer's dead letters beside each other (the
/// dashboard listing them while a purge or replay runs): each pass sees
/// every letter. A RabbitMQ pass holds the letters it reads until it ends,
/// so the purge beside the lists found fewer letters than the queue held,
/// stopped early and purged nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_side_by_side_each_see_every_letter() {
    let (_conn, ch) = common::broker().await;
    let queue = common::scratch_queue("deadside");
    let config = common::consumer_config(&queue);
    common::declare(&ch, &queue).await;
    let dead = format!("{queue}.dead");
    for i in 0..20 {
        common::publish(&ch, &dead, &format!("kept-{i}"), None, "{}").await;
    }
    for round in 0..5 {
        let id = format!("gone-{round}");
        common::publish(&ch, &dead, &id, None, "{}").await;
        let lists = futures::future::join_all(
            (0..4).map(|_| pass(&config, DeadAction::List(100), DeadFilter::default(), false)),
        );
        let (purged, _) = tokio::join!(pass(&config, DeadAction::Purge, by_id(&id), false), lists);
        assert_eq!(purged.done, 1, "round {round}: {purged:?}");
    }
    assert_eq!(matched(&config, DeadFilter::default()).await, 20);
    common::delete(&ch, &queue).await;
}

/// A broker that stops answering in the middle of a pass (a host that
/// died, a partition: no reset, only silence) ends the pass with an error
/// naming the step, and the next pass over those letters runs. The pass
/// waited for good, and every later pass over the consumer's letters (the
/// dashboard's, `postbox dead`'s) waited behind it.
#[tokio::test]
async fn a_pass_over_a_broker_gone_silent_ends_with_an_error() {
    let (_conn, ch) = common::broker().await;
    let queue = common::scratch_queue("deadsilent");
    let config = common::consumer_config(&queue);
    common::declare(&ch, &queue).await;
    for i in 0..3 {
        common::publish(
            &ch,
            &format!("{queue}.dead"),
            &format!("kept-{i}"),
            None,
            "{}",
        )
        .await;
    }
    let (proxy, through) = postbox_testkit::proxy::to_amqp().await;
    // `basic.get`: class 60, method 70.
    proxy.silence_on(&[0, 60, 0, 70]);
    let silent = ConsumerConfig {
        url: postbox_core::redact::SecretUrl::new(through),
        ..config.clone()
    };
    let (every, started) = (DeadFilter::default(), std::time::Instant::now());
    let pass = dead::run(&silent, DeadAction::Purge, &every, false, &|_, _| {});
    let ended = tokio::time::timeout(Duration::from_secs(60), pass)
        .await
        .expect("the pass ends within a minute");
    let error = ended.expect_err("a pass without answers fails").to_string();
    assert!(
        error.contains("reading: no answer from the broker within 15s"),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(matched(&config, DeadFilter::default()).await, 3);
    common::delete(&ch, &queue).await;
}
