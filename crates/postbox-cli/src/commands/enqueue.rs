//! `postbox enqueue`: one event from flags, or a JSON-lines file of
//! envelopes (for example a file sink's output, or missed events to upload).

use postbox_core::config::Uses;
use std::io::BufRead;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use postbox_core::store::EnqueueOutcome;
use postbox_core::NewEvent;

use crate::cli::{EnqueueArgs, Global};
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

/// One line of `--file`: the SPEC §4 envelope; `event_id` and `app_code`
/// are optional.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    event_id: Option<String>,
    app_code: Option<String>,
    event_type: String,
    aggregate_id: Option<String>,
    aggregate_version: Option<i64>,
    #[serde(default)]
    headers: Option<serde_json::Map<String, serde_json::Value>>,
    /// Kept as written (never parsed and re-serialized): a JSON string is the
    /// text of a non-JSON payload, anything else is the payload itself.
    payload: Box<serde_json::value::RawValue>,
    /// Present in envelopes written by a sink; the outbox sets its own.
    #[allow(dead_code)]
    created_at_ms: Option<i64>,
}

#[derive(Debug, Default, Serialize)]
struct Summary {
    inserted: u64,
    duplicates: u64,
    /// Skipped: the event was already delivered and archived.
    archived: u64,
    /// How many lines were invalid.
    invalid_count: u64,
    /// The first [`INVALID_KEPT`] of them, by line.
    invalid: Vec<Invalid>,
    /// Every line up to this one was handled (written, a duplicate,
    /// skipped or invalid); the lines after it were not, when the run
    /// `stopped`.
    done_through_line: u64,
    /// Why the run stopped before the end of the file (interrupted, a
    /// read error, the database gone).
    #[serde(skip_serializing_if = "Option::is_none")]
    stopped: Option<String>,
}

#[derive(Debug, Serialize)]
struct Invalid {
    line: u64,
    error: String,
}

/// How many invalid lines a run reports one by one (the rest are counted):
/// a file of millions of bad lines (the wrong file) must not fill memory.
const INVALID_KEPT: usize = 1000;

/// Room on a line besides its payload: the envelope's other fields, its
/// headers (at most [`postbox_core::event::MAX_HEADERS_BYTES`] once
/// compact, and JSON-escaped in the file) the most of them.
const LINE_SLACK: usize = 64 * 1024 + JSON_ESCAPED * postbox_core::event::MAX_HEADERS_BYTES;

/// How many bytes of a line one byte of payload may take: a string payload
/// escaped as JSON (`\u0001`) takes six.
const JSON_ESCAPED: usize = 6;

impl Summary {
    /// Counts line `line` invalid for `error`, keeping the first
    /// [`INVALID_KEPT`] by line.
    fn invalid_line(&mut self, line: u64, error: String) {
        self.invalid_count += 1;
        self.invalid.push(Invalid { line, error });
        if self.invalid.len() >= 2 * INVALID_KEPT {
            self.keep_first_invalid();
        }
    }

    fn keep_first_invalid(&mut self) {
        self.invalid.sort_by_key(|i| i.line);
        self.invalid.truncate(INVALID_KEPT);
    }
}

/// The lines of `reader` ([`read_line_capped`]: bytes read, and the line
/// or as much of it as was kept), read on a thread of its own; the end
/// or a read error ends them.
fn read_lines(
    mut reader: Box<dyn BufRead + Send>,
    cap: usize,
) -> tokio::sync::mpsc::Receiver<std::io::Result<(usize, Vec<u8>)>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    std::thread::spawn(move || loop {
        let mut raw = Vec::new();
        let read = read_line_capped(&mut *reader, &mut raw, cap);
        let end = matches!(read, Ok(0) | Err(_));
        if tx.blocking_send(read.map(|n| (n, raw))).is_err() || end {
            return;
        }
    });
    rx
}

