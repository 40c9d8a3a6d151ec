//! `postbox dead` on RabbitMQ: a pass over `<queue>.dead`.
//!
//! The letters are read with `basic.get` without acking, as many as the
//! queue held when the pass began (a letter dead-lettered meanwhile waits
//! for the next pass). A letter the pass takes is acked once it is done
//! with (replayed and confirmed, or purged); every other one stays unacked
//! until the pass closes its channel, when the broker puts them back in
//! their places. RabbitMQ has no id for a message, so a letter's
//! `position` is its place in the queue at the time of reading.
//!
//! Every step waits for the broker at most [`STEP_WITHIN`], and no longer
//! than the connection lives: a broker that stops answering, or a reply
//! lapin never hands over, ends the pass with an error naming the step.
//! Passes over one consumer's letters run one at a time, so a pass left
//! waiting would hold every later one (the dashboard's, `postbox dead`'s)
//! for good.
//!
//! A replay takes an event once per pass. A replayed letter the handler
//! refuses again comes back to the end of `<queue>.dead` while the pass
//! still reads, and is read in place of a letter the broker has not put
//! back yet (one an earlier pass held, say): that copy is the new failure,
//! left where it is, not replayed again.

use std::collections::HashSet;
use std::future::Future;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};

use super::message::{confirmed, headers_json, message_from_delivery, replay_properties};
use super::{unless_lost, STEP_WITHIN};
use crate::dead::letter::{DeadAction, DeadLetter, DeadReport, Failed, Pass};
use postbox_core::wire::rabbitmq::dead_queue;

/// `work`, `doing` on the broker: its result, or why it failed, or that the
/// connection was lost or the broker gave no answer within [`STEP_WITHIN`].
async fn step<T, E: std::fmt::Display>(
    conn: &Connection,
    doing: impl std::fmt::Display,
    work: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(STEP_WITHIN, unless_lost(conn, work)).await {
        Ok(Some(Ok(done))) => Ok(done),
        Ok(Some(Err(e))) => Err(format!("{doing}: {e}")),
        Ok(None) => Err(format!("{doing}: the connection was lost")),
        Err(_) => Err(format!(
            "{doing}: no answer from the broker within {STEP_WITHIN:?}"
        )),
    }
}

pub(crate) async fn run(pass: &Pass<'_>) -> Result<DeadReport, Failed> {
    let queue = pass.config.queue.clone();
    let dead = dead_queue(&queue);
    let props = ConnectionProperties::default().with_connection_name(
        format!("postbox-dead-{}", crate::consume::consumer_tag(&queue)).into(),
    );
    let (conn, _) = super::connect(pass.config.nodes(), 0, props)
        .await
        .map_err(|e| (dead.clone(), format!("connecting: {e}")))?;
    let result = match open_channels(&conn).await {
        Ok((reading, publishing)) => {
            let result = pass_over(&conn, pass, &queue, &dead, &reading, &publishing).await;
            // Letters read and not taken go back to their places with the
            // channel. Closed before the connection: dropped, they were
            // still closing when it closed, and lapin logged "ERROR
            // Connection error: invalid channel state: Closing" after every
            // pass that worked.
            let closing = futures::future::join(
                reading.close(200, "dead-letter pass done".into()),
                publishing.close(200, "dead-letter pass done".into()),
            );
            let _ = tokio::time::timeout(closing_within(&result), closing).await;
            result
        }
        Err(e) => Err(e),
    };
    // Bounded by time, not by the connection's loss (a closing connection
    // is no longer connected). A close the broker does not answer is given
    // up: the connection, once dropped, goes down with its socket.
    let within = closing_within(&result);
    let closing = conn.close(200, "dead-letter pass done".into());
    let _ = tokio::time::timeout(within, closing).await;
    result.map_err(|e| (dead, e))
}

/// How long closing waits for the broker: after a failed step it is not
/// waited for again.
fn closing_within<T>(result: &Result<T, String>) -> std::time::Duration {
    if result.is_ok() {
        STEP_WITHIN
    } else {
        std::time::Duration::from_secs(1)
    }
}

/// The pass's two channels: one reading the letters, one publishing
/// replays with confirms.
async fn open_channels(conn: &Connection) -> Result<(Channel, Channel), String> {
    let reading = step(conn, "opening a channel", conn.create_channel()).await?;
    let publishing = async {
        let publishing = step(conn, "opening a channel", conn.create_channel()).await?;
        step(
            conn,
            "opening a channel",
            publishing.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(publishing)
    };
    match publishing.await {
        Ok(publishing) => Ok((reading, publishing)),
        Err(e) => {
            // Closed before the connection, as the pass's channels are.
            let closing = reading.close(200, "dead-letter pass failed".into());
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), closing).await;
            Err(e)
        }
    }
}

async fn pass_over(
    conn: &Connection,
    pass: &Pass<'_>,
    queue: &str,
    dead: &str,
    reading: &Channel,
    publishing: &Channel,
) -> Result<DeadReport, String> {
    let declared = reading.queue_declare(
        dead.into(),
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    );
    let held = match step(conn, "counting the letters", declared).await {
        Ok(queue) => queue.message_count(),
        Err(e) if e.contains("NOT_FOUND") => {
            return Err(format!(
                "{dead} does not exist ({e}); is the consumer declared?"
            ))
        }
        Err(e) => return Err(e),
    };
    let mut report = DeadReport::new(dead.to_owned());
    let mut replayed: HashSet<String> = HashSet::new();
    for place in 1..=u64::from(held) {
        let get = reading.basic_get(dead.into(), BasicGetOptions { no_ack: false });
        let Some(got) = step(conn, "reading", get).await? else {
            break;
        };
        let d = got.delivery;
        let parsed = message_from_delivery(&d.properties, d.routing_key.as_str(), &d.data, false)
            .map(|m| m.envelope);
        let letter = DeadLetter::of(
            place.to_string(),
            parsed,
            headers_json(&d.properties),
            &d.data,
            None,
        );
        let again = |id: &String| pass.action == DeadAction::Replay && replayed.contains(id);
        if letter.event_id.as_ref().is_some_and(again) {
            // Back from this pass's own replay: read, not taken.
            report.scanned += 1;
        } else if report.saw(&letter, pass.filter, pass.action) && pass.writes() {
            if pass.action == DeadAction::Replay {
                let published = publishing.basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &d.data,
                    replay_properties(&d.properties),
                );
                let published = step(conn, format!("replaying to {queue}"), published).await?;
                let confirm = step(conn, format!("confirm from {queue}"), published).await?;
                confirmed(confirm, queue)?;
            }
            let ack = d.acker.ack(BasicAckOptions::default());
            step(conn, format!("removing the letter at {place}"), ack).await?;
            report.done += 1;
            if pass.action == DeadAction::Replay {
                replayed.extend(letter.event_id);
            }
        }
        if pass.stops_after(&report) {
            return Ok(report);
        }
    }
    Ok(pass.finished(report))
}
