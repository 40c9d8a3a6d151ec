//! Structured logs on stderr, text or JSON (`--log-format json`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::cli::{Global, LogFormat};

/// `default_filter` applies when neither `--log` nor RUST_LOG is given.
pub fn init(g: &Global, default_filter: &str) {
    let filter = g
        .log
        .clone()
        .map(EnvFilter::new)
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new(default_filter));
    // lapin logs every returned (unroutable) message with its body at WARN;
    // payloads never reach logs, the publisher reports the event itself.
    let filter = match "lapin::returned_messages=off".parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match g.log_format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.with_target(false).init(),
    }
}
