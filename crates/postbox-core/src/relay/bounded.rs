//! The relay's store, each call bounded in time.
//!
//! A statement whose database went silent (a failover whose old primary
//! vanished without a reset, a frozen VM) waits for good: the drivers set
//! no TCP keepalive and the server's `statement_timeout` cannot answer for
//! a server that is gone. A claim waiting so held the relay for good while
//! its heartbeat, on another connection, kept saying it was alive. Each
//! call here ends after the lease at most (a mark that takes longer is of
//! no use: the rows' leases have run out) with a database error, and the
//! relay goes on as after any database error: it claims again, on a new
//! connection. A claim gets twice the lease: one that waited on a lock
//! (DDL on the table) still commits on the server after the relay gave up
//! on it, and its rows, leased to a relay that never publishes them, would
//! wait out their lease and be taken over with an attempt counted. Their
//! lease starts when the claim runs, so a late answer is still worth
//! publishing.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::event::Fence;
use crate::store::{ClaimRequest, DeferUpdate, FailureUpdate, RelayBeat, RelayStore};
use crate::{ClaimSource, ClaimedEvent, Error, EventRecord, Result, TableName};

pub(super) struct Bounded {
    pub(super) inner: Arc<dyn RelayStore>,
    /// How long one call may take.
    pub(super) within: Duration,
}

impl Bounded {
    async fn call<T>(
        &self,
        operation: &'static str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.call_within(self.within, operation, work).await
    }

    async fn call_within<T>(
        &self,
        within: Duration,
        operation: &'static str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        Error::unless_silent(operation, within, work).await
    }
}

#[async_trait]
impl RelayStore for Bounded {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    async fn beat(&self, beat: &RelayBeat) -> Result<()> {
        self.call("heartbeat", self.inner.beat(beat)).await
    }

    fn table(&self) -> &TableName {
        self.inner.table()
    }

    async fn claim(
        &self,
        source: ClaimSource,
        req: &ClaimRequest<'_>,
    ) -> Result<Vec<ClaimedEvent>> {
        let within = 2 * self.within;
        self.call_within(within, "claim", self.inner.claim(source, req))
            .await
    }

    async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        self.call("mark delivered", self.inner.mark_delivered(fence, ids))
            .await
    }

    async fn mark_failed(&self, fence: &Fence, ids: &[i64], update: &FailureUpdate) -> Result<u64> {
        self.call("mark failed", self.inner.mark_failed(fence, ids, update))
            .await
    }

    async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        self.call("release", self.inner.release(fence, ids)).await
    }

    async fn defer(&self, fence: &Fence, ids: &[i64], update: &DeferUpdate) -> Result<u64> {
        self.call("defer", self.inner.defer(fence, ids, update))
            .await
    }

    async fn now_ms(&self) -> Result<i64> {
        self.call("read the clock", self.inner.now_ms()).await
    }

    async fn find(&self, event_id: &str) -> Result<Vec<EventRecord>> {
        self.call("find", self.inner.find(event_id)).await
    }

    async fn due(&self, app_codes: &[String]) -> Result<Vec<crate::wake::Due>> {
        self.call("idle probe", self.inner.due(app_codes)).await
    }

    async fn controls(&self) -> Result<Vec<crate::control::Control>> {
        self.call("read controls", self.inner.controls()).await
    }

    fn wake(&self) -> Option<crate::wake::Wake> {
        self.inner.wake()
    }

    fn listen(
        &self,
        wake: crate::wake::Wake,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Option<crate::BoxFuture<'static, ()>> {
        self.inner.listen(wake, shutdown)
    }
}
