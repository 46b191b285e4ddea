//! `nibble bench`: a load generator and measurement of a serving cluster, as its users run it.
//!
//! It sends seeded, token-exact requests ([`workload`]) through the router's gRPC API or its
//! OpenAI HTTP API ([`client`]) at each point of a load sweep: closed-loop concurrency or
//! open-loop Poisson rates ([`drive`]), reads the cluster's /metrics before, during and after
//! ([`scrape`]), and writes one JSON line per request and a summary per point ([`summary`]),
//! then plots ([`plot`]). With `--suite FILE` it starts each cluster of the suite itself, one
//! after the other on this machine, and runs the same sweep against each ([`suite`]).
//!
//! Output, in `--out DIR` (each file replaced whole after every point, so a run that stops
//! early leaves what it measured): `requests.jsonl`, `summary.json`, and the plots
//! `pareto.png`, `latency.png`, `goodput.png` (with `--slo`), `resident.png`.

mod args;
pub mod client;
pub mod drive;
pub mod plot;
pub mod scrape;
pub mod suite;
pub mod summary;
pub mod timeline;
pub mod workload;

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nibble_engine::{ModelSource, Tokenizer};

pub use args::BenchArgs;
use client::Client;
use drive::Point;
use scrape::Scraper;
use summary::{Load, RequestRecord, Slo, Summary};
use workload::{Phase, Prompts, Workload};

use crate::{files, Error, Result};

/// What every configuration of one run shares.
pub struct Plan {
    /// What each load point sends: one phase, or several one after the other.
    pub phases: Vec<Phase>,
    pub loads: Vec<Load>,
    pub warmup: usize,
    pub seed: u64,
    pub ignore_eos: bool,
    pub slo: Option<Slo>,
    /// The width of the windows each point's latencies over time are summarized in, seconds.
    pub window_s: f64,
}

impl Plan {
    /// The first phase's workload (what warm-up requests look like).
    pub fn workload(&self) -> &Workload {
        &self.phases[0].workload
    }

    /// `fixed 512/64`, or the phases': `fixed 1024/8 x 40, then fixed 32/128 x 40`.
    pub fn describe(&self) -> String {
        match self.phases.as_slice() {
            [one] => one.workload.describe(),
            phases => {
                let each = phases
                    .iter()
                    .map(|p| format!("{} x {}", p.workload.describe(), p.requests));
                each.collect::<Vec<_>>().join(", then ")
            }
        }
    }
}

/// One cluster to measure.
pub struct Target {
    pub name: String,
    pub client: Client,
    pub scraper: Scraper,
    /// The loads to offer it, when not the plan's (iso-capacity comparisons).
    pub loads: Option<Vec<Load>>,
}

/// Everything measured so far, written to `--out` after each point.
#[derive(Default)]
pub struct Results {
    pub records: Vec<RequestRecord>,
    pub summaries: Vec<Summary>,
}

impl Results {
    /// Replaces the output files with what has been measured.
    pub fn write(&self, out: &Path) -> Result<()> {
        std::fs::create_dir_all(out).map_err(|source| Error::Write {
            path: out.to_path_buf(),
            source,
        })?;
        let mut lines = Vec::new();
        for record in &self.records {
            serde_json::to_writer(&mut lines, record).expect("records serialize");
            lines.push(b'\n');
        }
        files::write_atomically(&out.join("requests.jsonl"), &lines)?;
        let summary = serde_json::to_vec_pretty(&self.summaries).expect("summaries serialize");
        files::write_atomically(&out.join("summary.json"), &summary)?;
        plot::render(&self.summaries, out).map_err(|e| Error::Bench(e.to_string()))?;
        Ok(())
    }
}

/// `nibble bench`.
pub fn run(args: &BenchArgs, out: &mut impl Write) -> Result<()> {
    let plan = args.plan()?;
    let tokenizer = Arc::new(open_tokenizer(&args.model)?);
    let corpus = args.corpus_tokens(&tokenizer)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Bench(format!("cannot start the runtime: {e}")))?;
    runtime.block_on(async {
        let mut results = Results::default();
        let outcome = match &args.suite {
            Some(path) => {
                let suite = suite::Suite::read(path, args)?;
                suite
                    .run(&plan, &tokenizer, &corpus, &args.out, &mut results, out)
                    .await
            }
            None => {
                let target = args.target().await?;
                measure(
                    &plan,
                    target,
                    &tokenizer,
                    &corpus,
                    &args.out,
                    &mut results,
                    out,
                )
                .await
            }
        };
        // What was measured is kept, whatever stopped the run.
        results.write(&args.out)?;
        outcome?;
        writeln!(
            out,
            "nibble bench: {} requests in {} points; results in {}",
            results.records.len(),
            results.summaries.len(),
            args.out.display()
        )
        .map_err(Error::Stdout)
    })
}

/// Reads the served model's tokenizer (the default model is fetched on first use).
fn open_tokenizer(model: &Path) -> Result<Tokenizer> {
    crate::fetch::ensure_default_model(model)?;
    let fail = |source| Error::Model {
        path: model.to_path_buf(),
        source,
    };
    ModelSource::open(model)
        .and_then(|s| s.load_tokenizer())
        .map_err(fail)
}

/// What a cluster says of itself before any load: its context length and workers.
struct Shape {
    max_context: usize,
    workers: usize,
    kv_tokens: Option<f64>,
}

