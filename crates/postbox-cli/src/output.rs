//! Human and JSON output.

use serde::Serialize;

use postbox_core::store::Inspected;
use postbox_core::EventRecord;

use crate::error::CliError;

/// Writes one line to stdout. A closed pipe (the reader went away, as
/// with `| head`) ends the process quietly with exit 0; any other write
/// error ends it with exit 1 and a message.
pub fn write_line(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{args}") {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        tracing::error!("cannot write to stdout: {e}");
        crate::logging::flush();
        std::process::exit(1);
    }
}

/// Prints `value` as pretty JSON on stdout.
pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(CliError::runtime)?;
    outln!("{text}");
    Ok(())
}

/// `2026-11-30 10:00:00.123Z` for epoch ms (empty for 0).
pub fn time(ms: i64) -> String {
    if ms <= 0 {
        return String::new();
    }
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// Shortens `s` to `max` characters with an ellipsis.
pub fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

/// A table of rows, one line each.
pub fn event_table(rows: &[EventRecord]) {
    table(rows.iter().map(|r| (r, false)));
}

/// A table of live and archived rows; archived ones are marked in the
/// status column.
pub fn inspected_table(rows: &[Inspected]) {
    table(rows.iter().map(|r| (&r.record, r.archived)));
}

fn table<'a>(rows: impl Iterator<Item = (&'a EventRecord, bool)>) {
    outln!(
        "{:>10}  {:<12} {:<36}  {:<20} {:<10} {:>5}  {:<24}  LAST ERROR",
        "ID",
        "APP",
        "EVENT ID",
        "TYPE",
        "STATUS",
        "TRIES",
        "CREATED"
    );
    for (r, archived) in rows {
        let status = if archived {
            format!("{} (archived)", r.status.as_str())
        } else {
            r.status.as_str().to_owned()
        };
        outln!(
            "{:>10}  {:<12} {:<36}  {:<20} {:<10} {:>5}  {:<24}  {}",
            r.id,
            clip(&r.app_code, 12),
            clip(&r.event_id, 36),
            clip(&r.event_type, 20),
            status,
            r.retry_count,
            time(r.created_at_ms),
            clip(r.last_error.as_deref().unwrap_or(""), 60)
        );
    }
}

/// How often [`Ticker`] logs.
const TICK_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Progress of long work where its bar is not drawn (stderr not a
/// terminal: cron, CI, a pipe): an INFO line every 10 s with the bar's
/// count and message, so a long `archive` or `enqueue --file` shows it is
/// moving (it printed nothing until the end). Stops when dropped.
pub struct Ticker(Option<tokio::task::JoinHandle<()>>);

impl Ticker {
    /// Logs `bar`'s position as `counted` (`rows archived`, `bytes read`).
    pub fn start(
        bar: &indicatif::ProgressBar,
        work: &'static str,
        counted: &'static str,
    ) -> Ticker {
        use std::io::IsTerminal;
        if std::io::stderr().is_terminal() {
            return Ticker(None);
        }
        let bar = bar.clone();
        Ticker(Some(tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            let mut every = tokio::time::interval_at(started + TICK_EVERY, TICK_EVERY);
            loop {
                every.tick().await;
                let message = bar.message();
                tracing::info!(
                    progress = bar.position(),
                    elapsed_s = started.elapsed().as_secs(),
                    "{work}: {} {counted} so far{}{message}",
                    bar.position(),
                    if message.is_empty() { "" } else { ", " },
                );
            }
        })))
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}
