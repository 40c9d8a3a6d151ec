//! `postbox migrate --print-sql`: the statements `migrate` runs, version by
//! version, as SQL text for a team's own migration tool (Flyway, Liquibase,
//! golang-migrate) or a DBA's review. Each version ends by recording
//! itself in `postbox_schema_migrations`, exactly as `migrate` does, so
//! `doctor` and a later `migrate` see the schema as migrated.

use postbox_core::TableName;

use crate::dialect::Dialect;
use crate::Placeholders;

/// One schema version's statements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptVersion {
    /// The schema version.
    pub version: u32,
    /// What it does.
    pub description: &'static str,
    /// Its statements, without terminators, in order.
    pub statements: Vec<String>,
}

/// The versions after `from` (0: all), for `table`, as dialect `D` runs
/// them (`partitioned`: version 1 creates the table range-partitioned,
/// where the dialect can; its partitions depend on the clock, and
/// `migrate` or any relay creates them). The first carries the ledger's
/// `CREATE TABLE IF NOT EXISTS`.
/// Left out: the migration lock (apply the script once, not from two
/// places at a time) and, on MySQL, continuing the ids of an archive that
/// was kept while the outbox table was dropped (`migrate` does that).
pub fn migration_script<D: Dialect>(
    table: &TableName,
    from: u32,
    partitioned: bool,
) -> Vec<ScriptVersion> {
    let s = &D::STATEMENTS;
    let mut out: Vec<ScriptVersion> = Vec::new();
    for (version, description, statements) in D::MIGRATIONS.iter().filter(|m| m.0 > from) {
        let mut sql = Vec::new();
        if out.is_empty() {
            sql.push(s.create_migrations_table.to_owned());
        }
        let statements = match (*version, D::PARTITIONS) {
            (1, Some(p)) if partitioned => p.v1,
            _ => statements,
        };
        sql.extend(statements.iter().map(|st| table.render(st)));
        if *version == 1 {
            sql.extend(
                D::CONTINUE_IDS_AFTER_ARCHIVE
                    .iter()
                    .map(|st| table.render(st)),
            );
        }
        let literals = [
            quoted(table.as_str()),
            version.to_string(),
            quoted(description),
        ];
        sql.push(inline(s.record_version, &literals, D::PLACEHOLDERS));
        out.push(ScriptVersion {
            version: *version,
            description,
            statements: sql,
        });
    }
    out
}

/// A SQL string literal (quotes doubled; the texts given have no
/// backslashes).
fn quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `sql` with its placeholders (`$1…`, `?` in order, or `?1…`) replaced by
/// `values`, each already a SQL literal (for statements that cannot be
/// prepared or are printed: `EXPLAIN` on MySQL, `migrate --print-sql`).
/// The statements' own text has no placeholder character inside quotes.
pub fn inline(sql: &str, values: &[String], p: Placeholders) -> String {
    match p {
        Placeholders::Numbered => values
            .iter()
            .enumerate()
            .rev()
            .fold(sql.to_owned(), |s, (i, v)| {
                s.replace(&format!("${}", i + 1), v)
            }),
        Placeholders::Question => {
            // `?` in order, or `?N` (SQLite) by number.
            let mut out = String::with_capacity(sql.len());
            let mut next = 0;
            let mut chars = sql.chars().peekable();
            while let Some(c) = chars.next() {
                if c != '?' {
                    out.push(c);
                    continue;
                }
                let mut digits = String::new();
                while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                    digits.push(*d);
                    chars.next();
                }
                let at = match digits.parse::<usize>() {
                    Ok(n) => n.saturating_sub(1),
                    Err(_) => {
                        next += 1;
                        next - 1
                    }
                };
                out.push_str(values.get(at).map_or("NULL", String::as_str));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_literals() {
        let v = ["'t'".to_owned(), "3".to_owned(), "'it''s'".to_owned()];
        assert_eq!(
            inline("VALUES ($1, $2, $3, now)", &v, Placeholders::Numbered),
            "VALUES ('t', 3, 'it''s', now)"
        );
        assert_eq!(
            inline("VALUES (?, ?, ?, now)", &v, Placeholders::Question),
            "VALUES ('t', 3, 'it''s', now)"
        );
        assert_eq!(
            inline("VALUES (?1, ?2, ?3, now)", &v, Placeholders::Question),
            "VALUES ('t', 3, 'it''s', now)"
        );
        assert_eq!(quoted("an aggregate's"), "'an aggregate''s'");
    }
}
