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
use postbox_core::{NewEvent, Publisher, Status};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connections_during_a_10000_event_run_lose_nothing() {
    let _serial = SERIAL.lock().await;
    let _broker = broker_shared().await;
    const N: usize = 10_000;
    let store = store().await;
    enqueue(store.as_ref(), N, "Tick").await;
    let exchange = scratch("close");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    declare_exchange(&channel, &exchange).await;
    let inbox = consume(&setup, &exchange, "#").await;
    let publisher = Arc::new(
        RabbitMqPublisher::connect(&config(&exchange, "{event_type}", false))
            .await
            .unwrap(),
    );
    let name = publisher.connection_name().to_owned();
    let started = Instant::now();
    let relay = start_relay(store.clone(), publisher.clone(), patient_worker());

    let mut closes = 0;
    for threshold in [N / 5, N / 2, 4 * N / 5] {
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
    let s = wait_until(store.as_ref(), Duration::from_secs(55), |s| {
        s.delivered == N as i64
    })
    .await;
    let took = started.elapsed();
    relay.stop().await;
    inbox.wait_for(N, Duration::from_secs(10)).await;
    let (messages, distinct) = inbox.counts();
    let retried = store
        .list(&EventFilter {
            app_code: Some(APP.into()),
            status: Some(Status::Delivered),
            limit: N as u32,
            ..Default::default()
        })
        .await
        .unwrap()
        .iter()
        .filter(|r| r.retry_count > 0)
        .count();
    println!(
        "close_connection x{closes}: events {N}, deliveries {messages}, distinct {distinct}, duplicates {}, rows retried {retried}, all delivered in {took:?}",
        messages - distinct
    );
    assert_eq!(distinct, N, "every event reached the queue");
    assert_eq!(
        (s.pending, s.retryable, s.failed, s.delivering),
        (0, 0, 0, 0)
    );
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_event_is_retried_then_dead_lettered() {
    let _serial = SERIAL.lock().await;
    let _broker = broker_shared().await;
    let store = store().await;
    enqueue(store.as_ref(), 5, "Nobody").await;
    enqueue(store.as_ref(), 20, "Somebody").await;
    let exchange = scratch("noroute");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    declare_exchange(&channel, &exchange).await;
    let inbox = consume(&setup, &exchange, "Somebody").await;
    let publisher = Arc::new(
        RabbitMqPublisher::connect(&config(&exchange, "{event_type}", false))
            .await
            .unwrap(),
    );
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
    let failed = store
        .list(&EventFilter {
            app_code: Some(APP.into()),
            status: Some(Status::Failed),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
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

    fn set_zero(&self) {
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]);
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
    let _serial = SERIAL.lock().await;
    // The alarm blocks every publishing connection: no other RabbitMQ test
    // of this binary may run meanwhile.
    let _broker = broker_exclusive().await;
    const N: usize = 10_000;
    let store = store().await;
    enqueue(store.as_ref(), N, "Tick").await;
    let exchange = scratch("alarm");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    declare_exchange(&channel, &exchange).await;
    let inbox = consume(&setup, &exchange, "#").await;
    let publisher = Arc::new(
        RabbitMqPublisher::connect(&config(&exchange, "{event_type}", false))
            .await
            .unwrap(),
    );
    let worker = WorkerConfig {
        batch_size: 50,
        ..patient_worker()
    };
    let started = Instant::now();
    let guard = tokio::task::spawn_blocking(WatermarkGuard::read)
        .await
        .unwrap();
    let relay = start_relay(store.clone(), publisher.clone(), worker);
    while inbox.len() < N / 20 {
        assert!(started.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let guard = tokio::task::spawn_blocking(move || {
        guard.set_zero();
        guard
    })
    .await
    .unwrap();
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
    let s = wait_until(store.as_ref(), Duration::from_secs(45), |s| {
        s.delivered == N as i64
    })
    .await;
    let recovered = restored_at.elapsed();
    relay.stop().await;
    inbox.wait_for(N, Duration::from_secs(10)).await;
    let (messages, distinct) = inbox.counts();
    println!(
        "memory alarm 4s: events {N}, delivered before/at alarm end {} (queue had {received_during}), max retryable {max_retryable}, deliveries {messages}, distinct {distinct}, duplicates {}, all delivered {recovered:?} after the alarm cleared, {:?} in all",
        during.delivered,
        messages - distinct,
        started.elapsed()
    );
    assert!(during.delivered < N as i64, "the alarm held delivery back");
    assert!(max_retryable > 0, "blocked publishes made rows retryable");
    assert_eq!(distinct, N, "every event reached the queue");
    assert_eq!(
        (s.pending, s.retryable, s.failed, s.delivering),
        (0, 0, 0, 0)
    );
    publisher.close().await;
}
