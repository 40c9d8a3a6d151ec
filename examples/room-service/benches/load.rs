//! The load run of the seed's room service: `rooms` rooms, each sending
//! `rate` commands per second for `secs` seconds, with IM failing a share
//! of its requests; on MariaDB + RabbitMQ, everything in this process (the
//! acceptance tests' stack). Prints command latency, outbox lag (commit →
//! IM, commit → activity), what failed, and the duplicates the consumers
//! saw after dedupe.
//!
//! ```sh
//! cargo bench -p room-service --bench load -- --rooms 100 --rate 20 --secs 60 --im-fail 0.1
//! ```

#[path = "../tests/stack/mod.rs"]
mod stack;

use std::time::{Duration, Instant};

use postbox_testkit::conformance::app_stats;
use room_service::im::Faults;
use serde_json::json;
use stack::{Options, Stack};

/// The load run's knobs.
#[derive(clap::Parser)]
struct Args {
    /// Rooms, each sending commands on its own.
    #[arg(long, default_value_t = 100)]
    rooms: usize,
    /// Commands per second per room.
    #[arg(long, default_value_t = 20)]
    rate: u32,
    /// How long the load runs.
    #[arg(long, default_value_t = 60)]
    secs: u64,
    /// The share of IM pushes that fail (500).
    #[arg(long, default_value_t = 0.1)]
    im_fail: f64,
    /// How long to wait, after the load, for every event to be delivered
    /// and handled.
    #[arg(long, default_value_t = 300)]
    drain_secs: u64,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

/// One room's commands: create, then join / mic take / gift / mic leave /
/// leave for ten users in turn, at `rate` per second until `until`.
/// Latencies of the commands that succeeded, and the statuses of the rest.
async fn drive(s: &Stack, room: String, rate: u32, until: Instant) -> (Vec<f64>, Vec<u16>) {
    let owner = format!("{room}-owner");
    let (mut took, mut refused) = (Vec::new(), Vec::new());
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut k = 0usize;
    while Instant::now() < until {
        tick.tick().await;
        let id = format!("{room}-{k}");
        // Commands 1..=5 are user 0's join … leave, 6..=10 user 1's, …
        let turn = k.saturating_sub(1) / 5;
        let user = format!("{room}-u{}", turn % 10);
        let seat = (turn % 8) as u8;
        let (name, body) = match (k, k % 5) {
            (0, _) => ("create", json!({ "command_id": id, "user_id": owner })),
            (_, 1) => ("join", json!({ "command_id": id, "user_id": user })),
            (_, 2) => (
                "mic",
                json!({ "command_id": id, "user_id": user, "seat": seat, "action": "take" }),
            ),
            (_, 3) => (
                "sendGift",
                json!({ "command_id": id, "user_id": owner, "to_user_id": user, "gift_id": "rose", "amount": 1 }),
            ),
            (_, 4) => (
                "mic",
                json!({ "command_id": id, "user_id": user, "seat": seat, "action": "leave" }),
            ),
            _ => ("leave", json!({ "command_id": id, "user_id": user })),
        };
        let started = Instant::now();
        let (status, _) = s.command(&room, name, body).await;
        if status == 200 {
            took.push(started.elapsed().as_secs_f64() * 1e3);
        } else {
            refused.push(status);
        }
        k += 1;
    }
    (took, refused)
}

/// Events the inbox of `group` acked without handling them: a newer
/// version of their aggregate had been handled first (SPEC: "an older one
/// is acknowledged and skipped as stale"). With three workers taking first
/// deliveries in parallel, version n+1 can overtake version n in hand.
fn stale_skipped(group: &str) -> i64 {
    stack::log_lines("stale event skipped")
        .iter()
        .filter(|l| l["fields"]["consumer_group"] == group)
        .count() as i64
}

/// What an undrained run left behind: the activity queues' depths, and the
/// room events activity never handled, with what the log says of them.
async fn not_drained(s: &Stack) {
    let queues = postbox_testkit::consumer_fixtures::rabbitmqctl_list(
        "queues",
        &["name", "messages_ready", "messages_unacknowledged"],
    )
    .await;
    for line in queues
        .lines()
        .filter(|l| l.starts_with(&s.names.activity_queue))
    {
        println!("queue (name, ready, unacked): {line}");
    }
    let ids: Vec<(String,)> = s
        .room_db
        .fetch_all("SELECT event_id FROM room_outbox", vec![])
        .await
        .unwrap();
    let missing: Vec<&String> = ids
        .iter()
        .map(|(id,)| id)
        .filter(|id| !s.activity.has(id))
        .collect();
    println!("room events activity never handled: {}", missing.len());
    for id in missing.iter().take(5) {
        println!("  {id}:");
        for line in stack::log_lines(id) {
            println!("    {line}");
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = <Args as clap::Parser>::parse();
    let s = Stack::start(Options::retries(10)).await;
    s.im.set_faults(Faults {
        fail_rate: a.im_fail,
        ..Faults::default()
    });
    println!(
        "load: {} rooms x {} commands/s for {} s (offered {} commands/s), IM failing {:.0} % of pushes; MariaDB + RabbitMQ, relays in-process, 3 activity consumers (prefetch 1) + notice",
        a.rooms,
        a.rate,
        a.secs,
        a.rooms as u32 * a.rate,
        a.im_fail * 100.0
    );
    let started = Instant::now();
    let until = started + Duration::from_secs(a.secs);
    let runs = (0..a.rooms).map(|r| drive(&s, format!("load{r}"), a.rate, until));
    let results = futures::future::join_all(runs).await;
    let elapsed = started.elapsed().as_secs_f64();
    let mut took = Vec::new();
    let mut refused = Vec::new();
    for (t, r) in results {
        took.extend(t);
        refused.extend(r);
    }
    let took = sorted(took);
    let ok = took.len();
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for r in &refused {
        *statuses.entry(*r).or_default() += 1;
    }
    println!(
        "commands: {ok} ok ({:.0}/s), refused {:?}; latency p50 {:.1} ms, p99 {:.1} ms",
        ok as f64 / elapsed,
        statuses,
        percentile(&took, 0.5),
        percentile(&took, 0.99)
    );

    // Drain: every committed event delivered (or dead after 10 attempts),
    // and handled by activity (or skipped there as stale).
    let drain = Instant::now();
    let mut last_handled = -1;
    let drained = loop {
        let room = app_stats(s.room_db.outbox(), "room").await;
        let wallet = app_stats(s.wallet_db.outbox(), "wallet").await;
        let open = [room.pending, room.retryable, room.delivering]
            .iter()
            .chain(&[wallet.pending, wallet.retryable, wallet.delivering])
            .sum::<i64>();
        // Each command that succeeded committed one room event (the
        // delivered count is exact only up to 25,000: compare with this).
        // The log is read for stale skips only once activity has gone
        // quiet, not while the consumers being measured still work.
        let handled = s.activity.seen().handled as i64;
        let quiet = handled == last_handled;
        last_handled = handled;
        if open == 0
            && (handled >= ok as i64 || (quiet && handled + stale_skipped("activity") >= ok as i64))
        {
            println!(
                "drained {:.1} s after the load: room delivered {}, failed {}; wallet delivered {}, failed {}",
                drain.elapsed().as_secs_f64(),
                room.delivered,
                room.failed,
                wallet.delivered,
                wallet.failed
            );
            break true;
        }
        if drain.elapsed() > Duration::from_secs(a.drain_secs) {
            println!(
                "NOT DRAINED after {} s: room {room:?}, wallet {wallet:?}; the figures below cover only what was delivered",
                a.drain_secs
            );
            not_drained(&s).await;
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let im_lag = sorted(s.im.lags().into_iter().map(|l| l as f64).collect());
    let activity_lag = sorted(s.activity.lags().into_iter().map(|l| l as f64).collect());
    let (im_received, im_duplicates, im_refused) = s.im.counts();
    println!(
        "outbox lag (commit -> IM): p50 {:.0} ms, p99 {:.0} ms over {} messages ({im_refused} pushes refused by the fault, {im_duplicates} repeats of {im_received} received)",
        percentile(&im_lag, 0.5),
        percentile(&im_lag, 0.99),
        im_lag.len()
    );
    println!(
        "outbox lag (commit -> activity handler): p50 {:.0} ms, p99 {:.0} ms",
        percentile(&activity_lag, 0.5),
        percentile(&activity_lag, 0.99)
    );
    let (activity, notice) = (s.activity.seen(), s.notice.seen());
    println!(
        "consumers after dedupe: activity handled {} of {ok} room events committed (duplicates {}, stale {}), notice handled {} (of them WalletDebited {}; duplicates {})",
        activity.handled,
        activity.duplicates,
        activity.stale,
        notice.handled,
        notice.by_type.get("WalletDebited").copied().unwrap_or(0),
        notice.duplicates,
    );
    let stale = stale_skipped("activity");
    println!(
        "activity's inbox skipped {stale} events as stale (a newer version of the room had been handled first by another worker)"
    );
    if drained {
        let lost = ok as i64 - activity.handled as i64 - stale;
        println!("lost: {lost} (commands that succeeded and neither reached activity nor were skipped as stale)");
    }
    s.stop().await;
}
