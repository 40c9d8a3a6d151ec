//! Outbox rows for unit tests of code that reads them (publishers' message
//! mapping, the admin API's timeline).

use postbox_core::{EventRecord, Status};

/// A claimed row: event `e{id}` of type `RoomCreated` of tenant `room`, on
/// aggregate `r1` at version `id`, with a `trace` header, on its second
/// attempt after one replay, created at epoch ms 5.
pub fn room_created(id: i64) -> EventRecord {
    EventRecord {
        id,
        app_code: "room".into(),
        event_id: format!("e{id}"),
        event_type: "RoomCreated".into(),
        aggregate_id: Some("r1".into()),
        aggregate_version: Some(id),
        payload: r#"{"room":1}"#.into(),
        headers: Some(r#"{"trace":"t"}"#.into()),
        status: Status::Delivering,
        retry_count: 1,
        replay_count: 1,
        created_at_ms: 5,
        updated_at_ms: 5,
        ..Default::default()
    }
}
