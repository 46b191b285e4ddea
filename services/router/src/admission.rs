//! Admission: at most `max_running` requests are dispatched at once; more wait, first come first
//! served, in a queue of at most `max_queued` for at most `queue_timeout`. A request that finds
//! the queue full, or waits out its timeout, is refused with `RESOURCE_EXHAUSTED` — never
//! dropped, never hung.
//!
//! The limit bounds the work one router puts on its workers (each running request holds KV pages
//! on a decode worker); workers still refuse a reservation they cannot fit, which the router
//! passes on as `RESOURCE_EXHAUSTED` too.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

/// How many requests run and wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Requests dispatched to workers at once.
    pub max_running: usize,
    /// Requests waiting for one of those places; more are refused at once.
    pub max_queued: usize,
    /// How long a request waits for a place before it is refused.
    pub queue_timeout: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_running: 64,
            max_queued: 256,
            queue_timeout: Duration::from_secs(30),
        }
    }
}

/// The running places and the queue in front of them.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    places: Arc<Semaphore>,
    waiting: AtomicUsize,
}

/// A running place; dropping it lets the next queued request in.
#[derive(Debug)]
pub struct Place(#[allow(dead_code)] OwnedSemaphorePermit);

/// Counts one queued request while it lives.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Admission {
    /// Admission under `config`; `max_running` is at least 1.
    pub fn new(config: AdmissionConfig) -> Self {
        let config = AdmissionConfig {
            max_running: config.max_running.max(1),
            ..config
        };
        Self {
            places: Arc::new(Semaphore::new(config.max_running)),
            waiting: AtomicUsize::new(0),
            config,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> AdmissionConfig {
        self.config
    }

    /// Requests holding a running place.
    pub fn running(&self) -> usize {
        self.config.max_running - self.places.available_permits()
    }

    /// Requests in the queue.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// A running place: at once when one is free, else after waiting in the queue.
    /// `RESOURCE_EXHAUSTED` when the queue is full or the wait times out.
    pub async fn admit(&self) -> Result<Place, Status> {
        if let Ok(permit) = Arc::clone(&self.places).try_acquire_owned() {
            return Ok(Place(permit));
        }
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        let _queued = Queued(&self.waiting);
        if before >= self.config.max_queued {
            return Err(Status::resource_exhausted(format!(
                "the router is at capacity: {} requests running and {} queued (the queue's limit)",
                self.running(),
                self.config.max_queued
            )));
        }
        match tokio::time::timeout(
            self.config.queue_timeout,
            Arc::clone(&self.places).acquire_owned(),
        )
        .await
        {
            Ok(Ok(permit)) => Ok(Place(permit)),
            Ok(Err(_)) => Err(Status::unavailable("the router is shutting down")),
            Err(_) => Err(Status::resource_exhausted(format!(
                "the router is at capacity: waited {} ms in the queue for one of {} running places",
                self.config.queue_timeout.as_millis(),
                self.config.max_running
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn admission(max_running: usize, max_queued: usize, timeout_ms: u64) -> Arc<Admission> {
        Arc::new(Admission::new(AdmissionConfig {
            max_running,
            max_queued,
            queue_timeout: Duration::from_millis(timeout_ms),
        }))
    }

    #[tokio::test]
    async fn full_queue_is_refused_and_a_freed_place_admits_the_next() {
        let a = admission(1, 1, 10_000);
        let first = a.admit().await.unwrap();
        assert_eq!((a.running(), a.waiting()), (1, 0));
        let queued = tokio::spawn({
            let a = Arc::clone(&a);
            async move { a.admit().await.map(|_| ()) }
        });
        while a.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        let refused = a.admit().await.unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert!(
            refused.message().contains("queued"),
            "{}",
            refused.message()
        );
        drop(first);
        queued.await.unwrap().unwrap();
        assert_eq!((a.running(), a.waiting()), (0, 0));
    }

    #[tokio::test]
    async fn a_wait_past_the_timeout_is_refused() {
        let a = admission(1, 4, 20);
        let _held = a.admit().await.unwrap();
        let err = a.admit().await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert!(err.message().contains("waited 20 ms"), "{}", err.message());
        assert_eq!(a.waiting(), 0, "a refused request leaves the queue");
    }

    #[tokio::test]
    async fn a_cancelled_wait_leaves_the_queue() {
        let a = admission(1, 1, 10_000);
        let _held = a.admit().await.unwrap();
        let waiter = tokio::spawn({
            let a = Arc::clone(&a);
            async move { a.admit().await.map(|_| ()) }
        });
        while a.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(a.waiting(), 0);
    }
}
