//! Stage 1: the claim queries, pending first, and the idle sleep.
//!
//! While a backlog drains (a claim came back full) or right after a
//! wake-up, the pending query runs back to back for every app_code, and
//! due retries and expired leases are swept once per poll interval. When
//! idle, one probe ([`RelayStore::due`]) for all app_codes replaces the
//! claim queries, and only what it found due is claimed; then the claimer
//! sleeps until the poll interval passes, the earliest retry or lease is
//! due, or the store's [`Wake`](crate::wake::Wake) is signalled. After a
//! wake-up or a claim that found rows it polls fast (10 ms, doubling up to
//! the poll interval): an in-process `enqueue` signals before its caller
//! commits. Wake-ups are coalesced: a woken claimer starts its next round
//! no sooner than [`WAKE_COALESCE`] after the previous one began, so a
//! stream of commits (each one a notification) is claimed a few rows per
//! round, not one round per commit.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::KeyValue;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{spans, Batch};
use crate::config::{Ordering, WorkerConfig};
use crate::control::Controls;
use crate::event::Fence;
use crate::store::{ClaimRequest, DeferUpdate, RelayStore};
use crate::wake::WakeListener;
use crate::{trace, ClaimSource, ClaimedEvent, Result};

/// The first pause of fast polling, after a wake-up or a claim that found
/// rows; it doubles up to the poll interval.
pub(super) const FAST_POLL: Duration = Duration::from_millis(10);

/// After a wake-up, the claimer waits until this long has passed since
/// its previous round began. At 1,000 commits/s, each notifying, that is
/// at most 200 claim rounds a second (about five rows each, with one mark
/// per batch) instead of a claim and a mark per event; it adds at most
/// this much to the latency of a woken delivery.
pub(super) const WAKE_COALESCE: Duration = Duration::from_millis(5);

pub(super) struct Claimer {
    /// Beats at every round (`/healthz`).
    pub pulse: super::Pulse,
    pub store: Arc<dyn RelayStore>,
    pub config: WorkerConfig,
    pub app_codes: Vec<String>,
    pub worker_id: String,
    pub wake: WakeListener,
    /// The runtime controls, read again before a round's claims when older
    /// than their refresh interval: a paused app_code is not claimed.
    pub controls: super::controls::ControlView,
    /// Rows claimed, for the heartbeat.
    pub tally: Arc<super::heartbeat::Tally>,
    /// One row taken over from an expired lease in publication at a time
    /// (see [`TAKEOVER_BATCH`]).
    pub takeovers: Arc<tokio::sync::Semaphore>,
}

/// One claim query to run: app_code `app` (its index), from `source`,
/// leaving out the pending rows of `skip_types`.
struct Claim<'a> {
    app: usize,
    source: ClaimSource,
    skip_types: &'a [String],
    controls: &'a Controls,
}

/// Expired leases taken over per round. Each is claimed alone, once the
/// one before it has been published (the takeover gate), and published
/// alone: a relay that died on a batch (an event that crashes or hangs it)
/// left every row of the batch leased, and taking them over together sent
/// them together into the same crash again, until every row of the batch
/// was dead-lettered with the one event that did it. Alone, a crash costs
/// the event that makes it its own attempts (and what else was in flight
/// then); a row not yet taken over is not leased, so it does not expire
/// with it. The gate is not waited for: while it is busy the claimer
/// claims its other work, and the round after the gate frees takes the
/// next. A round takes over at most this many.
const TAKEOVER_BATCH: u32 = 8;

/// How long a claim in flight when the relay is asked to stop may still
/// take. Bounded on its own at twice the lease (see `bounded.rs`), a claim
/// on a database gone silent held the stop for a minute at the default
/// lease, past the grace most supervisors give (Kubernetes: 30 s) before
/// they kill the process. Given up, it is what a kill would leave: rows
/// leased on the database by a claim that commits later wait out their
/// lease.
const CLAIM_AFTER_STOP: Duration = Duration::from_secs(5);

