//! One file per command.

pub mod adopt;
pub mod archive;
pub mod consume;
pub mod consumers;
pub mod control;
pub mod dead;
pub mod doctor;
pub mod enqueue;
pub mod events;
pub mod lint_sql;
pub mod migrate;
pub mod quickstart;
pub mod relay;
pub mod relays;
pub mod replay;
pub mod scans;
pub mod serve;
pub mod status;
pub mod topology;
