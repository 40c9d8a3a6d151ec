//! The process-wide Prometheus recorder.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use postbox_core::metrics as m;
use postbox_core::{Error, Result};

/// Publish calls: from a local file append to a slow broker confirm.
const PUBLISH_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Created → delivered: from a relay keeping up to an hour-long outage.
const LAG_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the global `metrics` recorder (once
/// per process; later calls return the same handle) and describes every
/// postbox metric. Histograms are exported with buckets.
///
/// Fails when another global recorder was installed first.
pub fn install_recorder() -> Result<PrometheusHandle> {
    // One install at a time: a thread that lost the race would otherwise
    // find the global recorder set but the handle not stored yet.
    static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _installing = INSTALLING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let refused = |e: metrics_exporter_prometheus::BuildError| {
        Error::config(
            "admin",
            format!("cannot install the Prometheus recorder: {e}"),
        )
    };
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(m::PUBLISH_DURATION_SECONDS.to_owned()),
            PUBLISH_BUCKETS,
        )
        .map_err(refused)?
        .set_buckets_for_metric(
            Matcher::Full(m::DELIVERY_LAG_SECONDS.to_owned()),
            LAG_BUCKETS,
        )
        .map_err(refused)?
        .set_buckets_for_metric(
            Matcher::Full(m::CONSUME_HANDLER_SECONDS.to_owned()),
            PUBLISH_BUCKETS,
        )
        .map_err(refused)?
        .build_recorder();
    let handle = recorder.handle();
    match metrics::set_global_recorder(recorder) {
        Ok(()) => {
            m::describe();
            Ok(HANDLE.get_or_init(|| handle).clone())
        }
        Err(e) => HANDLE.get().cloned().ok_or_else(|| {
            Error::config(
                "admin",
                format!("cannot install the Prometheus recorder: {e}"),
            )
        }),
    }
}

/// The Prometheus text exposition of `prometheus`.
pub(crate) fn render(prometheus: &PrometheusHandle) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        prometheus.render(),
    )
        .into_response()
}
