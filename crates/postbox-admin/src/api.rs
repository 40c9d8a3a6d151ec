//! The HTTP handlers: health, metrics, stats, event lists, one event's
//! timeline, and replay (the one mutating call, behind the bearer token).

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};

use postbox_core::store::{
    EventFilter, Inspected, ReplayPick, ReplayRequest, ReplaySelector, ReplayTargets,
};
use postbox_core::time::{now_ms, parse_time_arg};
use postbox_core::timeline::{control_changes, timeline, Step};
use postbox_core::{EventRecord, Status};

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::poller::Snapshot;
use crate::state::AppState;

/// Rows per page unless `limit` says otherwise.
const DEFAULT_PAGE: u32 = 50;
/// Largest page.
const MAX_PAGE: u32 = 500;

pub(crate) async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

/// `/healthz` of the admin server: beside a relay, 503 while the relay's
/// claim loop has not gone round for longer than any round can take (see
/// `postbox_core::relay::Pulse`), so that a supervisor's liveness probe
/// restarts a wedged relay. A relay whose database or broker is down still
/// goes round: it stays 200, and its metrics tell the rest.
pub(crate) async fn relay_healthz(State(state): State<AppState>) -> Response {
    match &state.pulse {
        Some(pulse) if pulse.is_stalled() => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({
                "status": "stalled",
                "error": format!(
                    "the relay's claim loop has not gone round for {} s (stalled after {} s)",
                    pulse.since_last_round().as_secs(),
                    pulse.stalled_after().as_secs()
                ),
            })),
        )
            .into_response(),
        Some(pulse) => Json(serde_json::json!({
            "status": "ok",
            "relay_last_round_ms_ago": pulse.since_last_round().as_millis() as u64,
        }))
        .into_response(),
        None => healthz().await.into_response(),
    }
}

pub(crate) async fn metrics(State(state): State<AppState>) -> Response {
    crate::recorder::render(&state.prometheus)
}

pub(crate) async fn stats(State(state): State<AppState>) -> Json<Snapshot> {
    Json(state.poller.snapshot())
}

/// `GET /api/events` query: the CLI's filters plus the page cursor.
#[derive(Debug, Deserialize)]
pub(crate) struct ListParams {
    app_code: Option<String>,
    aggregate_id: Option<String>,
    status: Option<String>,
    event_type: Option<String>,
    since: Option<String>,
    until: Option<String>,
    before_id: Option<i64>,
    limit: Option<u32>,
}

/// One page of rows, newest first.
#[derive(Debug, Serialize)]
pub(crate) struct Page {
    /// Rows of the outbox and of its archive (`"archived": true`).
    items: Vec<Inspected>,
    /// Pass as `before_id` for the next page; null on the last page.
    next: Option<i64>,
}

impl ListParams {
    fn filter(&self) -> ApiResult<EventFilter> {
        let now = now_ms();
        let time = |name: &str, v: &Option<String>| {
            v.as_deref()
                .filter(|s| !s.is_empty())
                .map(|s| {
                    parse_time_arg(s, now)
                        .map_err(|e| ApiError::bad_request(format!("{name}: {e}")))
                })
                .transpose()
        };
        let status = self
            .status
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<Status>()
                    .map_err(|e| ApiError::bad_request(format!("status: {e}")))
            })
            .transpose()?;
        let limit = self.limit.unwrap_or(DEFAULT_PAGE);
        if limit == 0 || limit > MAX_PAGE {
            return Err(ApiError::bad_request(format!(
                "limit: {limit} is out of range 1..={MAX_PAGE}"
            )));
        }
        let non_empty = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
        let app_code = non_empty(&self.app_code);
        let aggregate_id = non_empty(&self.aggregate_id);
        if aggregate_id.is_some() && app_code.is_none() {
            return Err(ApiError::bad_request(
                "aggregate_id: give an app_code too (aggregate ids are a tenant's)",
            ));
        }
        let (since_ms, until_ms) = (time("since", &self.since)?, time("until", &self.until)?);
        postbox_core::time::check_range(since_ms, until_ms)
            .map_err(|e| ApiError::bad_request(format!("since/until: {e}")))?;
        Ok(EventFilter {
            app_code,
            aggregate_id,
            status,
            event_type: non_empty(&self.event_type),
            since_ms,
            until_ms,
            before_id: self.before_id,
            limit,
            ..EventFilter::default()
        })
    }
}

