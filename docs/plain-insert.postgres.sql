INSERT INTO room_outbox (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers)
VALUES ($1, $2, $3, $4, $5, $6, $7)
