//! Live load of one worker, from two sources: the worker's periodic [`LoadReport`]s and this
//! router's own accounting of what it dispatched there and what finished since.
//!
//! A report is the worker's truth at one moment (it includes other routers' requests) but ages;
//! between reports the router adds what it dispatched and subtracts what finished since the
//! report, so a burst of decisions sees its own effect at once instead of herding onto the
//! worker that looked idle. The estimate is never below what this router alone has in flight
//! there. Each new report restarts the deltas.
//!
//! Invariants: `own_requests` and `own_pages` count exactly this router's dispatched and
//! unfinished work on the worker (a finish without a dispatch saturates at zero rather than
//! wrapping); the effective view's available pages are within `0..=total_pages`.

use nibble_discovery::Capacity;
use nibble_proto::v1;

/// What a worker says about its load (the `Worker.Load` RPC).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Requests being prefilled or decoded.
    pub running: u32,
    /// Requests queued for admission.
    pub waiting: u32,
    /// Pages no request and no cached block holds.
    pub free_pages: u64,
    /// Pages in the pool.
    pub total_pages: u64,
    /// Pages held only by the prefix cache, reclaimable by eviction.
    pub evictable_pages: u64,
    /// Prompt tokens the worker still has to compute.
    pub queued_prefill_tokens: u64,
}

impl LoadReport {
    /// Pages a request or the prefix cache holds and that eviction cannot reclaim: neither
    /// free nor evictable.
    pub fn used_pages(&self) -> u64 {
        self.total_pages
            .saturating_sub(self.free_pages.saturating_add(self.evictable_pages))
    }
}

impl From<&v1::LoadResponse> for LoadReport {
    fn from(load: &v1::LoadResponse) -> Self {
        Self {
            running: load.running_requests,
            waiting: load.waiting_requests,
            free_pages: load.free_pages,
            total_pages: load.total_pages,
            evictable_pages: load.evictable_pages,
            queued_prefill_tokens: load.queued_prefill_tokens,
        }
    }
}

/// A worker's load as the router estimates it now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests running (reported, plus dispatched minus finished since).
    pub running: u32,
    /// Requests queued on the worker (as last reported).
    pub waiting: u32,
    /// Prompt tokens the worker has still to compute (reported, plus what was dispatched minus
    /// what produced its first token since): what a new request there waits behind.
    pub queued_prefill_tokens: u64,
    /// Pages a new request could get: free plus evictable, minus what was dispatched since the
    /// report. 0 when the capacity is unknown.
    pub available_pages: u64,
    /// Pages in the pool; 0 when unknown (no report and no capacity in the registration).
    pub total_pages: u64,
    /// Requests this router has in flight on the worker.
    pub own_requests: u32,
}

impl Load {
    /// The fraction of the pool in use by requests, in `[0, 1]` (0 when the capacity is unknown).
    pub fn used_fraction(&self) -> f64 {
        if self.total_pages == 0 {
            return 0.0;
        }
        1.0 - self.available_pages as f64 / self.total_pages as f64
    }

    /// Whether `pages` more pages fit (always, when the capacity is unknown).
    pub fn fits(&self, pages: u64) -> bool {
        self.total_pages == 0 || pages <= self.available_pages
    }
}

/// One worker's load tracking (see the module docs).
#[derive(Debug, Clone, Default)]
pub(crate) struct LiveLoad {
    reported: LoadReport,
    own_requests: u32,
    own_pages: u64,
    /// Prompt tokens of this router's requests there that have no first token yet.
    own_prefill_tokens: u64,
    requests_since_report: i64,
    pages_since_report: i64,
    prefill_tokens_since_report: i64,
}

impl LiveLoad {
    /// Starts from the capacity a worker registered with.
    pub(crate) fn new(capacity: Capacity) -> Self {
        let mut load = Self::default();
        load.observe_capacity(capacity);
        load
    }

    /// A new report from the worker.
    pub(crate) fn report(&mut self, report: LoadReport) {
        self.reported = report;
        self.requests_since_report = 0;
        self.pages_since_report = 0;
        self.prefill_tokens_since_report = 0;
    }

    /// The worker's last report (the page counts of its registration until one arrives).
    pub(crate) fn reported(&self) -> LoadReport {
        self.reported
    }

    /// A registration update: the page counts it carries are a (coarser) report of pages.
    pub(crate) fn observe_capacity(&mut self, capacity: Capacity) {
        self.reported.free_pages = capacity.free_pages;
        self.reported.total_pages = capacity.total_pages;
        self.reported.evictable_pages = 0;
        self.pages_since_report = 0;
    }

    /// This router sent the worker a request that will hold `pages` pages and compute
    /// `prefill_tokens` prompt tokens there.
    pub(crate) fn dispatch(&mut self, pages: u64, prefill_tokens: u64) {
        self.own_requests += 1;
        self.own_pages += pages;
        self.requests_since_report += 1;
        self.pages_since_report += pages as i64;
        self.own_prefill_tokens += prefill_tokens;
        self.prefill_tokens_since_report += prefill_tokens as i64;
    }

    /// A request dispatched with `prefill_tokens` prompt tokens computed them (its first token
    /// came).
    pub(crate) fn prefill_finished(&mut self, prefill_tokens: u64) {
        self.own_prefill_tokens = self.own_prefill_tokens.saturating_sub(prefill_tokens);
        self.prefill_tokens_since_report -= prefill_tokens as i64;
    }

