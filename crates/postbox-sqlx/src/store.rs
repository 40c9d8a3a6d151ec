//! The capability traits (and so [`OutboxStore`](postbox_core::OutboxStore))
//! implemented by a store's inherent methods of the same names: the engine
//! uses it for every dialect.

/// Implements [`RelayStore`](postbox_core::RelayStore),
/// [`EnqueueStore`](postbox_core::EnqueueStore),
/// [`InspectStore`](postbox_core::InspectStore),
/// [`ReplayStore`](postbox_core::ReplayStore),
/// [`ArchiveStore`](postbox_core::ArchiveStore) and
/// [`SchemaStore`](postbox_core::SchemaStore) for a type whose inherent
/// methods carry the trait methods' names and signatures:
/// `capabilities_from_inherent!(impl[generics] Type where [bounds])`.
#[macro_export]
macro_rules! capabilities_from_inherent {
    (impl[$($gen:tt)*] $ty:ty where [$($bounds:tt)*]) => {
        const _: () = {
            use $crate::__private::async_trait;
            use $crate::__private::postbox_core::event::Fence;
            use $crate::__private::postbox_core::store::{
                AppStats, ArchiveReport, ArchiveRequest, ArchiveStore, ClaimRequest, ControlStore,
                DeferUpdate, EnqueueOutcome, EnqueueStore, EventFilter, FailureUpdate, HistoryEntry,
                InspectStore, MigrateReport, MinuteCount, QueryPlan, RelayBeat, RelaySeen, RelayStore, ReplayRequest,
                ReplayStore, SchemaReport, SchemaStore, StatementStats, StuckAggregate,
            };
            use $crate::__private::postbox_core::{
                ClaimSource, ClaimedEvent, EventRecord, NewEvent, Result, TableName,
            };
            use $crate::__private::postbox_core::control::{Control, ControlLogEntry};

            #[async_trait]
            impl<$($gen)*> RelayStore for $ty where $($bounds)* {
                fn backend(&self) -> &'static str {
                    <$ty>::backend(self)
                }
                async fn beat(&self, beat: &RelayBeat) -> Result<()> {
                    <$ty>::beat(self, beat).await
                }
                fn table(&self) -> &TableName {
                    <$ty>::table(self)
                }
                async fn claim(&self, source: ClaimSource, req: &ClaimRequest<'_>) -> Result<Vec<ClaimedEvent>> {
                    <$ty>::claim(self, source, req).await
                }
                async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
                    <$ty>::mark_delivered(self, fence, ids).await
                }
                async fn mark_failed(&self, fence: &Fence, ids: &[i64], update: &FailureUpdate) -> Result<u64> {
                    <$ty>::mark_failed(self, fence, ids, update).await
                }
                async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
                    <$ty>::release(self, fence, ids).await
                }
                async fn defer(&self, fence: &Fence, ids: &[i64], update: &DeferUpdate) -> Result<u64> {
                    <$ty>::defer(self, fence, ids, update).await
                }
                async fn now_ms(&self) -> Result<i64> {
                    <$ty>::now_ms(self).await
                }
                async fn find(&self, event_id: &str) -> Result<Vec<EventRecord>> {
                    <$ty>::find(self, event_id).await
                }
                async fn due(&self, app_codes: &[String]) -> Result<Vec<$crate::__private::postbox_core::wake::Due>> {
                    <$ty>::due(self, app_codes).await
                }
                async fn controls(&self) -> Result<Vec<Control>> {
                    <$ty>::controls(self).await
                }
                fn wake(&self) -> Option<$crate::__private::postbox_core::wake::Wake> {
                    <$ty>::wake(self)
                }
                fn listen(
                    &self,
                    wake: $crate::__private::postbox_core::wake::Wake,
                    shutdown: $crate::__private::postbox_core::relay::CancellationToken,
                ) -> Option<$crate::dialect::WakeFuture> {
                    <$ty>::listen(self, wake, shutdown)
                }
            }

            #[async_trait]
            impl<$($gen)*> EnqueueStore for $ty where $($bounds)* {
                async fn enqueue_batch(&self, events: &[NewEvent], max_payload_bytes: usize) -> Result<Vec<EnqueueOutcome>> {
                    <$ty>::enqueue_batch(self, events, max_payload_bytes).await
                }
            }

            #[async_trait]
            impl<$($gen)*> InspectStore for $ty where $($bounds)* {
                async fn stats(&self, app_codes: &[String]) -> Result<Vec<AppStats>> {
                    <$ty>::stats(self, app_codes).await
                }
                async fn present_app_codes(&self) -> Result<Vec<String>> {
                    <$ty>::present_app_codes(self).await
                }
                async fn list(&self, filter: &EventFilter) -> Result<Vec<EventRecord>> {
                    <$ty>::list(self, filter).await
                }
                async fn delivered_per_minute(&self, app_code: &str, since_ms: i64) -> Result<Vec<MinuteCount>> {
                    <$ty>::delivered_per_minute(self, app_code, since_ms).await
                }
                async fn find_archived(&self, event_id: &str, app_codes: &[String]) -> Result<Vec<EventRecord>> {
                    <$ty>::find_archived(self, event_id, app_codes).await
                }
                async fn list_archived(&self, filter: &EventFilter) -> Result<Vec<EventRecord>> {
                    <$ty>::list_archived(self, filter).await
                }
                async fn history(&self, event_id: &str) -> Result<Vec<HistoryEntry>> {
                    <$ty>::history(self, event_id).await
                }
                async fn archived_event_ids(&self, app_code: &str, event_ids: &[String]) -> Result<Vec<String>> {
                    <$ty>::archived_event_ids(self, app_code, event_ids).await
                }
                async fn relays(&self) -> Result<Vec<RelaySeen>> {
                    <$ty>::relays(self).await
                }
                async fn stuck_aggregates(&self, app_code: &str, older_than_ms: i64, limit: u32) -> Result<Vec<StuckAggregate>> {
                    <$ty>::stuck_aggregates(self, app_code, older_than_ms, limit).await
                }
            }

            #[async_trait]
            impl<$($gen)*> ControlStore for $ty where $($bounds)* {
                async fn set_control(&self, control: &Control, by: &str) -> Result<Control> {
                    <$ty>::set_control(self, control, by).await
                }
                async fn clear_control(&self, app_code: &str, event_type: &str, by: &str) -> Result<bool> {
                    <$ty>::clear_control(self, app_code, event_type, by).await
                }
                async fn control_log(&self, limit: u32) -> Result<Vec<ControlLogEntry>> {
                    <$ty>::control_log(self, limit).await
                }
            }

            #[async_trait]
            impl<$($gen)*> ReplayStore for $ty where $($bounds)* {
                async fn replay_ids_after(
                    &self,
                    filter: &EventFilter,
                    after_id: i64,
                    size: u32,
                ) -> Result<Vec<i64>> {
                    <$ty>::replay_ids_after(self, filter, after_id, size).await
                }
                async fn replay_to(&self, request: ReplayRequest<'_>) -> Result<Vec<EventRecord>> {
                    <$ty>::replay_to(self, request).await
                }
            }

            #[async_trait]
            impl<$($gen)*> ArchiveStore for $ty where $($bounds)* {
                async fn archive(&self, req: &ArchiveRequest, on_batch: &(dyn Fn(u64) + Send + Sync)) -> Result<ArchiveReport> {
                    <$ty>::archive(self, req, on_batch).await
                }
                async fn put_archived(&self, rows: &[EventRecord]) -> Result<u64> {
                    <$ty>::put_archived(self, rows).await
                }
                async fn archived_rows(&self, filter: &EventFilter) -> Result<Vec<EventRecord>> {
                    <$ty>::archived_rows(self, filter).await
                }
                async fn archived_ids(&self, filter: &EventFilter) -> Result<Vec<i64>> {
                    <$ty>::archived_ids(self, filter).await
                }
                async fn archived_app_codes(&self) -> Result<Vec<String>> {
                    <$ty>::app_codes_in(self, "{archive}").await
                }
                async fn delete_archived(&self, ids: &[i64]) -> Result<u64> {
                    <$ty>::delete_archived(self, ids).await
                }
            }

            #[async_trait]
            impl<$($gen)*> SchemaStore for $ty where $($bounds)* {
                async fn migrate(&self) -> Result<MigrateReport> {
                    <$ty>::migrate(self).await
                }
                async fn inspect_schema(&self) -> Result<SchemaReport> {
                    <$ty>::inspect_schema(self).await
                }
                async fn keep_partitions(&self) -> Result<Vec<String>> {
                    <$ty>::keep_partitions(self).await
                }
                async fn check_partitioning(&self) -> Result<()> {
                    <$ty>::check_partitioning(self).await
                }
                async fn partitions_ahead(&self) -> Result<Option<postbox_core::store::PartitionsAhead>> {
                    <$ty>::partitions_ahead(self).await
                }
                async fn statement_stats(&self) -> Result<StatementStats> {
                    <$ty>::statement_stats(self).await
                }
                async fn aggregate_index(&self, wanted: bool) -> Result<Vec<String>> {
                    <$ty>::aggregate_index(self, wanted).await
                }
                async fn adopt_with(
                    &self,
                    apply: bool,
                    progress: &(dyn for<'s> Fn(postbox_core::store::AdoptStep<'s>) + Send + Sync),
                ) -> Result<postbox_core::store::AdoptReport> {
                    <$ty>::adopt_with(self, apply, progress).await
                }
                async fn explain_claims(&self, app_code: &str, limit: u32) -> Result<Vec<QueryPlan>> {
                    <$ty>::explain_claims(self, app_code, limit).await
                }
                async fn explain_index_use(&self, app_code: &str) -> Result<Vec<QueryPlan>> {
                    <$ty>::explain_index_use(self, app_code).await
                }
            }
        };
    };
}

crate::capabilities_from_inherent!(
    impl[D: crate::Dialect] crate::SqlOutbox<D> where [
        for<'c> &'c mut <D::DB as sqlx::Database>::Connection: sqlx::Executor<'c, Database = D::DB>,
        for<'q> <D::DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, D::DB>,
        for<'r> i64: sqlx::Decode<'r, D::DB> + sqlx::Type<D::DB>,
        for<'r> i32: sqlx::Decode<'r, D::DB> + sqlx::Type<D::DB>,
        for<'r> String: sqlx::Decode<'r, D::DB> + sqlx::Type<D::DB>,
        for<'a> &'a str: sqlx::ColumnIndex<<D::DB as sqlx::Database>::Row>,
        usize: sqlx::ColumnIndex<<D::DB as sqlx::Database>::Row>,
    ]
);
