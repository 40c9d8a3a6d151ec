//! `postbox relays [--json]`: every relay of the table, on any host, as
//! its heartbeats in `<table>_relays` tell: worker id, host and pid, the
//! app_codes it serves, what it claimed, delivered and dead-lettered since
//! it started, its rate over the last heartbeat, when it was last heard
//! from, and its state (`running`, `stopped`, or `silent`: no heartbeat
//! for three intervals).

use postbox_core::config::Uses;

use crate::cli::Global;
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

pub async fn run(g: &Global) -> Result<(), CliError> {
    let settings = load_config(g, Uses::DATABASE)?;
    let store = open_store(&settings).await?;
    require_schema(store.as_ref()).await?;
    let relays = store.relays().await?;
    if g.json {
        return output::json(&relays);
    }
    if relays.is_empty() {
        outln!("no relay has run on `{}` yet", store.table());
        return Ok(());
    }
    outln!(
        "{:<8}  {:<36}  {:<20}  {:>10}  {:>10}  {:>7}  {:>8}  {:<24}  app_codes",
        "state",
        "worker_id",
        "host:pid",
        "claimed",
        "delivered",
        "failed",
        "per min",
        "last seen"
    );
    for r in &relays {
        let b = &r.beat;
        outln!(
            "{:<8}  {:<36}  {:<20}  {:>10}  {:>10}  {:>7}  {:>8}  {:<24}  {}",
            r.state,
            b.worker_id,
            format!("{}:{}", b.host, b.pid),
            b.claimed,
            b.delivered,
            b.failed,
            b.per_minute,
            output::time(r.seen_at_ms),
            b.app_codes.join(",")
        );
    }
    Ok(())
}
