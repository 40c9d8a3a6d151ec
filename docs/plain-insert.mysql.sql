INSERT INTO room_outbox (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers)
VALUES (?, ?, ?, ?, ?, ?, ?)
