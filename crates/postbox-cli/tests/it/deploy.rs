//! `deploy/`: the alert rules pass `promtool check rules`, and the example
//! configs are valid postbox configs. (That every metric the rules and the
//! Grafana dashboard name is exported is checked against live `/metrics`:
//! `postbox-admin`'s relay run and `consume::consume_serves_its_metrics`.)

use std::path::{Path, PathBuf};
use std::process::Command;

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(file)
}

#[test]
fn the_alert_rules_pass_promtool() {
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(deploy("prometheus/alerts.yml"))
        .output()
        .expect(
            "promtool is missing: install Debian's `prometheus` package (scripts/test does this)",
        );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("SUCCESS: 6 rules found"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_grafana_dashboard_queries_prometheus_in_every_panel() {
    let text = std::fs::read_to_string(deploy("grafana/postbox.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 8, "{} panels", panels.len());
    for p in panels {
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{}", p["title"]);
        for t in targets {
            assert!(t["expr"].as_str().unwrap().contains("postbox_"), "{t}");
        }
    }
}

#[test]
fn the_example_configs_are_valid() {
    for (file, vars) in [
        (
            "config/relay.toml",
            &[
                "POSTBOX_DATABASE_URL",
                "POSTBOX_AMQP_URL",
                "POSTBOX_ADMIN_TOKEN",
            ][..],
        ),
        (
            "config/consume.toml",
            &[
                "POSTBOX_AMQP_URL",
                "POSTBOX_INBOX_URL",
                "POSTBOX_ADMIN_TOKEN",
            ][..],
        ),
    ] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
        c.arg("--config")
            .arg(deploy(file))
            .args(["--json", "doctor"]);
        c.env_remove("POSTBOX_CONFIG");
        for v in vars {
            let value = match *v {
                "POSTBOX_DATABASE_URL" => "sqlite::memory:",
                "POSTBOX_INBOX_URL" => "sqlite::memory:",
                "POSTBOX_AMQP_URL" => "amqp://guest:guest@127.0.0.1:5672/%2f",
                _ => "t0ken",
            };
            c.env(v, value);
        }
        let out = c.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The configuration loads (exit 2 would be a config error); the
        // in-memory database has no table, so doctor reports that.
        assert_ne!(out.status.code(), Some(2), "{file}: {stderr}");
        assert!(!stderr.contains("config key"), "{file}: {stderr}");
    }
}