/// Reads one line (through its `\n`, or to the end) into `raw`, keeping at
/// most `cap` bytes of it; the bytes the line had (0 at the end of the
/// input). A line longer than `cap` is read past, never held whole: a file
/// without line breaks is not read into memory.
fn read_line_capped(
    reader: &mut dyn BufRead,
    raw: &mut Vec<u8>,
    cap: usize,
) -> std::io::Result<usize> {
    let mut read = 0;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(read);
        }
        let (n, ends) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        let room = cap.saturating_sub(raw.len()).min(n);
        raw.extend_from_slice(&buf[..room]);
        reader.consume(n);
        read += n;
        if ends {
            return Ok(read);
        }
    }
}

pub async fn run(g: &Global, args: EnqueueArgs) -> Result<(), CliError> {
    let config = load_config(g, Uses::DATABASE)?;
    let default_app = args
        .app_code
        .clone()
        .unwrap_or_else(|| config.database.app_codes[0].clone());
    let max_payload = config.database.max_payload_bytes;
    // Rows of an app_code no relay serves would be silently orphaned.
    let served = &config.database.app_codes;
    let check_app = |app: &str| -> Result<(), String> {
        if args.allow_unserved_app_code || served.iter().any(|a| a == app) {
            Ok(())
        } else {
            Err(format!(
                "app_code `{app}` is not in database.app_codes ({}): no relay would deliver it \
                 (add it there, or pass --allow-unserved-app-code)",
                served.join(", ")
            ))
        }
    };
    check_app(&default_app).map_err(|e| CliError::usage(format!("--app-code: {e}")))?;
    let store = open_store(&config).await?;
    require_schema(store.as_ref()).await?;

    let Some(path) = &args.file else {
        let mut event = NewEvent::new(
            default_app,
            args.event_type.clone().unwrap_or_default(),
            args.payload.clone().unwrap_or_default(),
        );
        if let Some(id) = &args.event_id {
            event = event.event_id(id.clone());
        }
        event.aggregate_id = args.aggregate_id.clone();
        event.aggregate_version = args.aggregate_version;
        for h in &args.headers {
            let (k, v) = h
                .split_once('=')
                .ok_or_else(|| CliError::usage(format!("--header `{h}`: write key=value")))?;
            event = event.header(k, v);
        }
        event.validate(max_payload)?;
        if !args.allow_archived
            && !store
                .archived_event_ids(&event.app_code, std::slice::from_ref(&event.event_id))
                .await?
                .is_empty()
        {
            return Err(CliError::runtime(format!(
                "event_id `{}` of app_code `{}` was already delivered and archived (in `{}_archive`); pass --allow-archived to deliver it again",
                event.event_id,
                event.app_code,
                store.table()
            )));
        }
        let out = store
            .enqueue_batch(std::slice::from_ref(&event), max_payload)
            .await?;
        if out[0] == EnqueueOutcome::Duplicate {
            return Err(CliError::runtime(format!(
                "duplicate event: app_code `{}` already has event_id `{}`",
                event.app_code, event.event_id
            )));
        }
        if g.json {
            return output::json(
                &serde_json::json!({"event_id": event.event_id, "app_code": event.app_code}),
            );
        }
        outln!("{}", event.event_id);
        return Ok(());
    };

    let (reader, total_bytes): (Box<dyn BufRead + Send>, Option<u64>) = if path.as_os_str() == "-" {
        (Box::new(std::io::BufReader::new(std::io::stdin())), None)
    } else {
        let f = std::fs::File::open(path)
            .map_err(|e| CliError::usage(format!("--file `{}`: {e}", path.display())))?;
        let len = f.metadata().map(|m| m.len()).ok();
        (Box::new(std::io::BufReader::new(f)), len)
    };
    let bar = progress(total_bytes);
    let _ticker = crate::output::Ticker::start(&bar, "enqueue --file", "bytes read");
    let mut out = FileWriter {
        store: store.as_ref(),
        max_payload,
        allow_archived: args.allow_archived,
        batch: Vec::with_capacity(args.batch_size),
        summary: Summary::default(),
    };
    // Ctrl-C or SIGTERM: the batch read so far is written, then the run
    // stops and says where (a second signal exits at once).
    let interrupted = postbox_core::relay::CancellationToken::new();
    postbox_runtime::signals::spawn_signal_handler(interrupted.clone(), || {});
    // The line break besides.
    let longest_line = LINE_SLACK
        .saturating_add(max_payload.saturating_mul(JSON_ESCAPED))
        .saturating_add(2);
    // Lines are read on a thread of their own, one ahead: a signal is
    // seen while the input waits (a producer piping into `--file -` that
    // pauses), not only between lines. It was not, and the second Ctrl-C
    // exited at once, the lines read but not written lost, with no
    // resume line.
    let mut lines = read_lines(reader, longest_line);
    let mut line_no = 0u64;
    let mut stopped = None;
    // A batch whose write failed: its lines are not handled, whatever
    // stopped the run.
    let mut write_failed = false;
    loop {
        let next = tokio::select! {
            biased;
            _ = interrupted.cancelled() => None,
            next = lines.recv() => Some(next),
        };
        let Some(next) = next else {
            stopped = Some(format!("interrupted after line {line_no}"));
            break;
        };
        let (n, raw) = match next {
            None | Some(Ok((0, _))) => break,
            Some(Ok((n, raw))) => {
                bar.inc(n as u64);
                (n, raw)
            }
            Some(Err(e)) => {
                stopped = Some(format!("reading line {}: {e}", line_no + 1));
                break;
            }
        };
        line_no += 1;
        // A line that is not UTF-8 is one bad line, not the end of the run.
        let parsed = match std::str::from_utf8(&raw) {
            _ if n > raw.len() => Err(format!(
                "{n} bytes long, over the {longest_line} a line may have (a payload of database.max_payload_bytes = {max_payload}, JSON-escaped, and the envelope)"
            )),
            Ok(line) if line.trim().is_empty() => continue,
            Ok(line) => parse_line(
                line.trim_end_matches(['\n', '\r']),
                &default_app,
                max_payload,
            )
            .and_then(|e| check_app(&e.app_code).map(|()| e)),
            Err(e) => Err(format!("not UTF-8 text: {e}")),
        };
        match parsed {
            Ok(e) => out.batch.push((line_no, e)),
            Err(error) => out.summary.invalid_line(line_no, error),
        }
        if out.batch.len() >= args.batch_size.max(1) {
            if let Err(e) = out.write_batch().await {
                stopped = Some(e.to_string());
                write_failed = true;
                break;
            }
            out.summary.done_through_line = line_no;
            bar.set_message(format!(
                "{} written, {} duplicate, {} invalid",
                out.summary.inserted, out.summary.duplicates, out.summary.invalid_count
            ));
        }
    }
    // What was read before a stop is written too, unless the database is
    // what stopped it.
    if !out.batch.is_empty() {
        match out.write_batch().await {
            Ok(()) => out.summary.done_through_line = line_no,
            Err(e) => stopped = stopped.or(Some(e.to_string())),
        }
    } else if !write_failed && (stopped.is_none() || interrupted.is_cancelled()) {
        // Every line read is handled: written, or invalid and counted.
        out.summary.done_through_line = line_no;
    }
    bar.finish_and_clear();
    let mut summary = out.summary;
    summary.keep_first_invalid();
    summary.stopped = stopped;

    if g.json {
        output::json(&summary)?;
    } else {
        outln!(
            "{} line(s): {} written, {} duplicate (already in the outbox), {} invalid",
            line_no,
            summary.inserted,
            summary.duplicates,
            summary.invalid_count
        );
        if summary.archived > 0 {
            outln!(
                "{} skipped: already delivered and archived (pass --allow-archived to deliver them again)",
                summary.archived
            );
        }
        for bad in summary.invalid.iter().take(20) {
            errln!("  line {}: {}", bad.line, bad.error);
        }
        if summary.invalid_count > 20 {
            errln!("  … and {} more", summary.invalid_count - 20);
        }
    }
    if let Some(why) = &summary.stopped {
        let next = summary.done_through_line + 1;
        return Err(CliError::runtime(format!(
            "stopped: {why}; lines 1 to {} are handled and the rest are not: go on with `tail -n +{next} FILE | postbox enqueue --file -` (lines without an event_id get a new one each run)",
            summary.done_through_line
        )));
    }
    if summary.invalid_count == 0 {
        Ok(())
    } else {
        Err(CliError::runtime(format!(
            "{} invalid line(s) were skipped; every valid line was written",
            summary.invalid_count
        )))
    }
}

