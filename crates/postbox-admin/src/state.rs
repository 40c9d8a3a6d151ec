//! The state every handler shares, apart from the server that builds it
//! and the handlers that read it.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;
use postbox_core::store::OutboxStore;

use crate::auth::Access;
use crate::poller::StatsPoller;
use crate::redact::Redaction;

/// Shared by every handler.
#[derive(Clone)]
pub(crate) struct AppState {
    pub store: Arc<dyn OutboxStore>,
    pub poller: StatsPoller,
    pub prometheus: PrometheusHandle,
    /// Who may call what (checked by `auth::guard` before any handler).
    pub access: Access,
    /// Payload fields masked in every event shown.
    pub redact: Arc<Redaction>,
    /// Configured publisher names (replay targets).
    pub publishers: Arc<Vec<String>>,
    /// The tenants served (where archived rows are looked up).
    pub app_codes: Arc<Vec<String>>,
    /// Who publishes what and who consumes it (`/api/topology`), when the
    /// server was given the config's publishers and consumers.
    pub topology: Option<Arc<dyn TopologySource>>,
    /// The claim loop of the relay this server runs beside, whose stall
    /// `/healthz` reports.
    pub pulse: Option<postbox_core::relay::Pulse>,
}

/// Gathers the topology (`postbox_runtime::topology`) for `/api/topology`.
pub trait TopologySource: Send + Sync + 'static {
    /// The topology as JSON, or why it could not be read.
    fn topology(&self) -> postbox_core::BoxFuture<'_, Result<serde_json::Value, String>>;
}
