//! A publisher that times out on a whole batch (or whose target it cannot
//! reach: [`crate::PublishError::Unreachable`]) is skipped for a while.
//!
//! Each publisher has its own lane (see [`super::publisher`]), so a target
//! that hangs does not hold the others back; without this it would still
//! spend a `publish_timeout` on every batch it is handed, and its rows
//! would wait that long for their next try. Once a publisher
//! has let every delivery of a batch time out, its breaker opens: for the
//! cool-down (5 s, doubling on each failed trial up to 60 s) its rows are
//! not published (counted as `postbox_publish_total{result = "skipped"}`)
//! but deferred for it, no attempt counted, until the cool-down ends at
//! least (fanout progress keeps what the others confirmed): an outage of
//! the target is not the events' fault, and one write per batch is what
//! the database pays while it lasts. The timeouts of the trial batches
//! count as attempts. The first
//! batch after the cool-down is a trial: any confirmation closes the
//! breaker; another batch of timeouts opens it for twice as long. A
//! batch that times out while the breaker is already open (it was in
//! flight beside the one that opened it) changes nothing. Each
//! opening and closing is one log line, not one per batch.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The first cool-down after a publisher timed out on a whole batch.
pub(crate) const FIRST_COOL_DOWN: Duration = Duration::from_secs(5);

/// The longest cool-down.
pub(crate) const MAX_COOL_DOWN: Duration = Duration::from_secs(60);

/// One publisher's breaker.
#[derive(Debug, Default)]
pub(crate) struct Breaker {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Skip publishing until then.
    open_until: Option<Instant>,
    /// The last cool-down (zero while closed).
    cool_down: Duration,
}

/// How one batch went for a publisher, as far as its breaker cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BatchResult {
    /// At least one delivery was confirmed.
    Confirmed,
    /// Every delivery timed out.
    AllTimedOut,
    /// Failures that are not all timeouts (the target answers).
    Other,
}

impl Breaker {
    /// `Some(remaining)` while the breaker is open at `now`: skip the
    /// publisher.
    pub(crate) fn skip(&self, now: Instant) -> Option<Duration> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state
            .open_until
            .and_then(|until| until.checked_duration_since(now))
            .filter(|left| !left.is_zero())
    }

    /// Records a batch that was published at `now`; returns what changed,
    /// for the caller to log.
    pub(crate) fn record(&self, result: BatchResult, now: Instant) -> Change {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            // Another batch in flight at the same time (a publisher that
            // takes several at once) already opened it: one outage, one
            // cool-down, not one doubling per batch.
            BatchResult::AllTimedOut if state.open_until.is_some_and(|until| until > now) => {
                Change::None
            }
            BatchResult::AllTimedOut => {
                state.cool_down = if state.cool_down.is_zero() {
                    FIRST_COOL_DOWN
                } else {
                    (state.cool_down * 2).min(MAX_COOL_DOWN)
                };
                state.open_until = Some(now + state.cool_down);
                Change::Opened(state.cool_down)
            }
            BatchResult::Confirmed if !state.cool_down.is_zero() => {
                *state = State::default();
                Change::Closed
            }
            BatchResult::Confirmed | BatchResult::Other => Change::None,
        }
    }
}

/// What [`Breaker::record`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// Nothing.
    None,
    /// Opened for this long.
    Opened(Duration),
    /// A trial confirmed: closed again.
    Closed,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_on_a_batch_of_timeouts_and_doubles_until_a_confirmation() {
        let b = Breaker::default();
        let t0 = Instant::now();
        assert_eq!(b.skip(t0), None, "closed at first");
        assert_eq!(b.record(BatchResult::Other, t0), Change::None);
        assert_eq!(b.skip(t0), None, "failures that answer do not open it");

        assert_eq!(
            b.record(BatchResult::AllTimedOut, t0),
            Change::Opened(FIRST_COOL_DOWN)
        );
        assert!(b.skip(t0 + Duration::from_secs(1)).is_some());
        let trial = t0 + FIRST_COOL_DOWN;
        assert_eq!(b.skip(trial), None, "a trial after the cool-down");
        assert_eq!(
            b.record(BatchResult::AllTimedOut, trial),
            Change::Opened(FIRST_COOL_DOWN * 2)
        );
        let mut at = trial;
        for _ in 0..10 {
            at += MAX_COOL_DOWN;
            b.record(BatchResult::AllTimedOut, at);
        }
        assert_eq!(
            b.skip(at + MAX_COOL_DOWN),
            None,
            "never longer than the maximum"
        );

        let later = at + MAX_COOL_DOWN;
        assert_eq!(b.record(BatchResult::Confirmed, later), Change::Closed);
        assert_eq!(b.skip(later), None);
        assert_eq!(b.record(BatchResult::Confirmed, later), Change::None);
        assert_eq!(
            b.record(BatchResult::AllTimedOut, later),
            Change::Opened(FIRST_COOL_DOWN),
            "a new streak starts from the first cool-down"
        );
    }

    /// RabbitMQ's lane has two batches in flight: both time out in one
    /// outage, and both pass the breaker as trials after a cool-down. The
    /// second of each pair finds the breaker open and leaves it as it is,
    /// so the cool-downs go 5 s, 10 s, as with one batch at a time (they
    /// went 10 s, 40 s).
    #[test]
    fn batches_in_flight_together_open_it_once() {
        let b = Breaker::default();
        let t0 = Instant::now();
        let beside = Duration::from_millis(3);
        assert_eq!(
            b.record(BatchResult::AllTimedOut, t0),
            Change::Opened(FIRST_COOL_DOWN)
        );
        assert_eq!(
            b.record(BatchResult::AllTimedOut, t0 + beside),
            Change::None
        );
        let trial = t0 + FIRST_COOL_DOWN;
        assert_eq!(b.skip(trial), None);
        assert_eq!(
            b.record(BatchResult::AllTimedOut, trial),
            Change::Opened(FIRST_COOL_DOWN * 2)
        );
        assert_eq!(
            b.record(BatchResult::AllTimedOut, trial + beside),
            Change::None
        );
        assert_eq!(
            b.skip(trial + beside),
            Some(FIRST_COOL_DOWN * 2 - beside),
            "open for the second cool-down, no longer"
        );
    }
}
