//! The consumers of a `postbox consume` process, over HTTP:
//!
//! - `GET /api/consumers`: each consumer's name, kind, queue, state
//!   (`consuming`, `paused`, `connecting`) and what it settled;
//! - `POST /api/consumers/{name}/pause` and `…/resume` (bearer token):
//!   stop or restart taking messages. The answer is the consumer as it is
//!   then, with `changed: false` when it already was so;
//! - `GET /api/consumers/{name}/dead` (filters in the query: `event_type`,
//!   `event_id`, `since`, `until`, `error`, `limit`): the consumer's dead
//!   letters on its broker, payloads masked as `[admin.redact]` says;
//! - `POST /api/consumers/{name}/dead/replay` and `…/dead/purge` (an
//!   operator; the same filters as a JSON body, with `dry_run` and `all`):
//!   send them back to the consumer's queue, or remove them. A body without
//!   a filter is refused unless it says `"all": true`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use postbox_core::BoxFuture;
use serde::Deserialize;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::redact::Redaction;

/// What a dead-letter request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadVerb {
    /// Read at most this many matching letters.
    List(usize),
    /// Send the matching letters back to the consumer's queue.
    Replay,
    /// Remove the matching letters.
    Purge,
}

/// A dead-letter request, its filters checked.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadRequest {
    /// What to do.
    pub verb: DeadVerb,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this event id.
    pub event_id: Option<String>,
    /// Dead-lettered at or after, epoch ms.
    pub since_ms: Option<i64>,
    /// Dead-lettered before, epoch ms.
    pub until_ms: Option<i64>,
    /// Text the last error contains (any case).
    pub error: Option<String>,
    /// Count, change nothing.
    pub dry_run: bool,
}

/// One consumer as the admin server controls it (implemented over
/// `postbox_consumers`' consumer state by the runtime).
pub trait ConsumerControl: Send + Sync + 'static {
    /// The consumer's config name.
    fn name(&self) -> &str;
    /// What `GET /api/consumers` shows of it (an object).
    fn snapshot(&self) -> serde_json::Value;
    /// Stops it taking messages; false when it was paused already.
    fn pause(&self) -> bool;
    /// Lets it take messages again; false when it was not paused.
    fn resume(&self) -> bool;
    /// A pass over its dead letters: the report as JSON (`dead_letters`,
    /// `scanned`, `matched`, `done`, `letters` with `event_type` and
    /// `payload` each), or why the broker failed.
    fn dead_letters(
        &self,
        request: DeadRequest,
    ) -> BoxFuture<'_, Result<serde_json::Value, String>>;
}

#[derive(Clone)]
struct Consumers {
    all: Arc<Vec<Arc<dyn ConsumerControl>>>,
    redact: Arc<Redaction>,
}

impl Consumers {
    fn named(&self, name: &str) -> Result<&Arc<dyn ConsumerControl>, ApiError> {
        self.all.iter().find(|c| c.name() == name).ok_or_else(|| {
            let known: Vec<&str> = self.all.iter().map(|c| c.name()).collect();
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "no consumer `{name}` in this process (it runs: {})",
                    known.join(", ")
                ),
            )
        })
    }
}

/// The routes over `consumers` (the caller's token is checked by
/// `auth::guard` in front of them: a viewer lists, an operator switches).
pub(crate) fn routes(consumers: Vec<Arc<dyn ConsumerControl>>, redact: Redaction) -> Router {
    Router::new()
        .route("/api/consumers", get(list))
        .route("/api/consumers/{name}/{action}", post(switch))
        .route("/api/consumers/{name}/dead", get(dead_list))
        .route("/api/consumers/{name}/dead/{action}", post(dead_change))
        .with_state(Consumers {
            all: Arc::new(consumers),
            redact: Arc::new(redact),
        })
}

/// The filters of a dead-letter request (query string or JSON body).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeadParams {
    event_type: Option<String>,
    event_id: Option<String>,
    /// RFC 3339, epoch ms, or a duration ago (`2h`).
    since: Option<String>,
    until: Option<String>,
    error: Option<String>,
    limit: Option<usize>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    all: bool,
}

impl DeadParams {
    fn request(mut self, verb: DeadVerb) -> Result<DeadRequest, ApiError> {
        // An empty field is no filter: `"error": ""` would match every
        // letter, and must not stand in for `"all": true`.
        for field in [
            &mut self.event_type,
            &mut self.event_id,
            &mut self.since,
            &mut self.until,
            &mut self.error,
        ] {
            if field.as_deref().is_some_and(|v| v.trim().is_empty()) {
                *field = None;
            }
        }
        let now = postbox_core::time::now_ms();
        let time = |name: &str, v: Option<String>| {
            v.map(|s| {
                postbox_core::time::parse_time_arg(&s, now)
                    .map_err(|e| ApiError::bad_request(format!("{name}: {e}")))
            })
            .transpose()
        };
        let filtered = self.event_type.is_some()
            || self.event_id.is_some()
            || self.since.is_some()
            || self.until.is_some()
            || self.error.is_some();
        if !matches!(verb, DeadVerb::List(_)) && self.limit.is_some() {
            // Taken for a cap, it was ignored: `"all": true, "limit": 1`
            // purged every dead letter.
            return Err(ApiError::bad_request(
                "`limit` applies to listing only: a replay or purge takes every letter its filter matches (preview it with \"dry_run\": true)",
            ));
        }
        if !matches!(verb, DeadVerb::List(_)) && !filtered && !self.all {
            return Err(ApiError::bad_request(
                "give a filter (event_type, event_id, since, until, error) or \"all\": true to take every dead letter of the consumer",
            ));
        }
        Ok(DeadRequest {
            verb,
            event_type: self.event_type,
            event_id: self.event_id,
            since_ms: time("since", self.since)?,
            until_ms: time("until", self.until)?,
            error: self.error,
            dry_run: self.dry_run,
        })
    }
}

