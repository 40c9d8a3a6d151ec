//! The integration tests of `postbox-publishers`, linked as one binary (`cargo test -p postbox-publishers --test it`):
//! one module per area, so the suite links a handful of binaries, not one per file.

mod rabbitmq_support;

mod fanout;
mod file_suite;
mod nats_publisher;
mod rabbitmq_faults;
mod rabbitmq_suite;
mod rabbitmq_tls;
mod redis_publisher;
mod webhook_publisher;
