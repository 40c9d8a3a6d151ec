//! The integration tests of `postbox-admin`, linked as one binary (`cargo test -p postbox-admin --test it`):
//! one module per area, so the suite links a handful of binaries, not one per file.

mod api;
mod metrics;