/// `GET /api/consumers/{name}/dead`.
async fn dead_list(
    State(c): State<Consumers>,
    Path(name): Path<String>,
    Query(params): Query<DeadParams>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let consumer = c.named(&name)?;
    let limit = params.limit.unwrap_or(50).min(1_000);
    let request = params.request(DeadVerb::List(limit))?;
    dead_pass(&c, consumer.as_ref(), request).await
}

/// `POST /api/consumers/{name}/dead/replay` or `…/dead/purge`.
async fn dead_change(
    State(c): State<Consumers>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    caller: Option<Extension<Caller>>,
    Path((name, action)): Path<(String, String)>,
    params: Option<Json<DeadParams>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let verb = match action.as_str() {
        "replay" => DeadVerb::Replay,
        "purge" => DeadVerb::Purge,
        _ => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no action `{action}`: POST /api/consumers/{{name}}/dead/replay or /purge"),
            ))
        }
    };
    let consumer = c.named(&name)?;
    let request = params.map(|Json(p)| p).unwrap_or_default().request(verb)?;
    let origin = crate::auth::origin(caller.as_deref(), peer);
    let dry_run = request.dry_run;
    let answer = dead_pass(&c, consumer.as_ref(), request).await?;
    tracing::info!(
        consumer = name,
        origin,
        action,
        dry_run,
        matched = answer["matched"].as_u64().unwrap_or(0),
        done = answer["done"].as_u64().unwrap_or(0),
        "admin API: dead letters {action}"
    );
    Ok(answer)
}

async fn dead_pass(
    c: &Consumers,
    consumer: &dyn ConsumerControl,
    request: DeadRequest,
) -> Result<Json<serde_json::Value>, ApiError> {
    let mut report = consumer
        .dead_letters(request)
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e))?;
    if let Some(letters) = report["letters"].as_array_mut() {
        for l in letters {
            let event_type = l["event_type"].as_str().unwrap_or_default().to_owned();
            if let Some(payload) = l["payload"].as_str() {
                let mut payload = payload.to_owned();
                c.redact.apply_payload(&event_type, &mut payload);
                l["payload"] = payload.into();
            }
        }
    }
    Ok(Json(report))
}

async fn list(State(c): State<Consumers>) -> Json<serde_json::Value> {
    let all: Vec<serde_json::Value> = c.all.iter().map(|c| c.snapshot()).collect();
    Json(serde_json::json!({ "consumers": all }))
}

/// `POST /api/consumers/{name}/pause` or `…/resume`.
async fn switch(
    State(c): State<Consumers>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    caller: Option<Extension<Caller>>,
    Path((name, action)): Path<(String, String)>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let origin = crate::auth::origin(caller.as_deref(), peer);
    let pause = match action.as_str() {
        "pause" => true,
        "resume" => false,
        _ => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no action `{action}`: POST /api/consumers/{{name}}/pause or /resume"),
            ))
        }
    };
    let consumer = c.named(&name)?;
    let changed = if pause {
        consumer.pause()
    } else {
        consumer.resume()
    };
    tracing::info!(
        consumer = name,
        origin,
        action,
        changed,
        "admin API: consumer {action}d"
    );
    let mut shown = consumer.snapshot();
    shown["changed"] = changed.into();
    Ok(Json(shown))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `{"error": ""}` is no filter: a purge or replay with it is refused
    /// without `"all": true` (it took every dead letter before).
    #[test]
    fn an_empty_filter_field_does_not_stand_in_for_all() {
        let params: DeadParams =
            serde_json::from_str(r#"{"error": "", "event_type": " "}"#).unwrap();
        let Err(refused) = params.request(DeadVerb::Purge) else {
            panic!("an empty error filter stood in for all");
        };
        assert!(
            refused.message.contains("\"all\": true"),
            "{}",
            refused.message
        );
        let params: DeadParams = serde_json::from_str(r#"{"error": "timeout"}"#).unwrap();
        assert!(params.request(DeadVerb::Purge).is_ok());
    }

    /// `limit` caps a listing only: on a purge or replay it was ignored,
    /// so `{"all": true, "limit": 1}` purged every letter.
    #[test]
    fn a_limit_on_a_purge_or_replay_is_refused() {
        for verb in [DeadVerb::Purge, DeadVerb::Replay] {
            let params: DeadParams = serde_json::from_str(r#"{"all": true, "limit": 1}"#).unwrap();
            let Err(refused) = params.request(verb) else {
                panic!("a limit taken for a cap");
            };
            assert!(refused.message.contains("`limit`"), "{}", refused.message);
        }
        let params: DeadParams = serde_json::from_str(r#"{"limit": 5}"#).unwrap();
        assert!(params.request(DeadVerb::List(5)).is_ok());
    }
}