pub(crate) async fn list(
    State(state): State<AppState>,
    Query(params): Query<ListParams>,
) -> ApiResult<Json<Page>> {
    let filter = params.filter()?;
    let mut items = state.store.list_inspected(&filter).await?;
    let next = if items.len() as u32 == filter.limit {
        items.last().map(|r| r.record.id)
    } else {
        None
    };
    for i in &mut items {
        state.redact.apply(&mut i.record);
    }
    Ok(Json(Page { items, next }))
}

/// `GET /api/events/{event_id}`: the row(s) and the timeline.
#[derive(Debug, Serialize)]
pub(crate) struct EventDetail {
    event_id: String,
    /// Rows of the outbox and of its archive (`"archived": true`).
    rows: Vec<Inspected>,
    timeline: Vec<Step>,
}

pub(crate) async fn show(
    State(state): State<AppState>,
    Path(event_id): Path<String>,
) -> ApiResult<Json<EventDetail>> {
    let rows = state
        .store
        .find_inspected(&event_id, &state.app_codes)
        .await?;
    if rows.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no event `{event_id}` in table `{}`", state.store.table()),
        ));
    }
    let history = state.store.history(&event_id).await?;
    let changes = control_changes(state.store.as_ref()).await;
    let records: Vec<&EventRecord> = rows.iter().map(|r| &r.record).collect();
    let timeline = timeline(&records, &history, &state.publishers, &changes);
    let mut rows = rows;
    for r in &mut rows {
        state.redact.apply(&mut r.record);
    }
    Ok(Json(EventDetail {
        event_id,
        rows,
        timeline,
    }))
}

/// `GET /api/publishers`: the configured publishers, a replay's possible
/// targets; and, in a relay's admin server, the target each publisher with
/// failover targets publishes to now (`active_targets`).
pub(crate) async fn publishers(State(state): State<AppState>) -> Json<serde_json::Value> {
    let active = postbox_core::publish::active_targets();
    Json(serde_json::json!({ "publishers": *state.publishers, "active_targets": active }))
}

/// `POST …/replay` query: narrows the replay to one tenant, and picks its
/// targets: `publishers=a,b` (only those), `all_publishers=true` (every
/// one); by default a `delivered` event goes to every publisher and any
/// other only to those that have not confirmed it.
#[derive(Debug, Deserialize)]
// An unknown key is refused, not dropped: `?dry_run=true` replayed for
// real, `?publisher=a` (the CLI's flag) to every publisher.
#[serde(deny_unknown_fields)]
pub(crate) struct ReplayParams {
    app_code: Option<String>,
    publishers: Option<String>,
    all_publishers: Option<bool>,
}

impl ReplayParams {
    fn targets(&self, configured: &[String]) -> ApiResult<ReplayTargets> {
        let named: Vec<String> = self
            .publishers
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        let all = self.all_publishers.unwrap_or(false);
        let pick = match (all, named.is_empty()) {
            (true, false) => {
                return Err(ApiError::bad_request(
                    "give either `publishers` or `all_publishers=true`, not both",
                ))
            }
            (true, true) => ReplayPick::All,
            (false, false) => ReplayPick::Only(named),
            (false, true) => ReplayPick::Unconfirmed,
        };
        ReplayTargets::new(pick, configured.to_vec())
            .map_err(|e| ApiError::bad_request(format!("publishers: {e}")))
    }
}

/// 400 when `rows` (as they are before a replay) hold an event not
/// delivered that a publisher `targets` leaves out has not confirmed.
fn refuse_left_out(targets: &ReplayTargets, rows: &[EventRecord]) -> ApiResult<()> {
    let left_out = targets.unconfirmed_left_out(rows);
    if left_out.is_empty() {
        return Ok(());
    }
    Err(ApiError::bad_request(format!(
        "{}; replaying to the chosen publishers alone would mark it delivered without them: add them to `publishers`, or leave `publishers` out",
        left_out.join("; ")
    )))
}

