//! `postbox dead` on Redis Streams: a pass over `<stream>.dead`, the
//! entries of this consumer's group (the dead stream is shared by every
//! group of the stream; other groups' entries are left alone and not
//! counted).
//!
//! The entries are read in pages (`XRANGE`), up to the last entry when the
//! pass began. A replay adds the entry back to `<stream>` and deletes the
//! dead one in one `MULTI`/`EXEC`, so it is either replayed or still dead;
//! a purge deletes it (`XDEL`). A letter's `position` is its entry id.

use std::collections::HashMap;

use redis::aio::ConnectionManager;
use redis::streams::StreamRangeReply;
use redis::Value;

use postbox_core::wire::redis::{dead_stream, CONSUMER_GROUP, PAYLOAD};

use super::message::{fields_with, headers_of, message_from_entry, text};
use super::topology::connect;
use crate::dead::letter::{replay_headers, DeadAction, DeadLetter, DeadReport, Failed, Pass};

/// Entries read per `XRANGE`.
const PAGE: usize = 200;

pub(crate) async fn run(pass: &Pass<'_>) -> Result<DeadReport, Failed> {
    let dead = dead_stream(&pass.config.queue);
    let mut conn = connect(pass.config.url.expose(), std::time::Duration::ZERO)
        .await
        .map_err(|e| (dead.clone(), format!("connecting: {e}")))?;
    pass_over(&mut conn, pass, &dead)
        .await
        .map_err(|e| (dead, e))
}

async fn pass_over(
    conn: &mut ConnectionManager,
    pass: &Pass<'_>,
    dead: &str,
) -> Result<DeadReport, String> {
    let group = pass.config.consumer_group();
    let mut report = DeadReport::new(format!("{dead} (group {group})"));
    let last: StreamRangeReply = redis::cmd("XREVRANGE")
        .arg(dead)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await
        .map_err(|e| format!("reading: {e}"))?;
    let Some(last) = last.ids.into_iter().next().map(|e| e.id) else {
        return Ok(pass.finished(report));
    };
    let mut from = "-".to_owned();
    loop {
        let page: StreamRangeReply = redis::cmd("XRANGE")
            .arg(dead)
            .arg(&from)
            .arg(&last)
            .arg("COUNT")
            .arg(PAGE)
            .query_async(conn)
            .await
            .map_err(|e| format!("reading: {e}"))?;
        let n = page.ids.len();
        for entry in page.ids {
            from = format!("({}", entry.id);
            if text(&entry.map, CONSUMER_GROUP).as_deref() != Some(group) {
                continue;
            }
            let letter = letter_of(&entry.id, &entry.map);
            if report.saw(&letter, pass.filter, pass.action) && pass.writes() {
                let mut tx = redis::pipe();
                tx.atomic();
                if pass.action == DeadAction::Replay {
                    let xadd = tx.cmd("XADD").arg(&pass.config.queue).arg("*");
                    let fields = fields_with(&entry.map, replay_headers(headers_of(&entry.map)));
                    for (k, v) in fields {
                        xadd.arg(k).arg(v);
                    }
                }
                tx.cmd("XDEL").arg(dead).arg(&entry.id);
                let _: Vec<Value> = tx
                    .query_async(conn)
                    .await
                    .map_err(|e| format!("{}: {e}", entry.id))?;
                report.done += 1;
            }
            if pass.stops_after(&report) {
                return Ok(report);
            }
        }
        if n < PAGE {
            break;
        }
    }
    Ok(pass.finished(report))
}

fn letter_of(id: &str, fields: &HashMap<String, Value>) -> DeadLetter {
    let payload = text(fields, PAYLOAD).unwrap_or_default();
    // An entry id is `<ms>-<seq>`.
    let time_ms = id.split('-').next().and_then(|ms| ms.parse().ok());
    DeadLetter::of(
        id.to_owned(),
        message_from_entry(fields, 1).map(|m| m.envelope),
        headers_of(fields),
        payload.as_bytes(),
        time_ms,
    )
}
