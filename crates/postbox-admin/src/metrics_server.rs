//! `/healthz`, `/metrics`, the consumers' API and the dashboard (its
//! consumers part), for a process without an outbox table (`postbox
//! consume`).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use postbox_core::config::AdminConfig;
use postbox_core::{Error, Result};

use crate::auth::{self, Access};
use crate::consumers_api::{self, ConsumerControl};

/// How often the recorder's upkeep runs (the stats poller's interval).
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves `/healthz`, the Prometheus `/metrics` of this process and, with
/// [`MetricsServer::with_consumers`], `/api/consumers`.
pub struct MetricsServer {
    listener: TcpListener,
    prometheus: PrometheusHandle,
    consumers: Vec<Arc<dyn ConsumerControl>>,
    access: Access,
    redact: std::collections::BTreeMap<String, Vec<String>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("listener", &self.listener)
            .field("consumers", &self.consumers.len())
            .finish_non_exhaustive()
    }
}

impl MetricsServer {
    /// Installs the Prometheus recorder (once per process) and binds
    /// `listen` (`host:port`, the key `admin.listen`).
    pub async fn bind(listen: &str) -> Result<Self> {
        let prometheus = crate::recorder::install_recorder()?;
        let listener = crate::listener::listen(listen, "admin.listen").await?;
        Ok(MetricsServer {
            listener,
            prometheus,
            consumers: Vec::new(),
            access: Access::of(&AdminConfig::default()),
            redact: Default::default(),
        })
    }

    /// Also serves `GET /api/consumers`, `POST
    /// /api/consumers/{name}/pause|resume` and the dead letters' routes
    /// over `consumers` (payloads masked by `admin.redact`), with the
    /// tokens and the `/metrics` rule of `admin` (the same as the outbox
    /// admin server's: a viewer lists, an operator switches).
    pub fn with_consumers(
        mut self,
        consumers: Vec<Arc<dyn ConsumerControl>>,
        admin: &AdminConfig,
    ) -> Self {
        self.consumers = consumers;
        self.access = Access::of(admin);
        self.redact = admin.redact.clone();
        self
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        crate::listener::local_addr(&self.listener)
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let addr = self.local_addr()?;
        tracing::info!(%addr, "metrics listening on http://{addr}/metrics");
        let prometheus = self.prometheus;
        // Histogram samples pile up in the recorder until a scrape or an
        // upkeep drains them: with nobody scraping (`[admin]` set for its
        // pause/resume), one sample per handled message, for good. The
        // relay's stats poller runs the upkeep; here this task does.
        let upkeep = tokio::spawn({
            let prometheus = prometheus.clone();
            let shutdown = shutdown.clone();
            async move {
                let mut every = tokio::time::interval(UPKEEP_EVERY);
                loop {
                    tokio::select! {
                        _ = every.tick() => prometheus.run_upkeep(),
                        _ = shutdown.cancelled() => return,
                    }
                }
            }
        });
        let app = Router::new()
            .route("/", get(crate::dashboard::index))
            .route("/dashboard.js", get(crate::dashboard::script))
            .route("/dashboard.css", get(crate::dashboard::style))
            .route("/healthz", get(crate::api::healthz))
            .route(
                "/metrics",
                get(async move || crate::recorder::render(&prometheus)),
            )
            .merge(consumers_api::routes(
                self.consumers,
                crate::redact::Redaction::new(self.redact),
            ))
            .layer(axum::middleware::from_fn_with_state(
                self.access,
                auth::guard,
            ))
            .into_make_service_with_connect_info::<SocketAddr>();
        let served = crate::listener::serve_until(self.listener, app, shutdown)
            .await
            .map_err(|e| Error::Io {
                context: format!("metrics server on {addr}"),
                source: e,
            });
        upkeep.abort();
        served
    }
}
