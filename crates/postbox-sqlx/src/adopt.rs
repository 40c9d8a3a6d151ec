//! `postbox adopt`: run postbox on a table a team already has. The table
//! is read from the catalog and compared with what postbox's statements
//! need, by the table's own names (`[database.columns]`): the columns
//! postbox can add (everything but the event itself), then the outbox
//! table's indexes, each built without blocking the table's writes where
//! the database can. `migrate` then adds the rest (the archive, history,
//! controls and relays tables, the wake-up trigger) and records the
//! schema versions, so `doctor`, the relay and every command treat the
//! table as their own.

use postbox_core::naming::COLUMNS;
use postbox_core::store::{AdoptReport, AdoptStep};
use postbox_core::{Error, Result, TableName};

use sqlx::Database;

use crate::dialect::{Dialect, Value};
use crate::engine::{first_column, query};
use crate::{db_error, SqlOutbox};

/// How a dialect adopts a table.
#[derive(Debug, Clone, Copy)]
pub struct Adopt {
    /// The table's columns: name, whether it allows NULL (0/1), whether it
    /// has a default (0/1), its length in characters and in bytes (NULL but
    /// for text); the table's name.
    pub columns_of: &'static str,
    /// The outbox table's indexes, each as a suffix and the statement
    /// that builds it on a live table without blocking its writes; `None`:
    /// the migrations' `CREATE INDEX` statements, through `online_index`.
    pub indexes: Option<&'static [(&'static str, &'static [&'static str])]>,
    /// A migration's `CREATE INDEX` as it runs on a live table without
    /// blocking its writes.
    pub online_index: fn(&str) -> String,
    /// The names of the table's indexes a failed online build left
    /// invalid (one column); the table's name. `None`: the database
    /// leaves none.
    pub invalid_indexes: Option<&'static str>,
    /// The names of the table's secondary indexes (one column), the
    /// primary key left out; the table's name.
    pub indexes_of: &'static str,
    /// `DROP INDEX` of one such index, `{name}`.
    pub drop_index: &'static str,
    /// `ALTER TABLE … ADD COLUMN` of `definition` on `table`, as it runs
    /// without rewriting the table, with any statement needed after it.
    pub add_column: fn(table: &str, column: &str, definition: &str) -> Vec<String>,
}

/// The event's own columns: a row means nothing without them, so postbox
/// never adds them.
const EVENT_COLUMNS: [&str; 5] = ["id", "app_code", "event_id", "event_type", "payload"];

