//! Aggregates held back by a head that cannot move (`ordering =
//! "per_aggregate"`), as `doctor` and `status` show them.

use postbox_core::store::{OutboxStore, StuckAggregate};

use crate::output;

/// How long a head that keeps failing or stays leased may hold its
/// aggregate back before `doctor` and `status` show it.
pub(crate) const HELD_BACK_AFTER_MS: i64 = 5 * 60 * 1000;

/// Aggregates whose head cannot move (`ordering = "per_aggregate"`), of
/// every app_code, oldest first: at most `limit` per app_code.
pub(crate) async fn held_back(
    store: &dyn OutboxStore,
    app_codes: &[String],
    limit: u32,
) -> postbox_core::Result<Vec<StuckAggregate>> {
    let mut out = Vec::new();
    for app in app_codes {
        out.extend(
            store
                .stuck_aggregates(app, HELD_BACK_AFTER_MS, limit)
                .await?,
        );
    }
    Ok(out)
}

/// One line per held-back aggregate.
pub(crate) fn describe_held_back(s: &StuckAggregate) -> String {
    format!(
        "app_code `{}` aggregate `{}`: head {} is {} for {:.0}s (retry_count {}{}), {} later event(s) wait",
        s.app_code,
        s.aggregate_id,
        s.head_event_id,
        s.head_status.as_str(),
        s.head_age_seconds,
        s.head_retry_count,
        s.head_last_error
            .as_deref()
            .map(|e| format!(", last error: {}", output::clip(e, 120)))
            .unwrap_or_default(),
        s.waiting
    )
}