fn parse_line(line: &str, default_app: &str, max_payload: usize) -> Result<NewEvent, String> {
    let l: Line = serde_json::from_str(line).map_err(|e| {
        // serde_json counts lines and columns within this one line: "line
        // 3: expected ident at line 1 column 2" named two lines.
        let what = match e.classify() {
            serde_json::error::Category::Data => "not an event envelope",
            _ => "not a JSON object",
        };
        format!("{what}: {e}")
            .trim_end_matches(&format!(" at line 1 column {}", e.column()))
            .to_owned()
            + &format!(" (at column {})", e.column())
    })?;
    // The inverse of the envelope's rule (postbox_core::envelope).
    let payload = if l.payload.get().starts_with('"') {
        serde_json::from_str::<String>(l.payload.get()).map_err(|e| e.to_string())?
    } else {
        l.payload.get().to_owned()
    };
    let mut headers = l.headers.unwrap_or_default();
    // Delivery metadata of an earlier delivery, not part of the event.
    headers.remove("x-attempt");
    headers.remove("x-replayed");
    let mut e = NewEvent::new(
        l.app_code.unwrap_or_else(|| default_app.to_owned()),
        l.event_type,
        payload,
    );
    if let Some(id) = l.event_id {
        e = e.event_id(id);
    }
    e.aggregate_id = l.aggregate_id;
    e.aggregate_version = l.aggregate_version;
    e.headers = Some(headers).filter(|h| !h.is_empty());
    e.validate(max_payload).map_err(|err| err.to_string())?;
    Ok(e)
}

