//! Structured logs on stderr, text or JSON (`--log-format json`).
//!
//! Logging never blocks or fails the code that logs: every line goes into a
//! bounded queue that one thread writes to stderr. When stderr is full (a
//! reader that stopped reading) lines are dropped and their number reported
//! once it drains; when stderr is closed (`postbox relay 2>&1 | head`) every
//! later line is dropped. Before this, a write error made
//! `tracing-subscriber` print with `eprintln!`, which panics on a closed
//! stderr: the panic killed whichever relay stage or signal handler was
//! logging, and the relay wedged with rows held in `delivering`.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

use crate::cli::{Global, LogFormat};

/// Lines held while stderr is slow; more are dropped.
const QUEUE_LINES: usize = 4096;

/// The process-wide sink, set by [`init`].
static SINK: OnceLock<Sink> = OnceLock::new();

enum Message {
    Line(Vec<u8>),
    /// Answered once every line queued before it has been written.
    Flush(SyncSender<()>),
}

struct Sink {
    queue: SyncSender<Message>,
    /// Lines dropped because the queue was full, not yet reported.
    dropped: AtomicU64,
    format: LogFormat,
}

impl Sink {
    fn start(format: LogFormat) -> Sink {
        let (queue, lines) = mpsc::sync_channel(QUEUE_LINES);
        let spawned = std::thread::Builder::new()
            .name("postbox-log".to_owned())
            .spawn(move || write_lines(lines));
        if let Err(e) = spawned {
            // Without the thread every line is dropped; say so once, directly.
            let _ = writeln!(
                std::io::stderr(),
                "postbox: cannot start the log writer ({e}); logging is off"
            );
        }
        Sink {
            queue,
            dropped: AtomicU64::new(0),
            format,
        }
    }

    /// Queues one line without waiting; drops it when the queue is full.
    fn push(&self, line: &[u8]) {
        let dropped = self.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            let note = dropped_note(self.format, dropped);
            if self.queue.try_send(Message::Line(note)).is_err() {
                self.dropped.fetch_add(dropped, Ordering::Relaxed);
            }
        }
        match self.queue.try_send(Message::Line(line.to_vec())) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Waits until every queued line is written, at most `limit`.
    fn flush(&self, limit: Duration) {
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        let deadline = Instant::now() + limit;
        let mut message = Message::Flush(done_tx);
        loop {
            match self.queue.try_send(message) {
                Ok(()) => break,
                Err(TrySendError::Disconnected(_)) => return,
                Err(TrySendError::Full(m)) => {
                    if Instant::now() >= deadline {
                        return;
                    }
                    message = m;
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        let _ = done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
    }
}

/// The writer thread: stops writing at the first error (a closed stderr),
/// keeps draining so that senders never notice.
fn write_lines(lines: Receiver<Message>) {
    let mut stderr_open = true;
    for message in lines {
        match message {
            Message::Line(line) => {
                if stderr_open {
                    let mut err = std::io::stderr().lock();
                    stderr_open = err.write_all(&line).and_then(|()| err.flush()).is_ok();
                }
            }
            Message::Flush(done) => {
                let _ = done.try_send(());
            }
        }
    }
}

fn dropped_note(format: LogFormat, dropped: u64) -> Vec<u8> {
    let message = format!("{dropped} log lines dropped: stderr was not being read");
    match format {
        LogFormat::Json => {
            let line = serde_json::json!({
                "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
                "level": "WARN",
                "message": message,
                "dropped": dropped,
            });
            format!("{line}\n").into_bytes()
        }
        LogFormat::Text => format!("WARN {message}\n").into_bytes(),
    }
}

/// What `tracing-subscriber` writes through: one formatted line per call.
#[derive(Clone, Copy)]
struct QueueWriter;

impl Write for QueueWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(sink) = SINK.get() {
            sink.push(buf);
        }
        // Never an error: a failed log write must not reach the code that logged.
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for QueueWriter {
    type Writer = QueueWriter;

    fn make_writer(&'a self) -> Self::Writer {
        QueueWriter
    }
}

/// What is never logged, whatever `--log` or RUST_LOG asks for (a filter
/// applied after theirs: a directive of theirs more specific than one of
/// postbox's own, `async_nats::connector=debug`, took precedence over it).
/// Payloads: lapin logs every returned (unroutable) message with its body
/// at WARN (the publisher reports the event itself), and whole frames,
/// bodies included, at TRACE. Secrets: the NATS client logs each
/// connection attempt at DEBUG with the server's URL in `Debug` form, its
/// password shown.
fn never_logged(meta: &tracing::Metadata<'_>) -> bool {
    let target = meta.target();
    let level = *meta.level();
    target.starts_with("lapin::returned_messages")
        || (target.starts_with("lapin") && level == tracing::Level::TRACE)
        || (target.starts_with("async_nats") && level > tracing::Level::INFO)
}

/// `default_filter` applies when neither `--log` nor RUST_LOG is given.
pub fn init(g: &Global, default_filter: &str) {
    let _ = SINK.set(Sink::start(g.log_format));
    let filter = g
        .log
        .clone()
        .map(EnvFilter::new)
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(QueueWriter);
    // After the filter `--log` or RUST_LOG gives, whatever it asks for.
    let never = tracing_subscriber::filter::filter_fn(|meta| !never_logged(meta));
    match g.log_format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .finish()
            .with(never)
            .init(),
        LogFormat::Text => builder.with_target(false).finish().with(never).init(),
    }
    // A panic's message goes through the same queue (as JSON in json mode)
    // instead of a blocking write that could hang on a full stderr.
    std::panic::set_hook(Box::new(|info| {
        let backtrace = std::backtrace::Backtrace::capture();
        if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
            tracing::error!(panic = %info, %backtrace, "internal error (a bug in postbox; please report it)");
        } else {
            tracing::error!(panic = %info, "internal error (a bug in postbox; please report it; RUST_BACKTRACE=1 shows where)");
        }
    }));
}

/// Writes `line` (without its newline) to stderr as is, in order with the
/// log lines and without blocking (startup notices such as the admin address).
pub fn notice(line: &str) {
    let line = format!("{line}\n");
    match SINK.get() {
        Some(sink) => sink.push(line.as_bytes()),
        None => {
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }
}

/// Reports the error that ends the process: a JSON log line with
/// `--log-format json`, else `postbox: {error}`; then writes out the queue
/// (waiting at most two seconds for a slow stderr).
pub fn fatal(format: LogFormat, error: &dyn std::fmt::Display, exit_code: i32) {
    // Written directly, not through the log filter: `--log off` still
    // shows why the process ended.
    match format {
        LogFormat::Json => {
            let line = serde_json::json!({
                "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
                "level": "ERROR",
                "message": format!("postbox: {error}"),
                "error": error.to_string(),
                "exit_code": exit_code,
                "target": "postbox",
            });
            notice(&line.to_string());
        }
        LogFormat::Text => notice(&format!("postbox: {error}")),
    }
    flush();
}

/// Writes out queued lines before the process exits (at most two seconds).
pub fn flush() {
    if let Some(sink) = SINK.get() {
        sink.flush(Duration::from_secs(2));
    }
}