engine_impl! {
impl SqlOutbox<D> {
    /// Compares the live table with what postbox needs and, with `apply`,
    /// changes it ([`AdoptReport`]).
    pub async fn adopt(&self, apply: bool) -> Result<AdoptReport> {
        self.adopt_with(apply, &|_| {}).await
    }

    /// [`SqlOutbox::adopt`], telling `progress` as each statement of
    /// `apply` starts and ends.
    pub async fn adopt_with(
        &self,
        apply: bool,
        progress: &(dyn for<'s> Fn(AdoptStep<'s>) + Send + Sync),
    ) -> Result<AdoptReport> {
        let Some(adopt) = D::ADOPT else {
            return Err(Error::Schema(format!(
                "`postbox adopt` is for PostgreSQL and MariaDB/MySQL tables, not {}",
                D::BACKEND
            )));
        };
        let t = self.table().clone();
        let op = "inspect the table to adopt";
        let found = self.column_facts(adopt.columns_of).await?;
        if found.is_empty() {
            return Err(Error::Schema(format!(
                "table `{t}` does not exist: `postbox migrate` creates a new outbox table; `adopt` is for one you have"
            )));
        }
        let has = |name: &str| found.iter().any(|c| c.name.eq_ignore_ascii_case(name));
        let definitions = column_definitions(&t.render(D::MIGRATIONS[0].2[0]));
        let mut report = AdoptReport {
            table: t.as_str().to_owned(),
            renamed: t.naming().renamed().map(|(a, b)| (a.to_owned(), b.to_owned())).collect(),
            legacy_statuses: t
                .naming()
                .legacy_statuses()
                .map(|(a, b)| (a.to_owned(), b.as_str().to_owned()))
                .collect(),
            ..AdoptReport::default()
        };
        for ours in COLUMNS {
            let theirs = t.column(ours);
            if has(theirs) {
                continue;
            }
            if EVENT_COLUMNS.contains(&ours) {
                report.blockers.push(format!(
                    "no column `{theirs}` for postbox's `{ours}`: name the table's column in [database.columns] ({ours} = \"…\")"
                ));
                continue;
            }
            report.missing_columns.push(theirs.to_owned());
            let definition = definitions
                .iter()
                .find(|d| d.split_whitespace().next() == Some(theirs))
                .ok_or_else(|| Error::Schema(format!("no definition of column `{theirs}`")))?;
            report.statements.extend((adopt.add_column)(t.as_str(), theirs, definition));
        }
        check_columns(&t, &definitions, &found, &mut report);
        let existing = self.catalog_names(op).await?;
        let invalid = match adopt.invalid_indexes {
            Some(sql) => self.names_of_table(sql, op).await?,
            None => Vec::new(),
        };
        let (widen, too_long) = aggregate_width::<D>(&t, &definitions, &found);
        report.blockers.extend(too_long);
        let indexes: Vec<(String, Vec<String>)> = match adopt.indexes {
            Some(list) => list
                .iter()
                .map(|(suffix, create)| {
                    (format!("{t}{suffix}"), create.iter().map(|c| widen(t.render(c))).collect())
                })
                .collect(),
            None => outbox_indexes(&t, D::MIGRATIONS)
                .into_iter()
                .map(|(name, create)| (name, vec![(adopt.online_index)(&create)]))
                .collect(),
        };
        let wanted: Vec<String> = indexes.iter().map(|(name, _)| name.clone()).collect();
        let named = |list: &[String], name: &str| list.iter().any(|e| e.eq_ignore_ascii_case(name));
        for (name, create) in indexes {
            if named(&invalid, &name) {
                // A build that failed (a duplicate event, a cancel) left
                // it there but unused: it goes, and is built again.
                report.statements.push(adopt.drop_index.replace("{name}", &name));
            } else if named(&existing, &name) {
                continue;
            }
            report.missing_indexes.push(name);
            report.statements.extend(create);
        }
        // The table's own indexes postbox never reads: each still costs a
        // write on every change of its columns.
        let ours = |name: &str| {
            name.eq_ignore_ascii_case(&format!("{t}{}", postbox_core::store::AGGREGATE_INDEX))
                || named(&wanted, name)
        };
        report.unread_indexes = self.names_of_table(adopt.indexes_of, op).await?;
        report.unread_indexes.retain(|name| !ours(name));
        if apply && report.blockers.is_empty() && report.missing_indexes.iter().any(|i| i.ends_with("_event_uq")) {
            // The unique event index cannot be built over duplicates:
            // name them before anything changes.
            let duplicates = self.duplicate_events().await?;
            if !duplicates.is_empty() {
                report.blockers.push(format!(
                    "events stored twice, which the unique ({}, {}) index postbox needs cannot hold: {}; keep one row of each",
                    t.column("app_code"),
                    t.column("event_id"),
                    duplicates.join(", ")
                ));
            }
        }
        if apply && report.blockers.is_empty() {
            for sql in &report.statements {
                tracing::info!(table = %t, statement = %sql, "adopt");
                progress(AdoptStep::Running(sql));
                let started = std::time::Instant::now();
                query::<D>(sql, [])
                    .execute(self.pool())
                    .await
                    .map_err(|e| db_error("adopt the table", e))?;
                progress(AdoptStep::Done(sql, started.elapsed()));
            }
            const MIGRATE: &str = "migrate: postbox's own tables, the trigger, the schema versions";
            progress(AdoptStep::Running(MIGRATE));
            let started = std::time::Instant::now();
            // The outbox table's indexes are built: `migrate` must not
            // drop and build them again under its lock (MySQL's versions
            // change them with `ALTER TABLE <table> …`; the statements
            // that change other tables start `ALTER TABLE <table>_…`).
            let alter = format!("ALTER TABLE {t} ");
            let migrated = self
                .migrate_skipping(|stmt| index_of(&t, stmt).is_some() || stmt.starts_with(&alter))
                .await?;
            progress(AdoptStep::Done(MIGRATE, started.elapsed()));
            report.migrated = Some(migrated);
            report.applied = true;
        }
        Ok(report)
    }
}
}

