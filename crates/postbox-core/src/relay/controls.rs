//! The relay's copy of the runtime controls ([`crate::control`]): read
//! from the store by the claimer before it claims, at most once per
//! [`REFRESH`] (an idle relay reads nothing), and shared with the publish
//! stage, which takes each row's retry rules from it.

use std::sync::{Arc, RwLock};
use std::time::Instant;

use crate::control::{Controls, REFRESH};
use crate::store::RelayStore;

/// Shared by the claimer (which refreshes it) and the publish stage.
#[derive(Clone, Default)]
pub(super) struct ControlView {
    inner: Arc<RwLock<View>>,
}

#[derive(Default)]
struct View {
    controls: Controls,
    read_at: Option<Instant>,
    /// Failed reads in a row (logged once per streak).
    failures: u32,
}

impl ControlView {
    /// The controls as last read.
    pub fn get(&self) -> Controls {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .controls
            .clone()
    }

    /// Reads the controls again when the copy is older than [`REFRESH`]. A
    /// failed read keeps the copy (logged once per streak of failures).
    pub async fn refresh(&self, store: &dyn RelayStore) {
        let stale = self
            .inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .read_at
            .is_none_or(|t| t.elapsed() >= REFRESH);
        if !stale {
            return;
        }
        let read = store.controls().await;
        let mut view = self.inner.write().unwrap_or_else(|p| p.into_inner());
        view.read_at = Some(Instant::now());
        match read {
            Ok(all) => {
                let fresh = Controls::new(all);
                if fresh != view.controls {
                    tracing::info!(controls = ?fresh.all(), "runtime controls changed");
                }
                view.controls = fresh;
                view.failures = 0;
            }
            Err(e) => {
                view.failures += 1;
                if view.failures == 1 {
                    tracing::warn!(error = %e, "could not read the runtime controls (run `postbox migrate` for schema version 9); the last ones read stay in force");
                }
            }
        }
    }
}
