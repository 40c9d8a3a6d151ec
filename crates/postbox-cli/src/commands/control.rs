//! `postbox control list | set | clear`: the runtime controls
//! (`<table>_controls`), which every relay applies within a second or two,
//! without a restart; every change is logged with who made it.

use postbox_core::config::Uses;
use postbox_core::control::{self, delivery_name, parse_delivery, Control, ControlChange};
use postbox_core::store::OutboxStore;
use postbox_core::store::{change_control, Changed};

use crate::cli::{ControlAction, ControlArgs, ControlKey, Global};
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

/// Who runs this command, for a control's "set by": `$USER`, else
/// `$LOGNAME`, else the process's uid (from `/proc/self/status`): cron,
/// `sudo -i` and containers often set neither variable, and the log said
/// `cli ?@host`.
fn operator() -> String {
    ["USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()))
        .or_else(|| uid_in(&std::fs::read_to_string("/proc/self/status").ok()?))
        .unwrap_or_else(|| "?".to_owned())
}

/// `uid N` from the real uid of a `/proc/<pid>/status` text.
fn uid_in(status: &str) -> Option<String> {
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    Some(format!("uid {}", line.split_whitespace().next()?))
}

pub async fn run(g: &Global, args: ControlArgs) -> Result<(), CliError> {
    let settings = load_config(g, Uses::DATABASE)?;
    let store = open_store(&settings).await?;
    require_schema(store.as_ref()).await?;
    let by = format!(
        "cli {}@{}",
        operator(),
        postbox_core::wire::host_name().unwrap_or_else(|| "?".to_owned())
    );
    match args.action.unwrap_or(ControlAction::List { changes: 20 }) {
        ControlAction::List { changes } => list(g, store.as_ref(), changes).await,
        ControlAction::Set {
            key,
            pause,
            resume,
            delivery,
            max_retry_count,
            sample_percent,
        } => {
            let change = ControlChange {
                paused: match (pause, resume) {
                    (true, true) => {
                        return Err(CliError::usage("give --pause or --resume, not both"))
                    }
                    (true, false) => Some(true),
                    (false, true) => Some(false),
                    (false, false) => None,
                },
                delivery: delivery
                    .as_deref()
                    .map(parse_delivery)
                    .transpose()
                    .map_err(|e| CliError::usage(format!("--delivery: {e}")))?,
                max_retry_count: number_or_default("--max-retry-count", max_retry_count, u32::MAX)?,
                sample_percent: number_or_default("--sample-percent", sample_percent, 100)?
                    .map(|p| p.map(|p| p as u8)),
            };
            if change == ControlChange::default() {
                return Err(CliError::usage(
                    "control set: give --pause, --resume, --delivery, --max-retry-count or --sample-percent",
                ));
            }
            set(g, store.as_ref(), &key, &change, &by).await
        }
        ControlAction::Clear { key } => {
            let gone = store
                .clear_control(&key.app_code, &key.event_type, &by)
                .await?;
            if g.json {
                return output::json(&serde_json::json!({ "cleared": gone }));
            }
            outln!(
                "{}",
                if gone {
                    format!(
                        "control of {} cleared: the config's rules apply",
                        shown(&key)
                    )
                } else {
                    format!("no control of {}", shown(&key))
                }
            );
            Ok(())
        }
    }
}

/// `flag`'s value: a number up to `max`, or `default` (`Some(None)`).
fn number_or_default(
    flag: &str,
    value: Option<String>,
    max: u32,
) -> Result<Option<Option<u32>>, CliError> {
    value
        .map(|n| {
            control::parse_number(&n, max).map_err(|e| CliError::usage(format!("{flag}: {e}")))
        })
        .transpose()
}

fn shown(key: &ControlKey) -> String {
    format!(
        "app_code `{}`, event type `{}`",
        key.app_code, key.event_type
    )
}

async fn set(
    g: &Global,
    store: &dyn OutboxStore,
    key: &ControlKey,
    change: &ControlChange,
    by: &str,
) -> Result<(), CliError> {
    let done = change_control(store, &key.app_code, &key.event_type, change, false, by).await?;
    match done {
        Changed::Cleared(gone) => {
            if g.json {
                return output::json(&serde_json::json!({ "cleared": gone }));
            }
            outln!(
                "control of {} sets nothing any more: cleared, the config's rules apply",
                shown(key)
            );
        }
        Changed::Set(stored) => {
            if g.json {
                return output::json(&stored);
            }
            outln!(
                "control of {}: {} (relays apply it within {} s)",
                shown(key),
                stored.describe(),
                control::REFRESH.as_secs() + 1
            );
        }
    }
    Ok(())
}

async fn list(g: &Global, store: &dyn OutboxStore, log: u32) -> Result<(), CliError> {
    let controls = store.controls().await?;
    let changes = store.control_log(log).await?;
    if g.json {
        return output::json(&serde_json::json!({ "controls": controls, "log": changes }));
    }
    if controls.is_empty() {
        outln!("no runtime controls: the config's rules apply");
    } else {
        outln!(
            "{:<16} {:<24} {:<7} {:<14} {:>15} {:>7}  set by",
            "app_code",
            "event_type",
            "paused",
            "delivery",
            "max_retry_count",
            "sample"
        );
        for c in &controls {
            row(c);
        }
    }
    if !changes.is_empty() {
        outln!();
        outln!("recent changes, newest first:");
        for e in &changes {
            outln!(
                "  {}  {}  {}/{}: {}",
                output::time(e.at_ms),
                e.by,
                e.app_code,
                e.event_type,
                e.change
            );
        }
    }
    Ok(())
}

fn row(c: &Control) {
    outln!(
        "{:<16} {:<24} {:<7} {:<14} {:>15} {:>7}  {} ({})",
        c.app_code,
        c.event_type,
        if c.paused { "yes" } else { "" },
        c.delivery.map_or("", delivery_name),
        c.max_retry_count
            .map_or_else(String::new, |n| n.to_string()),
        c.sample_percent
            .map_or_else(String::new, |p| format!("{p} %")),
        c.updated_by,
        output::time(c.updated_at_ms)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uid_is_read_from_the_status_text() {
        let status = "Name:\tpostbox\nUmask:\t0022\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\n";
        assert_eq!(uid_in(status).as_deref(), Some("uid 1000"));
        assert_eq!(uid_in("Name:\tpostbox\n"), None);
    }
}