/// One column of a table to adopt, as its catalog describes it.
#[derive(Debug)]
struct ColumnFacts {
    name: String,
    nullable: bool,
    has_default: bool,
    length: Option<i64>,
    /// Its length in bytes (text only): `length` times the character set's
    /// widest character.
    octets: Option<i64>,
}

engine_impl! {
impl SqlOutbox<D> {
    /// The table's columns, as `sql` ([`Adopt::columns_of`]) reads them;
    /// none when the table does not exist.
    async fn column_facts(&self, sql: &str) -> Result<Vec<ColumnFacts>> {
        let db = |e| db_error("inspect the table to adopt", e);
        let rows = query::<D>(sql, [Value::from(self.table().as_str())])
            .fetch_all(self.pool())
            .await
            .map_err(db)?;
        rows.iter()
            .map(|r| {
                Ok(ColumnFacts {
                    name: sqlx::Row::try_get(r, 0)?,
                    nullable: sqlx::Row::try_get::<i32, _>(r, 1)? != 0,
                    has_default: sqlx::Row::try_get::<i32, _>(r, 2)? != 0,
                    length: sqlx::Row::try_get(r, 3)?,
                    octets: sqlx::Row::try_get(r, 4)?,
                })
            })
            .collect::<std::result::Result<_, sqlx::Error>>()
            .map_err(db)
    }
}
}

/// Blockers for columns the table has in a form postbox's statements would
/// never match: NULL allowed where postbox's own table says `NOT NULL` (a
/// row with a NULL lease end or retry time is never claimed, nor counted),
/// or a status with no default (postbox's `enqueue` and the documented
/// `INSERT` write none: such rows would get NULL). `definitions` are
/// postbox's own, written with the table's names.
fn check_columns(
    t: &TableName,
    definitions: &[String],
    facts: &[ColumnFacts],
    report: &mut AdoptReport,
) {
    for ours in COLUMNS {
        let theirs = t.column(ours);
        let not_null = definitions
            .iter()
            .any(|d| d.split_whitespace().next() == Some(theirs) && d.contains("NOT NULL"));
        let Some(f) = facts.iter().find(|f| f.name.eq_ignore_ascii_case(theirs)) else {
            continue;
        };
        if not_null && f.nullable {
            report.blockers.push(format!(
                "column `{theirs}` allows NULL, and postbox's statements never match a NULL `{ours}` \
                 (such a row is never claimed nor counted): set its NULLs to a value and make it NOT NULL"
            ));
        }
        if ours == "status" && !f.has_default {
            report.blockers.push(format!(
                "column `{theirs}` has no default: postbox's enqueue and the documented INSERT write no status, \
                 so the row would never be claimed; give it the default its pending status is written as"
            ));
        }
    }
}

