//! `postbox_consume_total{consumer,result}` as a metrics recorder sees it.
//! The only test of this binary that installs the process-wide recorder;
//! the counts it reads are those of its consumer `billing`, a name no other
//! test uses, so tests running beside it do not change them.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use postbox_consumers::rabbitmq::RabbitMqConsumer;
use postbox_consumers::{Handled, Handler, HandlerError, Message};
use tokio_util::sync::CancellationToken;

use common::*;

/// Counters by `name{label=value,…}`.
#[derive(Default)]
struct Counters(Mutex<BTreeMap<String, Arc<AtomicU64>>>);

struct Cell(Arc<AtomicU64>);

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }
}

impl Recorder for &'static Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let cell = self.0.lock().unwrap().entry(name).or_default().clone();
        Counter::from_arc(Arc::new(Cell(cell)))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

struct FailBad;

#[async_trait]
impl Handler for FailBad {
    async fn handle(&self, m: &Message) -> Result<Handled, HandlerError> {
        if m.event_id() == "bad" {
            return Err(HandlerError::new("bad"));
        }
        Ok(Handled::Ok)
    }
}

#[tokio::test]
async fn outcomes_are_counted_by_consumer_and_result() {
    let counters: &'static Counters = Box::leak(Box::default());
    metrics::set_global_recorder(counters).unwrap();
    let value = |k: &str| {
        counters
            .0
            .lock()
            .unwrap()
            .get(k)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    };

    let (_conn, ch) = broker().await;
    let queue = scratch_queue("metrics");
    declare(&ch, &queue).await;
    let mut config = consumer_config(&queue);
    config.name = Some("billing".to_owned());
    config.max_attempts = 2;
    publish(&ch, &queue, "good-1", None, "{}").await;
    publish(&ch, &queue, "bad", None, "{}").await;
    publish(&ch, &queue, "good-2", None, "{}").await;
    let consumer = RabbitMqConsumer::new(config, Arc::new(FailBad)).unwrap();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(stop).await }
    });
    let start = Instant::now();
    while value("postbox_consume_total{consumer=billing,result=dead}") < 1 {
        assert!(start.elapsed() < Duration::from_secs(10), "no dead count");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(
        value("postbox_consume_total{consumer=billing,result=ok}"),
        2
    );
    assert_eq!(
        value("postbox_consume_total{consumer=billing,result=retry}"),
        1
    );
    assert_eq!(
        value("postbox_consume_total{consumer=billing,result=dead}"),
        1
    );
    delete(&ch, &queue).await;
}
