//! Helpers the unit tests of this crate share.

use postbox_core::config::{Config, Settings};
use postbox_core::Error;

/// Checked settings from a config written as JSON (same keys as the TOML).
pub(crate) fn settings(toml_like: serde_json::Value) -> Settings {
    let config: Config = serde_json::from_value(toml_like).unwrap();
    config.validate().unwrap()
}

/// The key a config error names; panics on any other error.
pub(crate) fn key_of(e: Error) -> String {
    match e {
        Error::Config { key, .. } => key,
        other => panic!("expected a config error, got {other:?}"),
    }
}