    /// A request [`dispatch`](Self::dispatch)ed with `pages` pages is done on the worker, with
    /// `prefill_tokens` of its prompt tokens never computed (0 once its first token came).
    pub(crate) fn finish(&mut self, pages: u64, prefill_tokens: u64) {
        self.own_requests = self.own_requests.saturating_sub(1);
        self.own_pages = self.own_pages.saturating_sub(pages);
        self.requests_since_report -= 1;
        self.pages_since_report -= pages as i64;
        self.prefill_finished(prefill_tokens);
    }

    /// The current estimate.
    pub(crate) fn current(&self) -> Load {
        let reported = &self.reported;
        let running = (i64::from(reported.running) + self.requests_since_report)
            .max(i64::from(self.own_requests))
            .clamp(0, i64::from(u32::MAX)) as u32;
        let total = reported.total_pages;
        let reclaimable = reported.free_pages.saturating_add(reported.evictable_pages) as i128;
        let available = (reclaimable - i128::from(self.pages_since_report))
            .min(i128::from(total.saturating_sub(self.own_pages)))
            .clamp(0, i128::from(total)) as u64;
        let queued_prefill_tokens = (i128::from(reported.queued_prefill_tokens)
            + i128::from(self.prefill_tokens_since_report))
        .max(i128::from(self.own_prefill_tokens))
        .clamp(0, i128::from(u64::MAX)) as u64;
        Load {
            running,
            waiting: reported.waiting,
            queued_prefill_tokens,
            available_pages: available,
            total_pages: total,
            own_requests: self.own_requests,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(running: u32, free: u64) -> LoadReport {
        LoadReport {
            running,
            waiting: 2,
            free_pages: free,
            total_pages: 1000,
            evictable_pages: 100,
            queued_prefill_tokens: 500,
        }
    }

    #[test]
    fn dispatches_count_until_the_next_report() {
        let mut load = LiveLoad::new(Capacity {
            free_pages: 1000,
            total_pages: 1000,
        });
        assert_eq!(load.current().running, 0);
        assert_eq!(load.current().available_pages, 1000);
        load.dispatch(10, 0);
        load.dispatch(20, 0);
        let now = load.current();
        assert_eq!((now.running, now.own_requests), (2, 2));
        assert_eq!(now.available_pages, 970);
        assert!((now.used_fraction() - 0.03).abs() < 1e-9);

        // The worker reports the two requests plus three from elsewhere.
        load.report(report(5, 870));
        let now = load.current();
        assert_eq!((now.running, now.waiting), (5, 2));
        assert_eq!(now.available_pages, 970);
        // What the worker said, without this router's estimate.
        assert_eq!(load.reported().used_pages(), 1000 - 870 - 100);

        // One finishes before the next report.
        load.finish(10, 0);
        let now = load.current();
        assert_eq!((now.running, now.own_requests), (4, 1));
        assert_eq!(now.available_pages, 980);
    }

    #[test]
    fn never_below_own_in_flight() {
        let mut load = LiveLoad::default();
        load.dispatch(4, 0);
        load.dispatch(4, 0);
        // A report taken before the requests arrived.
        load.report(report(0, 900));
        assert_eq!(load.current().running, 2);
        load.finish(4, 0);
        load.finish(4, 0);
        assert_eq!(load.current().running, 0);
        // Finishing more than was dispatched saturates.
        load.finish(4, 0);
        assert_eq!(load.current().own_requests, 0);
        assert_eq!(load.current().running, 0);
    }

    #[test]
    fn prompt_tokens_pend_until_the_first_token() {
        let mut load = LiveLoad::default();
        load.dispatch(4, 300);
        load.dispatch(4, 200);
        assert_eq!(load.current().queued_prefill_tokens, 500);
        // The worker reports the two prompts mostly computed, and another router's queued one.
        load.report(report(2, 900));
        assert_eq!(load.current().queued_prefill_tokens, 500);
        load.prefill_finished(300);
        assert_eq!(load.current().queued_prefill_tokens, 200);
        // Never below this router's own pending prompts, whatever an old report said.
        load.report(LoadReport {
            queued_prefill_tokens: 0,
            ..report(2, 900)
        });
        assert_eq!(load.current().queued_prefill_tokens, 200);
        // A request cancelled before its first token takes its prompt with it.
        load.finish(4, 200);
        load.finish(4, 0);
        assert_eq!(load.current().queued_prefill_tokens, 0);
    }

    #[test]
    fn unknown_capacity_always_fits() {
        let load = LiveLoad::default().current();
        assert_eq!(load.total_pages, 0);
        assert!(load.fits(1 << 40));
        assert_eq!(load.used_fraction(), 0.0);
        let mut known = LiveLoad::new(Capacity {
            free_pages: 8,
            total_pages: 8,
        });
        assert!(known.current().fits(8));
        known.dispatch(3, 0);
        assert!(!known.current().fits(6));
    }

    #[test]
    fn converts_from_the_wire() {
        let wire = v1::LoadResponse {
            free_pages: 1,
            total_pages: 2,
            evictable_pages: 3,
            running_requests: 4,
            waiting_requests: 5,
            pending_reservations: 6,
            queued_prefill_tokens: 7,
        };
        assert_eq!(
            LoadReport::from(&wire),
            LoadReport {
                running: 4,
                waiting: 5,
                free_pages: 1,
                total_pages: 2,
                evictable_pages: 3,
                queued_prefill_tokens: 7,
            }
        );
    }
}
