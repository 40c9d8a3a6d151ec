//! `postbox migrate`.

use crate::cli::Global;
use crate::error::CliError;
use crate::open::{load_config, open_store_creating, WITH_CONSUMERS};
use crate::output;

pub async fn run(g: &Global) -> Result<(), CliError> {
    let config = load_config(g, WITH_CONSUMERS)?;
    let store = open_store_creating(&config).await?;
    let report = store.migrate().await?;
    let inboxes = postbox_runtime::consumers::migrate_inboxes(&config).await?;
    if g.json {
        return output::json(&report);
    }
    for note in &report.notes {
        outln!("{} `{}`: {note}.", store.backend(), store.table());
    }
    if report.applied.is_empty() {
        outln!(
            "{} `{}` is up to date (schema version {}).",
            store.backend(),
            store.table(),
            report.version
        );
    } else {
        outln!(
            "{} `{}`: applied schema versions {:?}; now at version {}.",
            store.backend(),
            store.table(),
            report.applied,
            report.version
        );
    }
    for line in inboxes {
        outln!("{line}.");
    }
    Ok(())
}
