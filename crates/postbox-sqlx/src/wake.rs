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
