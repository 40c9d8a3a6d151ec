//! Span export (`[tracing] otlp`): OpenTelemetry's SDK with its OTLP/HTTP
//! exporter (protobuf), batching spans on the SDK's own thread so that an
//! unreachable collector never slows the relay or the consumers (a full
//! queue drops spans, it never blocks).

use std::time::Duration;

use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use postbox_core::config::TracingConfig;
use postbox_core::{trace, Error};

/// How long one export to the collector may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`SpanExport::shutdown`] waits to flush what is queued.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// The installed exporter: spans are recorded and exported until
/// [`shutdown`](SpanExport::shutdown).
#[derive(Debug)]
pub struct SpanExport {
    provider: SdkTracerProvider,
}

/// Installs the exporter `config` names as the global tracer provider and
/// turns span recording on ([`trace::set_exporting`]); `None` when
/// `[tracing] otlp` is not set (nothing is installed, nothing recorded).
pub fn start(config: &TracingConfig) -> Result<Option<SpanExport>, Error> {
    let Some(endpoint) = config.traces_endpoint() else {
        return Ok(None);
    };
    // reqwest is built without a bundled crypto provider: postbox uses ring
    // (an https:// collector).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(endpoint)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| Error::config("tracing.otlp", format!("cannot start the exporter: {e}")))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(config.service_name.clone())
                .build(),
        )
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    trace::set_exporting(true);
    tracing::info!(
        otlp = %config.otlp.as_ref().map(ToString::to_string).unwrap_or_default(),
        service_name = %config.service_name,
        "exporting spans"
    );
    Ok(Some(SpanExport { provider }))
}

impl SpanExport {
    /// Stops recording, and exports what is queued (waiting up to 5 s).
    pub async fn shutdown(self) {
        trace::set_exporting(false);
        let provider = self.provider;
        // The SDK blocks while it flushes.
        let flushed = tokio::task::spawn_blocking(move || {
            let result = provider.shutdown_with_timeout(FLUSH_TIMEOUT);
            drop(provider);
            result
        })
        .await;
        match flushed {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "exporting the last spans failed"),
            Err(e) => tracing::warn!(error = %e, "exporting the last spans failed"),
        }
    }
}
