//! Filter flags (`--status`, `--since`, …) as a store filter.

use postbox_core::store::EventFilter;
use postbox_core::time::{now_ms, parse_time_arg};
use postbox_core::Status;

use crate::cli::FilterArgs;
use crate::error::CliError;

/// Turns filter flags into a store filter; a bad value names its flag.
pub fn filter(args: &FilterArgs, limit: u32) -> Result<EventFilter, CliError> {
    let now = now_ms();
    let time = |flag: &str, v: &Option<String>| -> Result<Option<i64>, CliError> {
        v.as_deref()
            .map(|s| parse_time_arg(s, now).map_err(|e| CliError::usage(format!("--{flag}: {e}"))))
            .transpose()
    };
    let status = args
        .status
        .as_deref()
        .map(|s| {
            s.parse::<Status>()
                .map_err(|e| CliError::usage(format!("--status: {e}")))
        })
        .transpose()?;
    if args.aggregate.is_some() && args.app_code.is_none() {
        return Err(CliError::usage(
            "--aggregate needs --app-code (aggregate ids are a tenant's)",
        ));
    }
    let (since_ms, until_ms) = (time("since", &args.since)?, time("until", &args.until)?);
    postbox_core::time::check_range(since_ms, until_ms)
        .map_err(|e| CliError::usage(format!("--since/--until: {e}")))?;
    Ok(EventFilter {
        app_code: args.app_code.clone(),
        aggregate_id: args.aggregate.clone(),
        status,
        event_type: args.event_type.clone(),
        since_ms,
        until_ms,
        limit,
        ..EventFilter::default()
    })
}
