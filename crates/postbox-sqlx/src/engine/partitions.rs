//! A range-partitioned outbox table (`[database] partitioning`,
//! PostgreSQL): created by `migrate` (version 1 in its partitioned form),
//! kept ahead of the clock by `migrate` and by every relay, and archived a
//! whole partition at a time once every row in it is done.

use sqlx::Database;

use postbox_core::partition::{Partitioning, Range};
use postbox_core::store::PartitionsAhead;
use postbox_core::{Error, Result};

use super::{first_column, query, SqlOutbox};
use crate::db_error;
use crate::dialect::{Dialect, PartitionSql};

/// One partition of the table.
#[derive(Debug)]
pub(super) struct Attached {
    pub name: String,
    pub range: Range,
    /// A `DETACH … CONCURRENTLY` was interrupted.
    pub detach_pending: bool,
}

engine_impl! {
impl SqlOutbox<D> {
    /// The partitioning and the dialect's statements for it, when the
    /// table is partitioned.
    pub(super) fn partition_sql(&self) -> Option<(Partitioning, PartitionSql)> {
        Some((self.partitioning?, D::PARTITIONS?))
    }

    /// `{name}`, `{from}` and `{to}` of `sql` filled in, rendered.
    pub(super) fn partition_statement(&self, sql: &str, name: &str, range: Option<&Range>) -> String {
        let mut out = self.table.render(sql).replace("{name}", name);
        if let Some(r) = range {
            out = out.replace("{from}", &r.from_ms.to_string()).replace("{to}", &r.to_ms.to_string());
        }
        out
    }

    /// Refuses `partitioning` on an outbox table that exists and is not
    /// partitioned: a table is partitioned when it is created.
    pub(super) async fn refuse_unpartitioned(&self) -> Result<()> {
        let Some((_, sql)) = self.partition_sql() else {
            return Ok(());
        };
        let db = |e| db_error("migrate", e);
        let names = [self.table.as_str().to_owned()];
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let existing = self
            .fetch_expanded(&mut conn, &self.sql.existing_tables, vec![crate::Value::Texts(&names)])
            .await
            .map_err(db)?;
        if existing.is_empty() {
            return Ok(());
        }
        drop(conn);
        if self.is_partitioned(sql, "migrate").await? {
            return Ok(());
        }
        Err(Error::Schema(format!(
            "table `{}` exists and is not partitioned: database.partitioning applies when migrate creates the table \
             (move its rows into a new partitioned table, or leave partitioning unset)",
            self.table
        )))
    }

    /// Whether the outbox table is a partitioned one (in the catalog).
    async fn is_partitioned(&self, sql: PartitionSql, operation: &'static str) -> Result<bool> {
        let partitioned: i32 = query::<D>(sql.is_partitioned, [self.table.as_str().into()])
            .try_map(|row: <D::DB as Database>::Row| sqlx::Row::try_get(&row, 0))
            .fetch_one(&self.pool)
            .await
            .map_err(|e| db_error(operation, e))?;
        Ok(partitioned == 1)
    }

    /// [`postbox_core::store::SchemaStore::check_partitioning`]. Unset on
    /// a partitioned table, no relay kept partitions ahead and every insert
    /// failed once the last one was past; `weekly` over daily partitions
    /// skipped each week that overlapped a day made, leaving days without
    /// a partition.
    pub async fn check_partitioning(&self) -> Result<()> {
        let Some(sql) = D::PARTITIONS else {
            return Ok(());
        };
        let key = "database.partitioning";
        let table = &self.table;
        if !self.is_partitioned(sql, "check partitioning").await? {
            return match self.partitioning {
                None => Ok(()),
                Some(p) => Err(Error::config(
                    key,
                    format!(
                        "`{}`, but table `{table}` is not partitioned: partitioning applies when migrate creates the table; leave it unset",
                        p.as_str()
                    ),
                )),
            };
        }
        // Those from the clock's on: older ones (of an earlier setting,
        // merged by hand) are archived in time and hold up nothing, and a
        // DEFAULT partition is the operator's own.
        let now = self.now_ms().await?;
        let made: Vec<(String, Option<Partitioning>)> = self
            .partitions_read(sql)
            .await?
            .into_iter()
            .filter(|a| a.range.to_ms > now)
            .map(|a| (a.name, Partitioning::of_range(&a.range)))
            .collect();
        let table_is = made
            .iter()
            .find_map(|(_, p)| *p)
            .map_or("partitioned".to_owned(), |p| format!("partitioned {}", p.as_str()));
        match self.partitioning {
            None => Err(Error::config(
                key,
                format!(
                    "unset, but table `{table}` is {table_is}: set it as the table was made; unset, no relay keeps partitions ahead and every insert fails once the last one is past"
                ),
            )),
            Some(p) => match made.iter().find(|(_, m)| *m != Some(p)) {
                None => Ok(()),
                Some((name, m)) => Err(Error::config(
                    key,
                    format!(
                        "`{}`, but partition `{name}` of `{table}` is {}: set it as the table was made (a table keeps the partitioning it was created with)",
                        p.as_str(),
                        m.map_or("of another range", |m| if m == Partitioning::Daily { "a day" } else { "a week" })
                    ),
                )),
            },
        }
    }

    /// The table's partitions of created_at_ms ranges, by name; a
    /// `DEFAULT` partition (the operator's own safety net) is left out: its
    /// rows are archived row by row, and no range is made for it. It
    /// failed every keeper run and every archive run.
    pub(super) async fn attached_partitions(&self) -> Result<Vec<Attached>> {
        let Some((_, sql)) = self.partition_sql() else {
            return Ok(Vec::new());
        };
        self.partitions_read(sql).await
    }

    /// The table's partitions whose bound is a range of created_at_ms
    /// (not a `DEFAULT` one), read with `sql`'s statements.
    async fn partitions_read(&self, sql: PartitionSql) -> Result<Vec<Attached>> {
        let db = |e| db_error("list partitions", e);
        let rows = query::<D>(sql.attached, [self.table.as_str().into()])
            .fetch_all(&self.pool)
            .await
            .map_err(db)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            let name: String = sqlx::Row::try_get(row, 0).map_err(db)?;
            let bound: String = sqlx::Row::try_get(row, 1).map_err(db)?;
            let detach_pending = sqlx::Row::try_get::<i32, _>(row, 2).map_err(db)? == 1;
            let Some(range) = parse_bound(&bound) else {
                continue;
            };
            out.push(Attached { name, range, detach_pending });
        }
        Ok(out)
    }

    /// Creates the current partition and those [`Partitioning::ahead`] of
    /// the database clock that are missing; returns their names. Each in a
    /// transaction of its own, waiting at most the dialect's lock timeout.
    pub async fn keep_partitions(&self) -> Result<Vec<String>> {
        let Some((partitioning, sql)) = self.partition_sql() else {
            return Ok(Vec::new());
        };
        let now = self.now_ms().await?;
        let attached = self.attached_partitions().await?;
        let mut created = Vec::new();
        for range in partitioning.wanted(now) {
            let overlaps = |a: &Attached| a.range.from_ms < range.to_ms && range.from_ms < a.range.to_ms;
            if attached.iter().any(overlaps) {
                continue;
            }
            let name = range.name(self.table.as_str());
            // A table of its own, then attached, in one transaction:
            // `CREATE TABLE … PARTITION OF` takes the table's ACCESS
            // EXCLUSIVE lock, so while it waited for any transaction on
            // the table (a report, a slow producer), every insert queued
            // behind it; `ATTACH PARTITION` takes SHARE UPDATE EXCLUSIVE,
            // which no insert, claim or read waits for or holds.
            let create = self.partition_statement(sql.create, &name, Some(&range));
            let attach = self.partition_statement(sql.attach, &name, Some(&range));
            if let Err(e) = self.partition_ddl(&sql, &[&create, &attach], "create partitions").await {
                // Another `migrate` or a starting relay may have made it
                // meanwhile (`CREATE TABLE IF NOT EXISTS` is not safe side
                // by side: "already exists", or the attach finds it
                // attached): only a range still missing is an error.
                if !self.attached_partitions().await?.iter().any(overlaps) {
                    return Err(e);
                }
                continue;
            }
            created.push(name);
        }
        Ok(created)
    }

    /// How many partitions lie wholly after the database clock's current
    /// one (`doctor`); `None` when the table is not partitioned.
    pub async fn partitions_ahead(&self) -> Result<Option<PartitionsAhead>> {
        let Some((partitioning, _)) = self.partition_sql() else {
            return Ok(None);
        };
        let now = self.now_ms().await?;
        let current = partitioning.range_of(now);
        let attached = self.attached_partitions().await?;
        let covered = attached.iter().any(|a| a.range.contains(now));
        let ahead: Vec<&Attached> = attached.iter().filter(|a| a.range.from_ms >= current.to_ms).collect();
        let last = ahead.iter().max_by_key(|a| a.range.to_ms).map(|a| a.name.clone());
        Ok(Some(PartitionsAhead {
            ahead: if covered { ahead.len() as u32 } else { 0 },
            through: last,
        }))
    }

    /// [`SqlOutbox::aggregate_index`] on a partitioned table, without
    /// blocking its writers: the index on the parent alone, then each
    /// partition's built online and attached (partitions created later
    /// get theirs with the table's other indexes).
    pub(super) async fn partitioned_aggregate_index(&self, wanted: bool, parent: &str) -> Result<()> {
        let Some((_, sql)) = self.partition_sql() else {
            return Ok(());
        };
        let op = if wanted { "create the aggregate index" } else { "drop the aggregate index" };
        let run = |stmt: String| async move {
            query::<D>(&stmt, []).execute(&self.pool).await.map(drop).map_err(|e| db_error(op, e))
        };
        if !wanted {
            return run(self.table.render(sql.drop_index).replace("{parent}", parent)).await;
        }
        run(self.partition_statement(sql.index_parent, parent, None)).await?;
        for part in self.attached_partitions().await? {
            let index = format!("{}{}", part.name, postbox_core::store::AGGREGATE_INDEX);
            let with = |s: &str| self.partition_statement(s, &part.name, None).replace("{index}", &index).replace("{parent}", parent);
            run(with(sql.index_partition)).await?;
            run(with(sql.attach_index)).await?;
        }
        Ok(())
    }

    /// Archives whole partitions (before the rows of the others): an
    /// interrupted detach is finished; each partition wholly before
    /// `before_ms` and the clock's current partition, whose rows are all
    /// done, is detached without blocking the table (`DETACH …
    /// CONCURRENTLY`; a row a replay changed meanwhile attaches it back);
    /// then every detached partition (this run's, or one an interrupted
    /// run left) is moved into the archive or dropped (`drop`), its
    /// events' keys deleted. `(rows, partitions)` archived.
    pub(super) async fn archive_partitions(
        &self,
        before_ms: i64,
        drop: bool,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<(u64, u64)> {
        let Some((partitioning, sql)) = self.partition_sql() else {
            return Ok((0, 0));
        };
        let now = self.now_ms().await?;
        let current = partitioning.range_of(now);
        // Finished below with those an interrupted run left detached.
        let mut detached = Vec::new();
        for part in self.attached_partitions().await? {
            if part.detach_pending {
                self.partition_ddl(&sql, &[&self.partition_statement(sql.finalize, &part.name, None)], "archive a partition").await?;
                continue;
            }
            if part.range.to_ms > before_ms.min(current.from_ms) || self.partition_busy(&sql, &part.name).await? {
                continue;
            }
            self.partition_ddl(&sql, &[&self.partition_statement(sql.detach, &part.name, None)], "archive a partition").await?;
            if self.partition_busy(&sql, &part.name).await? {
                self.partition_ddl(&sql, &[&self.partition_statement(sql.attach, &part.name, Some(&part.range))], "archive a partition").await?;
                continue;
            }
            detached.push(part.name);
        }
        for name in self.detached_partitions(&sql).await? {
            if !detached.contains(&name) {
                detached.push(name);
            }
        }
        let (mut rows, mut parts) = (0, 0);
        for name in detached {
            if self.partition_busy(&sql, &name).await? {
                // Detached by a run that stopped before it could attach it
                // back: a row in it is not done.
                let Some(range) = partitioning.range_named(self.table.as_str(), &name) else {
                    continue;
                };
                self.partition_ddl(&sql, &[&self.partition_statement(sql.attach, &name, Some(&range))], "archive a partition").await?;
                continue;
            }
            let moved = self.finish_detached(&sql, &name, drop).await?;
            on_batch(moved);
            rows += moved;
            parts += 1;
        }
        Ok((rows, parts))
    }

    /// Whether partition (or detached partition) `name` holds a row that
    /// is not done.
    async fn partition_busy(&self, sql: &PartitionSql, name: &str) -> Result<bool> {
        let busy: i32 = query::<D>(&self.partition_statement(sql.busy, name, None), [])
            .try_map(|row: <D::DB as Database>::Row| sqlx::Row::try_get(&row, 0))
            .fetch_one(&self.pool)
            .await
            .map_err(|e| db_error("archive a partition", e))?;
        Ok(busy == 1)
    }

    /// DDL waiting at most the lock timeout for its locks: one statement
    /// outside a transaction (`DETACH … CONCURRENTLY` cannot run in one),
    /// or several in one.
    async fn partition_ddl(&self, sql: &PartitionSql, stmts: &[&str], op: &'static str) -> Result<()> {
        let db = |e| db_error(op, e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        sqlx::query(sql.lock_timeout).execute(&mut *conn).await.map_err(db)?;
        let res = match stmts {
            [one] => sqlx::query(one).execute(&mut *conn).await.map(drop),
            many => async {
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                for stmt in many {
                    sqlx::query(stmt).execute(&mut *tx).await?;
                }
                tx.commit().await
            }
            .await,
        };
        if sqlx::query(sql.reset_lock_timeout).execute(&mut *conn).await.is_err() {
            conn.close_on_drop();
        }
        res.map_err(db)
    }

    /// Moves (or drops) detached partition `name`, whose rows are all
    /// done: copied into the archive (here in one transaction with the
    /// drop; into another database first, checked there by event), then
    /// its events' keys deleted and the table dropped. Returns its rows.
    async fn finish_detached(&self, sql: &PartitionSql, name: &str, drop: bool) -> Result<u64> {
        let db = |e| db_error("archive a partition", e);
        let count: i64 = query::<D>(&format!("SELECT COUNT(*) FROM {name}"), [])
            .try_map(|row: <D::DB as Database>::Row| sqlx::Row::try_get(&row, 0))
            .fetch_one(&self.pool)
            .await
            .map_err(db)?;
        if !drop {
            if let Some(to) = self.elsewhere() {
                self.copy_detached_elsewhere(to, name).await?;
            }
        }
        let mut tx = self.pool.begin().await.map_err(db)?;
        let res = async {
            if !drop && self.elsewhere.is_none() {
                let copy = self.table.render(&format!(
                    "INSERT INTO {{archive}} ({cols}) SELECT {cols} FROM {name} ON CONFLICT DO NOTHING",
                    cols = crate::columns!()
                ));
                sqlx::query(&copy).execute(&mut *tx).await.map_err(db)?;
                // A row the archive took under neither its id nor its event
                // (its id belongs to another event there) would be lost.
                let lost = self.table.render(&format!(
                    "SELECT COUNT(*) FROM {name} d WHERE NOT EXISTS (SELECT 1 FROM {{archive}} a \
                     WHERE a.app_code = d.app_code AND a.event_id = d.event_id)"
                ));
                let lost: i64 = query::<D>(&lost, [])
                    .try_map(|row: <D::DB as Database>::Row| sqlx::Row::try_get(&row, 0))
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(db)?;
                if lost > 0 {
                    return Err(Error::Schema(format!(
                        "`{}` holds other events under the ids of {lost} rows of the detached partition `{name}`: it stays",
                        self.table.archive()
                    )));
                }
            }
            sqlx::query(&self.partition_statement(sql.forget_keys, name, None)).execute(&mut *tx).await.map_err(db)?;
            sqlx::query(&self.partition_statement(sql.drop, name, None)).execute(&mut *tx).await.map_err(db)?;
            Ok(())
        }
        .await;
        super::finish(tx, res, "archive a partition").await?;
        Ok(count as u64)
    }

    /// Copies detached partition `name` into the archive database `to`,
    /// 1,000 rows at a time, each checked there by event.
    async fn copy_detached_elsewhere(&self, to: &dyn postbox_core::OutboxStore, name: &str) -> Result<()> {
        let db = |e| db_error("archive a partition", e);
        let p = D::PLACEHOLDERS;
        let page = self.table.render(&format!(
            "SELECT {} FROM {name} WHERE id > {} ORDER BY id LIMIT 1000",
            crate::columns!(),
            p.nth(1)
        ));
        let mut after = i64::MIN;
        loop {
            let rows = query::<D>(&page, [after.into()]).fetch_all(&self.pool).await.map_err(db)?;
            let rows = crate::records(rows, self.table.naming(), "archive a partition")?;
            let Some(last) = rows.last() else {
                return Ok(());
            };
            after = last.id;
            super::elsewhere::far("archive a partition: copy into the archive database", to.put_archived(&rows)).await?;
            let mut by_app: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
            for r in &rows {
                by_app.entry(r.app_code.as_str()).or_default().push(r.event_id.clone());
            }
            for (app_code, events) in by_app {
                let held = super::elsewhere::far("archive a partition: check the archive database", to.archived_event_ids(app_code, &events)).await?;
                if held.len() < events.len() {
                    return Err(Error::Schema(format!(
                        "the archive database's `{}` holds other events under the ids of rows of the detached partition `{name}`: it stays",
                        self.table.archive()
                    )));
                }
            }
        }
    }

    /// Where archived rows a replay brings back are created, on a
    /// partitioned table: at their own `created_at_ms` where a partition
    /// holds it, else now (their partition was archived, and an insert
    /// with no partition to go to fails). `None` on a plain table.
    pub(super) async fn created_when_back(&self) -> Result<Option<CreatedWhenBack>> {
        if self.partition_sql().is_none() {
            return Ok(None);
        }
        let ranges = self.attached_partitions().await?.into_iter().map(|a| a.range).collect();
        Ok(Some(CreatedWhenBack { ranges, now_ms: self.now_ms().await? }))
    }

    /// Detached partitions left by an interrupted archive run.
    async fn detached_partitions(&self, sql: &PartitionSql) -> Result<Vec<String>> {
        let rows = query::<D>(sql.detached, [self.table.as_str().into()])
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("list detached partitions", e))?;
        first_column(rows).map_err(|e| db_error("list detached partitions", e))
    }
}
}

