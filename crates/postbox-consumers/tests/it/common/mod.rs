//! Shared helpers of the consumer tests: a RabbitMQ connection, scratch
//! queues, publishing events the way the relay does, a consumer config, and
//! the effect an inbox handler writes.
#![allow(dead_code)]

use async_trait::async_trait;
use lapin::Channel;
use postbox_consumers::inbox::TxHandler;
use postbox_consumers::{HandlerError, Message};
use postbox_core::config::{ConsumerConfig, ConsumerKind, HumanDuration};
use postbox_core::redact::SecretUrl;
pub use postbox_testkit::consumer_fixtures::{broker, ready, wait_until};
use postbox_testkit::consumer_fixtures::{delete_queues, AmqpEvent};
use postbox_testkit::servers::{amqp_url, scratch_name};

/// A queue name no other test uses.
pub fn scratch_queue(prefix: &str) -> String {
    scratch_name(prefix)
}

/// A consumer of `queue` that declares its topology.
pub fn consumer_config(queue: &str) -> ConsumerConfig {
    ConsumerConfig {
        kind: ConsumerKind::Rabbitmq,
        name: None,
        url: SecretUrl::new(amqp_url()),
        urls: Vec::new(),
        queue_type: Default::default(),
        queue: queue.to_owned(),
        bindings: vec![],
        declare: true,
        prefetch: 1,
        max_attempts: 5,
        retry_delay: HumanDuration::millis(200),
        max_retry_delay: HumanDuration::secs(5),
        consumer_group: None,
        handler: None,
        inbox: None,
        inbox_retention: HumanDuration::secs(7 * 86_400),
        ordering: postbox_core::config::Ordering::None,
        subject: None,
        dead_subject: None,
        ack_wait: HumanDuration::secs(30),
    }
}

/// Declares `queue` and its twins as the consumer would.
pub async fn declare(ch: &Channel, queue: &str) {
    postbox_consumers::rabbitmq::declare_topology(ch, &consumer_config(queue))
        .await
        .unwrap();
}

/// Publishes one event to `queue` through the default exchange with the
/// relay's mapping (SPEC §4), and waits for the confirm.
pub async fn publish(
    ch: &Channel,
    queue: &str,
    event_id: &str,
    aggregate: Option<(&str, i64)>,
    payload: &str,
) {
    AmqpEvent {
        event_id,
        event_type: "TestEvent",
        app_code: "test",
        created_at_ms: postbox_core::time::now_ms(),
        aggregate_id: aggregate.map(|a| a.0),
        aggregate_version: aggregate.map(|a| a.1),
    }
    .publish(ch, queue, payload)
    .await;
}

/// Deletes `queue` and its twins.
pub async fn delete(ch: &Channel, queue: &str) {
    delete_queues(ch, queue).await;
}

/// The inbox transaction a [`TxHandler`] on database `DB` writes through.
pub type Tx<DB> = sqlx::Transaction<'static, DB>;

/// The effect of an inbox handler: writes the event id to `table` inside the
/// inbox transaction, then fails if `fail` (the rollback must undo the write).
pub struct EffectRow {
    pub table: String,
    pub fail: bool,
}

impl EffectRow {
    /// An effect that succeeds.
    pub fn new(table: impl Into<String>) -> Self {
        EffectRow {
            table: table.into(),
            fail: false,
        }
    }
}

/// [`EffectRow`] on database `$db`, whose first bind parameter is
/// `$placeholder`.
macro_rules! effect_row {
    ($db:ty, $placeholder:literal) => {
        #[async_trait]
        impl TxHandler<$db> for EffectRow {
            async fn handle(&self, tx: &mut Tx<$db>, m: &Message) -> Result<(), HandlerError> {
                let insert = format!(
                    concat!("INSERT INTO {} (event_id) VALUES (", $placeholder, ")"),
                    self.table
                );
                sqlx::query(&insert)
                    .bind(m.event_id())
                    .execute(&mut **tx)
                    .await
                    .map_err(HandlerError::new)?;
                if self.fail {
                    return Err(HandlerError::new("downstream said no"));
                }
                Ok(())
            }
        }
    };
}

effect_row!(sqlx::Postgres, "$1");
effect_row!(sqlx::MySql, "?");
effect_row!(sqlx::Sqlite, "?");