async fn shape(target: &Target) -> Result<Shape> {
    let fail = |e: String| Error::Bench(format!("{}: {e}", target.name));
    let (max_context, mut workers) = target.client.describe().await.map_err(fail)?;
    let metrics = match target.scraper.is_empty() {
        true => None,
        false => Some(target.scraper.read().await.map_err(fail)?),
    };
    let kv_tokens = metrics
        .as_ref()
        .and_then(|m| m.sum("nibble_router_kv_capacity_tokens", &[("role", "decode")]));
    if workers == 0 {
        workers = metrics
            .as_ref()
            .and_then(|m| m.sum("nibble_router_workers", &[]))
            .unwrap_or(1.0) as usize;
    }
    Ok(Shape {
        max_context,
        workers: workers.max(1),
        kv_tokens,
    })
}

/// Checks that the cluster can serve the plan at all: every context fits the model, and a
/// closed loop's requests in flight fit the decode workers' KV, in every phase.
fn check(plan: &Plan, loads: &[Load], shape: &Shape, name: &str) -> Result<()> {
    for phase in &plan.phases {
        check_workload(&phase.workload, loads, shape, name)?;
    }
    Ok(())
}

fn check_workload(workload: &Workload, loads: &[Load], shape: &Shape, name: &str) -> Result<()> {
    let context = workload.max_context();
    if context > shape.max_context {
        return Err(Error::Bench(format!(
            "{name}: the workload ({}) reaches {context} tokens of context, more than the \
             model's {}",
            workload.describe(),
            shape.max_context
        )));
    }
    let Some(kv_tokens) = shape.kv_tokens.filter(|t| *t > 0.0) else {
        return Ok(());
    };
    let (per_request, shared) = workload.resident_tokens();
    for load in loads {
        if let Load::Concurrency(c) = *load {
            let needed = c as f64 * per_request as f64 + shared as f64;
            if needed > kv_tokens {
                return Err(Error::Bench(format!(
                    "{name}: concurrency {c} needs {needed:.0} tokens of KV resident at once \
                     ({}), but the decode workers hold {kv_tokens:.0}: lower the concurrency or \
                     raise --kv-budget-mib",
                    workload.describe()
                )));
            }
        }
    }
    Ok(())
}

/// Runs the plan's sweep against one target, adding to `results` (written after each point).
pub async fn measure(
    plan: &Plan,
    target: Target,
    tokenizer: &Arc<Tokenizer>,
    corpus: &[u32],
    out_dir: &Path,
    results: &mut Results,
    out: &mut impl Write,
) -> Result<()> {
    let loads = target.loads.clone().unwrap_or_else(|| plan.loads.clone());
    let shape = shape(&target).await?;
    check(plan, &loads, &shape, &target.name)?;
    if shape.kv_tokens.is_none() {
        writeln!(
            out,
            "nibble bench: {}: no /metrics read (--metrics URL): the KV capacity is not checked \
             and no cluster statistics are recorded",
            target.name
        )
        .map_err(Error::Stdout)?;
    }
    if plan.warmup > 0 {
        let mut prompts =
            Prompts::new(corpus.to_vec(), plan.seed ^ 0x5741_524d).map_err(Error::Bench)?;
        let mut jobs = prompts.jobs(plan.workload(), plan.warmup);
        jobs.iter_mut().for_each(|job| job.think = Duration::ZERO);
        let point = Point {
            config: format!("{} warm-up", target.name),
            load: Load::Concurrency(plan.warmup.min(4)),
            jobs,
            ignore_eos: plan.ignore_eos,
            phased: false,
            seed: plan.seed,
        };
        let warm = drive::run(
            &target.client,
            &Scraper::new(Vec::new()),
            Arc::clone(tokenizer),
            point,
        )
        .await;
        if let Some(failed) = warm.records.iter().find_map(|r| r.error.clone()) {
            return Err(Error::Bench(format!(
                "{}: a warm-up request failed: {failed}",
                target.name
            )));
        }
    }
    for (i, load) in loads.iter().enumerate() {
        // A fresh set of prompts per point (a cold prefix cache for each), the same for every
        // configuration.
        let mut prompts = Prompts::new(corpus.to_vec(), plan.seed.wrapping_add(i as u64))
            .map_err(Error::Bench)?;
        let point = Point {
            config: target.name.clone(),
            load: *load,
            jobs: prompts.phases(&plan.phases),
            ignore_eos: plan.ignore_eos,
            phased: plan.phases.len() > 1,
            seed: plan.seed.wrapping_add(i as u64),
        };
        let measured = drive::run(
            &target.client,
            &target.scraper,
            Arc::clone(tokenizer),
            point,
        )
        .await;
        let cluster = scrape::stats(&measured.before, &measured.after, &measured.samples);
        let of = summary::Of {
            config: &target.name,
            load: *load,
            workers: shape.workers,
            slo: plan.slo,
            window_s: plan.window_s,
        };
        let summary = Summary::new(
            of,
            &measured.records,
            measured.duration_s,
            cluster,
            measured.samples,
        );
        writeln!(out, "{}", summary.line()).map_err(Error::Stdout)?;
        results.records.extend(measured.records);
        results.summaries.push(summary);
        results.write(out_dir)?;
        if let Some(lost) = measured.lost {
            return Err(Error::Bench(format!(
                "{}: lost the cluster at {} ({lost}); what was measured is in {}",
                target.name,
                load.label(),
                out_dir.display()
            )));
        }
    }
    Ok(())
}
