//! A consumer's live state, shared with its process's admin server
//! (`GET /api/consumers`, `POST /api/consumers/{name}/pause|resume`): what
//! it settled so far, whether its broker session is up, and its pause
//! switch.
//!
//! Pausing stops a consumer from taking messages: the one in hand (and
//! any the broker already handed over) is finished and settled as usual,
//! then the consumer asks its broker for nothing more until it is resumed
//! (RabbitMQ: its consumer is cancelled, so the queue's other consumers
//! get the messages; NATS and Redis: it stops pulling). A pause never
//! redelivers a message and counts no attempt.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::Handled;

/// One settled message, as the report, `postbox_consume_total` and the
/// live state count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    Handled(Handled),
    Retry,
    Held,
    Dead,
}

/// One consumer's shared state (see the module docs).
#[derive(Debug)]
pub struct ConsumerState {
    name: String,
    kind: &'static str,
    queue: String,
    paused: watch::Sender<bool>,
    /// The session waits at its pause with nothing in hand.
    parked: AtomicBool,
    connected: AtomicBool,
    counts: Counts,
}

#[derive(Debug, Default)]
struct Counts {
    ok: AtomicU64,
    duplicate: AtomicU64,
    stale: AtomicU64,
    retry: AtomicU64,
    held: AtomicU64,
    dead: AtomicU64,
}

/// What `GET /api/consumers` shows of one consumer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConsumerSnapshot {
    /// The config's `name` (default: its queue).
    pub name: String,
    /// `rabbitmq`, `nats` or `redis`.
    pub kind: &'static str,
    /// Its queue, subject or stream.
    pub queue: String,
    /// `consuming`; `pausing` (asked to pause, finishing what it holds:
    /// a message in hand, or a pull or read under way), then `paused`
    /// (holding nothing, taking nothing); or `connecting` (no broker
    /// session up).
    pub state: &'static str,
    /// Settled messages by result since the process started (as
    /// `postbox_consume_total`): handled, duplicate, stale, sent to retry,
    /// held behind their aggregate, dead-lettered.
    pub ok: u64,
    /// See `ok`.
    pub duplicate: u64,
    /// See `ok`.
    pub stale: u64,
    /// See `ok`.
    pub retry: u64,
    /// See `ok`.
    pub held: u64,
    /// See `ok`.
    pub dead: u64,
}

impl ConsumerState {
    /// The state of consumer `name`, a `kind` consumer of `queue`: not
    /// paused, not connected, nothing counted.
    pub fn new(name: &str, kind: &'static str, queue: &str) -> Self {
        ConsumerState {
            name: name.to_owned(),
            kind,
            queue: queue.to_owned(),
            paused: watch::Sender::new(false),
            parked: AtomicBool::new(false),
            connected: AtomicBool::new(false),
            counts: Counts::default(),
        }
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Stops the consumer taking messages; false when it was paused
    /// already.
    pub fn pause(&self) -> bool {
        self.paused
            .send_if_modified(|p| !std::mem::replace(p, true))
    }

    /// Lets a paused consumer take messages again; false when it was not
    /// paused.
    pub fn resume(&self) -> bool {
        self.paused
            .send_if_modified(|p| std::mem::replace(p, false))
    }

    /// Whether the consumer is paused.
    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// What it is doing and what it settled so far.
    pub fn snapshot(&self) -> ConsumerSnapshot {
        let c = &self.counts;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let state = if self.is_paused() {
            if self.parked.load(Ordering::Relaxed) {
                "paused"
            } else {
                "pausing"
            }
        } else if self.connected.load(Ordering::Relaxed) {
            "consuming"
        } else {
            "connecting"
        };
        ConsumerSnapshot {
            name: self.name.clone(),
            kind: self.kind,
            queue: self.queue.clone(),
            state,
            ok: n(&c.ok),
            duplicate: n(&c.duplicate),
            stale: n(&c.stale),
            retry: n(&c.retry),
            held: n(&c.held),
            dead: n(&c.dead),
        }
    }

    /// While the consumer is paused, waits for it to be resumed; false
    /// when `shutdown` came first. Sessions call it with nothing in hand,
    /// before asking their broker for more messages.
    pub(crate) async fn unless_paused(&self, shutdown: &CancellationToken) -> bool {
        if !self.is_paused() {
            return true;
        }
        tracing::info!(consumer = self.name, "consumer paused: taking no messages");
        self.parked.store(true, Ordering::Relaxed);
        let resumed = tokio::select! {
            _ = shutdown.cancelled() => false,
            _ = self.resumed() => true,
        };
        self.parked.store(false, Ordering::Relaxed);
        if resumed {
            tracing::info!(consumer = self.name, "consumer resumed");
        }
        resumed
    }

    /// Resolves once the consumer is paused (at once if it is).
    pub(crate) async fn paused(&self) {
        let mut rx = self.paused.subscribe();
        let _ = rx.wait_for(|p| *p).await;
    }

    /// Resolves once the consumer is not paused (at once if it is not).
    pub(crate) async fn resumed(&self) {
        let mut rx = self.paused.subscribe();
        let _ = rx.wait_for(|p| !*p).await;
    }

    pub(crate) fn set_connected(&self, up: bool) {
        self.connected.store(up, Ordering::Relaxed);
    }

    pub(crate) fn count(&self, what: Counted) {
        let c = &self.counts;
        let field = match what {
            Counted::Handled(Handled::Ok) => &c.ok,
            Counted::Handled(Handled::Duplicate) => &c.duplicate,
            Counted::Handled(Handled::Stale) => &c.stale,
            Counted::Retry => &c.retry,
            Counted::Held => &c.held,
            Counted::Dead => &c.dead,
        };
        field.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pause_and_resume_switch_once_and_wake_the_waiters() {
        let s = ConsumerState::new("c", "rabbitmq", "q");
        assert_eq!(s.snapshot().state, "connecting");
        s.set_connected(true);
        assert_eq!(s.snapshot().state, "consuming");
        s.resumed().await; // not paused: at once
        assert!(s.pause());
        assert!(!s.pause(), "paused already");
        assert_eq!(s.snapshot().state, "pausing", "nothing parked yet");
        s.paused().await;
        let shutdown = CancellationToken::new();
        let parked = s.unless_paused(&shutdown);
        tokio::pin!(parked);
        assert!(futures::poll!(&mut parked).is_pending());
        assert_eq!(s.snapshot().state, "paused");
        assert!(s.resume());
        assert!(!s.resume(), "running already");
        assert!(parked.await, "resumed, not shut down");
        assert_eq!(s.snapshot().state, "consuming");
        s.count(Counted::Handled(Handled::Ok));
        s.count(Counted::Dead);
        let snap = s.snapshot();
        assert_eq!((snap.ok, snap.dead, snap.retry), (1, 1, 0));
    }
}
