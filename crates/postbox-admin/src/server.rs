//! Binding the listener and serving the routes until shutdown.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use postbox_core::config::{named_tokens, AdminToken, MetricsAccess, Settings};
use postbox_core::redact::Secret;
use postbox_core::store::OutboxStore;
use postbox_core::{Error, Result};

use crate::auth::{self, Access};
use crate::poller::StatsPoller;
use crate::state::AppState;
use crate::{api, dashboard};

/// What the admin server needs besides the store.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// Listen address, `host:port` (port 0 picks a free one).
    pub listen: String,
    /// What set `listen`, named when it cannot be listened on:
    /// `admin.listen`, or `--listen` where a flag overrides the key.
    pub listen_from: &'static str,
    /// An operator token named `admin` (`admin.token`).
    pub token: Option<Secret>,
    /// Named tokens with their roles (`[[admin.tokens]]`). Without any
    /// token, reads are open and changes refused.
    pub tokens: Vec<AdminToken>,
    /// Whether `/metrics` needs a token.
    pub metrics: MetricsAccess,
    /// Payload fields shown as `"***"`, per event type (`[admin.redact]`).
    pub redact: BTreeMap<String, Vec<String>>,
    /// Tenants shown by the gauges, `/api/stats` and the dashboard.
    pub app_codes: Vec<String>,
    /// How often the gauges are refreshed from the database.
    pub poll_interval: Duration,
    /// Names of the configured `[[publishers]]`, the targets a replay can
    /// pick (empty: a replay can only take its default targets or all).
    pub publishers: Vec<String>,
}

impl AdminSettings {
    /// Settings from checked configuration: `[admin]` (or its defaults),
    /// the tenants `app_codes` (empty: `database.app_codes`) and the
    /// `[[publishers]]` names as replay targets, polling every 5 s.
    pub fn from_settings(settings: &Settings, app_codes: Vec<String>) -> Self {
        let admin = settings.admin_or_default();
        AdminSettings {
            listen: admin.listen,
            listen_from: "admin.listen",
            token: Some(admin.token).filter(|t| !t.is_empty()),
            tokens: admin.tokens,
            metrics: admin.metrics,
            redact: admin.redact,
            app_codes: settings.app_codes_or_default(app_codes),
            poll_interval: Duration::from_secs(5),
            publishers: settings
                .publishers
                .iter()
                .map(|p| p.name().to_owned())
                .collect(),
        }
    }
}

/// An admin server bound to its address, not yet serving.
pub struct AdminServer {
    listener: TcpListener,
    state: AppState,
}

impl AdminServer {
    /// Installs the Prometheus recorder (once per process) and binds
    /// `settings.listen`.
    pub fn bind(
        store: Arc<dyn OutboxStore>,
        settings: AdminSettings,
    ) -> postbox_core::BoxFuture<'static, Result<Self>> {
        Box::pin(Self::bind_here(store, settings))
    }

    async fn bind_here(store: Arc<dyn OutboxStore>, settings: AdminSettings) -> Result<Self> {
        let prometheus = crate::recorder::install_recorder()?;
        let listener = crate::listener::listen(&settings.listen, settings.listen_from).await?;
        let token = settings.token.clone().unwrap_or_default();
        let access = Access::new(&named_tokens(&token, &settings.tokens), settings.metrics);
        if access.is_open() {
            tracing::warn!(
                "no admin token is set: anyone who reaches admin.listen reads events and their payloads, and replay and every other change is refused; set admin.token or [[admin.tokens]]"
            );
        }
        let poller = StatsPoller::new(
            store.clone(),
            settings.app_codes.clone(),
            settings.poll_interval,
            Some(prometheus.clone()),
        );
        Ok(AdminServer {
            listener,
            state: AppState {
                store,
                poller,
                prometheus,
                access,
                redact: Arc::new(crate::redact::Redaction::new(settings.redact.clone())),
                publishers: Arc::new(settings.publishers.clone()),
                app_codes: Arc::new(settings.app_codes.clone()),
                topology: None,
                pulse: None,
            },
        })
    }

    /// Also serves `GET /api/topology` from `source`.
    pub fn with_topology(mut self, source: Arc<dyn crate::state::TopologySource>) -> Self {
        self.state.topology = Some(source);
        self
    }

    /// Runs beside a relay: `/healthz` answers 503 while its claim loop
    /// has stalled.
    pub fn with_relay_pulse(mut self, pulse: postbox_core::relay::Pulse) -> Self {
        self.state.pulse = Some(pulse);
        self
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        crate::listener::local_addr(&self.listener)
    }

    /// Serves until `shutdown` is cancelled; polls the gauges meanwhile.
    pub fn run(self, shutdown: CancellationToken) -> postbox_core::BoxFuture<'static, Result<()>> {
        Box::pin(self.run_here(shutdown))
    }

    async fn run_here(self, shutdown: CancellationToken) -> Result<()> {
        let addr = self.local_addr()?;
        // The first figures before the first request.
        self.state.poller.poll_once().await;
        let poll_task = tokio::spawn(self.state.poller.clone().run(shutdown.clone()));
        tracing::info!(%addr, "admin API and dashboard listening on http://{addr}/");
        let app = router(self.state).into_make_service_with_connect_info::<SocketAddr>();
        let served = crate::listener::serve_until(self.listener, app, shutdown.clone()).await;
        shutdown.cancel();
        let _ = poll_task.await;
        served.map_err(|e| Error::Io {
            context: format!("admin server on {addr}"),
            source: e,
        })
    }
}

fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(dashboard::index))
        .route("/dashboard.js", get(dashboard::script))
        .route("/dashboard.css", get(dashboard::style))
        .route("/healthz", get(api::relay_healthz))
        .route("/metrics", get(api::metrics))
        .route("/api/stats", get(api::stats))
        .route("/api/publishers", get(api::publishers))
        .route("/api/topology", get(api::topology))
        .route("/api/relays", get(api::relays))
        .route("/api/events", get(api::list))
        .route("/api/events/{event_id}", get(api::show))
        .route("/api/events/{event_id}/replay", post(api::replay))
        .route("/api/replay", post(api::replay_filtered))
        .route("/api/controls", get(api::controls).post(api::set_control))
        .layer(middleware::from_fn(answer_within))
        .layer(middleware::from_fn_with_state(
            state.access.clone(),
            auth::guard,
        ))
        .with_state(state)
}

/// How long a call may take, its database statements included.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// Gives a call up after [`ANSWER_WITHIN`]: a database gone silent (a
/// failover whose old primary vanished, a frozen host) answered no
/// statement, and every call waiting on it held a connection of the pool
/// (the relay's own, under `postbox relay`) for good, while the dashboard
/// sent more every few seconds.
async fn answer_within(
    req: axum::extract::Request,
    next: middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    match tokio::time::timeout(ANSWER_WITHIN, next.run(req)).await {
        Ok(res) => res,
        Err(_) => {
            tracing::warn!(%method, path, "admin API: no answer within {}s; the call was given up", ANSWER_WITHIN.as_secs());
            let reads = method == axum::http::Method::GET || method == axum::http::Method::HEAD;
            let after = if reads {
                ""
            } else {
                "; the change may have been made all the same: look before trying again"
            };
            crate::error::ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "no answer within {}s (the database is slow or not answering); the call was given up{after}",
                    ANSWER_WITHIN.as_secs()
                ),
            )
            .into_response()
        }
    }
}