/// Rows put back to `pending`, and the publishers each goes to.
#[derive(Debug, Serialize)]
pub(crate) struct Replayed {
    replayed: Vec<EventRecord>,
    /// Per replayed row (same order): the targeted publishers, when the
    /// configured publishers are known.
    targets: Vec<Option<Vec<String>>>,
}

/// `POST /api/events/{event_id}/replay` (an operator token, checked by
/// `auth::guard`): the origin recorded in the history names the token.
pub(crate) async fn replay(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    caller: Option<Extension<Caller>>,
    Path(event_id): Path<String>,
    Query(params): Query<ReplayParams>,
) -> ApiResult<Json<Replayed>> {
    let origin = crate::auth::origin(caller.as_deref(), peer);
    let targets = params.targets(&state.publishers)?;
    let selector = ReplaySelector::EventIds {
        app_code: params.app_code.clone().filter(|s| !s.is_empty()),
        event_ids: vec![event_id.clone()],
    };
    // An id in several app_codes, without one given, would replay each:
    // read first. (A pick leaving out an unconfirmed publisher is refused
    // by the store's write, 400.)
    if matches!(selector, ReplaySelector::EventIds { app_code: None, .. }) {
        let before = state
            .store
            .replay_to(ReplayRequest {
                selector: &selector,
                dry_run: true,
                origin: &origin,
                targets: &targets,
            })
            .await?;
        if let Some((_, apps)) = selector.ambiguous_ids(&before).first() {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!(
                    "event `{event_id}` is in app_codes {}: event ids are unique per app_code; give `app_code`",
                    apps.join(", ")
                ),
            ));
        }
    }
    let replayed = state
        .store
        .replay_to(ReplayRequest {
            selector: &selector,
            dry_run: false,
            origin: &origin,
            targets: &targets,
        })
        .await?;
    if replayed.is_empty() {
        // Only the tenant asked for: a row of another app_code is not this
        // event (it answered 409, "being delivered", for good).
        let mut rows = state.store.find(&event_id).await?;
        if let ReplaySelector::EventIds {
            app_code: Some(code),
            ..
        } = &selector
        {
            rows.retain(|r| &r.app_code == code);
        }
        return Err(if rows.is_empty() {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no event `{event_id}` to replay"),
            )
        } else {
            ApiError::new(
                StatusCode::CONFLICT,
                format!("event `{event_id}` is being delivered right now; replay it once its attempt ends"),
            )
        });
    }
    let to: Vec<Option<String>> = replayed.iter().map(|r| targets.targets_of(r)).collect();
    for (r, to) in replayed.iter().zip(&to) {
        tracing::info!(event_id = %r.event_id, app_code = %r.app_code, origin, publishers = to.as_deref().unwrap_or("?"), "replayed: back to pending");
    }
    // Fresh counts for the dashboard that asked, before the next tick.
    state.poller.poll_soon();
    let targets = to
        .into_iter()
        .map(|t| {
            t.map(|t| {
                t.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
        })
        .collect();
    let mut replayed = replayed;
    for r in &mut replayed {
        state.redact.apply(r);
    }
    Ok(Json(Replayed { replayed, targets }))
}

/// `POST /api/replay` body: the filters of `GET /api/events` (without the
/// page), the targets of `POST …/replay`, `dry_run`, and `all` (a replay
/// without any filter must say so).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BulkReplay {
    app_code: Option<String>,
    aggregate_id: Option<String>,
    status: Option<String>,
    event_type: Option<String>,
    since: Option<String>,
    until: Option<String>,
    publishers: Option<String>,
    all_publishers: Option<bool>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    all: bool,
}

/// The most events one `POST /api/replay` takes (more: the paced replay).
const BULK_REPLAY_MAX: u32 = 10_000;