/// Writes the events of `--file` in batches, counting what happened to them.
struct FileWriter<'a> {
    store: &'a dyn postbox_core::OutboxStore,
    max_payload: usize,
    allow_archived: bool,
    /// Read, not written yet, each with its line.
    batch: Vec<(u64, NewEvent)>,
    summary: Summary,
}

impl FileWriter<'_> {
    /// Writes and empties the batch. A batch the database refuses for its
    /// content (a NUL byte PostgreSQL's text refuses, an over-long value)
    /// is written row by row, so the bad row is counted invalid with its
    /// line and the others are written; any other failure (the database
    /// gone) stops the run, the batch unwritten.
    async fn write_batch(&mut self) -> Result<(), CliError> {
        let rows = std::mem::take(&mut self.batch);
        let mut events: Vec<NewEvent> = rows.iter().map(|(_, e)| e.clone()).collect();
        match self.write_events(&mut events).await {
            Err(CliError::Usage(_)) if rows.len() > 1 => {
                for (line, event) in rows {
                    let mut one = vec![event];
                    match self.write_events(&mut one).await {
                        Ok(()) => {}
                        Err(CliError::Usage(error)) => self.summary.invalid_line(line, error),
                        Err(e) => return Err(e),
                    }
                    // Each row is its own transaction here: a stop further
                    // on leaves this one handled, and the resume point says
                    // so (it stayed at the batch's start, and resuming from
                    // there wrote the rows before again).
                    self.summary.done_through_line = line;
                }
                Ok(())
            }
            Err(CliError::Usage(error)) => {
                self.summary.invalid_line(rows[0].0, error);
                Ok(())
            }
            other => other,
        }
    }

    /// Writes `batch` in one transaction, counting what happened to each
    /// event (an archived one is left out and counted).
    async fn write_events(&mut self, batch: &mut Vec<NewEvent>) -> Result<(), CliError> {
        let (store, summary) = (self.store, &mut self.summary);
        // Counted once the batch is written: a batch refused is written
        // again row by row, and counted its archived rows twice.
        let mut archived_left_out = 0;
        if !self.allow_archived && !batch.is_empty() {
            // The outbox's unique key covers the live table only: an event id
            // already archived would be written and delivered again.
            let mut apps: Vec<&str> = batch.iter().map(|e| e.app_code.as_str()).collect();
            apps.sort_unstable();
            apps.dedup();
            let mut archived = std::collections::HashSet::new();
            for app in apps {
                let ids: Vec<String> = batch
                    .iter()
                    .filter(|e| e.app_code == app)
                    .map(|e| e.event_id.clone())
                    .collect();
                for id in store.archived_event_ids(app, &ids).await? {
                    archived.insert((app.to_owned(), id));
                }
            }
            let before = batch.len();
            batch.retain(|e| !archived.contains(&(e.app_code.clone(), e.event_id.clone())));
            archived_left_out = (before - batch.len()) as u64;
        }
        if batch.is_empty() {
            summary.archived += archived_left_out;
            return Ok(());
        }
        let outcomes = store.enqueue_batch(batch, self.max_payload).await?;
        summary.archived += archived_left_out;
        for outcome in outcomes {
            match outcome {
                EnqueueOutcome::Inserted(_) => summary.inserted += 1,
                EnqueueOutcome::Duplicate => summary.duplicates += 1,
            }
        }
        batch.clear();
        Ok(())
    }
}

