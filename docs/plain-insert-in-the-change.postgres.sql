WITH changed AS (
  UPDATE accounts SET balance = balance + 1, version = version + 1 WHERE id = $1
  RETURNING id, version
)
INSERT INTO room_outbox (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers)
SELECT $2, $3, $4, 'acct-' || id, version, $5, $6 FROM changed
