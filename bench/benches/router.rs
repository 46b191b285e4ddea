//! Router decision latency (p50/p99/max) and decisions per second against a prefix index holding
//! 16 workers × 100k blocks, with ~2k-token prompts (see `nibble_bench::router` for the
//! workload).
//!
//! Criterion reports means; a routing decision's tail matters, so this bench has its own
//! harness: it times every decision and prints percentiles. One thread, as in the service, where
//! one task owns the router state.
//!
//! Phases, each over the same cycling mix of prompts with 64 requests in flight (the oldest is
//! finished as each new one is routed, so load accounting moves as it does when serving):
//! 1. latency: `Router::route` (index walk, scoring, choice, in-flight accounting) timed one by
//!    one;
//! 2. throughput: the same loop timed as a whole, `finish` included;
//! 3. the index walk alone (`PrefixIndex::prefix_depths` over every worker);
//! 4. hashing a raw 2k-token prompt (`Prompt::new`), which a service does before routing;
//! 5. the worst case: `route` for prompts every worker caches whole, so the walk visits all 128
//!    blocks with all 16 workers still matching.
//!
//! `NIBBLE_BENCH_DECISIONS` sets decisions per phase (default 200,000). Run without `--bench`
//! (as `cargo test --all-targets` does), it only checks that every phase works, on a small
//! workload.

use std::collections::{BTreeMap, VecDeque};
use std::hint::black_box;
use std::time::Instant;

use nibble_bench::router::{cached_everywhere, percentiles, workload, Workload, WorkloadConfig};
use nibble_router::{Prompt, Reason, Ticket, WorkerSet};

/// Requests kept in flight while routing.
const IN_FLIGHT: usize = 64;
/// Decisions routed before measuring.
const WARM_UP: usize = 20_000;
const QUANTILES: [f64; 5] = [0.5, 0.9, 0.99, 0.999, 1.0];

fn main() {
    // `cargo bench` passes `--bench`; `cargo test` runs benchmarks without it, as a smoke test.
    let measuring = std::env::args().any(|arg| arg == "--bench");
    let (config, default_decisions) = if measuring {
        (WorkloadConfig::default(), 200_000)
    } else {
        println!("test mode (no --bench): a small workload, to check that every phase runs");
        (WorkloadConfig::smoke_test(), 1_000)
    };
    let decisions = std::env::var("NIBBLE_BENCH_DECISIONS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default_decisions);
    let start = Instant::now();
    let mut w = workload(&config);
    let stats = w.router.stats();
    println!(
        "workload: {} prefill + {} decode workers × {} blocks, {} distinct blocks, built in {:.1} s",
        stats.prefill_workers,
        stats.decode_workers,
        config.blocks_per_worker,
        stats.index_blocks,
        start.elapsed().as_secs_f64()
    );
    println!(
        "index fill: {} Stored events, {} blocks in {:.0} ms = {:.1} M blocks/s",
        w.events,
        w.stored_blocks,
        w.fill_time.as_secs_f64() * 1e3,
        w.stored_blocks as f64 / w.fill_time.as_secs_f64() / 1e6
    );
    println!(
        "prompts: {} tokens ({} full pages), {} distinct, {decisions} decisions per phase",
        w.prompts[0].tokens(),
        w.prompts[0].hashes().len(),
        w.prompts.len()
    );

    let warm_up = WARM_UP.min(decisions);
    let mut driver = Driver::default();
    for i in 0..warm_up {
        driver.route(&mut w, i);
    }
    let mut samples: Vec<u64> = (0..decisions)
        .map(|i| driver.route_timed(&mut w, warm_up + i))
        .collect();
    report("route (latency phase)", &mut samples);
    driver.print_mix();

    let start = Instant::now();
    for i in 0..decisions {
        driver.route(&mut w, i);
    }
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "throughput: {decisions} decisions (route + finish) in {:.3} s = {:.0} decisions/s",
        elapsed,
        decisions as f64 / elapsed
    );

    let all = w.router.index().workers();
    let mut samples: Vec<u64> = (0..decisions)
        .map(|i| {
            let hashes = w.prompts[i % w.prompts.len()].hashes();
            let start = Instant::now();
            black_box(w.router.index().prefix_depths(black_box(hashes), all));
            start.elapsed().as_nanos() as u64
        })
        .collect();
    report("index walk (prefix_depths)", &mut samples);

    let page_size = config.page_size;
    let mut samples: Vec<u64> = (0..decisions.div_ceil(10))
        .map(|i| {
            let tokens = &w.raw_prompts[i % w.raw_prompts.len()];
            let start = Instant::now();
            black_box(Prompt::new(black_box(tokens), page_size).expect("a valid prompt"));
            start.elapsed().as_nanos() as u64
        })
        .collect();
    report("hash a prompt (Prompt::new)", &mut samples);

    w.prompts = cached_everywhere(&mut w.router, &config, 256);
    let mut driver = Driver::default();
    let mut samples: Vec<u64> = (0..decisions)
        .map(|i| driver.route_timed(&mut w, i))
        .collect();
    report("route, prompt cached whole on every worker", &mut samples);
    driver.print_mix();
}

