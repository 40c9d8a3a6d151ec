//! An event's life as `postbox events show` and `GET /api/events/{id}`
//! tell it: enqueued, each recorded attempt, the runtime-control changes
//! that applied to it while it was not yet done, then its delivery.

use serde::Serialize;

use crate::control::{ControlLogEntry, ANY};
use crate::store::{confirmed_on_delivery, ControlStore, HistoryEntry};
use crate::{EventRecord, Status};

/// How many of the newest control changes the timeline looks through.
pub const CONTROL_CHANGES: u32 = 500;

/// The newest [`CONTROL_CHANGES`] control changes, for [`timeline`]; none
/// (logged) when the log cannot be read, as on a schema before version 9:
/// the timeline is then told without them.
pub async fn control_changes(store: &dyn ControlStore) -> Vec<ControlLogEntry> {
    store
        .control_log(CONTROL_CHANGES)
        .await
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not read the control log; the timeline leaves control changes out");
            Vec::new()
        })
}

/// One step of an event's life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Step {
    /// When, epoch ms (the database's clock).
    pub at_ms: i64,
    /// `enqueued`, a history kind (`failed`, `lease_expired`,
    /// `dead_lettered`, `replayed`), `control` or `delivered`.
    pub kind: &'static str,
    /// The row's app_code.
    pub app_code: String,
    /// The attempt it concerns (0 for a replay).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<i32>,
    /// The publisher(s) it concerns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publisher: Option<String>,
    /// The event type (enqueued), the error, the replay's origin, or the
    /// control change and who made it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The steps of `rows` (the event's rows, one per app_code), oldest first:
/// `history` (the event's attempt history, kept for the first row's
/// app_code), and each of `changes` (the control log) whose key covers a
/// row and that was made between the row's enqueue and its end (delivered
/// or failed), or since its enqueue while it is not done.
pub fn timeline(
    rows: &[&EventRecord],
    history: &[HistoryEntry],
    publishers: &[String],
    changes: &[ControlLogEntry],
) -> Vec<Step> {
    let mut steps = Vec::new();
    let app_of_history = rows.first().map(|r| r.app_code.clone()).unwrap_or_default();
    for r in rows {
        steps.push(Step {
            at_ms: r.created_at_ms,
            kind: "enqueued",
            app_code: r.app_code.clone(),
            attempt: None,
            publisher: None,
            detail: Some(r.event_type.clone()),
        });
        let done = matches!(r.status, Status::Delivered | Status::Failed);
        steps.extend(
            changes
                .iter()
                .filter(|c| covers(c, r) && c.at_ms >= r.created_at_ms)
                .filter(|c| !done || c.at_ms <= r.updated_at_ms)
                .map(|c| Step {
                    at_ms: c.at_ms,
                    kind: "control",
                    app_code: r.app_code.clone(),
                    attempt: None,
                    publisher: None,
                    detail: Some(format!(
                        "{}/{}: {} (by {})",
                        c.app_code, c.event_type, c.change, c.by
                    )),
                }),
        );
        if r.status == Status::Delivered {
            steps.push(Step {
                at_ms: r.updated_at_ms,
                kind: "delivered",
                app_code: r.app_code.clone(),
                attempt: Some(r.retry_count + 1),
                // Those that confirmed on this attempt; `delivered_to`
                // holds the ones that confirmed on earlier attempts.
                publisher: Some(confirmed_on_delivery(r, publishers).join(","))
                    .filter(|p| !p.is_empty()),
                detail: (!r.delivered_to.is_empty())
                    .then(|| format!("confirmed earlier: {}", r.delivered_to.join(", "))),
            });
        }
    }
    steps.extend(history.iter().map(|h| Step {
        at_ms: h.at_ms,
        kind: h.kind.as_str(),
        app_code: app_of_history.clone(),
        attempt: Some(h.attempt),
        publisher: h.publisher.clone(),
        detail: h.detail.clone(),
    }));
    steps.sort_by_key(|s| s.at_ms);
    steps
}

/// Whether the control `change` was made to applies to row `r`.
fn covers(change: &ControlLogEntry, r: &EventRecord) -> bool {
    (change.app_code == r.app_code || change.app_code == ANY)
        && (change.event_type == r.event_type || change.event_type == ANY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::HistoryKind;

    fn row(status: Status) -> EventRecord {
        EventRecord {
            app_code: "room".into(),
            event_type: "Tick".into(),
            status,
            retry_count: 1,
            created_at_ms: 1_000,
            updated_at_ms: 3_000,
            ..EventRecord::default()
        }
    }

    fn change(at_ms: i64, app_code: &str, event_type: &str) -> ControlLogEntry {
        ControlLogEntry {
            at_ms,
            by: "cli ops@host".into(),
            app_code: app_code.into(),
            event_type: event_type.into(),
            change: "paused".into(),
        }
    }

    #[test]
    fn timeline_runs_from_enqueue_through_attempts_to_delivery() {
        let history = [HistoryEntry {
            at_ms: 2_000,
            kind: HistoryKind::Failed,
            attempt: 1,
            publisher: Some("file".into()),
            detail: Some("disk full".into()),
        }];
        let delivered = row(Status::Delivered);
        let t = timeline(&[&delivered], &history, &[], &[]);
        let kinds: Vec<_> = t.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, ["enqueued", "failed", "delivered"]);
        assert_eq!(t[2].attempt, Some(2));
        let failed = row(Status::Failed);
        let t = timeline(&[&failed], &[], &[], &[]);
        assert_eq!(t.len(), 1, "no delivered step for a failed row");
    }

    /// Issue 14.1: a control change shows in the timeline of each event it
    /// applied to while the event was not done, and in no other.
    #[test]
    fn control_changes_show_where_they_applied() {
        let changes = [
            change(500, "room", "Tick"),   // before the enqueue
            change(1_500, "room", "Tick"), // while it waited
            change(2_000, "*", "*"),       // every key
            change(2_500, "room", "Other"),
            change(2_600, "game", "*"),
            change(3_500, "room", "*"), // after its delivery
        ];
        let delivered = row(Status::Delivered);
        let t = timeline(&[&delivered], &[], &[], &changes);
        let controls: Vec<i64> = t
            .iter()
            .filter(|s| s.kind == "control")
            .map(|s| s.at_ms)
            .collect();
        assert_eq!(controls, [1_500, 2_000]);
        assert_eq!(
            t[1].detail.as_deref(),
            Some("room/Tick: paused (by cli ops@host)")
        );
        // Not done yet: every later change that covers it.
        let waiting = row(Status::Pending);
        let t = timeline(&[&waiting], &[], &[], &changes);
        let n = t.iter().filter(|s| s.kind == "control").count();
        assert_eq!(n, 3);
    }
}
