//! PostgreSQL inbox statements.

use super::sql::Dialect;

/// PostgreSQL. `migrate` takes a transaction-level advisory lock first, so
/// consumers starting together do not race on `CREATE TABLE IF NOT EXISTS`.
pub(crate) const DIALECT: Dialect = Dialect {
    create: &[
        "SELECT pg_advisory_xact_lock(hashtext('postbox_inbox_migrate'))",
        "CREATE TABLE IF NOT EXISTS {table} (
            consumer_group VARCHAR(128) NOT NULL,
            event_id VARCHAR(64) NOT NULL,
            created_at_ms BIGINT NOT NULL,
            PRIMARY KEY (consumer_group, event_id))",
        "CREATE INDEX IF NOT EXISTS {table}_created_idx ON {table} (created_at_ms)",
        "CREATE TABLE IF NOT EXISTS {table}_versions (
            consumer_group VARCHAR(128) NOT NULL,
            aggregate_id VARCHAR(128) NOT NULL,
            aggregate_version BIGINT NOT NULL,
            updated_at_ms BIGINT NOT NULL,
            PRIMARY KEY (consumer_group, aggregate_id))",
        "CREATE INDEX IF NOT EXISTS {table}_versions_updated_idx ON {table}_versions (updated_at_ms)",
    ],
    // primary key
    insert_event: "INSERT INTO {table} (consumer_group, event_id, created_at_ms) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    has_event: "SELECT COUNT(*) FROM {table} WHERE consumer_group = $1 AND event_id = $2",
    // primary key of _versions
    insert_version: "INSERT INTO {table}_versions (consumer_group, aggregate_id, aggregate_version, updated_at_ms) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    // primary key of _versions
    lock_version: "SELECT aggregate_version FROM {table}_versions WHERE consumer_group = $1 AND aggregate_id = $2 FOR UPDATE",
    // primary key of _versions
    update_version: "UPDATE {table}_versions SET aggregate_version = $1, updated_at_ms = $2 WHERE consumer_group = $3 AND aggregate_id = $4",
    // {table}_created_idx
    purge_events: "DELETE FROM {table} WHERE ctid IN (SELECT ctid FROM {table} WHERE created_at_ms < $1 LIMIT $2)",
    // {table}_versions_updated_idx
    purge_versions: "DELETE FROM {table}_versions WHERE ctid IN (SELECT ctid FROM {table}_versions WHERE updated_at_ms < $1 LIMIT $2)",
    on_connect: None,
};

super::inbox_backend!(sqlx::Postgres, DIALECT);
