//! Four real `postbox relay` processes drain at least 52,000 events written
//! by concurrent producers while one relay is SIGKILLed and restarted twice.
//! Every event is delivered at least once, nothing is left undelivered, and
//! every duplicate is explained by a killed relay's lease.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_ok, postbox, server_outbox, signal};
use postbox_core::store::{EnqueueOutcome, OutboxStore};
use postbox_core::{NewEvent, Status};
use tokio::process::{Child, Command};

/// 52,000 events at least, 26,000 per app_code: past the 25,000 delivered
/// rows `stats` counts one by one (DELIVERED_COUNT_CAP), so the drain is
/// judged by the open rows, never by an estimated delivered count.
const EVENTS_PER_PRODUCER: usize = 13_000;
const PRODUCERS: usize = 4;
const RELAYS: usize = 4;
const APPS: [&str; 2] = ["room", "wallet"];

struct Relay {
    child: Child,
    out: PathBuf,
}

fn config(dir: &Path, url: &str, table: &str, out: &Path) -> PathBuf {
    let path = dir.join(format!(
        "{}.toml",
        out.file_stem().unwrap().to_str().unwrap()
    ));
    std::fs::write(
        &path,
        format!(
            r#"
[database]
url = "{url}"
table = "{table}"
app_codes = ["room", "wallet"]
max_connections = 4

[outbox_worker]
poll_interval = "50ms"
batch_size = 100
publish_timeout = "1s"
lease = "15s"
max_retry_count = 10
initial_backoff = "100ms"
max_backoff = "1s"

[[publishers]]
kind = "file"
path = "{out}"
"#,
            out = out.display()
        ),
    )
    .unwrap();
    path
}

/// `postbox --config cfg log_args… relay`, killed when dropped.
fn relay_process(cfg: &Path, log_args: &[&str], stderr: impl Into<Stdio>) -> Child {
    Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["--config", cfg.to_str().unwrap()])
        .args(log_args)
        .arg("relay")
        .stdout(Stdio::null())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("start postbox relay")
}

/// Waits at most `secs` for a relay sent SIGTERM, which must exit 0.
async fn exits_0(child: &mut Child, secs: u64, who: &str) {
    let status = tokio::time::timeout(Duration::from_secs(secs), child.wait())
        .await
        .unwrap_or_else(|_| panic!("{who}: the relay ignored SIGTERM"))
        .unwrap();
    assert!(status.success(), "{who}: relay exited with {status}");
}

fn start_relay(dir: &Path, url: &str, table: &str, slot: usize, incarnation: usize) -> Relay {
    let out = dir.join(format!("relay-{slot}-{incarnation}.jsonl"));
    let cfg = config(dir, url, table, &out);
    let log = std::fs::File::create(dir.join(format!("relay-{slot}-{incarnation}.log"))).unwrap();
    let child = relay_process(&cfg, &["--log-format", "json"], log);
    Relay { child, out }
}

/// True when relay 0's current incarnation holds leased rows right now.
async fn holds_leases(store: &dyn OutboxStore, dir: &Path, incarnation: usize) -> bool {
    let log =
        std::fs::read_to_string(dir.join(format!("relay-0-{incarnation}.log"))).unwrap_or_default();
    let Some(worker_id) = log.lines().find_map(|l| {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        (v["message"] == "relay started").then(|| v["worker_id"].as_str().map(str::to_owned))?
    }) else {
        return false;
    };
    let filter = postbox_core::store::EventFilter {
        status: Some(Status::Delivering),
        limit: 1000,
        ..Default::default()
    };
    let leased = store.list(&filter).await.expect("list delivering rows");
    leased
        .iter()
        .any(|r| r.worker_id.as_deref() == Some(worker_id.as_str()))
}

/// Delivered rows (exact up to 25,000 per app_code, then the database's
/// estimate) and open rows (exact).
async fn stats(store: &dyn OutboxStore) -> (i64, i64) {
    let all = store.stats(&APPS.map(String::from)).await.expect("stats");
    let delivered = all.iter().map(|s| s.delivered).sum();
    let open = all
        .iter()
        .map(|s| s.pending + s.delivering + s.retryable + s.failed)
        .sum();
    (delivered, open)
}

