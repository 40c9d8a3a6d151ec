//! `<queue>`, `<queue>.retry`, `<queue>.dead` and the bindings.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};
use postbox_core::config::ConsumerConfig;

/// `<queue>.retry`: where a failed message waits for its delay.
pub fn retry_queue(queue: &str) -> String {
    format!("{queue}.retry")
}

/// `<queue>.dead`: where a message goes after `max_attempts`.
pub fn dead_queue(queue: &str) -> String {
    format!("{queue}.dead")
}

/// Declares the queue, its retry and dead twins and its bindings (exchanges
/// are declared as durable `topic` exchanges, as the RabbitMQ publisher
/// declares them). Idempotent; a queue that exists with other arguments is
/// an error from the broker.
pub async fn declare_topology(channel: &Channel, config: &ConsumerConfig) -> lapin::Result<()> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let queue = config.queue.as_str();
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await?;
    let mut retry_args = FieldTable::default();
    // Expired copies go back to <queue> through the default exchange.
    retry_args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from("")),
    );
    retry_args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(LongString::from(queue)),
    );
    channel
        .queue_declare(retry_queue(queue).into(), durable, retry_args)
        .await?;
    channel
        .queue_declare(dead_queue(queue).into(), durable, FieldTable::default())
        .await?;
    for b in &config.bindings {
        channel
            .exchange_declare(
                b.exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                queue.into(),
                b.exchange.as_str().into(),
                b.routing_key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}
