//! The integration tests of `postbox-cli`, linked as one binary (`cargo test -p postbox-cli --test it`):
//! one module per area, so the suite links a handful of binaries, not one per file.

mod common;

mod adopt;
mod archive;
mod cli;
mod clusters;
mod consume;
mod control;
mod dashboard;
mod deploy;
mod docs_zh;
mod doctor;
mod printed_sql;
mod relay_hosts;
mod relay_processes;
mod relays;
mod topology;
mod tracing;
