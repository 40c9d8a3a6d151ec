//! Waking an idle relay: the in-process [`Wake`] handle a store signals
//! after `enqueue`, which a database's push (PostgreSQL `LISTEN`) signals
//! too, and the idle probe's answer ([`Due`]).
//!
//! A relay that has nothing to do sleeps until its poll interval passes,
//! the earliest due retry or lease end comes, or its [`Wake`] is signalled,
//! whichever is first.

use std::sync::Arc;

use serde::Serialize;
use tokio::sync::watch;

/// A cloneable signal: "rows may have been written". Every clone signals
/// the same listeners; a signal given while no one waits is kept until the
/// next wait of each listener, so none is lost between two claims.
#[derive(Debug, Clone)]
pub struct Wake(Arc<watch::Sender<u64>>);

impl Default for Wake {
    fn default() -> Self {
        Wake(Arc::new(watch::Sender::new(0)))
    }
}

impl Wake {
    /// A handle no one has signalled yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Wakes every listener (cheap: no allocation, no lock held across an
    /// await; a signal with no listener is a no-op).
    pub fn signal(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A listener that sees the signals given from now on.
    pub fn listen(&self) -> WakeListener {
        let mut rx = self.0.subscribe();
        rx.mark_unchanged();
        WakeListener(rx)
    }
}

/// One waiter of a [`Wake`].
#[derive(Debug)]
pub struct WakeListener(watch::Receiver<u64>);

impl WakeListener {
    /// Returns once the [`Wake`] was signalled since the last call (at once
    /// when it was signalled in between).
    pub async fn woken(&mut self) {
        if self.0.changed().await.is_err() {
            // Every handle is gone: nothing can wake us any more.
            std::future::pending::<()>().await;
        }
    }
}

/// What the idle probe ([`crate::RelayStore::due`]) found for one app_code,
/// on the database's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Due {
    /// Tenant.
    pub app_code: String,
    /// A `pending` row exists.
    pub pending: bool,
    /// Milliseconds until the earliest `retryable` row is due (≤ 0: due
    /// now); `None` when there is no retryable row.
    pub retry_in_ms: Option<i64>,
    /// Milliseconds until the earliest lease of a `delivering` row ends
    /// (≤ 0: expired now); `None` when no row is delivering.
    pub lease_in_ms: Option<i64>,
}

impl Due {
    /// Everything may be due: the answer of a store that cannot probe, so
    /// the relay runs every claim query.
    pub fn anything(app_code: &str) -> Self {
        Due {
            app_code: app_code.to_owned(),
            pending: true,
            retry_in_ms: Some(0),
            lease_in_ms: Some(0),
        }
    }

    /// A retryable row is due now.
    pub fn retry_due(&self) -> bool {
        self.retry_in_ms.is_some_and(|ms| ms <= 0)
    }

    /// A lease has expired.
    pub fn lease_expired(&self) -> bool {
        self.lease_in_ms.is_some_and(|ms| ms <= 0)
    }

    /// Milliseconds until something of this app_code becomes due that is
    /// not due now, if anything.
    pub fn next_in_ms(&self) -> Option<i64> {
        [self.retry_in_ms, self.lease_in_ms]
            .into_iter()
            .flatten()
            .filter(|ms| *ms > 0)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_signal_given_before_the_wait_is_not_lost() {
        let wake = Wake::new();
        let mut a = wake.listen();
        let mut b = wake.clone().listen();
        wake.clone().signal();
        tokio::time::timeout(Duration::from_secs(1), a.woken())
            .await
            .expect("a woke");
        tokio::time::timeout(Duration::from_secs(1), b.woken())
            .await
            .expect("b woke");
        // Consumed: the next wait waits.
        assert!(tokio::time::timeout(Duration::from_millis(50), a.woken())
            .await
            .is_err());
    }

    #[test]
    fn due_reads_the_probe() {
        let d = Due {
            app_code: "a".into(),
            pending: false,
            retry_in_ms: Some(3_600_000),
            lease_in_ms: Some(-5),
        };
        assert!(!d.retry_due());
        assert!(d.lease_expired());
        assert_eq!(d.next_in_ms(), Some(3_600_000));
        let any = Due::anything("a");
        assert!(any.pending && any.retry_due() && any.lease_expired());
        assert_eq!(any.next_in_ms(), None);
    }
}
