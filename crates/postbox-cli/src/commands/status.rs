//! `postbox status`.

use crate::cli::{Global, StatusArgs};
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

pub async fn run(g: &Global, args: StatusArgs) -> Result<(), CliError> {
    let config = load_config(g)?;
    let store = open_store(&config).await?;
    require_schema(store.as_ref()).await?;
    let app_codes = if args.app_codes.is_empty() {
        config.database.app_codes.clone()
    } else {
        args.app_codes
    };
    let stats = store.stats(&app_codes).await?;
    if g.json {
        return output::json(&stats);
    }
    println!(
        "{:<16} {:>10} {:>10} {:>12} {:>10} {:>8} {:>14} {:>12}",
        "APP",
        "PENDING",
        "DELIVERING",
        "DELIVERED",
        "RETRYABLE",
        "FAILED",
        "OLDEST PENDING",
        "RETRY DUE"
    );
    for s in &stats {
        println!(
            "{:<16} {:>10} {:>10} {:>12} {:>10} {:>8} {:>14} {:>12}",
            output::clip(&s.app_code, 16),
            s.pending,
            s.delivering,
            s.delivered,
            s.retryable,
            s.failed,
            format!("{:.1}s", s.oldest_pending_age_seconds),
            s.retryable_due
        );
    }
    if config.outbox_worker.ordering == postbox_core::config::Ordering::PerAggregate {
        let stuck = crate::commands::doctor::held_back(store.as_ref(), &app_codes, 10).await?;
        if !stuck.is_empty() {
            println!("\naggregates held back (per_aggregate ordering):");
            for s in &stuck {
                println!("  {}", crate::commands::doctor::describe_held_back(s));
            }
        }
    }
    Ok(())
}
