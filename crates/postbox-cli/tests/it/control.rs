//! Issue 14.1 from the command line: `postbox control` pauses an app_code
//! while a `postbox relay` process runs (its rows stay pending, the other
//! app_code goes on), resumes it (delivered within a couple of seconds, no
//! restart), and lists the controls with the log of who changed what; bad
//! input exits 2 naming the flag.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{assert_ok, json, signal, Project};

fn lines(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_process_follows_the_controls_set_from_another_process() {
    let project = Project::room_and_wallet_to_a_file("ctl").await;
    let out_file = project.path().join("out.jsonl");
    // Bad input names what was wrong.
    for (args, says) in [
        (vec!["control", "set", "--app-code", "room"], "--pause"),
        (
            vec!["control", "set", "--app-code", "", "--pause"],
            "app_code and event_type",
        ),
        (
            vec!["control", "set", "--max-retry-count", "lots"],
            "--max-retry-count",
        ),
        (
            vec!["control", "set", "--delivery", "sometimes"],
            "--delivery",
        ),
        (
            vec!["control", "set", "--sample-percent", "150"],
            "--sample-percent",
        ),
    ] {
        let out = project.run(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(says),
            "{args:?}: {out:?}"
        );
    }
    let mut relay = project.spawn(&["relay"], Stdio::null());
    assert_ok(&project.run(&["control", "set", "--app-code", "room", "--pause"]));
    let enqueue = |app: &str| {
        assert_ok(&project.run(&[
            "enqueue",
            "--app-code",
            app,
            "--event-type",
            "T",
            "--payload",
            "{}",
        ]));
    };
    // The relay reads controls at most a second old before it claims.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    enqueue("room");
    enqueue("wallet");
    let start = Instant::now();
    while lines(&out_file) < 1 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "wallet not delivered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(lines(&out_file), 1, "the paused app_code's event waits");
    let status = json(&project.run(&["--json", "status"]));
    let room = status
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["app_code"] == "room")
        .unwrap()
        .clone();
    assert_eq!(room["pending"], 1, "{status}");

    let resumed = Instant::now();
    assert_ok(&project.run(&["control", "set", "--app-code", "room", "--resume"]));
    while lines(&out_file) < 2 {
        assert!(
            resumed.elapsed() < Duration::from_secs(5),
            "not delivered after resume"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("delivered {:?} after the resume", resumed.elapsed());
    assert!(
        resumed.elapsed() < Duration::from_secs(3),
        "applied within 2 s (plus a poll)"
    );
    // The resume is in the timeline of the event it let go; the pause,
    // made before the event was written, is not.
    let rows = json(&project.run(&["--json", "events", "list", "--app-code", "room"]));
    let id = rows[0]["event_id"]
        .as_str()
        .expect("an event_id")
        .to_owned();
    let shown = json(&project.run(&["--json", "events", "show", &id]));
    let controls: Vec<&str> = shown[0]["timeline"]
        .as_array()
        .expect("a timeline")
        .iter()
        .filter(|s| s["kind"] == "control")
        .map(|s| s["detail"].as_str().unwrap())
        .collect();
    assert_eq!(controls.len(), 1, "{shown}");
    assert!(
        controls[0].starts_with("room/*: cleared (by cli "),
        "{controls:?}"
    );
    let text = common::text(&project.run(&["events", "show", &id]));
    assert!(
        text.contains("control") && text.contains("room/*: cleared"),
        "{text}"
    );

    // A control that sets nothing any more was cleared; the log has all.
    let listed = json(&project.run(&["--json", "control", "list"]));
    assert_eq!(listed["controls"], serde_json::json!([]), "{listed}");
    let changes: Vec<&str> = listed["log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["change"].as_str().unwrap())
        .collect();
    assert_eq!(changes, ["cleared", "paused"], "{listed}");
    assert!(
        listed["log"][0]["by"].as_str().unwrap().starts_with("cli "),
        "{listed}"
    );
    assert_ok(&project.run(&[
        "control",
        "set",
        "--event-type",
        "Tick",
        "--max-retry-count",
        "0",
        "--delivery",
        "at_most_once",
    ]));
    assert_ok(&project.run(&[
        "control",
        "set",
        "--event-type",
        "Tick",
        "--sample-percent",
        "10",
    ]));
    let text = common::text(&project.run(&["control"]));
    assert!(
        text.contains("Tick") && text.contains("at_most_once") && text.contains("10 %"),
        "{text}"
    );
    assert_ok(&project.run(&["control", "clear", "--event-type", "Tick"]));
    signal("TERM", relay.id());
    assert!(relay.wait().unwrap().success());
}
