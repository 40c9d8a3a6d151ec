//! `/healthz` and `/metrics` alone, for a process without an outbox table
//! (`postbox consume`).

use std::net::SocketAddr;

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use postbox_core::{Error, Result};

/// Serves `/healthz` and the Prometheus `/metrics` of this process.
#[derive(Debug)]
pub struct MetricsServer {
    listener: TcpListener,
    prometheus: PrometheusHandle,
}

impl MetricsServer {
    /// Installs the Prometheus recorder (once per process) and binds
    /// `listen` (`host:port`, the key `admin.listen`).
    pub async fn bind(listen: &str) -> Result<Self> {
        let prometheus = crate::recorder::install_recorder()?;
        let listener = crate::listener::listen(listen).await?;
        Ok(MetricsServer {
            listener,
            prometheus,
        })
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
        let app = Router::new()
            .route("/healthz", get(crate::api::healthz))
            .route(
                "/metrics",
                get(async move || crate::recorder::render(&prometheus)),
            );
        axum::serve(self.listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
            .map_err(|e| Error::Io {
                context: format!("metrics server on {addr}"),
                source: e,
            })
    }
}
