//! SQLite inbox statements.

use super::sql::Dialect;

/// SQLite. A transaction takes the write lock at its first statement (the
/// inbox insert), so the version check needs no row lock.
pub(crate) const DIALECT: Dialect = Dialect {
    create: &[
        "CREATE TABLE IF NOT EXISTS {table} (
            consumer_group TEXT NOT NULL,
            event_id TEXT NOT NULL,
            created_at_ms INTEGER NOT NULL,
            PRIMARY KEY (consumer_group, event_id))",
        "CREATE INDEX IF NOT EXISTS {table}_created_idx ON {table} (created_at_ms)",
        "CREATE TABLE IF NOT EXISTS {table}_versions (
            consumer_group TEXT NOT NULL,
            aggregate_id TEXT NOT NULL,
            aggregate_version INTEGER NOT NULL,
            updated_at_ms INTEGER NOT NULL,
            PRIMARY KEY (consumer_group, aggregate_id))",
        "CREATE INDEX IF NOT EXISTS {table}_versions_updated_idx ON {table}_versions (updated_at_ms)",
    ],
    // primary key
    insert_event: "INSERT OR IGNORE INTO {table} (consumer_group, event_id, created_at_ms) VALUES (?, ?, ?)",
    has_event: "SELECT COUNT(*) FROM {table} WHERE consumer_group = ? AND event_id = ?",
    // primary key of _versions
    insert_version: "INSERT OR IGNORE INTO {table}_versions (consumer_group, aggregate_id, aggregate_version, updated_at_ms) VALUES (?, ?, ?, ?)",
    // primary key of _versions
    lock_version: "SELECT aggregate_version FROM {table}_versions WHERE consumer_group = ? AND aggregate_id = ?",
    // primary key of _versions
    update_version: "UPDATE {table}_versions SET aggregate_version = ?, updated_at_ms = ? WHERE consumer_group = ? AND aggregate_id = ?",
    // {table}_created_idx
    purge_events: "DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE created_at_ms < ? LIMIT ?)",
    // {table}_versions_updated_idx
    purge_versions: "DELETE FROM {table}_versions WHERE rowid IN (SELECT rowid FROM {table}_versions WHERE updated_at_ms < ? LIMIT ?)",
    // A transaction holds the database's one write lock from the inbox
    // insert until the handler's commit, so every other writer of the file
    // (another consumer, another process) waits the handler's time: with
    // sqlx's 5 s, one past a slow handler failed "database is locked", an
    // attempt spent.
    on_connect: Some("PRAGMA busy_timeout = 60000"),
};

super::inbox_backend!(sqlx::Sqlite, DIALECT);
