//! `postbox replay`.

use postbox_core::config::Uses;
use postbox_core::store::{ReplayPick, ReplayRequest, ReplaySelector, ReplayTargets};

use crate::cli::{Global, ReplayArgs};
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

pub async fn run(g: &Global, args: ReplayArgs) -> Result<(), CliError> {
    let f = &args.filter;
    let has_filter = f.status.is_some()
        || f.aggregate.is_some()
        || f.event_type.is_some()
        || f.since.is_some()
        || f.until.is_some();
    let selector = match (args.event_ids.is_empty(), has_filter) {
        (false, false) => ReplaySelector::EventIds {
            app_code: f.app_code.clone(),
            event_ids: args.event_ids.clone(),
        },
        (true, true) => ReplaySelector::Filter(crate::filter::filter(f, 0)?),
        (false, true) => {
            return Err(CliError::usage(
                "give either event ids or filters (--status, --aggregate, --event-type, --since, --until), not both",
            ))
        }
        (true, false) => {
            return Err(CliError::usage(
                "nothing selected: give event ids, or --status failed, --aggregate ID, or --since/--until (with --dry-run to preview)",
            ))
        }
    };
    let config = load_config(g, Uses::DATABASE)?;
    let pick = if args.all_publishers {
        ReplayPick::All
    } else if !args.publishers.is_empty() {
        ReplayPick::Only(args.publishers.clone())
    } else {
        ReplayPick::Unconfirmed
    };
    let configured = config
        .publishers
        .iter()
        .map(|p| p.name().to_owned())
        .collect();
    let targets = ReplayTargets::new(pick, configured)
        .map_err(|e| CliError::usage(format!("--publisher: {e}")))?;
    let store = open_store(&config).await?;
    require_schema(store.as_ref()).await?;
    if matches!(targets.pick, ReplayPick::Only(_)) {
        let before = store
            .replay_to(ReplayRequest {
                selector: &selector,
                dry_run: true,
                origin: "cli",
                targets: &targets,
            })
            .await?;
        let left_out = targets.unconfirmed_left_out(&before);
        if !left_out.is_empty() {
            return Err(CliError::usage(format!(
                "--publisher: {}; replaying to the chosen publishers alone would mark it delivered without them: add them with --publisher, or leave --publisher out to send to every publisher that has not confirmed",
                left_out.join("; ")
            )));
        }
    }
    let rows = store
        .replay_to(ReplayRequest {
            selector: &selector,
            dry_run: args.dry_run,
            origin: "cli",
            targets: &targets,
        })
        .await?;
    if !args.dry_run {
        for r in &rows {
            let to = targets.targets_of(r).unwrap_or_default();
            tracing::info!(event_id = %r.event_id, app_code = %r.app_code, origin = "cli", publishers = %to, "event replayed");
        }
    }
    if g.json {
        #[derive(serde::Serialize)]
        struct Out<'a> {
            dry_run: bool,
            count: usize,
            events: &'a [postbox_core::EventRecord],
        }
        return output::json(&Out {
            dry_run: args.dry_run,
            count: rows.len(),
            events: &rows,
        });
    }
    let verb = if args.dry_run {
        "would replay"
    } else {
        "replayed"
    };
    outln!("{verb} {} event(s)", rows.len());
    if !rows.is_empty() {
        output::event_table(&rows[..rows.len().min(50)]);
        if rows.len() > 50 {
            outln!("… and {} more", rows.len() - 50);
        }
    }
    if let ReplaySelector::EventIds { event_ids, .. } = &selector {
        let missing: Vec<&String> = event_ids
            .iter()
            .filter(|id| !rows.iter().any(|r| &r.event_id == *id))
            .collect();
        if !missing.is_empty() {
            errln!(
                "not found or being delivered right now: {}",
                missing
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            return Err(CliError::runtime(format!(
                "{} event id(s) not replayed",
                missing.len()
            )));
        }
    }
    Ok(())
}
