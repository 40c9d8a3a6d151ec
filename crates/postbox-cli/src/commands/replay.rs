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
    let paced = args.rate.is_some() || args.batch.is_some() || args.resume || args.state.is_some();
    if paced {
        let ReplaySelector::Filter(filter) = selector else {
            return Err(CliError::usage(
                "--rate, --batch, --resume and --state pace a replay by filter (--since/--until, --status, …), not one by event ids",
            ));
        };
        if args.dry_run {
            return Err(CliError::usage(
                "a paced replay changes rows as it goes: preview it with --dry-run without --rate/--batch",
            ));
        }
        return paced_replay(g, store.as_ref(), filter, &targets, &args).await;
    }
    let by_id_anywhere = matches!(selector, ReplaySelector::EventIds { app_code: None, .. });
    if matches!(targets.pick, ReplayPick::Only(_)) || by_id_anywhere {
        let before = store
            .replay_to(ReplayRequest {
                selector: &selector,
                dry_run: true,
                origin: "cli",
                targets: &targets,
            })
            .await?;
        let ambiguous = selector.ambiguous_ids(&before);
        if !ambiguous.is_empty() {
            return Err(CliError::usage(format!(
                "{}: event ids are unique per app_code, so this would replay each of them; give --app-code",
                ambiguous
                    .iter()
                    .map(|(id, apps)| format!("`{id}` is in app_codes {}", apps.join(", ")))
                    .collect::<Vec<_>>()
                    .join("; ")
            )));
        }
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
    // Ids asked for that were not replayed: unknown, or in flight.
    let missing: Vec<&String> = match &selector {
        ReplaySelector::EventIds { event_ids, .. } => event_ids
            .iter()
            .filter(|id| !rows.iter().any(|r| &r.event_id == *id))
            .collect(),
        ReplaySelector::Filter(_) => Vec::new(),
    };
    let not_replayed = || CliError::runtime(format!("{} event id(s) not replayed", missing.len()));
    if g.json {
        #[derive(serde::Serialize)]
        struct Out<'a> {
            dry_run: bool,
            count: usize,
            events: &'a [postbox_core::EventRecord],
            not_replayed: &'a [&'a String],
        }
        output::json(&Out {
            dry_run: args.dry_run,
            count: rows.len(),
            events: &rows,
            not_replayed: &missing,
        })?;
        // The same exit as without --json: a script learns that some
        // were not replayed (it exited 0).
        return if missing.is_empty() {
            Ok(())
        } else {
            Err(not_replayed())
        };
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
    if !missing.is_empty() {
        errln!(
            "not found or being delivered right now: {}",
            missing
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        // An archived one is no live row to replay by id: say so and how
        // it comes back (it said "not found", while `events show` found
        // it). The time range may hold other events of that millisecond:
        // the dry run shows them.
        let apps = match &selector {
            ReplaySelector::EventIds {
                app_code: Some(a), ..
            } => vec![a.clone()],
            _ => config.database.app_codes.clone(),
        };
        for id in &missing {
            for r in store.find_archived(id, &apps).await.unwrap_or_default() {
                errln!(
                    "  `{id}` is archived: bring it back by its time, `postbox replay --app-code {} --since {} --until {} --dry-run`, then without --dry-run",
                    r.app_code,
                    r.created_at_ms,
                    r.created_at_ms + 1
                );
            }
        }
        return Err(not_replayed());
    }
    Ok(())
}

/// Rows per batch of a paced replay without `--batch`.
const DEFAULT_BATCH: std::num::NonZeroU32 = std::num::NonZeroU32::new(1000).unwrap();

/// `--rate`/`--batch`/`--resume`: a backfill (`postbox_runtime::backfill`),
/// with a progress line per batch on stderr; SIGINT or SIGTERM stops it
/// after the batch in hand, keeping the cursor for `--resume`.
async fn paced_replay(
    g: &Global,
    store: &dyn postbox_core::store::OutboxStore,
    filter: postbox_core::store::EventFilter,
    targets: &ReplayTargets,
    args: &ReplayArgs,
) -> Result<(), CliError> {
    use postbox_runtime::backfill::{self, Backfill, Ended};
    let stop = postbox_core::relay::CancellationToken::new();
    postbox_runtime::signals::spawn_signal_handler(stop.clone(), crate::logging::flush);
    let (since, until) = (
        filter.since_ms,
        filter.until_ms.unwrap_or_else(postbox_core::time::now_ms),
    );
    let b = Backfill {
        filter,
        batch: args.batch.unwrap_or(DEFAULT_BATCH),
        rate: args.rate,
        targets,
        origin: "cli",
        state: args
            .state
            .clone()
            .unwrap_or_else(|| ".postbox-replay.json".into()),
    };
    let started = std::time::Instant::now();
    let first_share = std::sync::Mutex::new(None::<f64>);
    let on_batch = |p: &backfill::Progress| {
        let mut line = format!("replayed {} rows (through id {})", p.replayed, p.after_id);
        // How far through the time range, and at this pace how long is left.
        if let (Some(since), Some(at)) = (since, p.last_created_at_ms) {
            let share = ((at - since) as f64 / (until - since).max(1) as f64).clamp(0.0, 1.0);
            let first = *first_share.lock().unwrap().get_or_insert(share);
            line.push_str(&format!(", {:.0} % of the time range", share * 100.0));
            if share > first {
                let left = started.elapsed().as_secs_f64() * (1.0 - share) / (share - first);
                line.push_str(&format!(
                    ", about {} left",
                    humantime::format_duration(std::time::Duration::from_secs(left.ceil() as u64))
                ));
            }
        }
        errln!("{line}");
    };
    let ended = backfill::run(store, &b, args.resume, &stop, &on_batch).await?;
    let (done, p) = match &ended {
        Ended::Done(p) => (true, p),
        Ended::Stopped(p) => (false, p),
    };
    if g.json {
        output::json(&serde_json::json!({
            "done": done,
            "replayed": p.replayed,
            "through_id": p.after_id,
            "state": if done { None } else { Some(b.state.display().to_string()) },
        }))?;
    } else if done {
        outln!("replayed {} event(s) in batches of {}", p.replayed, b.batch);
    }
    if done {
        Ok(())
    } else {
        Err(CliError::runtime(format!(
            "stopped after id {} ({} rows replayed): the same command with --resume continues (state in {})",
            p.after_id,
            p.replayed,
            b.state.display()
        )))
    }
}