fn progress(total_bytes: Option<u64>) -> ProgressBar {
    let bar = match total_bytes {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template("{bar:30} {percent:>3}% {bytes}/{total_bytes} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        ),
        None => ProgressBar::new_spinner(),
    };
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_over_the_cap_is_read_past_not_held() {
        let input = format!("{}\n{{\"x\":1}}\nlast", "a".repeat(100));
        let mut reader = std::io::BufReader::with_capacity(16, input.as_bytes());
        let mut raw = Vec::new();
        assert_eq!(read_line_capped(&mut reader, &mut raw, 10).unwrap(), 101);
        assert_eq!(raw, b"aaaaaaaaaa");
        raw.clear();
        assert_eq!(read_line_capped(&mut reader, &mut raw, 10).unwrap(), 8);
        assert_eq!(raw, b"{\"x\":1}\n");
        raw.clear();
        assert_eq!(read_line_capped(&mut reader, &mut raw, 10).unwrap(), 4);
        assert_eq!(raw, b"last");
        raw.clear();
        assert_eq!(read_line_capped(&mut reader, &mut raw, 10).unwrap(), 0);
    }

    /// A bad line's error names the line once (the caller's number) and
    /// what is wrong with it; it said "line 3: expected ident at line 1
    /// column 2".
    #[test]
    fn a_bad_line_says_what_it_is_not() {
        let not_json = parse_line("not json", "room", 1 << 20).unwrap_err();
        assert!(not_json.starts_with("not a JSON object: "), "{not_json}");
        assert!(!not_json.contains("line 1"), "{not_json}");
        assert!(not_json.ends_with("(at column 2)"), "{not_json}");
        let no_type = parse_line(r#"{"payload": {}}"#, "room", 1 << 20).unwrap_err();
        assert!(no_type.starts_with("not an event envelope: "), "{no_type}");
        assert!(no_type.contains("event_type"), "{no_type}");
    }

    #[test]
    fn every_invalid_line_is_counted_and_the_first_are_kept() {
        let mut summary = Summary::default();
        for line in (1..=5000).rev() {
            summary.invalid_line(line, "bad".to_owned());
            assert!(summary.invalid.len() < 2 * INVALID_KEPT);
        }
        summary.keep_first_invalid();
        assert_eq!(summary.invalid_count, 5000);
        let kept: Vec<u64> = summary.invalid.iter().map(|i| i.line).collect();
        assert_eq!(kept, (1..=INVALID_KEPT as u64).collect::<Vec<_>>());
    }
}
