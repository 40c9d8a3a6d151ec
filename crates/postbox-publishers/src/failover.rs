//! Failover between brokers (SPEC §10, `failover`): one logical publisher
//! over a priority list of targets (the primary, then each failover
//! target), publishing to one at a time.
//!
//! - When the active target has been unreachable (no live connection) for
//!   `failover_after`, publishing moves to the first other target that is
//!   reachable, in priority order.
//! - When a higher-priority target has been reachable again for
//!   `failback_after`, publishing returns to it (hysteresis: a target that
//!   flaps does not take traffic back at once).
//! - Every switch is logged and counted (`postbox_publisher_switches_total`);
//!   `postbox_publisher_active_target` says which target is active, and so
//!   do `GET /api/publishers` and the dashboard of the relay's admin server
//!   ([`postbox_core::publish::active_targets`]).
//!
//! Each target keeps connecting in the background, so the primary is
//! watched while it is not used. The relay sees one publisher: fanout
//! progress (`delivered_to`) records the logical name, whichever target
//! confirmed. Events in flight at a switch may reach both targets
//! (consumers dedupe by `event_id`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use postbox_core::metrics as m;
use postbox_core::publish::{Delivery, PublishError, PublishResults, Publisher};

/// One target of the priority list.
pub struct Target {
    /// `primary`, or the failover target's name.
    pub name: String,
    /// Its publisher.
    pub publisher: Arc<dyn Publisher>,
}

/// How often the targets' connections are looked at while nothing is
/// published (a publish looks at them too).
const WATCH_EVERY: Duration = Duration::from_millis(500);

/// A publisher over a priority list of targets.
pub struct FailoverPublisher {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    targets: Vec<Target>,
    failover_after: Duration,
    failback_after: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    active: usize,
    /// Per target: whether it was reachable when last looked at, and
    /// since when.
    seen: Vec<Option<(bool, Instant)>>,
}

impl FailoverPublisher {
    /// A publisher named `name` over `targets` (the first is the primary);
    /// a task looks at the targets every half second while it lives.
    pub fn new(
        name: String,
        targets: Vec<Target>,
        failover_after: Duration,
        failback_after: Duration,
    ) -> Self {
        let n = targets.len();
        // The first target reachable now (a relay may start while the
        // primary is down): the rules take over from there.
        let first = (targets.iter())
            .position(|t| t.publisher.connected() != Some(false))
            .unwrap_or(0);
        let publisher = Inner {
            name,
            targets,
            failover_after,
            failback_after,
            state: Mutex::new(State {
                active: first,
                seen: vec![None; n],
            }),
        };
        publisher.export(first);
        if first > 0 {
            tracing::warn!(publisher = %publisher.name, target = %publisher.targets[first].name, "primary unreachable at start: publishing to the next reachable target");
        }
        let inner = Arc::new(publisher);
        let watched = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(WATCH_EVERY);
            loop {
                every.tick().await;
                let Some(inner) = watched.upgrade() else {
                    return;
                };
                inner.choose(Instant::now());
                // Again on every look: a recorder installed after this
                // publisher was made (the relay's admin server) gets the
                // state too, not only the next switch.
                let active = inner.state.lock().unwrap_or_else(|p| p.into_inner()).active;
                inner.export(active);
            }
        });
        FailoverPublisher { inner }
    }
}

impl Inner {
    /// Says which target is active: the gauge of each, and the admin API's
    /// record.
    fn export(&self, active: usize) {
        for (i, t) in self.targets.iter().enumerate() {
            let value = if i == active { 1.0 } else { 0.0 };
            metrics::gauge!(m::PUBLISHER_ACTIVE_TARGET, "publisher" => self.name.clone(), "target" => t.name.clone()).set(value);
        }
        postbox_core::publish::set_active_target(&self.name, &self.targets[active].name);
    }