/// [`SqlOutbox::created_when_back`]'s answer.
#[derive(Debug)]
pub(super) struct CreatedWhenBack {
    ranges: Vec<Range>,
    now_ms: i64,
}

impl CreatedWhenBack {
    /// A row created at `created_ms` is created at this when it comes back.
    pub(super) fn of(&self, created_ms: i64) -> i64 {
        if self.ranges.iter().any(|r| r.contains(created_ms)) {
            created_ms
        } else {
            self.now_ms
        }
    }

    /// [`CreatedWhenBack::of`] as an SQL expression of `created_at_ms`.
    pub(super) fn sql(&self) -> String {
        let held: Vec<String> = self
            .ranges
            .iter()
            .map(|r| {
                format!(
                    "(created_at_ms >= {} AND created_at_ms < {})",
                    r.from_ms, r.to_ms
                )
            })
            .collect();
        if held.is_empty() {
            return self.now_ms.to_string();
        }
        format!(
            "CASE WHEN {} THEN created_at_ms ELSE {} END",
            held.join(" OR "),
            self.now_ms
        )
    }
}

/// `FOR VALUES FROM ('1') TO ('2')` (PostgreSQL's `pg_get_expr` of a
/// partition bound) as a range.
fn parse_bound(bound: &str) -> Option<Range> {
    let numbers: Vec<i64> = bound
        .split(|c: char| !(c.is_ascii_digit() || c == '-'))
        .filter(|s| !s.is_empty() && *s != "-")
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()
        .ok()?;
    match numbers[..] {
        [from_ms, to_ms] => Some(Range { from_ms, to_ms }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_range_bound_is_read() {
        let r =
            super::parse_bound("FOR VALUES FROM ('1796342400000') TO ('1796428800000')").unwrap();
        assert_eq!((r.from_ms, r.to_ms), (1_796_342_400_000, 1_796_428_800_000));
        assert!(super::parse_bound("DEFAULT").is_none());
        assert!(super::parse_bound("FOR VALUES IN ('a')").is_none());
    }
}
