//! `postbox consumers [list | pause NAME | resume NAME]`: the consumers of
//! the `postbox consume` process serving this config's `[admin]`, through
//! its API (`/api/consumers`). Pausing stops a consumer taking messages
//! once it has finished those in hand; nothing is redelivered.

use std::time::Duration;

use postbox_core::config::{AdminRole, Uses};
use serde_json::Value;

use crate::cli::{ConsumersAction, ConsumersArgs, Global};
use crate::error::CliError;
use crate::open::load_config;
use crate::output;

pub async fn run(g: &Global, args: ConsumersArgs) -> Result<(), CliError> {
    let uses = Uses {
        admin: true,
        consumers: true,
        ..Uses::DATABASE
    };
    let settings = load_config(g, uses)?;
    let Some(admin) = &settings.admin else {
        return Err(CliError::usage(
            "admin: `postbox consumers` talks to `postbox consume` through its [admin] listen address, and this config has no [admin]",
        ));
    };
    let base = format!("http://{}", admin.listen);
    // reqwest is built without a bundled crypto provider: postbox uses ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| CliError::runtime(format!("cannot build an HTTP client: {e}")))?;
    let (request, need) = match &args.action {
        None | Some(ConsumersAction::List) => {
            (http.get(format!("{base}/api/consumers")), AdminRole::Viewer)
        }
        Some(ConsumersAction::Pause { name }) => (
            http.post(format!("{base}/api/consumers/{name}/pause")),
            AdminRole::Operator,
        ),
        Some(ConsumersAction::Resume { name }) => (
            http.post(format!("{base}/api/consumers/{name}/resume")),
            AdminRole::Operator,
        ),
    };
    // The config's first token that may do this (`admin.token` first).
    let token = admin
        .named_tokens()
        .into_iter()
        .find(|(_, role, _)| *role >= need)
        .map(|(_, _, t)| t);
    let request = match &token {
        Some(t) => request.bearer_auth(t.expose()),
        None => request,
    };
    let unreachable = |e: reqwest::Error| {
        CliError::runtime(format!(
            "no `postbox consume` answered on {base} (admin.listen): {}",
            e.without_url()
        ))
    };
    let answer = request.send().await.map_err(unreachable)?;
    let status = answer.status();
    let body: Value = answer.json().await.map_err(unreachable)?;
    if !status.is_success() {
        let why = body["error"].as_str().unwrap_or("no reason given");
        return Err(CliError::runtime(format!(
            "{base} answered {status}: {why}"
        )));
    }
    if g.json {
        return output::json(&body);
    }
    match &args.action {
        None | Some(ConsumersAction::List) => {
            let all = body["consumers"].as_array().cloned().unwrap_or_default();
            outln!(
                "{:<28} {:<9} {:<28} {:<11} {:>8} {:>8} {:>8}",
                "CONSUMER",
                "KIND",
                "QUEUE",
                "STATE",
                "OK",
                "RETRY",
                "DEAD"
            );
            for c in &all {
                outln!(
                    "{:<28} {:<9} {:<28} {:<11} {:>8} {:>8} {:>8}",
                    text(&c["name"]),
                    text(&c["kind"]),
                    text(&c["queue"]),
                    text(&c["state"]),
                    c["ok"],
                    c["retry"],
                    c["dead"]
                );
            }
        }
        Some(_) => {
            let changed = if body["changed"] == true {
                ""
            } else {
                " (no change)"
            };
            outln!(
                "consumer {}: {}{changed}",
                text(&body["name"]),
                text(&body["state"])
            );
        }
    }
    Ok(())
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}
