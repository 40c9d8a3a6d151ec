//! The integration tests of `postbox-consumers`, linked as one binary (`cargo test -p postbox-consumers --test it`):
//! one module per area, so the suite links a handful of binaries, not one per file.

mod common;
#[macro_use]
mod nats_redis_suite;

mod dead_letters;
mod inbox;
mod kill;
mod metrics;
mod nats_consumer;
mod rabbitmq;
mod redis_consumer;