async fn drain_with_kills(store: Arc<dyn OutboxStore>, url: &str) {
    let _heavy = common::one_heavy_test_at_a_time().await;
    let table = store.table().as_str().to_owned();
    // Kept after the run (relay logs and outputs) for a look when it fails.
    // Named by process too: another run of the suite on this machine (a
    // second checkout) would otherwise delete this run's relay outputs.
    let dir = &std::env::temp_dir().join(format!(
        "postbox-relay-processes-{}-{}",
        store.backend(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();

    let cfg = config(dir, url, &table, &dir.join("migrate.jsonl"));
    assert_ok(&postbox(
        dir,
        &["--config", cfg.to_str().unwrap(), "migrate"],
    ));

    let mut killed_outputs = Vec::new();

    // The producers write at least EVENTS_PER_PRODUCER each and keep writing
    // until both kills have happened, so the kills always land while there
    // is work to hold leases on, however fast this machine drains.
    let kills_done = Arc::new(AtomicBool::new(false));
    let produced_count = Arc::new(AtomicI64::new(0));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let store = store.clone();
            let kills_done = kills_done.clone();
            let produced_count = produced_count.clone();
            tokio::spawn(async move {
                let mut ids = Vec::with_capacity(EVENTS_PER_PRODUCER);
                let mut chunk = 0;
                while ids.len() < EVENTS_PER_PRODUCER
                    || (!kills_done.load(Ordering::Relaxed) && ids.len() < 4 * EVENTS_PER_PRODUCER)
                {
                    let batch: Vec<NewEvent> = (0..50)
                        .map(|i| {
                            let n = chunk * 50 + i;
                            NewEvent::new(
                                APPS[n % 2],
                                "LoadTest",
                                format!(r#"{{"producer":{p},"n":{n}}}"#),
                            )
                            .aggregate(format!("agg-{}", n % 97), n as i64)
                        })
                        .collect();
                    let out = store.enqueue_batch(&batch, 1 << 20).await.expect("enqueue");
                    assert!(out.iter().all(|o| matches!(o, EnqueueOutcome::Inserted(_))));
                    ids.extend(batch.into_iter().map(|e| e.event_id));
                    produced_count.fetch_add(50, Ordering::Relaxed);
                    chunk += 1;
                }
                ids
            })
        })
        .collect();

    let minimum = (EVENTS_PER_PRODUCER * PRODUCERS) as i64;
    // The relays start against a backlog (as after an outage) while the
    // producers keep writing, so they drain full batches and hold leases.
    while stats(store.as_ref()).await.1 < minimum / 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut relays: Vec<Relay> = (0..RELAYS)
        .map(|slot| start_relay(dir, url, &table, slot, 0))
        .collect();
    // Early, while most of the backlog is left: a relay holds leases only
    // while there is work to claim.
    let kill_at = [minimum / 10, minimum / 5];
    let mut kills = 0;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let (delivered, open) = stats(store.as_ref()).await;
        if kills < kill_at.len() && delivered >= kill_at[kills] {
            // Freeze relay 0 and kill it only if it still holds leases once
            // the statements it had already sent (a claim's commit, a mark)
            // have finished on the server: a kill between publish and mark
            // is what this test is about.
            let victim = &mut relays[0];
            let pid = victim.child.id().expect("relay 0 running");
            signal("STOP", pid);
            tokio::time::sleep(Duration::from_millis(100)).await;
            if holds_leases(store.as_ref(), dir, kills).await {
                victim.child.start_kill().expect("SIGKILL relay 0");
                victim.child.wait().await.unwrap();
                killed_outputs.push(victim.out.clone());
                kills += 1;
                eprintln!("SIGKILLed relay 0 at {delivered} delivered while it held leases; restarting it");
                relays[0] = start_relay(dir, url, &table, 0, kills);
                if kills == kill_at.len() {
                    kills_done.store(true, Ordering::Relaxed);
                }
            } else {
                signal("CONT", pid);
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        }
        // Every row written and none open: all delivered. (The delivered
        // count is an estimate past 25,000 per app_code: it cannot say so.)
        let written = producers.iter().all(|p| p.is_finished());
        if written && open == 0 {
            break;
        }
        if Instant::now() >= deadline {
            assert_eq!(kills, 2, "relay 0 was never seen holding leases");
            let s = store.stats(&APPS.map(String::from)).await.unwrap();
            let logs: Vec<String> = (0..RELAYS)
                .map(|slot| {
                    std::fs::read_to_string(dir.join(format!("relay-{slot}-0.log")))
                        .unwrap_or_default()
                        .lines()
                        .rev()
                        .take(5)
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .collect();
            panic!("not drained in time: {delivered} delivered, {open} open: {s:?}\nlast log lines:\n{}", logs.join("\n---\n"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(kills, 2, "both kills happened during the run");

    let mut produced = Vec::new();
    for p in producers {
        produced.extend(p.await.unwrap());
    }
    let total = produced.len() as i64;
    assert_eq!(total, produced_count.load(Ordering::Relaxed));

    // Graceful stop: SIGTERM, and every relay exits 0.
    for r in &relays {
        signal("TERM", r.child.id().expect("relay still running"));
    }
    for (slot, r) in relays.iter_mut().enumerate() {
        exits_0(&mut r.child, 20, &format!("relay {slot}")).await;
    }

    // Read every relay's output; a killed relay may have left a torn last line.
    let mut seen: HashMap<String, Vec<PathBuf>> = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if !path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("relay-")
            || path.extension().unwrap() != "jsonl"
        {
            continue;
        }
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            match serde_json::from_str::<serde_json::Value>(line) {
                Ok(v) => seen
                    .entry(v["event_id"].as_str().unwrap().to_owned())
                    .or_default()
                    .push(path.clone()),
                Err(e) => assert!(
                    killed_outputs.contains(&path),
                    "bad line in a live relay's output {}: {e}",
                    path.display()
                ),
            }
        }
    }
    let missing: Vec<&String> = produced
        .iter()
        .filter(|id| !seen.contains_key(*id))
        .collect();
    assert!(
        missing.is_empty(),
        "{} events never delivered, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    let produced_set: HashSet<&String> = produced.iter().collect();
    assert!(
        seen.keys().all(|k| produced_set.contains(k)),
        "nothing but produced events was delivered"
    );

    let duplicates: Vec<(&String, &Vec<PathBuf>)> =
        seen.iter().filter(|(_, files)| files.len() > 1).collect();
    for (event_id, files) in &duplicates {
        let row = store.find(event_id).await.unwrap().remove(0);
        assert!(
            files.iter().any(|f| killed_outputs.contains(f)),
            "duplicate {event_id} not explained by a killed relay: {files:?}, row {row:?}"
        );
        assert_eq!(row.status, Status::Delivered);
        assert!(
            row.retry_count >= 1,
            "{event_id}: the killed lease was counted as an attempt"
        );
    }
    // The kills hit relays holding leases: their rows were taken over.
    let mut taken_over = 0u64;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "log") {
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                    if v["message"]
                        .as_str()
                        .is_some_and(|m| m.starts_with("took over expired leases"))
                    {
                        taken_over += v["rows"].as_u64().unwrap_or(0);
                    }
                }
            }
        }
    }
    assert!(
        taken_over > 0,
        "the killed relays held leases that others took over"
    );
    let total_lines: usize = seen.values().map(Vec::len).sum();
    println!(
        "{}: {} events, {} deliveries, {} duplicates (all from the {} SIGKILLed relay incarnations), {} rows taken over from killed leases",
        store.backend(),
        total,
        total_lines,
        total_lines - total as usize,
        killed_outputs.len(),
        taken_over
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_with_kills_postgres() {
    let (url, store) = server_outbox("postgres", "conc", 8).await;
    drain_with_kills(store, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_with_kills_mariadb() {
    let (url, store) = server_outbox("mysql", "conc", 8).await;
    drain_with_kills(store, &url).await;
}

/// Issue 9.1: a relay whose stderr is closed (`… 2>&1 | head -4`, then the
/// reader exits) or never read (a full pipe) keeps delivering, and SIGTERM
/// still stops it promptly with exit 0. Debug logging makes every claim
/// write log lines, so the broken sink is hit at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_keeps_delivering_when_stderr_is_closed_or_full() {
    use tokio::io::{AsyncBufReadExt, BufReader};

    let (url, store) = server_outbox("postgres", "logsink", 4).await;
    let table = store.table().as_str().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let mut delivered_so_far = 0;
    for sink in ["closed", "full"] {
        let out = dir.path().join(format!("{sink}.jsonl"));
        let cfg = config(dir.path(), &url, &table, &out);
        let mut child = relay_process(
            &cfg,
            &["--log-format", "json", "--log", "trace"],
            Stdio::piped(),
        );
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        // Like `head`: read until the relay has started, then stop reading.
        let started = tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.contains("relay started") {
                    return;
                }
            }
            panic!("{sink}: stderr ended before `relay started`");
        })
        .await;
        assert!(started.is_ok(), "{sink}: relay did not start");
        let unread = if sink == "closed" {
            drop(lines);
            None
        } else {
            Some(lines)
        };

        let events: Vec<NewEvent> = (0..300)
            .map(|n| NewEvent::new(APPS[n % 2], "LogSinkTest", format!(r#"{{"n":{n}}}"#)))
            .collect();
        for chunk in events.chunks(50) {
            store.enqueue_batch(chunk, 1 << 20).await.expect("enqueue");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        delivered_so_far += events.len() as i64;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (delivered, open) = stats(store.as_ref()).await;
            if delivered == delivered_so_far && open == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{sink} stderr: the relay stopped delivering ({delivered} of {delivered_so_far} delivered, {open} open)"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let written = std::fs::read_to_string(&out).unwrap();
        for e in &events {
            assert!(
                written.contains(&e.event_id),
                "{sink}: {} not in the output",
                e.event_id
            );
        }

        signal("TERM", child.id().expect("relay running"));
        exits_0(&mut child, 10, &format!("{sink} stderr")).await;
        drop(unread);
    }
}

/// Issue 9.5: `max_payload_bytes` is enforced by `enqueue` only, so a 3 MiB
/// payload written with the documented plain INSERT went to every broker.
/// The relay dead-letters it at once with a clear `last_error`, without
/// trying the publishers and without holding back the other rows.
///
/// `insert(url, sql, big_id)` runs `plain_insert_sql` (on `room_outbox`,
/// renamed to the scratch table) for the oversized event `big_id`.
async fn oversized_plain_insert_is_dead_lettered<F, Fut>(
    server: &str,
    plain_insert_sql: &str,
    insert: F,
) where
    F: FnOnce(String, String, String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (url, store) = server_outbox(server, "big", 4).await;
    let big_id = &uuid_like(server);
    let table = store.table().as_str().to_owned();
    let sql = plain_insert_sql.replace("room_outbox", &table);
    insert(url.clone(), sql, big_id.clone()).await;
    let small: Vec<NewEvent> = (0..5)
        .map(|n| NewEvent::new("room", "Small", format!(r#"{{"n":{n}}}"#)))
        .collect();
    store.enqueue_batch(&small, 1 << 20).await.expect("enqueue");

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("oversized.jsonl");
    let cfg = config(dir.path(), &url, &table, &out);
    let mut child = relay_process(&cfg, &[], Stdio::null());
    let deadline = Instant::now() + Duration::from_secs(20);
    let s = loop {
        let s = store.stats(&["room".to_owned()]).await.unwrap().remove(0);
        if s.delivered == 5 && s.failed == 1 {
            break s;
        }
        assert!(Instant::now() < deadline, "not settled: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    signal("TERM", child.id().unwrap());
    exits_0(&mut child, 10, "oversized").await;

    assert_eq!(s.pending + s.delivering + s.retryable, 0, "{s:?}");
    let row = store.find(big_id).await.unwrap().remove(0);
    assert_eq!(row.status, Status::Failed);
    assert_eq!(row.retry_count, 1, "dead-lettered at its first attempt");
    let error = row.last_error.unwrap_or_default();
    assert!(
        error.contains("3145728 bytes") && error.contains("max_payload_bytes"),
        "{error}"
    );
    let written = std::fs::read_to_string(&out).unwrap_or_default();
    assert!(
        !written.contains(big_id),
        "the oversized row reached a publisher"
    );
    assert_eq!(written.lines().count(), 5, "the small rows were delivered");
}

/// A 3 MiB JSON payload.
fn big_payload() -> String {
    let payload = format!(r#"{{"blob":"{}"}}"#, "x".repeat(3 * 1024 * 1024 - 11));
    assert_eq!(payload.len(), 3 * 1024 * 1024);
    payload
}

/// The test of [`oversized_plain_insert_is_dead_lettered`] on `$server`,
/// whose `docs/plain-insert.$server.sql` runs through a fresh `$pool`.
macro_rules! oversized_plain_insert_test {
    ($name:ident, $server:literal, $pool:ty) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let sql = include_str!(concat!("../../../../docs/plain-insert.", $server, ".sql"));
            oversized_plain_insert_is_dead_lettered($server, sql, |url, sql, big_id| async move {
                let pool = <$pool>::connect(&url).await.unwrap();
                sqlx::query(&sql)
                    .bind("room")
                    .bind(&big_id)
                    .bind("Huge")
                    .bind(None::<String>)
                    .bind(None::<i64>)
                    .bind(big_payload())
                    .bind(None::<String>)
                    .execute(&pool)
                    .await
                    .expect("plain insert");
                pool.close().await;
            })
            .await;
        }
    };
}

oversized_plain_insert_test!(
    oversized_plain_insert_is_dead_lettered_postgres,
    "postgres",
    sqlx::PgPool
);
oversized_plain_insert_test!(
    oversized_plain_insert_is_dead_lettered_mariadb,
    "mysql",
    sqlx::MySqlPool
);

fn uuid_like(prefix: &str) -> String {
    format!("{prefix}-huge-{}-{}", std::process::id(), rand_suffix())
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}
