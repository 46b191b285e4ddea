//! Gauges set at scrape time: each service registers a [`Collect`]or, held weakly, that reads
//! its state (a worker asks its engine for pages and queues; the router reads its admission
//! queue and worker table) and sets its gauges just before the recorder renders.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};

/// What [`Collect::collect`] returns.
pub type CollectFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// A source of gauges sampled when the metrics are scraped.
pub trait Collect: Send + Sync {
    /// Sets this source's gauges to their current values. Should not take long: a scrape waits
    /// for every collector.
    fn collect(&self) -> CollectFuture<'_>;
}

static COLLECTORS: Mutex<Vec<Weak<dyn Collect>>> = Mutex::new(Vec::new());

fn collectors() -> std::sync::MutexGuard<'static, Vec<Weak<dyn Collect>>> {
    COLLECTORS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Asks `collector` for its gauges before every scrape, for as long as it lives elsewhere.
pub fn register<C: Collect + 'static>(collector: &Arc<C>) {
    let weak: Weak<dyn Collect> = Arc::downgrade(collector) as Weak<dyn Collect>;
    let mut all = collectors();
    all.retain(|c| c.strong_count() > 0);
    all.push(weak);
}

/// Runs every live collector, one after the other.
pub(crate) async fn collect_all() {
    let live: Vec<Arc<dyn Collect>> = {
        let mut all = collectors();
        all.retain(|c| c.strong_count() > 0);
        all.iter().filter_map(Weak::upgrade).collect()
    };
    for collector in live {
        collector.collect().await;
    }
}
