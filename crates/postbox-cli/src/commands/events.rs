//! `postbox events list|show`.

use postbox_core::config::Uses;
use serde::Serialize;

use postbox_core::store::Inspected;
use postbox_core::timeline::{control_changes, timeline, Step};
use postbox_core::Status;

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
            let mut f = crate::filter::filter(&list.filter, list.limit)?;
            f.before_id = list.before_id;
            let rows = store.list_inspected(&f).await?;
            if g.json {
                return output::json(&rows);
            }
            output::inspected_table(&rows);
            if rows.len() as u32 == list.limit {
                if let Some(last) = rows.last() {
                    errln!("(more rows: add --before-id {})", last.record.id);
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
            let changes = control_changes(store.as_ref()).await;
            let publishers: Vec<String> = config
                .publishers
                .iter()
                .map(|p| p.name().to_owned())
                .collect();
            if g.json {
                let shown: Vec<Shown> = rows
                    .iter()
                    .map(|r| Shown {
                        timeline: timeline(&[&r.record], &history, &publishers, &changes),
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
                outln!("event_id           {}", r.event_id);
                outln!("app_code           {}", r.app_code);
                outln!("event_type         {}", r.event_type);
                if archived {
                    outln!(
                        "status             {} (archived, in `{}`)",
                        r.status,
                        store.table().archive()
                    );
                } else {
                    outln!("status             {}", r.status);
                }
                outln!("id                 {}", r.id);
                outln!(
                    "aggregate          {} v{}",
                    r.aggregate_id.as_deref().unwrap_or("-"),
                    r.aggregate_version.map_or("-".into(), |v| v.to_string())
                );
                outln!("retry_count        {}", r.retry_count);
                outln!("replayed           {} time(s)", r.replay_count);
                outln!(
                    "delivered_to       {}",
                    if r.delivered_to.is_empty() {
                        "-".to_owned()
                    } else {
                        r.delivered_to.join(", ")
                    }
                );
                outln!("created            {}", output::time(r.created_at_ms));
                outln!("updated            {}", output::time(r.updated_at_ms));
                if r.status == Status::Retryable && r.next_retry_at_ms > 0 {
                    outln!("next retry         {}", output::time(r.next_retry_at_ms));
                }
                if r.lock_until_ms > 0 {
                    outln!(
                        "leased until       {} by {}",
                        output::time(r.lock_until_ms),
                        r.worker_id.as_deref().unwrap_or("?")
                    );
                }
                outln!(
                    "last_error         {}",
                    r.last_error.as_deref().unwrap_or("-")
                );
                outln!("headers            {}", r.headers.as_deref().unwrap_or("-"));
                outln!("payload            {}", r.payload);
                outln!("timeline");
                for step in timeline(&[&r], &history, &publishers, &changes) {
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
                    outln!("{line}");
                }
                outln!();
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
