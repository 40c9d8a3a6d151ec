//! Test support for postbox: where the servers are, scratch table names,
//! publishers for tests, and the conformance suite every backend runs.
//!
//! A missing server is a loud failure naming the server and how to start
//! it, never a silent skip.

pub mod adopted;
pub mod amqp;
pub mod cli_fixtures;
pub mod clusters;
pub mod conformance;
pub mod consumer_fixtures;
pub mod faults;
pub mod http;
pub mod netns;
pub mod proxy;
pub mod publisher_suite;
pub mod publishers;
pub mod records;
pub mod servers;
pub mod sql_text;
pub mod store_setup;
pub mod wake;

pub use publishers::RecordingPublisher;
pub use servers::{amqp_url, mysql_url, nats_url, postgres_url, redis_url, scratch_table};

/// Checks the plan of the claim `query` among `plans`: it reads through
/// the index it was written for and, measured, at most `max_rows` rows.
pub fn assert_plan_reads(plans: &[postbox_core::store::QueryPlan], query: &str, max_rows: u64) {
    let p = plans
        .iter()
        .find(|p| p.query == query)
        .unwrap_or_else(|| panic!("no plan of {query}"));
    assert!(
        p.is_good(),
        "{query} reads {:?}, not {}:\n{}",
        p.indexes_used,
        p.expected_index,
        p.plan
    );
    let read = p.rows_examined.expect("the database counts rows read");
    assert!(read <= max_rows, "{query} read {read} rows:\n{}", p.plan);
}

/// Checks claim plans: each reads through the index it was written for,
/// scans nothing whole, and (where measured) reads at most `max_rows` rows.
pub fn assert_claim_plans(plans: &[postbox_core::store::QueryPlan], max_rows: u64) {
    assert_eq!(plans.len(), 4, "four claim queries");
    for p in plans {
        assert!(
            p.is_good(),
            "{} does not use {} (uses {:?}, full scan {}):\n{}",
            p.query,
            p.expected_index,
            p.indexes_used,
            p.full_scan,
            p.plan
        );
        if let Some(rows) = p.rows_examined {
            assert!(
                rows <= max_rows,
                "{} read {rows} rows, more than {max_rows}:\n{}",
                p.query,
                p.plan
            );
        }
        println!(
            "{}: index {:?}, rows read {:?}",
            p.query, p.indexes_used, p.rows_examined
        );
    }
}
