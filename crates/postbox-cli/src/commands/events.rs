//! `postbox events list|show`.

use postbox_core::config::Uses;
use serde::Serialize;

use postbox_core::store::{HistoryEntry, Inspected};
use postbox_core::{EventRecord, Status};

use crate::cli::{EventsArgs, EventsCommand, Global};
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

pub async fn run(g: &Global, args: EventsArgs) -> Result<(), CliError> {
    let config = load_config(g, Uses::DATABASE)?;
    let store = open_store(&config).await?;
    require_schema(store.as_ref()).await?;
    match args.command {
        EventsCommand::List(list) => {
            let mut f = super::filter(&list.filter, list.limit)?;
            f.before_id = list.before_id;
            let rows = store.list_inspected(&f).await?;
            if g.json {
                return output::json(&rows);
            }
            output::inspected_table(&rows);
            if rows.len() as u32 == list.limit {
                if let Some(last) = rows.last() {
                    eprintln!("(more rows: add --before-id {})", last.record.id);
                }
            }
            Ok(())
        }
        EventsCommand::Show(show) => {
            let rows = store
                .find_inspected(&show.event_id, &config.database.app_codes)
                .await?;
            if rows.is_empty() {
                return Err(CliError::runtime(format!(
                    "no event `{}` in `{}`",
                    show.event_id,
                    store.table()
                )));
            }
            let history = store.history(&show.event_id).await?;
            if g.json {
                let shown: Vec<Shown> = rows
                    .iter()
                    .map(|r| Shown {
                        timeline: timeline(&r.record, &history),
                        row: r,
                    })
                    .collect();
                return output::json(&shown);
            }
            for Inspected {
                record: r,
                archived,
            } in rows
            {
                println!("event_id           {}", r.event_id);
                println!("app_code           {}", r.app_code);
                println!("event_type         {}", r.event_type);
                if archived {
                    println!(
                        "status             {} (archived, in `{}`)",
                        r.status,
                        store.table().archive()
                    );
                } else {
                    println!("status             {}", r.status);
                }
                println!("id                 {}", r.id);
                println!(
                    "aggregate          {} v{}",
                    r.aggregate_id.as_deref().unwrap_or("-"),
                    r.aggregate_version.map_or("-".into(), |v| v.to_string())
                );
                println!("retry_count        {}", r.retry_count);
                println!("replayed           {} time(s)", r.replay_count);
                println!(
                    "delivered_to       {}",
                    if r.delivered_to.is_empty() {
                        "-".to_owned()
                    } else {
                        r.delivered_to.join(", ")
                    }
                );
                println!("created            {}", output::time(r.created_at_ms));
                println!("updated            {}", output::time(r.updated_at_ms));
                if r.next_retry_at_ms > 0 {
                    println!("next retry         {}", output::time(r.next_retry_at_ms));
                }
                if r.lock_until_ms > 0 {
                    println!(
                        "leased until       {} by {}",
                        output::time(r.lock_until_ms),
                        r.worker_id.as_deref().unwrap_or("?")
                    );
                }
                println!(
                    "last_error         {}",
                    r.last_error.as_deref().unwrap_or("-")
                );
                println!("headers            {}", r.headers.as_deref().unwrap_or("-"));
                println!("payload            {}", r.payload);
                println!("timeline");
                for step in timeline(&r, &history) {
                    let mut line = format!("  {:<24}  {:<13}", output::time(step.at_ms), step.kind);
                    if let Some(a) = step.attempt.filter(|a| *a > 0) {
                        line.push_str(&format!("  attempt {a}"));
                    }
                    if let Some(p) = step.publisher {
                        line.push_str(&format!("  [{p}]"));
                    }
                    if let Some(d) = step.detail {
                        line.push_str(&format!("  {d}"));
                    }
                    println!("{line}");
                }
                println!();
            }
            Ok(())
        }
    }
}

/// `events show --json`: the row's fields and its timeline.
#[derive(Serialize)]
struct Shown<'a> {
    #[serde(flatten)]
    row: &'a Inspected,
    timeline: Vec<Step>,
}

/// One step of an event's life, from enqueue to delivery.
#[derive(Serialize)]
struct Step {
    at_ms: i64,
    /// `enqueued`, a history kind, or `delivered`.
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    attempt: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    publisher: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

/// Enqueued (created_at), each history entry, then delivered (updated_at)
/// when the row is delivered.
fn timeline(r: &EventRecord, history: &[HistoryEntry]) -> Vec<Step> {
    let mut steps = vec![Step {
        at_ms: r.created_at_ms,
        kind: "enqueued",
        attempt: None,
        publisher: None,
        detail: None,
    }];
    steps.extend(history.iter().map(|h| Step {
        at_ms: h.at_ms,
        kind: h.kind.as_str(),
        attempt: Some(h.attempt),
        publisher: h.publisher.clone(),
        detail: h.detail.clone(),
    }));
    if r.status == Status::Delivered {
        steps.push(Step {
            at_ms: r.updated_at_ms,
            kind: "delivered",
            attempt: Some(r.retry_count + 1),
            publisher: None,
            detail: (!r.delivered_to.is_empty()).then(|| r.delivered_to.join(", ")),
        });
    }
    steps
}
