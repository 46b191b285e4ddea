//! Offering one load point's jobs to a cluster: closed loop (a fixed number of clients, each
//! sending its next job when the last one finished) or open loop (jobs arriving as a seeded
//! Poisson process, each on its own client task, however many are in flight).
//!
//! A multi-turn job runs its turns in order on one client: each turn sends the conversation so
//! far (earlier prompts and the answers as generated: their token ids over gRPC, their text
//! tokenized again over HTTP, as a chat client would send it) plus its new tokens, after the
//! job's think time.
//!
//! When a request fails and the cluster no longer answers a fresh call, the point stops
//! sending: what was measured is kept and the point is marked
//! lost, so the run can report it and exit non-zero.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nibble_engine::Tokenizer;
use nibble_telemetry::progress::{Bar, Unit};
use tokio::sync::mpsc;

use super::client::{Answer, Ask, Client};
use super::scrape::{Metrics, Scraper};
use super::summary::{Load, RequestRecord, Sample};
use super::workload::{arrival_gaps, Job};

/// How often the cluster's state is sampled while a point runs.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// One load point to run.
pub struct Point {
    pub config: String,
    pub load: Load,
    pub jobs: Vec<Job>,
    pub ignore_eos: bool,
    /// Whether the jobs come in several phases (each record then says which).
    pub phased: bool,
    pub seed: u64,
}

/// What a point measured.
pub struct Measured {
    pub records: Vec<RequestRecord>,
    pub duration_s: f64,
    pub samples: Vec<Sample>,
    pub before: Metrics,
    pub after: Metrics,
    /// Set when the cluster stopped answering during the point (what it was told).
    pub lost: Option<String>,
}

/// What every client task shares.
struct Shared {
    client: Client,
    tokenizer: Arc<Tokenizer>,
    config: String,
    load: String,
    ignore_eos: bool,
    phased: bool,
    start: Instant,
    sent: AtomicUsize,
    stop: AtomicBool,
    lost: Arc<std::sync::Mutex<Option<String>>>,
    records: mpsc::UnboundedSender<RequestRecord>,
}

impl Shared {
    /// Runs `job`'s turns in order; stops early when the point is stopped.
    async fn run(&self, job: &Job) {
        let mut client = self.client.clone();
        let mut context: Vec<u32> = Vec::new();
        for (turn, step) in job.turns.iter().enumerate() {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            if turn > 0 && !job.think.is_zero() {
                tokio::time::sleep(job.think).await;
            }
            context.extend(&step.new_tokens);
            let index = self.sent.fetch_add(1, Ordering::Relaxed);
            let start_s = self.start.elapsed().as_secs_f64();
            let ask = Ask {
                prompt: &context,
                max_tokens: step.output,
                ignore_eos: self.ignore_eos,
            };
            let Answer {
                mut record,
                token_ids,
                text,
            } = client.send(&ask).await;
            record.config = self.config.clone();
            record.load = self.load.clone();
            record.index = index;
            record.group = job.group;
            record.phase = self.phased.then_some(job.phase);
            record.turn = (job.turns.len() > 1).then_some(turn);
            record.start_s = start_s;
            let failed = record.error.clone();
            let _ = self.records.send(record);
            if let Some(error) = failed {
                if !client.alive().await {
                    self.stop.store(true, Ordering::Relaxed);
                    self.lost.lock().expect("not poisoned").get_or_insert(error);
                }
                return;
            }
            if turn + 1 < job.turns.len() {
                match token_ids.is_empty() {
                    false => context.extend(token_ids),
                    true => context.extend(self.tokenizer.encode(&text, false).unwrap_or_default()),
                }
            }
        }
    }
}

/// Runs `point` against `client`, sampling `scraper` while it runs.
pub async fn run(
    client: &Client,
    scraper: &Scraper,
    tokenizer: Arc<Tokenizer>,
    point: Point,
) -> Measured {
    let turns: usize = point.jobs.iter().map(|j| j.turns.len()).sum();
    let bar = Bar::new(
        format!("{} {}", point.config, point.load.label()),
        turns as u64,
        Unit::Steps,
    );
    let before = scraper.read().await.unwrap_or_default();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    let lost = Arc::new(std::sync::Mutex::new(None));
    // The only handle outside the client tasks: when `offer` ends, the last sender goes and
    // the collector below ends.
    let shared = Arc::new(Shared {
        client: client.clone(),
        tokenizer,
        config: point.config.clone(),
        load: point.load.label(),
        ignore_eos: point.ignore_eos,
        phased: point.phased,
        start,
        sent: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        lost: Arc::clone(&lost),
        records: tx,
    });
    let offered = offer(shared, Arc::new(point.jobs), point.load, point.seed);
    let collect = async {
        let mut records = Vec::with_capacity(turns);
        let sampling = scraper.sample_until(start, SAMPLE_EVERY, async {
            while let Some(record) = rx.recv().await {
                records.push(record);
                bar.set(records.len() as u64);
            }
        });
        let samples = sampling.await;
        (records, samples)
    };
    let ((), (mut records, samples)) = tokio::join!(offered, collect);
    let duration_s = start.elapsed().as_secs_f64();
    drop(bar);
    records.sort_by_key(|r| r.index);
    let after = scraper.read().await.unwrap_or_default();
    let lost = lost.lock().expect("not poisoned").take();
    Measured {
        records,
        duration_s,
        samples,
        before,
        after,
        lost,
    }
}

/// Offers the jobs as `load` says and returns when every one has ended, dropping `shared` (and
/// with it the records' last sender).
async fn offer(shared: Arc<Shared>, jobs: Arc<Vec<Job>>, load: Load, seed: u64) {
    let mut tasks = tokio::task::JoinSet::new();
    match load {
        Load::Concurrency(clients) => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..clients.max(1) {
                let (shared, jobs, next) =
                    (Arc::clone(&shared), Arc::clone(&jobs), Arc::clone(&next));
                tasks.spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= jobs.len() || shared.stop.load(Ordering::Relaxed) {
                            return;
                        }
                        shared.run(&jobs[i]).await;
                    }
                });
            }
        }
        Load::Rate(rate) => {
            let gaps = arrival_gaps(rate, jobs.len(), seed);
            let start = Instant::now();
            let mut at = 0.0;
            for (i, gap) in gaps.into_iter().enumerate() {
                // Arrival times are absolute: a slow spawn does not delay the ones after it.
                at += gap;
                let due = start + Duration::from_secs_f64(at);
                tokio::time::sleep_until(due.into()).await;
                if shared.stop.load(Ordering::Relaxed) {
                    break;
                }
                let (shared, jobs) = (Arc::clone(&shared), Arc::clone(&jobs));
                tasks.spawn(async move { shared.run(&jobs[i]).await });
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    drop(shared);
}
