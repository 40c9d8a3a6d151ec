//! The state every handler shares, apart from the server that builds it
//! and the handlers that read it.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;
use postbox_core::store::OutboxStore;

use crate::auth::TokenCheck;
use crate::poller::StatsPoller;

/// Shared by every handler.
#[derive(Clone)]
pub(crate) struct AppState {
    pub store: Arc<dyn OutboxStore>,
    pub poller: StatsPoller,
    pub prometheus: PrometheusHandle,
    pub token: TokenCheck,
    /// Configured publisher names (replay targets).
    pub publishers: Arc<Vec<String>>,
    /// The tenants served (where archived rows are looked up).
    pub app_codes: Arc<Vec<String>>,
}