/// Widens the head index's copy of the aggregate (MySQL's virtual
/// `open_aggregate_id`, as long as postbox's own `aggregate_id`) to the
/// table's: shorter, an `INSERT` of a longer aggregate failed (or, out of
/// strict mode, two aggregates alike in their first characters became
/// one). With a blocker when MySQL's head index key, (app_code, aggregate,
/// version, id), would not fit InnoDB's 3,072 bytes: the build failed
/// after the virtual columns were added. (PostgreSQL's head index is over
/// the column itself, and its key limit is no matter here.)
fn aggregate_width<D: Dialect>(
    t: &TableName,
    definitions: &[String],
    facts: &[ColumnFacts],
) -> (impl Fn(String) -> String + use<D>, Option<String>) {
    let column = t.column("aggregate_id");
    let ours = definitions
        .iter()
        .find(|d| d.split_whitespace().next() == Some(column))
        .and_then(|d| {
            d.split_once("VARCHAR(")?
                .1
                .split_once(')')?
                .0
                .parse::<i64>()
                .ok()
        });
    let fact = |name: &str| facts.iter().find(|f| f.name.eq_ignore_ascii_case(name));
    let theirs = fact(column).and_then(|f| f.length);
    let widen = match (ours, theirs) {
        (Some(o), Some(t)) if t > o => Some((
            format!("open_aggregate_id VARCHAR({o})"),
            format!("open_aggregate_id VARCHAR({t})"),
        )),
        _ => None,
    };
    let octets = |name: &str| fact(name).and_then(|f| f.octets);
    let app = octets(t.column("app_code")).unwrap_or(256);
    let too_long = match (D::BACKEND == "mysql" && widen.is_some(), theirs, octets(column)) {
        (true, Some(n), Some(bytes)) if bytes + app + 16 > 3_072 => Some(format!(
            "column `{column}` holds {n} characters ({bytes} bytes): the head index postbox needs on (`{}`, aggregate, version, id) \
             would be longer than InnoDB's 3,072 bytes; shorten it to at most {} bytes",
            t.column("app_code"),
            3_072 - 16 - app
        )),
        _ => None,
    };
    let widen = move |stmt: String| match &widen {
        Some((from, to)) => stmt.replace(from.as_str(), to),
        None => stmt,
    };
    (widen, too_long)
}

/// The column definitions of a `CREATE TABLE … ( … )` statement, one per
/// column, each starting with its name.
fn column_definitions(create: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (create.find('('), create.rfind(')')) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let (mut depth, mut start) = (0, open + 1);
    let body = &create[..close];
    for (i, c) in body.char_indices().skip(open + 1) {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(body[start..i].trim().to_owned());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(body[start..].trim().to_owned());
    out
}

engine_impl! {
impl SqlOutbox<D> {
    /// The names (one column) `sql` reads about the outbox table, its only
    /// bind.
    async fn names_of_table(&self, sql: &str, op: &'static str) -> Result<Vec<String>> {
        let rows = query::<D>(sql, [Value::from(self.table().as_str())])
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error(op, e))?;
        first_column(rows).map_err(|e| db_error(op, e))
    }

    /// Up to five `app_code/event_id` pairs stored more than once (one
    /// read of the table).
    async fn duplicate_events(&self) -> Result<Vec<String>> {
        let sql = self.table().render(
            "SELECT app_code, event_id FROM {table} GROUP BY app_code, event_id HAVING COUNT(*) > 1 LIMIT 5",
        );
        let rows = query::<D>(&sql, [])
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("look for events stored twice", e))?;
        rows.iter()
            .map(|r| {
                let app: String = sqlx::Row::try_get(r, 0)?;
                let id: String = sqlx::Row::try_get(r, 1)?;
                Ok(format!("{app}/{id}"))
            })
            .collect::<std::result::Result<_, sqlx::Error>>()
            .map_err(|e| db_error("look for events stored twice", e))
    }
}
}

