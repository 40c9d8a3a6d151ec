//! `postbox adopt`: run postbox on an outbox table a team already has.

use postbox_core::config::Uses;
use postbox_core::store::{AdoptReport, AdoptStep};
use postbox_lint::one_line;

use crate::cli::{AdoptArgs, Global};
use crate::error::CliError;
use crate::open::{load_config, open_store};
use crate::output;

pub async fn run(g: &Global, args: AdoptArgs) -> Result<(), CliError> {
    let config = load_config(g, Uses::DATABASE)?;
    let store = open_store(&config).await?;
    // Each statement as it runs: an index build on a large table takes
    // minutes (on stderr, so `--json` stays one document).
    let progress = |step: AdoptStep<'_>| match step {
        AdoptStep::Running(sql) => errln!("adopt: running {}", one_line(sql, 120)),
        AdoptStep::Done(_, took) => errln!("adopt: done in {:.1} s", took.as_secs_f64()),
    };
    let report = store.adopt_with(args.apply, &progress).await?;
    if g.json {
        output::json(&report)?;
    } else {
        print(store.backend(), &report, args.apply);
    }
    if report.blockers.is_empty() {
        Ok(())
    } else {
        Err(CliError::runtime(format!(
            "cannot adopt `{}`: {}",
            report.table,
            report.blockers.join("; ")
        )))
    }
}

fn print(backend: &str, r: &AdoptReport, apply: bool) {
    outln!("{backend} `{}`:", r.table);
    let pairs = |v: &[(String, String)], sep: &str| {
        v.iter()
            .map(|(a, b)| format!("{a}{sep}{b}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !r.renamed.is_empty() {
        outln!("  columns named by the table: {}", pairs(&r.renamed, " = "));
    }
    if !r.legacy_statuses.is_empty() {
        outln!(
            "  legacy statuses, read as postbox's: {}",
            pairs(&r.legacy_statuses, " → ")
        );
    }
    let list = |v: &[String]| {
        if v.is_empty() {
            "none".to_owned()
        } else {
            v.join(", ")
        }
    };
    outln!("  columns to add: {}", list(&r.missing_columns));
    outln!("  indexes to add: {}", list(&r.missing_indexes));
    if !r.unread_indexes.is_empty() {
        outln!(
            "  the table's own indexes postbox does not read (each is written on every change of its columns; drop them once the old worker is gone): {}",
            r.unread_indexes.join(", ")
        );
    }
    for b in &r.blockers {
        outln!("  blocked: {b}");
    }
    if !r.blockers.is_empty() {
        return;
    }
    match &r.migrated {
        Some(m) if apply => {
            outln!(
                "applied {} statement(s); the rest of the schema (archive, history, controls, relays, wake-up trigger) is at version {}{}.",
                r.statements.len(),
                m.version,
                if m.applied.is_empty() {
                    String::new()
                } else {
                    format!(" (applied {:?})", m.applied)
                }
            );
            outln!("`postbox doctor` checks the table; the relay can start.");
        }
        _ if r.statements.is_empty() => {
            outln!("nothing to add: `postbox adopt --apply` records the schema and adds postbox's own tables.");
        }
        _ => {
            outln!(
                "-- the statements, in order: run them with --apply, or with your own tool and then `postbox adopt --apply` (which finds them and adds only postbox's own tables)"
            );
            for s in &r.statements {
                outln!("{s};");
            }
        }
    }
}
