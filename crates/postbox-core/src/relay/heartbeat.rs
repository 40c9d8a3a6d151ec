//! The relay's heartbeat: its row in `<table>_relays` (schema version 10),
//! written when it starts, every [`RELAY_BEAT`] while it runs and once more
//! when it stops, so that `postbox relays`, `GET /api/relays` and the
//! dashboard list every relay of the table, on any host, with what it did.
//! One write per beat. While the relay is idle the beat is not written
//! beside the idle probe: it is handed to the claimer, whose next idle
//! round writes it *instead of* probing, so an idle relay still makes at
//! most one database round trip per poll interval in all (the probe it
//! skips is the safety net's: due retries and expired leases wait one
//! interval more, once per beat; pushed and in-process wake-ups are not
//! delayed).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::store::{RelayBeat, RelayStore, RELAY_BEAT};

/// How long the last beat, written as the relay stops, may take.
const LAST_BEAT_WITHIN: std::time::Duration = std::time::Duration::from_secs(3);

/// What the stages did since the relay started, counted as they go, and
/// the beat the claimer is to write while the relay is idle.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub claimed: AtomicU64,
    pub delivered: AtomicU64,
    pub failed: AtomicU64,
    /// The claimer's last round found nothing and it sleeps until its next
    /// probe.
    idle: AtomicBool,
    /// A beat for the claimer's next idle round to write.
    handed: Mutex<Option<RelayBeat>>,
}

impl Tally {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether the claimer's last round found nothing.
    pub fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::Relaxed);
    }

    /// The beat handed to the claimer, if any (taking it).
    pub fn take_beat(&self) -> Option<RelayBeat> {
        self.handed.lock().map(|mut b| b.take()).unwrap_or(None)
    }

    /// Hands `beat` to the claimer; the beat handed before and not taken.
    fn hand(&self, beat: Option<RelayBeat>) -> Option<RelayBeat> {
        self.handed
            .lock()
            .map(|mut slot| std::mem::replace(&mut *slot, beat))
            .unwrap_or(None)
    }
}

/// Writes the heartbeats of one relay.
pub(super) struct Heartbeat {
    pub store: Arc<dyn RelayStore>,
    pub worker_id: String,
    pub app_codes: Vec<String>,
    pub tally: Arc<Tally>,
    /// This host's name and this process's id ([`host_and_pid`]), read once.
    pub host: (String, u32),
}

impl Heartbeat {
    /// Beats until `stop` is cancelled; the last beat is [`Heartbeat::last`]'s.
    pub async fn run(self, stop: CancellationToken) -> Self {
        let mut since = (Instant::now(), 0u64);
        let mut failures = 0u32;
        loop {
            let delivered = self.tally.delivered.load(Ordering::Relaxed);
            let elapsed_ms = since.0.elapsed().as_millis().max(1) as u64;
            let per_minute = delivered.saturating_sub(since.1) * 60_000 / elapsed_ms;
            since = (Instant::now(), delivered);
            let beat = self.beat(per_minute, false);
            // The claimer writes it in place of its next probe, when idle
            // and coming round within a beat; else it is written here (a
            // beat handed earlier and not taken is stale).
            let idle = self.tally.idle.load(Ordering::Relaxed);
            let untaken = self.tally.hand(idle.then_some(beat.clone()));
            if untaken.is_some() {
                self.tally.hand(None);
            }
            if !idle || untaken.is_some() {
                let written = tokio::select! {
                    written = self.store.beat(&beat) => written,
                    _ = stop.cancelled() => return self,
                };
                match written {
                    Ok(()) => failures = 0,
                    Err(e) => {
                        failures += 1;
                        // One line per streak: the relay works on without it.
                        if failures == 1 {
                            tracing::warn!(error = %e, "could not write the relay heartbeat (run `postbox migrate` for schema version 10); relaying goes on");
                        }
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(RELAY_BEAT) => {}
                _ = stop.cancelled() => return self,
            }
        }
    }

    /// The last beat: the relay stopped, with its final counts. Given
    /// [`LAST_BEAT_WITHIN`]: on a database gone silent it held the stop for
    /// the pool's connect timeout, and the registry shows a relay whose
    /// beats stopped as gone anyway.
    pub async fn last(&self) {
        let beat = self.beat(0, true);
        let last = self.store.beat(&beat);
        let last =
            crate::Error::unless_silent("write the relay's last heartbeat", LAST_BEAT_WITHIN, last);
        if let Err(e) = last.await {
            tracing::debug!(error = %e, "could not write the relay's last heartbeat");
        }
    }

    fn beat(&self, per_minute: u64, stopped: bool) -> RelayBeat {
        RelayBeat {
            worker_id: self.worker_id.clone(),
            host: self.host.0.clone(),
            pid: self.host.1,
            app_codes: self.app_codes.clone(),
            claimed: self.tally.claimed.load(Ordering::Relaxed),
            delivered: self.tally.delivered.load(Ordering::Relaxed),
            failed: self.tally.failed.load(Ordering::Relaxed),
            per_minute,
            stopped,
        }
    }
}

/// This host's name and this process's id.
pub(super) fn host_and_pid() -> (String, u32) {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    (host, std::process::id())
}
