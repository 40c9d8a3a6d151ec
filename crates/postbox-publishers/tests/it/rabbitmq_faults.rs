//! RabbitMQ faults during real relay runs (PostgreSQL store on a scratch
//! table): connections closed by the broker, unroutable events, a memory
//! alarm. These disturb the broker, so they run one at a time, and the
//! alarm runs alone among the RabbitMQ tests ([`broker_exclusive`]).

use crate::rabbitmq_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use postbox_core::config::{HumanDuration, RelaySettings, WorkerConfig};
use postbox_core::relay::{CancellationToken, Relay};
use postbox_core::store::{AppStats, EventFilter, OutboxStore};
use postbox_core::{EventRecord, NewEvent, Publisher, Status};
use postbox_postgres::PgOutbox;
use postbox_publishers::rabbitmq::RabbitMqPublisher;
use postbox_testkit::conformance::fast_worker;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::postgres_url;
use postbox_testkit::store_setup::migrated;
use rabbitmq_support::*;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const APP: &str = "rmq";

async fn store() -> Arc<dyn OutboxStore> {
    let store = migrated("postgres", postgres_url(), |url| async move {
        PgOutbox::connect(&url, &scratch_table("rmq"), 4).await
    })
    .await;
    Arc::new(store)
}

async fn enqueue(store: &dyn OutboxStore, n: usize, event_type: &str) {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| NewEvent::new(APP, event_type, format!(r#"{{"n":{i}}}"#)))
        .collect();
    for chunk in events.chunks(1000) {
        store.enqueue_batch(chunk, 1 << 20).await.expect("enqueue");
    }
}

async fn stats(store: &dyn OutboxStore) -> AppStats {
    store.stats(&[APP.to_owned()]).await.unwrap().remove(0)
}

/// Up to `limit` rows of the test's app in `status`.
async fn rows(store: &dyn OutboxStore, status: Status, limit: u32) -> Vec<EventRecord> {
    let filter = EventFilter {
        app_code: Some(APP.into()),
        status: Some(status),
        limit,
        ..Default::default()
    };
    store.list(&filter).await.unwrap()
}

/// Retries for as long as a fault lasts, quickly.
fn patient_worker() -> WorkerConfig {
    WorkerConfig {
        batch_size: 200,
        publish_timeout: HumanDuration::millis(1500),
        lease: HumanDuration::secs(10),
        max_retry_count: 1000,
        initial_backoff: HumanDuration::millis(50),
        max_backoff: HumanDuration::millis(300),
        ..fast_worker()
    }
}

struct RunningRelay {
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<postbox_core::Result<postbox_core::relay::RelayReport>>,
}

fn start_relay(
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    config: WorkerConfig,
) -> RunningRelay {
    let shutdown = CancellationToken::new();
    let settings = RelaySettings::new(config, vec![APP.to_owned()]).unwrap();
    let relay = Relay::new(store, vec![publisher], settings);
    let handle = tokio::spawn(relay.run(shutdown.clone()));
    RunningRelay { shutdown, handle }
}

impl RunningRelay {
    async fn stop(self) {
        self.shutdown.cancel();
        self.handle.await.expect("relay task").expect("relay run");
    }
}

async fn wait_until(
    store: &dyn OutboxStore,
    limit: Duration,
    mut done: impl FnMut(&AppStats) -> bool,
) -> AppStats {
    let deadline = Instant::now() + limit;
    loop {
        let s = stats(store).await;
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "not reached in {limit:?}: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One test's turn: the tests of this file run one at a time ([`SERIAL`]),
/// each holding the broker as it needs it. Taken in that order, always.
struct Turn {
    _broker: Hold,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

/// How a test holds the broker (see [`broker_shared`]).
enum Hold {
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'static, ()>),
    Exclusive(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'static, ()>),
}

impl Turn {
    async fn take(exclusive: bool) -> Turn {
        let serial = SERIAL.lock().await;
        let broker = if exclusive {
            Hold::Exclusive(broker_exclusive().await)
        } else {
            Hold::Shared(broker_shared().await)
        };
        Turn {
            _broker: broker,
            _serial: serial,
        }
    }
}

/// Events of the long runs.
const TICKS: usize = 10_000;

/// A long run: [`TICKS`] `Tick` events in a fresh store, and a publisher
/// routing them into the queue of a scratch exchange.
struct TickRun {
    store: Arc<dyn OutboxStore>,
    target: ScratchExchange,
    publisher: Arc<RabbitMqPublisher>,
}

impl TickRun {
    /// All [`TICKS`] events are in the table.
    async fn start(prefix: &str) -> TickRun {
        TickRun::start_with(prefix, TICKS).await
    }

    /// The first `first` events are in the table; [`TickRun::enqueue_rest`]
    /// adds the others.
    async fn start_with(prefix: &str, first: usize) -> TickRun {
        let store = store().await;
        enqueue(store.as_ref(), first, "Tick").await;
        let target = scratch_exchange(prefix, "#").await;
        let publisher = Arc::new(publisher_to(&target.name).await);
        TickRun {
            store,
            target,
            publisher,
        }
    }

    async fn enqueue_rest(&self, first: usize) {
        enqueue(self.store.as_ref(), TICKS - first, "Tick").await;
    }

    /// The stats once every tick is delivered (within `limit`).
    async fn all_delivered(&self, limit: Duration) -> AppStats {
        wait_until(self.store.as_ref(), limit, |s| s.delivered == TICKS as i64).await
    }

    /// (messages, distinct event ids) the queue received, once every tick
    /// arrived or 10 s passed. Counted by distinct id: with duplicates
    /// (a publish retried after its confirm was lost), the message count
    /// reaches TICKS before the last ticks are consumed.
    async fn received(&self) -> (usize, usize) {
        self.target
            .inbox
            .wait_for_distinct(TICKS, Duration::from_secs(10))
            .await
    }
}

/// Every tick reached the queue and every row ended delivered.
fn assert_each_tick_delivered(s: &AppStats, distinct: usize) {
    assert_eq!(distinct, TICKS, "every event reached the queue");
    assert_eq!(
        (s.pending, s.retryable, s.failed, s.delivering),
        (0, 0, 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connections_during_a_10000_event_run_lose_nothing() {
    let _turn = Turn::take(false).await;
    let run = TickRun::start("close").await;
    let (store, inbox, publisher) = (&run.store, &run.target.inbox, &run.publisher);
    let name = publisher.connection_name().to_owned();
    let started = Instant::now();
    let relay = start_relay(store.clone(), publisher.clone(), patient_worker());

    let mut closes = 0;
    for threshold in [TICKS / 5, TICKS / 2, 4 * TICKS / 5] {
        while inbox.len() < threshold {
            assert!(
                started.elapsed() < Duration::from_secs(50),
                "stalled at {}",
                inbox.len()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The publisher may be between connections (reconnecting after the
        // last close): look again until it has one.
        let mut n = 0;
        let looking = Instant::now();
        while n == 0 && looking.elapsed() < Duration::from_secs(15) {
            n = tokio::task::spawn_blocking({
                let name = name.clone();
                move || close_connections_named(&name)
            })
            .await
            .unwrap();
            if n == 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        assert!(n >= 1, "found no connection named {name} for 15 s");
        closes += n;
    }
    let s = run.all_delivered(Duration::from_secs(55)).await;
    let took = started.elapsed();
    relay.stop().await;
    let (messages, distinct) = run.received().await;
    let retried = rows(store.as_ref(), Status::Delivered, TICKS as u32)
        .await
        .iter()
        .filter(|r| r.retry_count > 0)
        .count();
    println!(
        "close_connection x{closes}: events {TICKS}, deliveries {messages}, distinct {distinct}, duplicates {}, rows retried {retried}, all delivered in {took:?}",
        messages - distinct
    );
    assert_each_tick_delivered(&s, distinct);
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_event_is_retried_then_dead_lettered() {
    let _turn = Turn::take(false).await;
    let store = store().await;
    enqueue(store.as_ref(), 5, "Nobody").await;
    enqueue(store.as_ref(), 20, "Somebody").await;
    let target = scratch_exchange("noroute", "Somebody").await;
    let (exchange, inbox) = (&target.name, &target.inbox);
    let publisher = Arc::new(publisher_to(exchange).await);
    let worker = WorkerConfig {
        max_retry_count: 3,
        initial_backoff: HumanDuration::millis(100),
        max_backoff: HumanDuration::millis(200),
        ..fast_worker()
    };
    let started = Instant::now();
    let relay = start_relay(store.clone(), publisher.clone(), worker);
    let mut saw_retryable = false;
    let s = wait_until(store.as_ref(), Duration::from_secs(30), |s| {
        saw_retryable |= s.retryable > 0;
        s.failed == 5 && s.delivered == 20
    })
    .await;
    relay.stop().await;
    assert!(
        saw_retryable,
        "unroutable rows went retryable before failed"
    );
    assert_eq!(s.retryable + s.pending + s.delivering, 0);
    let failed = rows(store.as_ref(), Status::Failed, 10).await;
    for r in &failed {
        assert_eq!(r.event_type, "Nobody");
        assert_eq!(r.retry_count, 3);
        let err = r.last_error.as_deref().unwrap_or_default();
        assert!(
            err.contains(&format!(
                "unroutable: exchange {exchange}, routing key Nobody"
            )),
            "{err}"
        );
    }
    let got = inbox.wait_for(20, Duration::from_secs(5)).await;
    println!(
        "unroutable: 5 dead-lettered after 3 attempts each, 20 routable delivered ({} received) in {:?}",
        got.len(),
        started.elapsed()
    );
    assert!(got.iter().all(|r| r.event_type == "Somebody"));
    publisher.close().await;
}

/// Restores the broker's memory high watermark, even when the test fails.
struct WatermarkGuard(String);

impl WatermarkGuard {
    /// Reads the current watermark, to be restored by `drop`.
    fn read() -> Self {
        let current = rabbitmqctl(&["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."]);
        let current = current.trim().to_owned();
        // A leftover 0 from a killed run is not worth restoring.
        let restore = match current.parse::<f64>() {
            Ok(f) if f > 0.0 => current,
            _ if current.starts_with("{absolute,") => current,
            _ => "0.4".to_owned(),
        };
        WatermarkGuard(restore)
    }

    /// Sets the watermark to 0 and returns once the broker reports the
    /// memory alarm (it blocks publishers from then on).
    fn set_zero(&self) {
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]);
        let asked = Instant::now();
        while !rabbitmqctl(&["eval", "rabbit_alarm:get_alarms()."]).contains("memory") {
            assert!(
                asked.elapsed() < Duration::from_secs(20),
                "the broker raised no memory alarm 20 s after the watermark went to 0"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for WatermarkGuard {
    fn drop(&mut self) {
        let args: Vec<String> = match self.0.strip_prefix("{absolute,") {
            Some(bytes) => vec![
                "set_vm_memory_high_watermark".into(),
                "absolute".into(),
                bytes.trim_end_matches('}').trim().into(),
            ],
            None => vec!["set_vm_memory_high_watermark".into(), self.0.clone()],
        };
        let ok = std::process::Command::new("rabbitmqctl")
            .args(&args)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            eprintln!(
                "COULD NOT RESTORE the RabbitMQ memory watermark: run `rabbitmqctl {}`",
                args.join(" ")
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_alarm_delays_delivery_without_loss() {
    // The alarm blocks every publishing connection: no other RabbitMQ test
    // of this binary may run meanwhile.
    let _turn = Turn::take(true).await;
    // A twentieth of the events goes before the alarm, the rest once the
    // broker reports it: a relay drains thousands a second, faster than
    // `rabbitmqctl` raises an alarm, so events already queued could all be
    // gone before it holds (the flake CI saw).
    let first = TICKS / 20;
    let run = TickRun::start_with("alarm", first).await;
    let (store, inbox, publisher) = (&run.store, &run.target.inbox, &run.publisher);
    let worker = WorkerConfig {
        batch_size: 50,
        ..patient_worker()
    };
    let started = Instant::now();
    let guard = tokio::task::spawn_blocking(WatermarkGuard::read)
        .await
        .unwrap();
    let relay = start_relay(store.clone(), publisher.clone(), worker);
    while inbox.len() < first {
        assert!(started.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let guard = tokio::task::spawn_blocking(move || {
        guard.set_zero();
        guard
    })
    .await
    .unwrap();
    run.enqueue_rest(first).await;
    let alarm_at = Instant::now();
    // Publishes time out or fail while the alarm holds; rows wait as retryable.
    let mut max_retryable = 0;
    while alarm_at.elapsed() < Duration::from_secs(4) {
        max_retryable = max_retryable.max(stats(store.as_ref()).await.retryable);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let during = stats(store.as_ref()).await;
    let received_during = inbox.len();
    tokio::task::spawn_blocking(move || drop(guard))
        .await
        .unwrap();
    let restored_at = Instant::now();
    let s = run.all_delivered(Duration::from_secs(45)).await;
    let recovered = restored_at.elapsed();
    relay.stop().await;
    let (messages, distinct) = run.received().await;
    println!(
        "memory alarm 4s: events {TICKS}, delivered before/at alarm end {} (queue had {received_during}), max retryable {max_retryable}, deliveries {messages}, distinct {distinct}, duplicates {}, all delivered {recovered:?} after the alarm cleared, {:?} in all",
        during.delivered,
        messages - distinct,
        started.elapsed()
    );
    assert!(
        during.delivered < TICKS as i64,
        "the alarm held delivery back"
    );
    assert!(max_retryable > 0, "blocked publishes made rows retryable");
    assert_each_tick_delivered(&s, distinct);
    publisher.close().await;
}