/// What an index statement of the outbox table itself (not its archive
/// or other tables) does: `(name, Some(create))` for a `CREATE [UNIQUE]
/// INDEX`, written `IF NOT EXISTS`; `(name, None)` for each index a `DROP
/// INDEX` names.
fn index_of(t: &postbox_core::TableName, stmt: &str) -> Option<Vec<(String, Option<String>)>> {
    let words: Vec<&str> = stmt.split_whitespace().collect();
    let own = |name: &str| {
        name.strip_prefix(t.as_str())
            .is_some_and(|rest| rest.starts_with('_') && !rest.starts_with("_archive"))
    };
    let (unique, rest) = match words.as_slice() {
        ["CREATE", "INDEX", rest @ ..] => (false, rest),
        ["CREATE", "UNIQUE", "INDEX", rest @ ..] => (true, rest),
        ["DROP", "INDEX", rest @ ..] => {
            let names = rest.strip_prefix(&["IF", "EXISTS"][..]).unwrap_or(rest);
            let dropped: Vec<_> = names
                .iter()
                .map(|n| n.trim_end_matches(','))
                .filter(|n| own(n))
                .map(|n| (n.to_owned(), None))
                .collect();
            return (!dropped.is_empty()).then_some(dropped);
        }
        _ => return None,
    };
    let rest = rest
        .strip_prefix(&["IF", "NOT", "EXISTS"][..])
        .unwrap_or(rest);
    let [name, "ON", table, ..] = rest else {
        return None;
    };
    if *table != t.as_str() && !table.starts_with(&format!("{}(", t.as_str())) || !own(name) {
        return None;
    }
    let after_name = stmt
        .split_once(&format!(" {name} "))
        .map_or("", |(_, after)| after);
    let unique = if unique { "UNIQUE " } else { "" };
    let create = format!("CREATE {unique}INDEX IF NOT EXISTS {name} {after_name}");
    Some(vec![((*name).to_owned(), Some(create))])
}

/// The outbox table's indexes as the migrations leave them: the last
/// definition of each that no later `DROP INDEX` removes, in migration
/// order.
fn outbox_indexes(
    t: &postbox_core::TableName,
    migrations: &[crate::Migration],
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (_, _, statements) in migrations {
        for stmt in statements.iter().map(|s| t.render(s)) {
            for (name, create) in index_of(t, &stmt).unwrap_or_default() {
                out.retain(|(n, _)| *n != name);
                if let Some(create) = create {
                    out.push((name, create));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions_split_at_top_level_commas() {
        let defs = column_definitions(
            "CREATE TABLE IF NOT EXISTS t ( id BIGINT PRIMARY KEY, a VARCHAR(64) NOT NULL, \
             b BIGINT NOT NULL DEFAULT (EXTRACT(EPOCH FROM now()) * 1000)::BIGINT)",
        );
        assert_eq!(
            defs,
            [
                "id BIGINT PRIMARY KEY",
                "a VARCHAR(64) NOT NULL",
                "b BIGINT NOT NULL DEFAULT (EXTRACT(EPOCH FROM now()) * 1000)::BIGINT"
            ]
        );
    }

    #[test]
    fn indexes_are_the_last_definition_of_each_not_dropped_later() {
        let t = postbox_core::TableName::new("o").unwrap();
        let migrations: &[crate::Migration] = &[
            (1, "", &["CREATE UNIQUE INDEX IF NOT EXISTS {table}_event_uq ON {table} (app_code, event_id)",
                      "CREATE INDEX IF NOT EXISTS {table}_old_idx ON {table} (status)",
                      "CREATE INDEX IF NOT EXISTS {archive}_created_idx ON {archive} (created_at_ms)"]),
            (2, "", &["DROP INDEX IF EXISTS {table}_old_idx, {table}_gone_idx",
                      "CREATE INDEX IF NOT EXISTS {table}_due_idx ON {table} (a)"]),
            (3, "", &["DROP INDEX IF EXISTS {table}_due_idx",
                      "CREATE INDEX {table}_due_idx ON {table} (a, b)"]),
        ];
        let got = outbox_indexes(&t, migrations);
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["o_event_uq", "o_due_idx"]);
        assert_eq!(got[1].1, "CREATE INDEX IF NOT EXISTS o_due_idx ON o (a, b)");
    }
}
