//! Relay throughput against the bare SQL, measured in the same run.
//!
//! ```sh
//! cargo bench -p postbox-cli --bench relay_drain -- [postgres|mysql] [ROWS] [RUNS]
//! ```
//!
//! Each run loads ROWS pending rows (default 100,000) and drains them twice:
//! **baseline** — the backend's own claim and mark statements in a tight
//! loop, one after the other, no publishing; **relay** — the real relay
//! (claim → publish → mark pipeline) to the `file` publisher writing to
//! `/dev/null`. It prints events/s for each run and the medians, and the
//! ratio relay / baseline. Both use batch_size 100 (the default).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use postbox_core::config::{FilePublisherConfig, HumanDuration, RelaySettings, WorkerConfig};
use postbox_core::publish::{Delivery, PublishError};
use postbox_core::relay::{CancellationToken, Relay};
use postbox_core::store::{ClaimRequest, OutboxStore};
use postbox_core::{ClaimSource, Publisher};
use postbox_publishers::file::FilePublisher;
use postbox_testkit::conformance::app_stats;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::{ensure_database, mysql_url, postgres_url};

const APP: &str = "bench";
const BATCH: u32 = 100;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let db = match args.first().map(String::as_str).unwrap_or("postgres") {
        "postgres" => "postgres",
        "mysql" | "mariadb" => "mysql",
        other => panic!("unknown database `{other}`: use postgres or mysql"),
    };
    let rows: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let runs: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    println!("relay_drain: {db}, {rows} rows, {runs} runs, batch_size {BATCH}");

    let mut base = Vec::new();
    let mut relay = Vec::new();
    for run in 1..=runs {
        let store = fresh(db, rows).await;
        let b = baseline(store.as_ref(), rows).await;
        drop_table(db, store.table().as_str()).await;
        let store = fresh(db, rows).await;
        let r = relayed(store.clone(), rows).await;
        drop_table(db, store.table().as_str()).await;
        println!(
            "run {run}: baseline {b:>9.0} events/s   relay {r:>9.0} events/s   ratio {:.2}",
            r / b
        );
        base.push(b);
        relay.push(r);
    }
    let (mb, mr) = (median(&mut base), median(&mut relay));
    println!(
        "median: baseline {mb:.0} events/s, relay {mr:.0} events/s, relay/baseline = {:.2}",
        mr / mb
    );
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A migrated scratch table holding `rows` pending rows, on `db`
/// (`postgres` or `mysql`).
async fn fresh(db: &str, rows: u64) -> Arc<dyn OutboxStore> {
    let table = scratch_table("bench");
    let url = url_of(db);
    ensure_database(db, &url).await;
    let (store, load, analyze): (Arc<dyn OutboxStore>, _, _) = if db == "postgres" {
        let store = postbox_postgres::PgOutbox::connect(&url, &table, 8)
            .await
            .expect("connect");
        let load = format!(
            "INSERT INTO {table} (app_code, event_id, event_type, aggregate_id, payload) \
             SELECT 'bench', 'ev-' || g, 'BenchEvent', 'agg-' || (g % 1000), '{{\"n\":' || g || ',\"pad\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}}' \
             FROM generate_series(1, {rows}) g"
        );
        (Arc::new(store), load, format!("VACUUM ANALYZE {table}"))
    } else {
        let store = postbox_mysql::MySqlOutbox::connect(&url, &table, 8)
            .await
            .expect("connect");
        // MariaDB's sequence engine numbers the rows.
        let load = format!(
            "INSERT INTO {table} (app_code, event_id, event_type, aggregate_id, payload) \
             SELECT 'bench', CONCAT('ev-', seq), 'BenchEvent', CONCAT('agg-', seq % 1000), \
             CONCAT('{{\"n\":', seq, ',\"pad\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}}') \
             FROM seq_1_to_{rows}"
        );
        (Arc::new(store), load, format!("ANALYZE TABLE {table}"))
    };
    store.migrate().await.expect("migrate");
    exec(db, &load).await;
    exec(db, &analyze).await;
    store
}

fn url_of(db: &str) -> String {
    if db == "postgres" {
        postgres_url()
    } else {
        mysql_url()
    }
}

/// Runs one statement on `db` over a connection of its own.
async fn exec(db: &str, sql: &str) {
    use sqlx::Connection;
    let url = url_of(db);
    if db == "postgres" {
        let mut c = sqlx::PgConnection::connect(&url).await.expect("connect");
        sqlx::query(sql).execute(&mut c).await.map(|_| ())
    } else {
        let mut c = sqlx::MySqlConnection::connect(&url).await.expect("connect");
        sqlx::query(sql).execute(&mut c).await.map(|_| ())
    }
    .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn drop_table(db: &str, table: &str) {
    exec(
        db,
        &format!("DROP TABLE IF EXISTS {table}, {table}_archive"),
    )
    .await;
}

/// The bare claim and mark statements, back to back.
async fn baseline(store: &dyn OutboxStore, rows: u64) -> f64 {
    let start = Instant::now();
    let mut done = 0u64;
    let req = ClaimRequest {
        app_code: APP,
        limit: BATCH,
        worker_id: "baseline",
        lease_ms: 30_000,
        ordered: false,
    };
    loop {
        let batch = store
            .claim(ClaimSource::Pending, &req)
            .await
            .expect("claim");
        if batch.is_empty() {
            break;
        }
        let ids: Vec<i64> = batch.iter().map(|c| c.record.id).collect();
        done += store
            .mark_delivered(&batch[0].fence(), &ids)
            .await
            .expect("mark");
    }
    assert_eq!(done, rows, "baseline drained every row");
    rows as f64 / start.elapsed().as_secs_f64()
}

/// Counts what the inner publisher confirmed, to know when to look.
struct Counting {
    inner: FilePublisher,
    published: AtomicU64,
}

#[async_trait]
impl Publisher for Counting {
    fn name(&self) -> &str {
        self.inner.name()
    }
    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>> {
        let r = self.inner.publish(batch).await;
        self.published
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        r
    }
}

/// The real relay to `/dev/null`.
async fn relayed(store: Arc<dyn OutboxStore>, rows: u64) -> f64 {
    let file = FilePublisher::open(&FilePublisherConfig {
        name: None,
        path: "/dev/null".into(),
    })
    .await
    .expect("open /dev/null");
    let publisher = Arc::new(Counting {
        inner: file,
        published: AtomicU64::new(0),
    });
    let config = WorkerConfig {
        batch_size: BATCH,
        poll_interval: HumanDuration::millis(50),
        ..WorkerConfig::default()
    };
    let shutdown = CancellationToken::new();
    let relay = Relay::new(
        store.clone(),
        vec![publisher.clone()],
        RelaySettings::new(config, vec![APP.to_owned()]).expect("a valid [outbox_worker]"),
    );
    let start = Instant::now();
    let task = tokio::spawn(relay.run(shutdown.clone()));
    while publisher.published.load(Ordering::Relaxed) < rows {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Published all; wait for the last marks (delivered rows are counted
    // only up to a cap, so look at what is left open instead).
    loop {
        let s = app_stats(store.as_ref(), APP).await;
        if s.pending + s.delivering + s.retryable + s.failed == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed();
    shutdown.cancel();
    let report = task.await.expect("relay task").expect("relay");
    assert_eq!(report.delivered, rows);
    rows as f64 / elapsed.as_secs_f64()
}