    /// Looks at every target's connection, switches when the rules say
    /// so, and returns the target to publish to.
    fn choose(&self, now: Instant) -> &Arc<dyn Publisher> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        for (i, t) in self.targets.iter().enumerate() {
            // A publisher that cannot tell counts as reachable.
            let up = t.publisher.connected().unwrap_or(true);
            if state.seen[i].is_none_or(|(was, _)| was != up) {
                state.seen[i] = Some((up, now));
            }
        }
        // How long target `i` has been reachable (`up`) or not, if it is so
        // (a caller that read the clock before another saw a change counts 0).
        let lasted = |state: &State, i: usize, up: bool| {
            (state.seen[i])
                .and_then(|(was, since)| (was == up).then(|| now.saturating_duration_since(since)))
        };
        let active = state.active;
        let back = (0..active)
            .find(|&i| lasted(&state, i, true).is_some_and(|d| d >= self.failback_after));
        let down_for = lasted(&state, active, false);
        let next = match (back, down_for) {
            (Some(i), _) => Some((i, format!("{} is reachable again", self.targets[i].name))),
            (None, Some(down)) if down >= self.failover_after => (0..self.targets.len())
                .find(|&i| i != active && lasted(&state, i, true).is_some())
                .map(|i| {
                    let why = format!(
                        "{} unreachable for {} s",
                        self.targets[active].name,
                        down.as_secs()
                    );
                    (i, why)
                }),
            _ => None,
        };
        if let Some((to, why)) = next {
            self.switch(&mut state, to, &why);
        }
        &self.targets[state.active].publisher
    }

    fn switch(&self, state: &mut State, to: usize, why: &str) {
        let from = &self.targets[state.active].name;
        let to_name = &self.targets[to].name;
        tracing::warn!(publisher = %self.name, from = %from, to = %to_name, reason = why, "publisher switched targets");
        metrics::counter!(m::PUBLISHER_SWITCHES_TOTAL, "publisher" => self.name.clone(), "from" => from.clone(), "to" => to_name.clone()).increment(1);
        self.export(to);
        state.active = to;
    }
}

/// How long a target unreachable at start waits before it tries again,
/// at first and at most (doubling in between).
const CONNECT_AGAIN: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// A target that could not be reached when the relay started: it keeps
/// connecting in the background (each failure logged, at most every 30 s)
/// and counts as unreachable until it is connected, so the failover
/// publisher neither picks it nor fails back to it before then.
pub struct Connecting {
    name: String,
    connected: Arc<std::sync::OnceLock<Arc<dyn Publisher>>>,
}

impl Connecting {
    /// Target `name`, whose first connection failed with `error`;
    /// `connect` tries again.
    pub fn start<F, Fut>(name: String, error: &postbox_core::Error, connect: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = postbox_core::Result<Arc<dyn Publisher>>> + Send,
    {
        tracing::warn!(publisher = %name, error = %error, "failover target unreachable at start; connecting in the background");
        let connected = Arc::new(std::sync::OnceLock::new());
        let cell = Arc::downgrade(&connected);
        let who = name.clone();
        tokio::spawn(async move {
            let mut wait = CONNECT_AGAIN.0;
            loop {
                tokio::time::sleep(wait).await;
                if cell.strong_count() == 0 {
                    return;
                }
                match connect().await {
                    Ok(publisher) => {
                        tracing::info!(publisher = %who, "failover target connected");
                        if let Some(cell) = cell.upgrade() {
                            let _ = cell.set(publisher);
                        }
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(publisher = %who, error = %e, "failover target still unreachable");
                        wait = (wait * 2).min(CONNECT_AGAIN.1);
                    }
                }
            }
        });
        Connecting { name, connected }
    }
}

#[async_trait]
impl Publisher for Connecting {
    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>> {
        match self.connected.get() {
            Some(p) => p.publish(batch).await,
            None => (batch.iter())
                .map(|_| {
                    Err(PublishError::Unreachable(format!(
                        "{} is not connected yet",
                        self.name
                    )))
                })
                .collect(),
        }
    }

