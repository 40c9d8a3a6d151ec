//! `postbox status`.

use postbox_core::config::Uses;
use serde::Serialize;

use postbox_core::store::AppStats;

use crate::cli::{Global, StatusArgs};
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

/// One app_code's figures, and whether a relay serves it.
#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    stats: AppStats,
    /// Listed in `database.app_codes`: a relay with this config delivers
    /// its rows. Rows of an unserved app_code are never delivered.
    served: bool,
}

pub async fn run(g: &Global, args: StatusArgs) -> Result<(), CliError> {
    let config = load_config(g, Uses::DATABASE)?;
    let store = open_store(&config).await?;
    require_schema(store.as_ref()).await?;
    let served = &config.database.app_codes;
    let app_codes = if args.only.app_codes.is_empty() {
        // Every app_code with rows too: a typo'd one is otherwise silently
        // orphaned.
        let mut all = served.clone();
        for code in store.present_app_codes().await? {
            if !all.contains(&code) {
                all.push(code);
            }
        }
        all
    } else {
        args.only.app_codes
    };
    let rows: Vec<Row> = store
        .stats(&app_codes)
        .await?
        .into_iter()
        .map(|stats| Row {
            served: served.contains(&stats.app_code),
            stats,
        })
        .collect();
    if g.json {
        return output::json(&rows);
    }
    outln!(
        "{:<16} {:>10} {:>10} {:>12} {:>10} {:>8} {:>8} {:>14} {:>12}",
        "APP",
        "PENDING",
        "DELIVERING",
        "DELIVERED",
        "RETRYABLE",
        "FAILED",
        "DROPPED",
        "OLDEST PENDING",
        "RETRY DUE"
    );
    for Row { stats: s, served } in &rows {
        let app = if *served {
            output::clip(&s.app_code, 16)
        } else {
            format!("{}*", output::clip(&s.app_code, 15))
        };
        outln!(
            "{:<16} {:>10} {:>10} {:>12} {:>10} {:>8} {:>8} {:>14} {:>12}",
            app,
            s.pending,
            s.delivering,
            if s.delivered_estimated {
                format!("~{}", s.delivered)
            } else {
                s.delivered.to_string()
            },
            s.retryable,
            s.failed,
            if s.dropped > postbox_core::store::DELIVERED_COUNT_CAP {
                format!("{}+", postbox_core::store::DELIVERED_COUNT_CAP)
            } else {
                s.dropped.to_string()
            },
            format!("{:.1}s", s.oldest_pending_age_seconds),
            s.retryable_due
        );
    }
    if rows.iter().any(|r| r.stats.delivered_estimated) {
        outln!(
            "~ estimated from the database's statistics: delivered rows are counted only up to {}",
            postbox_core::store::DELIVERED_COUNT_CAP
        );
    }
    if rows.iter().any(|r| !r.served) {
        outln!(
            "* unserved: not in database.app_codes, so no relay delivers these rows \
             (fix the producer's app_code, or add it to database.app_codes)"
        );
    }
    if config.outbox_worker.ordering == postbox_core::config::Ordering::PerAggregate {
        let stuck = crate::held_back::held_back(store.as_ref(), &app_codes, 10).await?;
        if !stuck.is_empty() {
            outln!("\naggregates held back (per_aggregate ordering):");
            for s in &stuck {
                outln!("  {}", crate::held_back::describe_held_back(s));
            }
        }
    }
    Ok(())
}
