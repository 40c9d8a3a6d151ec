//! Reading what the `postbox` command and the admin API answer in JSON.

use serde_json::Value;

/// The element of the JSON array `list` whose `field` equals `want` (a
/// `doctor` check by `name`, a timeline step by `kind`), or `None`.
pub fn find_in(list: &Value, field: &str, want: &str) -> Option<Value> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a JSON array: {list}"))
        .iter()
        .find(|item| item[field] == want)
        .cloned()
}

/// [`find_in`], failing the test when no element matches.
pub fn expect_in(list: &Value, field: &str, want: &str) -> Value {
    find_in(list, field, want).unwrap_or_else(|| panic!("no {field} = {want:?} in {list:#}"))
}

/// For each element of the JSON array `list`, its `fields` as one JSON
/// array: `[["e1", true], ["e2", false]]` for `["event_id", "archived"]`.
pub fn pluck(list: &Value, fields: &[&str]) -> Vec<Value> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a JSON array: {list}"))
        .iter()
        .map(|item| fields.iter().map(|f| item[*f].clone()).collect())
        .collect()
}
