//! `postbox events list|show`.

use crate::cli::{EventsArgs, EventsCommand, Global};
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

pub async fn run(g: &Global, args: EventsArgs) -> Result<(), CliError> {
    let config = load_config(g)?;
    let store = open_store(&config).await?;
    require_schema(store.as_ref()).await?;
    match args.command {
        EventsCommand::List(list) => {
            let mut f = super::filter(&list.filter, list.limit)?;
            f.before_id = list.before_id;
            let rows = store.list(&f).await?;
            if g.json {
                return output::json(&rows);
            }
            output::event_table(&rows);
            if rows.len() as u32 == list.limit {
                if let Some(last) = rows.last() {
                    eprintln!("(more rows: add --before-id {})", last.id);
                }
            }
            Ok(())
        }
        EventsCommand::Show(show) => {
            let rows = store.find(&show.event_id).await?;
            if rows.is_empty() {
                return Err(CliError::runtime(format!(
                    "no event `{}` in `{}`",
                    show.event_id,
                    store.table()
                )));
            }
            if g.json {
                return output::json(&rows);
            }
            for r in rows {
                println!("event_id           {}", r.event_id);
                println!("app_code           {}", r.app_code);
                println!("event_type         {}", r.event_type);
                println!("status             {}", r.status);
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
                println!();
            }
            Ok(())
        }
    }
}
