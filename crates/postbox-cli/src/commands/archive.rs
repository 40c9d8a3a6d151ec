//! `postbox archive`.

use postbox_core::config::Uses;
use std::sync::atomic::{AtomicU64, Ordering};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use postbox_core::config::HumanDuration;

use crate::cli::{ArchiveArgs, Global};
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

pub async fn run(g: &Global, args: ArchiveArgs) -> Result<(), CliError> {
    let config = load_config(g, Uses::DATABASE)?;
    let older_than = match &args.older_than {
        Some(s) => s
            .parse::<HumanDuration>()
            .map_err(|e| CliError::usage(format!("--older-than: {e}")))?,
        None => config.archive.older_than,
    };
    let batch_size = args.batch_size.unwrap_or(config.archive.batch_size);
    if batch_size == 0 {
        return Err(CliError::usage("--batch-size must be > 0"));
    }
    let app_codes = if args.only.app_codes.is_empty() {
        config.database.app_codes.clone()
    } else {
        args.only.app_codes
    };
    let store = open_store(&config).await?;
    require_schema(store.as_ref()).await?;

    // Drawn on stderr only when it is a terminal (indicatif hides it otherwise).
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} archived {pos} rows in {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_draw_target(ProgressDrawTarget::stderr());
    let _ticker = crate::output::Ticker::start(&bar, "archive", "rows archived");
    let moved = AtomicU64::new(0);
    let report = postbox_core::archive::archive_once(
        store.as_ref(),
        &app_codes,
        older_than.as_millis_i64(),
        batch_size,
        args.max_batches,
        config.archive.partitions,
        &|n| {
            let total = moved.fetch_add(n, Ordering::Relaxed) + n;
            bar.set_position(total);
        },
    )
    .await;
    bar.finish_and_clear();
    let report = report?;
    if report.locked_out {
        return Err(CliError::runtime(format!(
            "another archiver holds the lock on `{}`; nothing done (try again when it has finished)",
            store.table()
        )));
    }
    if g.json {
        #[derive(serde::Serialize)]
        struct Out<'a> {
            table: &'a str,
            archive: String,
            older_than: String,
            #[serde(flatten)]
            report: &'a postbox_core::store::ArchiveReport,
        }
        return output::json(&Out {
            table: store.table().as_str(),
            archive: store.table().archive(),
            older_than: older_than.to_string(),
            report: &report,
        });
    }
    outln!(
        "archived {} row(s) older than {} into `{}` in {} batch(es){}",
        report.moved,
        older_than,
        store.table().archive(),
        report.batches,
        if report.complete {
            ""
        } else {
            "; stopped at --max-batches, more remain"
        }
    );
    Ok(())
}
