//! Prometheus metric names of the relay, the archiver and the admin gauge
//! poller (SPEC §8), in one place so that what records a metric and what
//! reads it never disagree on a name. The consumers' own
//! `postbox_consume_total` is in `postbox_consumers::metrics`.
//!
//! Everything records through the [`metrics`] facade; nothing is exported
//! unless the process installs a recorder (`postbox-admin` installs the
//! Prometheus one and then calls [`describe`]).

/// Counter `{publisher, result}`: publishes by outcome, one per event and
/// publisher. `result` is one of [`RESULT_OK`], [`RESULT_ERROR`],
/// [`RESULT_TIMEOUT`], [`RESULT_SKIPPED`], [`RESULT_DEFERRED`].
pub const PUBLISH_TOTAL: &str = "postbox_publish_total";
/// Histogram `{publisher}`: seconds one publisher took over its share of a
/// batch (one `publish_each` call, bounded by the batch's lease).
pub const PUBLISH_DURATION_SECONDS: &str = "postbox_publish_duration_seconds";
/// Histogram: seconds from `created_at_ms` to the delivered mark.
pub const DELIVERY_LAG_SECONDS: &str = "postbox_delivery_lag_seconds";
/// Counter `{app_code}`: rows that became `failed` (dead letters).
pub const DEAD_LETTERED_TOTAL: &str = "postbox_dead_lettered_total";
/// Counter: expired leases taken over (each counts as a failed attempt).
pub const LEASE_EXPIRED_TOTAL: &str = "postbox_lease_expired_total";
/// Counter: rows left out by a runtime control's sampling (`dropped`), by
/// app_code.
pub const DROPPED_TOTAL: &str = "postbox_dropped_total";
/// Gauge `{publisher, target}`: 1 for the target a publisher with failover
/// targets publishes to now, 0 for its others.
pub const PUBLISHER_ACTIVE_TARGET: &str = "postbox_publisher_active_target";
/// Counter `{publisher, from, to}`: switches between a publisher's targets.
pub const PUBLISHER_SWITCHES_TOTAL: &str = "postbox_publisher_switches_total";
/// Counter: rows moved to the archive table.
pub const ARCHIVED_TOTAL: &str = "postbox_archived_total";
/// Gauge `{app_code, status}`: rows per status, from the admin poller.
pub const OUTBOX_EVENTS: &str = "postbox_outbox_events";
/// Gauge `{app_code}`: age of the oldest pending row, from the admin poller.
pub const OUTBOX_OLDEST_PENDING_AGE_SECONDS: &str = "postbox_outbox_oldest_pending_age_seconds";
/// Gauge `{table}`: a partitioned outbox table's partitions ready after
/// the current one (set by each relay when it checks, every 10 minutes).
pub const PARTITIONS_AHEAD: &str = "postbox_partitions_ahead";
/// Sets [`PARTITIONS_AHEAD`] for `table`.
pub fn partitions_ahead(table: &str, ahead: u32) {
    metrics::gauge!(PARTITIONS_AHEAD, "table" => table.to_owned()).set(f64::from(ahead));
}

/// Histogram `{consumer}`: seconds a consumer's handler took over one
/// message (`postbox consume`; the HTTP bridge's POST and answer).
pub const CONSUME_HANDLER_SECONDS: &str = "postbox_consume_handler_seconds";

/// `result` label of a confirmed publish.
pub const RESULT_OK: &str = "ok";
/// `result` label of a publish the target refused or failed.
pub const RESULT_ERROR: &str = "error";
/// `result` label of a publish cut off by `publish_timeout`.
pub const RESULT_TIMEOUT: &str = "timeout";
/// Not handed to the publisher: it timed out on a whole batch recently and
/// is skipped for a cool-down (see the relay's publisher isolation); the
/// rows are deferred for it, no attempt counted.
pub const RESULT_SKIPPED: &str = "skipped";
/// Not handed to the publisher because it was behind (its lane was full):
/// the rows wait for it, no attempt counted.
pub const RESULT_DEFERRED: &str = "deferred";

/// Registers units and help texts with the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        PUBLISH_TOTAL,
        "Publishes by publisher and result (ok, error, timeout), one per event."
    );
    describe_histogram!(
        PUBLISH_DURATION_SECONDS,
        Unit::Seconds,
        "Time one publisher took over its share of a batch."
    );
    describe_histogram!(
        DELIVERY_LAG_SECONDS,
        Unit::Seconds,
        "Time from an event's creation to its delivered mark."
    );
    describe_counter!(
        DEAD_LETTERED_TOTAL,
        "Events that ran out of attempts and became failed."
    );
    describe_counter!(
        LEASE_EXPIRED_TOTAL,
        "Expired leases taken over; each counts as a failed attempt."
    );
    describe_counter!(
        DROPPED_TOTAL,
        "Events a runtime control's sampling left out (status dropped)."
    );
    describe_counter!(ARCHIVED_TOTAL, "Rows moved to the archive table.");
    describe_gauge!(
        PUBLISHER_ACTIVE_TARGET,
        "1 for the target a publisher with failover targets publishes to now, 0 for the others."
    );
    describe_counter!(
        PUBLISHER_SWITCHES_TOTAL,
        "Switches of a publisher between its targets (failover and failback)."
    );
    describe_histogram!(
        CONSUME_HANDLER_SECONDS,
        Unit::Seconds,
        "Time a consumer's handler took over one message."
    );
    describe_gauge!(
        PARTITIONS_AHEAD,
        "A partitioned outbox table's partitions ready after the current one (inserts past the last fail)."
    );
    describe_gauge!(
        OUTBOX_EVENTS,
        "Outbox rows by app_code and status (polled on an interval)."
    );
    describe_gauge!(
        OUTBOX_OLDEST_PENDING_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest pending row per app_code (polled on an interval)."
    );
}
