//! The integration tests of `postbox-mysql`, linked as one binary (`cargo test -p postbox-mysql --test it`):
//! one module per area, so the suite links a handful of binaries, not one per file.

mod adopted;
mod claim_plans;
mod conformance;
mod mysql_backend;
