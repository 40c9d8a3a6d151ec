//! Issue 14.5: `postbox relays` lists every relay of the table from the
//! heartbeats in `<table>_relays`: a running `postbox relay` process is
//! there at once with its host, pid and app_codes; stopped, it says so,
//! with what it claimed and delivered.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{assert_ok, json, signal, Project};

/// The relay of process `pid` in `postbox relays --json`, once `ready`
/// holds for it (within 10 s).
fn relay_of(
    project: &Project,
    pid: u32,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let all = json(&project.run(&["--json", "relays"]));
        let found = all
            .as_array()
            .expect("a list of relays")
            .iter()
            .find(|r| r["pid"] == pid)
            .cloned();
        if let Some(r) = found.filter(|r| ready(r)) {
            return r;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "relay {pid} not as expected: {all}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_process_is_listed_while_it_runs_and_after_it_stops() {
    let project = Project::room_and_wallet_to_a_file("relays").await;
    let out = project.run(&["relays"]);
    assert_ok(&out);
    assert!(common::text(&out).contains("no relay has run"), "{out:?}");

    let mut relay = project.spawn(&["relay"], Stdio::null());
    let pid = relay.id();
    let running = relay_of(&project, pid, |r| r["state"] == "running");
    assert_eq!(running["app_codes"], serde_json::json!(["room", "wallet"]));
    assert!(
        running["worker_id"]
            .as_str()
            .unwrap()
            .contains(&pid.to_string()),
        "{running}"
    );
    assert!(!running["host"].as_str().unwrap().is_empty(), "{running}");

    for _ in 0..3 {
        project.enqueue("room", "{}");
    }
    let start = Instant::now();
    while project.lines("out.jsonl") < 3 {
        assert!(start.elapsed() < Duration::from_secs(10), "not delivered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = common::text(&project.run(&["relays"]));
    assert!(
        text.contains("running") && text.contains(&format!(":{pid}")),
        "{text}"
    );

    signal("TERM", pid);
    assert!(relay.wait().unwrap().success());
    let stopped = relay_of(&project, pid, |r| r["state"] == "stopped");
    assert_eq!(
        (stopped["claimed"].as_u64(), stopped["delivered"].as_u64()),
        (Some(3), Some(3)),
        "{stopped}"
    );
    assert!(
        stopped["stopped_at_ms"].as_i64().unwrap() >= stopped["started_at_ms"].as_i64().unwrap()
    );
}
