//! The consumers of a `postbox consume` process, over HTTP:
//!
//! - `GET /api/consumers`: each consumer's name, kind, queue, state
//!   (`consuming`, `paused`, `connecting`) and what it settled;
//! - `POST /api/consumers/{name}/pause` and `…/resume` (bearer token):
//!   stop or restart taking messages. The answer is the consumer as it is
//!   then, with `changed: false` when it already was so.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};

use crate::auth::Caller;
use crate::error::ApiError;

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
}

#[derive(Clone)]
struct Consumers {
    all: Arc<Vec<Arc<dyn ConsumerControl>>>,
}

/// The routes over `consumers` (the caller's token is checked by
/// `auth::guard` in front of them: a viewer lists, an operator switches).
pub(crate) fn routes(consumers: Vec<Arc<dyn ConsumerControl>>) -> Router {
    Router::new()
        .route("/api/consumers", get(list))
        .route("/api/consumers/{name}/{action}", post(switch))
        .with_state(Consumers {
            all: Arc::new(consumers),
        })
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
    let Some(consumer) = c.all.iter().find(|c| c.name() == name) else {
        let known: Vec<&str> = c.all.iter().map(|c| c.name()).collect();
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no consumer `{name}` in this process (it runs: {})",
                known.join(", ")
            ),
        ));
    };
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