/// What a bulk replay took: how many rows (each app_code's), and the first
/// of them.
#[derive(Debug, Serialize)]
pub(crate) struct BulkReplayed {
    dry_run: bool,
    count: usize,
    /// The first rows (at most [`DEFAULT_PAGE`]).
    sample: Vec<EventRecord>,
}

/// `POST /api/replay` (an operator): every row the filters take back to
/// `pending`, keeping event ids, as `postbox replay --status … --since …`
/// does (one statement per app_code, through its indexes); `dry_run`
/// counts them first, for the confirmation the dashboard asks.
pub(crate) async fn replay_filtered(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    caller: Option<Extension<Caller>>,
    body: Option<Json<BulkReplay>>,
) -> ApiResult<Json<BulkReplayed>> {
    let b = body.map(|Json(b)| b).unwrap_or_default();
    let list = ListParams {
        app_code: b.app_code,
        aggregate_id: b.aggregate_id,
        status: b.status,
        event_type: b.event_type,
        since: b.since,
        until: b.until,
        before_id: None,
        limit: None,
    };
    let filter = list.filter()?;
    let narrowed = filter.status.is_some()
        || filter.aggregate_id.is_some()
        || filter.event_type.is_some()
        || filter.since_ms.is_some()
        || filter.until_ms.is_some();
    if !narrowed && !b.all {
        return Err(ApiError::bad_request(
            "give a filter (status, aggregate_id, event_type, since, until) or \"all\": true to replay every event",
        ));
    }
    let targets = ReplayParams {
        app_code: None,
        publishers: b.publishers,
        all_publishers: b.all_publishers,
    }
    .targets(&state.publishers)?;
    // Bounded: a replay (or its dry run) of every row of a month read them
    // all into this process (the relay's, with `[admin]` on `relay`) and
    // wrote them in one transaction. Counted by their ids first.
    let matching = state
        .store
        .replay_ids_after(&filter, 0, BULK_REPLAY_MAX + 1)
        .await?;
    if matching.len() > BULK_REPLAY_MAX as usize {
        return Err(ApiError::bad_request(format!(
            "the filter takes more than {BULK_REPLAY_MAX} events: replay them paced with `postbox replay` and the same filters plus `--rate` (a batch at a time, behind the relay, resumable), or narrow it"
        )));
    }
    let origin = crate::auth::origin(caller.as_deref(), peer);
    let selector = ReplaySelector::Filter(filter);
    let rows = state
        .store
        .replay_to(ReplayRequest {
            selector: &selector,
            dry_run: b.dry_run,
            origin: &origin,
            targets: &targets,
        })
        .await?;
    if b.dry_run {
        // The real run is refused for it (by the store): say so now.
        refuse_left_out(&targets, &rows)?;
    }
    if !b.dry_run {
        tracing::info!(
            origin,
            rows = rows.len(),
            ?selector,
            "replayed by filter: back to pending"
        );
        state.poller.poll_soon();
    }
    let count = rows.len();
    let mut sample: Vec<EventRecord> = rows.into_iter().take(DEFAULT_PAGE as usize).collect();
    for r in &mut sample {
        state.redact.apply(r);
    }
    Ok(Json(BulkReplayed {
        dry_run: b.dry_run,
        count,
        sample,
    }))
}

/// `GET /api/controls`: the runtime controls and the newest changes.
pub(crate) async fn controls(State(state): State<AppState>) -> ApiResult<Json<serde_json::Value>> {
    let controls = state.store.controls().await?;
    let log = state.store.control_log(50).await?;
    Ok(Json(
        serde_json::json!({ "controls": controls, "log": log }),
    ))
}

/// `POST /api/controls` body: the key (`*` for any), the fields to change
/// (`delivery` and `max_retry_count` take `"default"` or null for the
/// config's), or `clear`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ControlBody {
    app_code: String,
    event_type: String,
    paused: Option<bool>,
    #[serde(default)]
    delivery: Option<serde_json::Value>,
    #[serde(default)]
    max_retry_count: Option<serde_json::Value>,
    #[serde(default)]
    sample_percent: Option<serde_json::Value>,
    #[serde(default)]
    clear: bool,
}

