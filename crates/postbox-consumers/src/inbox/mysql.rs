//! MySQL 8 / MariaDB inbox statements.

use super::sql::Dialect;

/// MySQL and MariaDB. Indexes are declared inside `CREATE TABLE` because
/// MySQL has no `CREATE INDEX IF NOT EXISTS`.
pub(crate) const DIALECT: Dialect = Dialect {
    create: &[
        "CREATE TABLE IF NOT EXISTS {table} (
            consumer_group VARCHAR(128) NOT NULL,
            event_id VARCHAR(64) NOT NULL,
            created_at_ms BIGINT NOT NULL,
            PRIMARY KEY (consumer_group, event_id),
            INDEX {table}_created_idx (created_at_ms)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
        "CREATE TABLE IF NOT EXISTS {table}_versions (
            consumer_group VARCHAR(128) NOT NULL,
            aggregate_id VARCHAR(128) NOT NULL,
            aggregate_version BIGINT NOT NULL,
            updated_at_ms BIGINT NOT NULL,
            PRIMARY KEY (consumer_group, aggregate_id),
            INDEX {table}_versions_updated_idx (updated_at_ms)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
    ],
    // primary key; event_id and group lengths are checked before, so IGNORE
    // only ever ignores the duplicate
    insert_event: "INSERT IGNORE INTO {table} (consumer_group, event_id, created_at_ms) VALUES (?, ?, ?)",
    has_event: "SELECT COUNT(*) FROM {table} WHERE consumer_group = ? AND event_id = ?",
    // primary key of _versions. Not `INSERT IGNORE`: on a known aggregate it
    // takes a shared lock, and two transactions that both hold one and then
    // ask `FOR UPDATE` deadlock (error 1213). `ON DUPLICATE KEY UPDATE` takes
    // the row's exclusive lock at once, so the second waits instead.
    insert_version: "INSERT INTO {table}_versions (consumer_group, aggregate_id, aggregate_version, updated_at_ms) VALUES (?, ?, ?, ?) ON DUPLICATE KEY UPDATE aggregate_version = aggregate_version",
    // primary key of _versions
    lock_version: "SELECT aggregate_version FROM {table}_versions WHERE consumer_group = ? AND aggregate_id = ? FOR UPDATE",
    // primary key of _versions
    update_version: "UPDATE {table}_versions SET aggregate_version = ?, updated_at_ms = ? WHERE consumer_group = ? AND aggregate_id = ?",
    // {table}_created_idx
    purge_events: "DELETE FROM {table} WHERE created_at_ms < ? LIMIT ?",
    // {table}_versions_updated_idx
    purge_versions: "DELETE FROM {table}_versions WHERE updated_at_ms < ? LIMIT ?",
    on_connect: None,
};

super::inbox_backend!(sqlx::MySql, DIALECT);