/// How long one round goes on claiming due retries (or expired leases)
/// of one app_code past batches all of paused types: each batch is given
/// back, due again after [`PAUSED_RECHECK`], so the next claim reads past
/// it; a longer paused backlog is read past over the next rounds.
const CLAIM_PAST_HELD: Duration = Duration::from_secs(1);

/// The longest pause after a round that wrote the heartbeat in place of
/// its probe: the probe it stood in for follows within it (the default
/// `poll_interval`, 1 s, is not longer).
const BEAT_THEN_PROBE: Duration = Duration::from_secs(1);

/// How long a due retry of a paused type waits before the sweep takes it
/// again (to give it back again, or to publish it once resumed).
const PAUSED_RECHECK: Duration = Duration::from_secs(5);

/// [`PAUSED_RECHECK`] for a row given back for a pause before. Due again
/// every 5 s, a paused backlog of due retries came back faster than a
/// relay could claim past it (a batch a round: past 5 batches it never got
/// through), and the other types' retries and expired leases behind it in
/// due order waited for the whole pause; and it was rewritten every 5 s.
/// A paused type's retry is sent within this of the pause's end.
const PAUSED_RECHECK_AGAIN: Duration = Duration::from_secs(60);

/// Why rows were given back while paused (their `last_error` when deferred).
const PAUSED: &str = "paused by a runtime control";

/// What one round of claims found.
#[derive(Default)]
struct Round {
    /// A claim came back with `batch_size` rows: more are waiting.
    full: bool,
    /// A claim came back with rows.
    found: bool,
    /// A claim (or the probe) failed, not transiently.
    error: bool,
    /// A claim came back with `batch_size` rows, all of paused types, and
    /// gave them back: what comes after them was not looked at.
    held_full: bool,
    /// Expired leases were due, but the takeover before is still being
    /// published: they are taken over once it has been.
    takeover_waits: bool,
    /// Rows taken over from expired leases.
    taken_over: u64,
}

