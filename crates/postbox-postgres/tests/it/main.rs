//! The integration tests of `postbox-postgres`, linked as one binary (`cargo test -p postbox-postgres --test it`):
//! one module per area, so the suite links a handful of binaries, not one per file.

mod adopted;
mod claim_plans;
mod crash;
mod partitioned;
mod poison_log;
mod postgres;
mod wake;
