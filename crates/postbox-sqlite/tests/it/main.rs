//! The integration tests of `postbox-sqlite`, linked as one binary (`cargo test -p postbox-sqlite --test it`):
//! one module per area, so the suite links a handful of binaries, not one per file.

mod conformance;
mod sqlite_backend;
