//! The dashboard in a real browser: `postbox serve` on a PostgreSQL scratch
//! table with delivered, pending and failed rows; headless Chromium (Debian's
//! `/usr/bin/chromium`, driven by playwright-core from `tests/browser/`)
//! checks the counts shown, replays a failed event through its button and
//! sees it leave the failed list. A missing chromium or node is a failure.

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use postbox_core::{NewEvent, Status};

const TOKEN: &str = "browser-test-token-91c2";

/// Kills `postbox serve` however the test ends.
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn require(path: &str, what: &str) {
    assert!(
        Path::new(path).exists(),
        "{what} is missing at {path}: install it with `apt-get install chromium nodejs npm` (scripts/test does this)"
    );
}

/// Node and the directory of the browser scripts, checked: Chromium, node
/// and playwright-core must be installed.
pub(crate) fn browser() -> (std::path::PathBuf, std::path::PathBuf) {
    require("/usr/bin/chromium", "Chromium");
    let node = which("node").expect(
        "node is missing: install it with `apt-get install nodejs npm` (scripts/test does this)",
    );
    let browser_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    assert!(
        browser_dir.join("node_modules/playwright-core").exists(),
        "playwright-core is not installed: run `npm ci` in {} (scripts/test does this)",
        browser_dir.display()
    );
    (node, browser_dir)
}

/// Runs `script` of the browser directory with `args`; its JSON result.
pub(crate) fn run_browser(script: &str, args: &serde_json::Value) -> serde_json::Value {
    let (node, browser_dir) = browser();
    let started = Instant::now();
    let out = Command::new(node)
        .current_dir(&browser_dir)
        .arg(script)
        .arg(args.to_string())
        .output()
        .expect("run node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "browser check failed after {:?}:\n{stdout}\n{}",
        started.elapsed(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).expect("browser result JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_replays_a_failed_event_in_a_browser() {
    browser();

    let (url, store) = common::server_outbox("postgres", "dash", 2).await;
    let table = store.table().as_str().to_owned();
    let app = "web";
    // Events 0, 2 and 6 are room-1's (delivered, delivered, failed).
    let evs: Vec<NewEvent> = (0..10)
        .map(|i| {
            let e = NewEvent::new(app, "RoomCreated", format!(r#"{{"n":{i}}}"#));
            match i {
                0 | 2 | 6 => e.aggregate("room-1", i),
                _ => e.aggregate(format!("room-{}", i + 10), 1),
            }
        })
        .collect();
    store.enqueue_batch(&evs, 1 << 20).await.expect("enqueue");
    store
        .aggregate_index(true)
        .await
        .expect("the aggregate index");
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    let set = |status: &'static str, ids: Vec<String>| {
        let pool = pool.clone();
        let sql = format!(
            "UPDATE {table} SET status = $1, retry_count = CASE WHEN $1 = 'failed' THEN 3 ELSE 0 END, \
             last_error = CASE WHEN $1 = 'failed' THEN 'connection refused' END WHERE event_id = ANY($2)"
        );
        async move {
            sqlx::query(&sql)
                .bind(status)
                .bind(ids)
                .execute(&pool)
                .await
                .expect("set status");
        }
    };
    let ids: Vec<String> = evs.iter().map(|e| e.event_id.clone()).collect();
    set("delivered", ids[0..5].to_vec()).await;
    set("failed", ids[5..7].to_vec()).await;
    // ids[7..10] stay pending.
    // A relay's heartbeat, listed with the others.
    let beat = postbox_core::store::RelayBeat {
        worker_id: "dash-relay".into(),
        host: "dash-host".into(),
        pid: 4242,
        app_codes: vec![app.into()],
        claimed: 7,
        delivered: 5,
        failed: 2,
        per_minute: 60,
        stopped: false,
    };
    store.beat(&beat).await.expect("a heartbeat");

    let dir = tempfile::tempdir().unwrap();
    let config = common::write_config(
        dir.path(),
        &format!(
            "[database]\nurl = \"{url}\"\ntable = \"{table}\"\napp_codes = [\"{app}\"]\n\n\
             [[publishers]]\nkind = \"file\"\npath = \"-\"\n\n\
             [admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"${{DASH_TOKEN}}\"\n"
        ),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["--config", &config, "serve", "--listen", "127.0.0.1:0"])
        .env("DASH_TOKEN", TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start postbox serve");
    let stderr = child.stderr.take().unwrap();
    let serve = Serve(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("serve: {line}");
            if let Some(rest) = line.split("dashboard on ").nth(1) {
                let _ = tx.send(rest.trim().to_owned());
            }
        }
    });
    let base = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("postbox serve printed its address");

    let args = serde_json::json!({
        "url": base,
        "token": TOKEN,
        "app": app,
        "counts": { "delivered": 5, "pending": 3, "failed": 2 },
        "replay": ids[6],
        "lookup": ids[0],
        "aggregate": "room-1",
        "aggregate_ids": [ids[6], ids[2], ids[0]],
        "relay": "dash-relay",
    });
    let result = run_browser("dashboard.mjs", &args);
    assert_eq!(result["failed_listed"], 2, "{result}");
    assert_eq!(
        result["relay"],
        serde_json::json!([
            "running",
            "dash-relay",
            "dash-host:4242",
            "web",
            "7",
            "5",
            "2",
            "60"
        ]),
        "the relay list: {result}"
    );
    assert_eq!(
        result["topology"],
        serde_json::json!(["RoomCreated", app, "file (file)", "file `-`", "—"]),
        "{result}"
    );
    assert_eq!(result["failed_after"], 1, "{result}");
    assert_eq!(result["prompts"], 1, "the token is asked once: {result}");
    assert_eq!(result["lookup_status"], "delivered", "{result}");
    assert_eq!(result["search_failed"], 1, "{result}");
    assert_eq!(
        result["aggregate_rows"],
        serde_json::json!([ids[6], ids[2], ids[0]]),
        "an aggregate's events, newest first: {result}"
    );
    assert_eq!(
        result["confirms"],
        serde_json::json!(["Replay 1 event matching status failed?"]),
        "{result}"
    );
    assert_eq!(result["failed_at_end"], 0, "{result}");
    let log = result["control_log"].as_str().unwrap();
    assert!(
        log.contains("api admin@") && log.contains("paused sample_percent=25"),
        "{result}"
    );
    assert_eq!(result["controls_after"], 0, "{result}");
    assert!(
        result["timeline"][0].as_str().unwrap().contains("enqueued"),
        "{result}"
    );
    assert_eq!(
        result["offsite_requests"],
        serde_json::json!([]),
        "no CDN: {result}"
    );

    let row = store.find(&ids[6]).await.unwrap().remove(0);
    assert_eq!(
        row.status,
        Status::Pending,
        "the replayed row is pending again"
    );
    assert_eq!(row.event_id, ids[6]);
    assert_eq!(
        store.find(&ids[5]).await.unwrap()[0].status,
        Status::Pending,
        "replayed in bulk from the search"
    );
    drop(serve);
}

pub(crate) fn which(bin: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.is_file())
}
