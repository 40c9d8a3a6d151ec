//! `postbox topology [--json]`: who publishes what, and who consumes it
//! (`postbox_runtime::topology`): each event type of the latest rows,
//! through each `[[publishers]]` entry, to the queues, durable consumers
//! and consumer groups that take it.

use postbox_core::config::Uses;
use postbox_core::topology::Topology;

use crate::cli::Global;
use crate::error::CliError;
use crate::open::{load_config, open_store, require_schema};
use crate::output;

pub async fn run(g: &Global) -> Result<(), CliError> {
    let uses = Uses {
        publishers: true,
        consumers: true,
        ..Uses::DATABASE
    };
    let settings = load_config(g, uses)?;
    let store = open_store(&settings).await?;
    require_schema(store.as_ref()).await?;
    let topology = postbox_runtime::topology::gather(&settings, store.as_ref()).await?;
    if g.json {
        return output::json(&topology);
    }
    print(&topology);
    Ok(())
}

fn print(t: &Topology) {
    if t.event_types.is_empty() {
        outln!("no events in the outbox yet: nothing to route");
    }
    for kind in &t.event_types {
        outln!("{} ({})", kind.event_type, kind.app_code);
        for r in t
            .routes
            .iter()
            .filter(|r| r.app_code == kind.app_code && r.event_type == kind.event_type)
        {
            outln!("  → {} ({}): {}", r.publisher, r.kind, r.target);
            if r.subscribers.is_empty() && matches!(r.kind, "rabbitmq" | "nats" | "redis") {
                outln!("      → nobody this config or the broker knows of");
            }
            for s in &r.subscribers {
                outln!("      → {} via {} ({})", s.name, s.via, s.source);
            }
        }
    }
    for c in &t.idle_consumers {
        outln!("consumer `{c}`: no route of the event types seen reaches it");
    }
    for u in &t.brokers.unreachable {
        outln!("not asked: {u}");
    }
}