/// Routes prompts with `IN_FLIGHT` requests in flight (the oldest ends as a new one starts)
/// and tallies what timed decisions chose.
#[derive(Default)]
struct Driver {
    in_flight: VecDeque<(Ticket, Reason)>,
    reasons: BTreeMap<&'static str, usize>,
    cached_tokens: usize,
}

impl Driver {
    /// Routes prompt `i` (cycling), untimed.
    fn route(&mut self, w: &mut Workload, i: usize) {
        let prompt = &w.prompts[i % w.prompts.len()];
        let routed = w
            .router
            .route(black_box(prompt), WorkerSet::EMPTY)
            .expect("the workload has decode workers");
        self.retire(w, routed.ticket, routed.decision.reason);
    }

    /// Routes prompt `i` (cycling); returns the nanoseconds `Router::route` took.
    fn route_timed(&mut self, w: &mut Workload, i: usize) -> u64 {
        let prompt = &w.prompts[i % w.prompts.len()];
        let start = Instant::now();
        let routed = w
            .router
            .route(black_box(prompt), WorkerSet::EMPTY)
            .expect("the workload has decode workers");
        let ns = start.elapsed().as_nanos() as u64;
        *self
            .reasons
            .entry(routed.decision.reason.as_str())
            .or_default() += 1;
        self.cached_tokens += routed.decision.decode.cached_tokens;
        self.retire(w, routed.ticket, routed.decision.reason);
        ns
    }

    fn retire(&mut self, w: &mut Workload, ticket: Ticket, reason: Reason) {
        self.in_flight.push_back((ticket, reason));
        if self.in_flight.len() > IN_FLIGHT {
            if let Some((old, reason)) = self.in_flight.pop_front() {
                if reason == Reason::Disaggregated {
                    w.router.prefill_done(old);
                }
                w.router.finish(old);
            }
        }
    }

    fn print_mix(&self) {
        let routed = self.reasons.values().sum::<usize>().max(1);
        let mix: Vec<String> = self
            .reasons
            .iter()
            .map(|(reason, n)| format!("{reason} {:.1}%", 100.0 * *n as f64 / routed as f64))
            .collect();
        println!(
            "  decisions: {}; mean cached on the decode worker {:.0} tokens",
            mix.join(", "),
            self.cached_tokens as f64 / routed as f64
        );
    }
}

fn report(what: &str, samples: &mut [u64]) {
    let mean = samples.iter().sum::<u64>() as f64 / samples.len() as f64;
    let p = percentiles(samples, &QUANTILES);
    let us = |ns: u64| ns as f64 / 1e3;
    println!(
        "{what}: mean {:.2} µs, p50 {:.2} µs, p90 {:.2} µs, p99 {:.2} µs, p99.9 {:.2} µs, max {:.1} µs ({} samples)",
        mean / 1e3,
        us(p[0]),
        us(p[1]),
        us(p[2]),
        us(p[3]),
        us(p[4]),
        samples.len()
    );
}
