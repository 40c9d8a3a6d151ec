//! The idle probe for databases without array parameters.

use postbox_core::TableName;

use crate::dialect::Value;

/// The idle probe ([`crate::Dialect::due_query`]) as one `UNION ALL`
/// branch per app_code: `branch` (with `{table}`) takes the app_code as its
/// four `?`, in order.
pub fn due_union<'q>(
    table: &TableName,
    branch: &str,
    app_codes: &'q [String],
) -> (String, Vec<Value<'q>>) {
    let branch = table.render(branch);
    let sql = vec![branch.as_str(); app_codes.len()].join(" UNION ALL ");
    let binds = app_codes.iter().flat_map(|a| [Value::from(a); 4]).collect();
    (sql, binds)
}

/// One app_code's branch of the idle probe for [`due_union`], binding the
/// app_code four times; `$text` is the SQL type the app_code is read back
/// as, `$now` the dialect's clock. Whether a pending row exists and how
/// long until the earliest retryable row is due and the earliest lease
/// ends, each reading the first entry of an index prefix (the dialect's
/// `sql.rs` names them: one `(app_code, status, next_retry_at_ms, id)`
/// index on MariaDB, a partial index per status on SQLite). A delivering
/// row's `next_retry_at_ms` is its lease end (the claim sets both), so
/// one column serves both `MIN`s; never a scan (MariaDB `ANALYZE`: a
/// `ref` read of one index entry and two min/max lookups).
#[macro_export]
macro_rules! due_branch {
    ($text:literal, $now:expr) => {
        concat!(
            "SELECT CAST(? AS ",
            $text,
            ") AS app_code, \
               EXISTS (SELECT 1 FROM {table} WHERE app_code = ? AND status = 'pending') AS pending, \
               (SELECT MIN(next_retry_at_ms) FROM {table} WHERE app_code = ? AND status = 'retryable') - ",
            $now,
            " AS retry_in_ms, \
               (SELECT MIN(next_retry_at_ms) FROM {table} WHERE app_code = ? AND status = 'delivering') - ",
            $now,
            " AS lease_in_ms"
        )
    };
}
