UPDATE accounts SET balance = balance + 1, version = version + 1 WHERE id = ? AND version = ?;
INSERT INTO room_outbox (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers)
SELECT ?, ?, ?, ?, ?, ?, ? FROM DUAL WHERE ROW_COUNT() > 0