/// A number up to `max` (`Some(Some(n))`), or back to the config's
/// (`Some(None)`: `null` or `"default"`), or not given (`None`).
fn number_or_default(
    field: &str,
    value: Option<serde_json::Value>,
    max: u32,
) -> Result<Option<Option<u32>>, ApiError> {
    let text = match value {
        None => return Ok(None),
        Some(serde_json::Value::Null) => return Ok(Some(None)),
        Some(serde_json::Value::String(s)) => s,
        Some(other) => other.to_string(),
    };
    postbox_core::control::parse_number(&text, max)
        .map(Some)
        .map_err(|e| ApiError::bad_request(format!("{field}: {e}")))
}

/// `POST /api/controls` (an operator): changes one control, logged under
/// the token's name; a control that then sets nothing is cleared.
pub(crate) async fn set_control(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    caller: Option<Extension<Caller>>,
    Json(b): Json<ControlBody>,
) -> ApiResult<Json<serde_json::Value>> {
    use postbox_core::control::{parse_delivery, ControlChange};
    use postbox_core::store::{change_control, Changed};
    let by = crate::auth::origin(caller.as_deref(), peer);
    let bad = |e: String| ApiError::bad_request(e);
    let delivery = match b.delivery {
        None => None,
        Some(serde_json::Value::Null) => Some(None),
        Some(serde_json::Value::String(s)) => {
            Some(parse_delivery(&s).map_err(|e| bad(format!("delivery: {e}")))?)
        }
        Some(other) => return Err(bad(format!("delivery: {other} is not a string"))),
    };
    let change = ControlChange {
        paused: b.paused,
        delivery,
        max_retry_count: number_or_default("max_retry_count", b.max_retry_count, u32::MAX)?,
        sample_percent: number_or_default("sample_percent", b.sample_percent, 100)?
            .map(|p| p.map(|p| p as u8)),
    };
    let done = change_control(
        state.store.as_ref(),
        &b.app_code,
        &b.event_type,
        &change,
        b.clear,
        &by,
    )
    .await?;
    Ok(Json(match done {
        Changed::Cleared(cleared) => {
            tracing::info!(
                app_code = b.app_code,
                event_type = b.event_type,
                origin = by,
                "admin API: control cleared"
            );
            serde_json::json!({ "cleared": cleared })
        }
        Changed::Set(stored) => {
            tracing::info!(app_code = b.app_code, event_type = b.event_type, origin = by, control = %stored.describe(), "admin API: control set");
            serde_json::to_value(stored).unwrap_or_default()
        }
    }))
}

/// `GET /api/relays`: every relay of the table, as its heartbeats in
/// `<table>_relays` tell (worker id, host, pid, app_codes, counts, rate,
/// last seen, state).
pub(crate) async fn relays(State(state): State<AppState>) -> ApiResult<Json<serde_json::Value>> {
    let relays = state.store.relays().await?;
    Ok(Json(serde_json::json!({ "relays": relays })))
}

/// `GET /api/topology`: who publishes what, and who consumes it.
pub(crate) async fn topology(
    State(state): State<AppState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Some(source) = &state.topology else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "this admin server was started without the config's publishers and consumers: no topology",
        ));
    };
    source
        .topology()
        .await
        .map(Json)
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_params_validate_names_the_parameter() {
        let p = ListParams {
            app_code: Some(String::new()),
            aggregate_id: None,
            status: Some("lost".into()),
            event_type: None,
            since: None,
            until: None,
            before_id: None,
            limit: None,
        };
        let e = p.filter().err().unwrap();
        assert!(e.message.starts_with("status:"), "{}", e.message);
        let p = ListParams {
            status: None,
            limit: Some(0),
            ..p
        };
        assert!(p.filter().err().unwrap().message.starts_with("limit:"));
        let p = ListParams {
            limit: None,
            aggregate_id: Some("order-1".into()),
            ..p
        };
        assert!(p
            .filter()
            .err()
            .unwrap()
            .message
            .starts_with("aggregate_id:"));
    }
}
