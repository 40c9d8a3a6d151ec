//! `postbox dead list|show|replay|purge --consumer NAME`: a consumer's dead
//! letters, straight on its broker (`postbox_consumers::dead`). Works
//! whether `postbox consume` runs or not.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use postbox_consumers::dead::{self, DeadAction, DeadFilter, DeadLetter, DeadReport};
use postbox_core::config::ConsumerConfig;
use postbox_core::time::{now_ms, parse_time_arg};

use crate::cli::{DeadArgs, DeadCommand, DeadFilterArgs, Global};
use crate::error::CliError;
use crate::open::{load_config, WITH_CONSUMERS};
use crate::output;

pub async fn run(g: &Global, args: DeadArgs) -> Result<(), CliError> {
    let settings = load_config(g, WITH_CONSUMERS)?;
    // (filter flags, action, dry run, `--all`, whether one event is shown whole)
    let (args, action, dry_run, all, showing) = match args.action {
        DeadCommand::List { filter, limit } => {
            (filter, DeadAction::List(limit), false, false, false)
        }
        DeadCommand::Show { consumer, event_id } => {
            let filter = DeadFilterArgs {
                consumer,
                event_id: Some(event_id),
                ..DeadFilterArgs::default()
            };
            (filter, DeadAction::List(usize::MAX), false, false, true)
        }
        DeadCommand::Replay(c) => (c.filter, DeadAction::Replay, c.dry_run, c.all, false),
        DeadCommand::Purge(c) => (c.filter, DeadAction::Purge, c.dry_run, c.all, false),
    };
    let consumer = find(&settings.consumers, &args.consumer)?;
    let filter = dead_filter(&args)?;
    let verb = match action {
        DeadAction::List(_) => "read",
        DeadAction::Replay => "replayed",
        DeadAction::Purge => "purged",
    };
    if action.changes() && filter.is_empty() && !all {
        return Err(CliError::usage(format!(
            "dead {}: give a filter (--event-type, --event-id, --since, --until, --error) or --all to take every dead letter of the consumer",
            if action == DeadAction::Replay { "replay" } else { "purge" }
        )));
    }
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {msg} in {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    // Drawn on stderr only when it is a terminal (indicatif hides it otherwise).
    bar.set_draw_target(ProgressDrawTarget::stderr());
    let shown = bar.clone();
    let progress = move |scanned: u64, done: u64| {
        shown.set_message(format!("{scanned} letters read, {done} {verb}"));
    };
    let report = dead::run(consumer, action, &filter, dry_run, &progress).await;
    bar.finish_and_clear();
    let report = report.map_err(|e| match e {
        dead::DeadError::Unsupported(m) => CliError::usage(m),
        other => CliError::runtime(other),
    })?;
    if g.json {
        return output::json(&report);
    }
    match action {
        DeadAction::List(_) if showing => show(&report),
        DeadAction::List(_) => list(&report),
        DeadAction::Replay | DeadAction::Purge => summary(&report, verb, dry_run),
    }
    Ok(())
}

fn find<'a>(consumers: &'a [ConsumerConfig], name: &str) -> Result<&'a ConsumerConfig, CliError> {
    consumers.iter().find(|c| c.name() == name).ok_or_else(|| {
        let known: Vec<&str> = consumers.iter().map(ConsumerConfig::name).collect();
        CliError::usage(format!(
            "--consumer: no consumer `{name}` in [[consumers]] (the config has: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        ))
    })
}

fn dead_filter(args: &DeadFilterArgs) -> Result<DeadFilter, CliError> {
    let now = now_ms();
    let time = |flag: &str, v: &Option<String>| -> Result<Option<i64>, CliError> {
        v.as_deref()
            .map(|s| parse_time_arg(s, now).map_err(|e| CliError::usage(format!("--{flag}: {e}"))))
            .transpose()
    };
    let (since_ms, until_ms) = (time("since", &args.since)?, time("until", &args.until)?);
    postbox_core::time::check_range(since_ms, until_ms)
        .map_err(|e| CliError::usage(format!("--since/--until: {e}")))?;
    Ok(DeadFilter {
        event_id: args.event_id.clone(),
        event_type: args.event_type.clone(),
        since_ms,
        until_ms,
        error: args.error.clone(),
    })
}

fn list(report: &DeadReport) {
    outln!(
        "{:<14} {:<38} {:<24} {:<24} {:>8}  last error",
        "position",
        "event_id",
        "event_type",
        "dead at",
        "attempts"
    );
    for l in &report.letters {
        outln!(
            "{:<14} {:<38} {:<24} {:<24} {:>8}  {}",
            output::clip(&l.position, 14),
            output::clip(l.event_id.as_deref().unwrap_or("(none)"), 38),
            output::clip(&l.event_type, 24),
            l.dead_at_ms.map_or_else(|| "?".to_owned(), output::time),
            l.attempts.map_or_else(|| "?".to_owned(), |a| a.to_string()),
            output::clip(l.last_error.as_deref().unwrap_or(""), 80)
        );
    }
    if report.complete {
        outln!(
            "{} of {} dead letters in {} shown",
            report.letters.len(),
            report.matched,
            report.dead_letters
        );
    } else {
        // The list stopped reading at its limit: how many more match is
        // not known (it said "50 of 50" of thousands).
        outln!(
            "the first {} dead letters in {} shown; more may match (raise --limit)",
            report.letters.len(),
            report.dead_letters
        );
    }
}

fn show(report: &DeadReport) {
    if report.letters.is_empty() {
        outln!("no dead letter of that event in {}", report.dead_letters);
    }
    for l in &report.letters {
        show_one(l);
    }
}

fn show_one(l: &DeadLetter) {
    outln!("position:     {}", l.position);
    outln!(
        "event_id:     {}",
        l.event_id.as_deref().unwrap_or("(none)")
    );
    outln!("event_type:   {}", l.event_type);
    outln!("app_code:     {}", l.app_code);
    if let Some(a) = &l.aggregate_id {
        outln!("aggregate_id: {a}");
    }
    outln!("created:      {}", output::time(l.created_at_ms));
    outln!(
        "dead at:      {}",
        l.dead_at_ms.map_or_else(|| "?".to_owned(), output::time)
    );
    outln!(
        "attempts:     {}",
        l.attempts.map_or_else(|| "?".to_owned(), |a| a.to_string())
    );
    outln!("last error:   {}", l.last_error.as_deref().unwrap_or(""));
    outln!(
        "headers:      {}",
        serde_json::Value::Object(l.headers.clone())
    );
    outln!("payload:      {}", l.payload);
    outln!();
}

fn summary(report: &DeadReport, verb: &str, dry_run: bool) {
    if dry_run {
        outln!(
            "dry run: {} of {} dead letters in {} would be {verb}; nothing changed",
            report.matched,
            report.scanned,
            report.dead_letters
        );
        for l in &report.letters {
            outln!(
                "  {} {} {}",
                l.position,
                l.event_id.as_deref().unwrap_or("(none)"),
                l.event_type
            );
        }
        if report.matched as usize > report.letters.len() {
            outln!(
                "  … and {} more",
                report.matched as usize - report.letters.len()
            );
        }
    } else {
        outln!(
            "{} of {} dead letters in {} {verb}",
            report.done,
            report.scanned,
            report.dead_letters
        );
    }
}