    async fn publish_each(
        &self,
        batch: &[Delivery<'_>],
        publish_timeout: Duration,
        results: &PublishResults,
    ) {
        match self.connected.get() {
            Some(p) => p.publish_each(batch, publish_timeout, results).await,
            None => results.set_all(self.publish(batch).await),
        }
    }

    fn connected(&self) -> Option<bool> {
        Some(
            self.connected
                .get()
                .is_some_and(|p| p.connected() != Some(false)),
        )
    }

    fn max_in_flight(&self) -> usize {
        self.connected.get().map_or(1, |p| p.max_in_flight())
    }

    async fn close(&self) {
        if let Some(p) = self.connected.get() {
            p.close().await;
        }
    }
}

impl FailoverPublisher {
    /// The target publishing now.
    fn active(&self) -> &Arc<dyn Publisher> {
        let inner = &self.inner;
        let active = inner.state.lock().unwrap_or_else(|p| p.into_inner()).active;
        &inner.targets[active].publisher
    }
}

#[async_trait]
impl Publisher for FailoverPublisher {
    fn name(&self) -> &str {
        &self.inner.name
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>> {
        let target = self.inner.choose(Instant::now()).clone();
        target.publish(batch).await
    }

    async fn publish_each(
        &self,
        batch: &[Delivery<'_>],
        publish_timeout: Duration,
        results: &PublishResults,
    ) {
        let target = self.inner.choose(Instant::now()).clone();
        target.publish_each(batch, publish_timeout, results).await
    }

    fn connected(&self) -> Option<bool> {
        self.active().connected()
    }

    /// The active target's: the next batch goes there.
    fn max_in_flight(&self) -> usize {
        self.active().max_in_flight()
    }

    async fn close(&self) {
        for t in &self.inner.targets {
            t.publisher.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A target whose connection the test sets.
    struct Stub {
        up: AtomicBool,
    }

    #[async_trait]
    impl Publisher for Stub {
        fn name(&self) -> &str {
            "stub"
        }

        async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>> {
            batch.iter().map(|_| Ok(())).collect()
        }

        fn connected(&self) -> Option<bool> {
            Some(self.up.load(Ordering::Relaxed))
        }
    }

    #[tokio::test]
    async fn it_fails_over_after_its_delay_and_fails_back_only_after_a_steady_primary() {
        let stubs: Vec<_> = (0..2)
            .map(|_| {
                Arc::new(Stub {
                    up: AtomicBool::new(true),
                })
            })
            .collect();
        let targets = ["primary", "dr"]
            .iter()
            .zip(&stubs)
            .map(|(name, stub)| Target {
                name: (*name).to_owned(),
                publisher: stub.clone(),
            })
            .collect();
        let (after, back) = (Duration::from_secs(10), Duration::from_secs(60));
        let p = FailoverPublisher::new("mq".into(), targets, after, back);
        let active = |at: Instant| {
            let chosen = p.inner.choose(at);
            usize::from(!Arc::ptr_eq(
                chosen,
                &(stubs[0].clone() as Arc<dyn Publisher>),
            ))
        };
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(active(at(0)), 0);
        stubs[0].up.store(false, Ordering::Relaxed);
        assert_eq!(active(at(1)), 0, "down, but not for failover_after yet");
        assert_eq!(active(at(10)), 0);
        assert_eq!(active(at(11)), 1, "down for 10 s: the next target");
        stubs[0].up.store(true, Ordering::Relaxed);
        assert_eq!(active(at(20)), 1, "back, but not for failback_after yet");
        stubs[0].up.store(false, Ordering::Relaxed);
        assert_eq!(active(at(30)), 1);
        stubs[0].up.store(true, Ordering::Relaxed);
        assert_eq!(active(at(40)), 1, "a flap starts the wait again");
        assert_eq!(active(at(99)), 1);
        assert_eq!(
            active(at(100)),
            0,
            "reachable for 60 s: back to the primary"
        );
        // With no other target reachable, it stays where it is.
        stubs[0].up.store(false, Ordering::Relaxed);
        stubs[1].up.store(false, Ordering::Relaxed);
        assert_eq!(active(at(200)), 0);
        assert_eq!(active(at(300)), 0);
        assert_eq!(postbox_core::publish::active_targets()["mq"], "primary");
    }
}
