//! Values written into a MySQL multi-statement query the way a driver
//! that prepares client-side sends them (PHP's PDO with emulated prepares,
//! Go's `interpolateParams=true`): the server prepares one statement at a
//! time, so the `?` of `docs/plain-insert-in-the-change.mysql.sql` are
//! replaced before the query leaves, and the statements travel in one
//! round trip.

/// One value for a `?`.
#[derive(Clone, Copy, Debug)]
pub enum Literal<'a> {
    Int(i64),
    Text(&'a str),
    Null,
}

impl Literal<'_> {
    /// The value as MariaDB's default `sql_mode` reads it: a string
    /// quoted, its backslashes, quotes and NULs escaped.
    fn write(self, out: &mut String) {
        match self {
            Literal::Int(n) => out.push_str(&n.to_string()),
            Literal::Null => out.push_str("NULL"),
            Literal::Text(s) => {
                out.push('\'');
                for c in s.chars() {
                    match c {
                        '\\' => out.push_str("\\\\"),
                        '\'' => out.push_str("\\'"),
                        '\0' => out.push_str("\\0"),
                        c => out.push(c),
                    }
                }
                out.push('\'');
            }
        }
    }
}

/// `sql` with its `?` replaced by `values`, in order. `sql` must hold no
/// `?` inside its own string literals.
///
/// # Panics
///
/// When the number of `?` and of values differ.
pub fn interpolate(sql: &str, values: &[Literal<'_>]) -> String {
    let mut out = String::with_capacity(sql.len() + 64 * values.len());
    let mut next = values.iter();
    for (i, part) in sql.split('?').enumerate() {
        if i > 0 {
            next.next()
                .unwrap_or_else(|| panic!("{sql}: more ? than {} values", values.len()))
                .write(&mut out);
        }
        out.push_str(part);
    }
    assert!(
        next.next().is_none(),
        "{sql}: fewer ? than {} values",
        values.len()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_replace_the_placeholders_in_order_and_strings_are_escaped() {
        let sql = interpolate(
            "UPDATE t SET a = ? WHERE id = ?; INSERT INTO u VALUES (?, ?)",
            &[
                Literal::Text(r#"it's a \"x\""#),
                Literal::Int(-7),
                Literal::Null,
                Literal::Text("nul\0"),
            ],
        );
        assert_eq!(
            sql,
            r#"UPDATE t SET a = 'it\'s a \\"x\\"' WHERE id = -7; INSERT INTO u VALUES (NULL, 'nul\0')"#
        );
    }

    #[test]
    #[should_panic(expected = "fewer ? than 2 values")]
    fn a_value_left_over_is_an_error() {
        interpolate("SELECT ?", &[Literal::Int(1), Literal::Int(2)]);
    }
}
