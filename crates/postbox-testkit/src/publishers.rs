//! Publishers for tests: they record what they were given and fail on
//! demand.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use async_trait::async_trait;
use postbox_core::publish::{Delivery, PublishError};
use postbox_core::Publisher;

/// Records every delivery; fails the event types it is told to, or
/// everything while `down` is set.
#[derive(Default)]
pub struct RecordingPublisher {
    name: String,
    fail_types: Vec<String>,
    panic_types: Vec<String>,
    down: AtomicBool,
    hanging: AtomicBool,
    /// Milliseconds each publish call takes before answering.
    delay_ms: AtomicU64,
    /// [`Publisher::max_in_flight`] (0 counts as 1).
    in_flight: usize,
    /// Publish calls under way now, and the most seen at once.
    running: AtomicUsize,
    most_at_once: AtomicUsize,
    delivered: Mutex<Vec<(String, i32, bool)>>,
    attempts: Mutex<HashMap<String, u32>>,
    offers: Mutex<Vec<(String, bool)>>,
}

impl RecordingPublisher {
    /// A publisher named `name` that confirms everything.
    pub fn new(name: &str) -> Self {
        RecordingPublisher {
            name: name.to_owned(),
            ..Default::default()
        }
    }

    /// Fails every event of this type.
    pub fn failing_type(mut self, event_type: &str) -> Self {
        self.fail_types.push(event_type.to_owned());
        self
    }

    /// Takes `n` batches at once ([`Publisher::max_in_flight`]).
    pub fn in_flight(mut self, n: usize) -> Self {
        self.in_flight = n;
        self
    }

    /// The most publish calls that were under way at once.
    pub fn most_at_once(&self) -> usize {
        self.most_at_once.load(Ordering::SeqCst)
    }

    /// Panics when handed an event of this type (a publisher bug).
    pub fn panicking_type(mut self, event_type: &str) -> Self {
        self.panic_types.push(event_type.to_owned());
        self
    }

    /// While true, every publish fails.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// While true, every publish hangs (never answers: the relay's
    /// `publish_timeout` ends it), as a target that accepts connections and
    /// then says nothing.
    pub fn set_hanging(&self, hanging: bool) {
        self.hanging.store(hanging, Ordering::SeqCst);
    }

    /// Each publish call takes `delay` before it answers (a slow target
    /// that still answers within its timeout).
    pub fn set_delay(&self, delay: std::time::Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// `(event_id, x-attempt, x-replayed)` of every confirmed delivery, in order.
    pub fn delivered(&self) -> Vec<(String, i32, bool)> {
        self.delivered.lock().unwrap().clone()
    }

    /// Event ids confirmed, in order.
    pub fn delivered_ids(&self) -> Vec<String> {
        self.delivered().into_iter().map(|d| d.0).collect()
    }

    /// Every offer in order: `(event_id, confirmed)`.
    pub fn offers(&self) -> Vec<(String, bool)> {
        self.offers.lock().unwrap().clone()
    }

    /// How many times an event was offered (confirmed or not).
    pub fn attempts(&self, event_id: &str) -> u32 {
        self.attempts
            .lock()
            .unwrap()
            .get(event_id)
            .copied()
            .unwrap_or(0)
    }
}

#[async_trait]
impl Publisher for RecordingPublisher {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_in_flight(&self) -> usize {
        self.in_flight.max(1)
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_at_once.fetch_max(now, Ordering::SeqCst);
        let _running = Running(&self.running);
        if self.hanging.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let delay = self.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        let down = self.down.load(Ordering::SeqCst);
        let mut out = Vec::with_capacity(batch.len());
        for d in batch {
            if self.panic_types.contains(&d.record.event_type) {
                panic!("{} has a bug with {}", self.name, d.record.event_type);
            }
            *self
                .attempts
                .lock()
                .unwrap()
                .entry(d.record.event_id.clone())
                .or_default() += 1;
            let ok = !down && !self.fail_types.contains(&d.record.event_type);
            self.offers
                .lock()
                .unwrap()
                .push((d.record.event_id.clone(), ok));
            if down {
                out.push(Err(PublishError::failed(format!("{} is down", self.name))));
            } else if self.fail_types.contains(&d.record.event_type) {
                out.push(Err(PublishError::failed(format!(
                    "{} refuses {}",
                    self.name, d.record.event_type
                ))));
            } else {
                self.delivered.lock().unwrap().push((
                    d.record.event_id.clone(),
                    d.attempt,
                    d.replayed,
                ));
                out.push(Ok(()));
            }
        }
        out
    }
}

/// Counts a publish call out when it ends (or is dropped).
struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