impl Claimer {
    /// Returns the number of rows claimed. A failed claim is no failure of
    /// the stage: it is logged and tried again after a pause that grows
    /// with the streak (the database may be restarting).
    pub async fn run(
        mut self,
        out: mpsc::Sender<Batch>,
        shutdown: CancellationToken,
    ) -> Result<u64> {
        let poll = self.config.poll_interval.get();
        // Due retries and expired leases are looked for once per poll
        // interval, not on every claim: while a backlog drains, the pending
        // query alone runs back to back.
        let mut last_sweep: Vec<Option<Instant>> = vec![None; self.app_codes.len()];
        let mut claimed = 0u64;
        let mut db_errors = 0u32;
        // Claim pending rows of every app_code without probing first: a
        // backlog drains, or a wake-up said rows were written.
        let mut draining = false;
        // The pause after the next round that finds nothing, while polling
        // fast after activity.
        let mut fast: Option<Duration> = None;
        while !shutdown.is_cancelled() {
            self.pulse.beat();
            let round_started = Instant::now();
            let mut round = Round::default();
            let mut next_due: Option<Duration> = None;
            let mut plan: Vec<(usize, Vec<ClaimSource>)> = Vec::new();
            let mut beat_round = false;
            if draining {
                for (i, sweep) in last_sweep.iter_mut().enumerate() {
                    let mut sources = Vec::with_capacity(3);
                    if sweep.is_none_or(|t| t.elapsed() >= poll) {
                        sources.extend([ClaimSource::ExpiredLease, ClaimSource::DueRetry]);
                        *sweep = Some(Instant::now());
                    }
                    sources.push(ClaimSource::Pending);
                    plan.push((i, sources));
                }
            } else if let Some(beat) = self.tally.take_beat() {
                // Idle, and the heartbeat is due: this round's one round
                // trip writes it instead of probing (see `heartbeat`); the
                // probe follows within a second.
                beat_round = true;
                // Neither this beat nor the probe is worth waiting for
                // once the relay stops: a database gone silent held the
                // stop for the pool's connect timeout.
                let beat = tokio::select! {
                    beat = self.store.beat(&beat) => beat,
                    _ = shutdown.cancelled() => break,
                };
                if let Err(e) = beat {
                    tracing::debug!(error = %e, "could not write the relay heartbeat");
                }
            } else {
                let probe = tokio::select! {
                    probe = self.store.due(&self.app_codes) => probe,
                    _ = shutdown.cancelled() => break,
                };
                match probe {
                    Ok(dues) => {
                        db_errors = 0;
                        for due in dues {
                            let Some(i) = self.app_codes.iter().position(|a| *a == due.app_code)
                            else {
                                continue;
                            };
                            // The probe looked at retries and leases: a sweep.
                            last_sweep[i] = Some(Instant::now());
                            let mut sources = Vec::with_capacity(3);
                            if due.lease_expired() {
                                sources.push(ClaimSource::ExpiredLease);
                            }
                            if due.retry_due() {
                                sources.push(ClaimSource::DueRetry);
                            }
                            if due.pending {
                                sources.push(ClaimSource::Pending);
                            }
                            if !sources.is_empty() {
                                plan.push((i, sources));
                            }
                            if let Some(ms) = due.next_in_ms() {
                                let at = Duration::from_millis(ms.unsigned_abs());
                                next_due = Some(next_due.map_or(at, |n| n.min(at)));
                            }
                        }
                    }
                    Err(e) if e.is_transient() => {
                        tracing::debug!(error = %e, "idle probe hit a transient conflict");
                    }
                    Err(e) => {
                        round.error = true;
                        db_errors += 1;
                        if db_errors == 1 || db_errors.is_power_of_two() {
                            tracing::error!(error = %e, consecutive = db_errors, "idle probe failed");
                        }
                    }
                }
            }
            let mut controls = Controls::default();
            if !plan.is_empty() {
                self.controls.refresh(self.store.as_ref()).await;
                controls = self.controls.get();
                plan.retain(|(i, _)| !controls.paused(&self.app_codes[*i]));
            }
            for (i, sources) in plan {
                let skip_types = controls.paused_types(&self.app_codes[i]);
                for source in sources {
                    // Due retries and expired leases are claimed in due
                    // order whatever their type: a batch all of paused
                    // types, given back, is claimed past at once, or the
                    // other types' rows due after a paused backlog waited
                    // one poll per batch of it.
                    let past_held = Instant::now();
                    let mut taken_over = 0;
                    loop {
                        let claim = Claim {
                            app: i,
                            source,
                            skip_types: &skip_types,
                            controls: &controls,
                        };
                        let Some(outcome) = self
                            .claim_one(claim, &out, &shutdown, &mut claimed, &mut db_errors)
                            .await
                        else {
                            return Ok(claimed);
                        };
                        round.full |= outcome.full;
                        round.found |= outcome.found;
                        round.error |= outcome.error;
                        round.taken_over += outcome.taken_over;
                        if outcome.takeover_waits {
                            // The gate is busy: the other sources go on, and
                            // the next round (woken when the gate frees)
                            // takes this app_code's expired leases.
                            round.takeover_waits = true;
                            last_sweep[i] = None;
                            break;
                        }
                        if source == ClaimSource::ExpiredLease && outcome.full {
                            taken_over += 1;
                            if taken_over < TAKEOVER_BATCH {
                                continue;
                            }
                            // More expired leases than a round takes over:
                            // the next round takes the next ones.
                            last_sweep[i] = None;
                            break;
                        }
                        if !outcome.held_full
                            || source == ClaimSource::Pending
                            || past_held.elapsed() >= CLAIM_PAST_HELD
                        {
                            break;
                        }
                    }
                }
            }
            if round.taken_over > 0 {
                tracing::warn!(
                    rows = round.taken_over,
                    "took over expired leases; counted as failed attempts"
                );
            }
            if round.full && !round.error {
                draining = true;
                self.tally.set_idle(false);
                continue;
            }
            draining = false;
            self.tally.set_idle(!round.found);
            if round.found {
                fast = Some(FAST_POLL);
            }
            let pause = if round.error {
                (poll * db_errors.min(10)).min(Duration::from_secs(30))
            } else {
                let mut pause = poll;
                if let Some(f) = fast {
                    pause = pause.min(f);
                    fast = Some(f * 2).filter(|next| *next < poll);
                }
                if beat_round {
                    // A poll longer than a heartbeat found one handed over
                    // at every round: it never probed again.
                    pause = pause.min(BEAT_THEN_PROBE);
                }
                next_due.map_or(pause, |due| pause.min(due))
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                // The takeover that held the gate has been published.
                _ = self.takeovers.acquire(), if round.takeover_waits => {}
                _ = self.wake.woken() => {
                    // Rows were written (here, or pushed by the database):
                    // claim pending at once, then poll fast, for an
                    // in-process producer may commit a little later.
                    draining = true;
                    self.tally.set_idle(false);
                    fast = Some(FAST_POLL);
                    let wait = WAKE_COALESCE.saturating_sub(round_started.elapsed());
                    if !wait.is_zero() {
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = shutdown.cancelled() => {}
                        }
                    }
                }
                _ = shutdown.cancelled() => {}
            }
        }
        Ok(claimed)
    }

    /// Runs one claim query and hands its batch on; `None` when the relay
    /// stops.
    async fn claim_one(
        &self,
        Claim {
            app: i,
            source,
            skip_types,
            controls,
        }: Claim<'_>,
        out: &mpsc::Sender<Batch>,
        shutdown: &CancellationToken,
        claimed: &mut u64,
        db_errors: &mut u32,
    ) -> Option<Round> {
        // A round of many app_codes, each claim waiting on a slow publish
        // stage, can outlast the pulse's window: each claim is a beat.
        self.pulse.beat();
        let app_code = self.app_codes[i].as_str();
        let batch_size = self.config.batch_size;
        let mut round = Round::default();
        // A takeover claims only once the one before it has been published
        // (see [`TAKEOVER_BATCH`]), and takes the gate before a slot of the
        // channel. The gate is tried, never waited for: waiting, the
        // claimer claimed nothing else meanwhile, for every app_code (and,
        // holding a slot, kept a failing publish stage from draining).
        let gate = match source {
            ClaimSource::ExpiredLease => match self.takeovers.clone().try_acquire_owned() {
                Ok(gate) => Some(gate),
                Err(_) => {
                    round.takeover_waits = true;
                    return Some(round);
                }
            },
            _ => None,
        };
        // Claim only when the publish stage can take the batch: a claimed
        // batch waits behind at most the one in flight (the wait
        // LeaseBudget allows for).
        let permit = tokio::select! {
            permit = out.reserve() => permit,
            _ = shutdown.cancelled() => return None,
        };
        // The publish stage is gone (it failed, and says so itself).
        let permit = permit.ok()?;
        if shutdown.is_cancelled() {
            return None;
        }
        let limit = match source {
            ClaimSource::ExpiredLease => 1,
            _ => batch_size,
        };
        let req = ClaimRequest {
            app_code,
            limit,
            worker_id: &self.worker_id,
            lease_ms: self.config.lease.as_millis_i64(),
            ordered: self.config.ordering == Ordering::PerAggregate,
            skip_types,
        };
        // The lease starts on the database while the claim runs: count the
        // batch's age from before it.
        let claim_started = Instant::now();
        let traced_since = trace::exporting().then(SystemTime::now);
        let claim = self.store.claim(source, &req);
        tokio::pin!(claim);
        let answer = tokio::select! {
            answer = &mut claim => answer,
            _ = shutdown.cancelled() => {
                // Its answer is still worth having (its rows go to the
                // publish stage, which releases them), for a while.
                match tokio::time::timeout(CLAIM_AFTER_STOP, &mut claim).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        tracing::warn!(
                            app_code,
                            "the claim in flight had no answer {} s after the stop; leaving it (rows it may still lease on the database wait out their lease)",
                            CLAIM_AFTER_STOP.as_secs()
                        );
                        return None;
                    }
                }
            }
        };
        match answer {
            Ok(events) if events.is_empty() => {}
            Ok(events) => {
                // A paused type's due retries and expired leases (and rows
                // claimed just before a pause was read) go back. Nothing
                // to look at while nothing is paused.
                let mut events = events;
                let fetched = events.len();
                if controls.any_paused() {
                    let held;
                    (held, events) = events
                        .into_iter()
                        .partition(|e| controls.holds(&e.record.app_code, &e.record.event_type));
                    if !held.is_empty() {
                        self.hold_back(held).await;
                    }
                }
                if events.is_empty() {
                    round.held_full = fetched == limit as usize;
                    return Some(round);
                }
                *db_errors = 0;
                *claimed += events.len() as u64;
                super::heartbeat::Tally::add(&self.tally.claimed, events.len() as u64);
                round.found = true;
                if source == ClaimSource::ExpiredLease {
                    metrics::counter!(crate::metrics::LEASE_EXPIRED_TOTAL)
                        .increment(events.len() as u64);
                    tracing::debug!(
                        app_code,
                        event_id = %events[0].record.event_id,
                        "took over an expired lease"
                    );
                    round.taken_over += events.len() as u64;
                }
                if events.len() as u32 == limit {
                    round.full = true;
                }
                if let Some(started) = traced_since {
                    let attributes = vec![
                        KeyValue::new("postbox.app_code", app_code.to_owned()),
                        KeyValue::new("postbox.claim_source", format!("{source:?}")),
                        KeyValue::new("postbox.rows", events.len() as i64),
                    ];
                    let links = spans::links(events.iter().map(|e| &e.record));
                    spans::batch("postbox.claim", started, links, attributes, None);
                }
                // A reserved slot cannot refuse: a publish stage that stops
                // drains and releases what is queued.
                permit.send(Batch {
                    events,
                    claimed_at: claim_started,
                    gate,
                });
            }
            Err(e) if e.is_transient() => {
                // A deadlock with a producer or another relay: the claim was
                // rolled back; claim again soon.
                tracing::debug!(app_code, ?source, error = %e, "claim hit a transient conflict");
            }
            Err(e) => {
                round.error = true;
                *db_errors += 1;
                // One line per streak of failures, not per poll.
                if *db_errors == 1 || db_errors.is_power_of_two() {
                    tracing::error!(app_code, ?source, error = %e, consecutive = *db_errors, "claim failed");
                }
            }
        }
        Some(round)
    }

    /// Gives back rows a claim took while their app_code or type is paused,
    /// counting no attempt: a row never tried becomes `pending` again (the
    /// pending claims leave it out while paused); a retry stays
    /// `retryable`, due after [`PAUSED_RECHECK`] ([`PAUSED_RECHECK_AGAIN`]
    /// when it was given back for a pause before), keeping the publishers
    /// that confirmed it.
    async fn hold_back(&self, held: Vec<ClaimedEvent>) {
        let (fresh, retries): (Vec<_>, Vec<_>) =
            held.into_iter().partition(|e| e.record.retry_count == 0);
        if !fresh.is_empty() {
            super::release(self.store.as_ref(), &fresh, PAUSED).await;
        }
        let mut waiting: HashMap<(Fence, Vec<String>, bool), Vec<i64>> = HashMap::new();
        for e in retries {
            // Given back for a pause before: the pause goes on.
            let again = e.record.last_error.as_deref() == Some(PAUSED);
            let key = (e.fence(), e.record.delivered_to.clone(), again);
            waiting.entry(key).or_default().push(e.record.id);
        }
        for ((fence, delivered_to, again), ids) in waiting {
            let recheck = if again {
                PAUSED_RECHECK_AGAIN
            } else {
                PAUSED_RECHECK
            };
            let update = DeferUpdate {
                after_ms: recheck.as_millis() as i64,
                delivered_to,
                reason: PAUSED.to_owned(),
            };
            // Retried as the mark stage's writes are: a row left leased
            // waits out its lease, and its takeover counts an attempt.
            if let Err(e) = super::retrying("give back paused rows", || {
                self.store.defer(&fence, &ids, &update)
            })
            .await
            {
                tracing::warn!(error = %e, rows = ids.len(), "could not give back paused rows; their leases expire by themselves");
            }
        }
    }
}
