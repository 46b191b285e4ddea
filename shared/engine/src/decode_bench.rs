//! End-to-end decode throughput, measured the way a decode worker serves.
//!
//! An [`Engine`] over the paged cache decodes a batch of sequences that each already hold
//! `context` tokens of K/V. Those K/V arrive the way a prefill worker's pages reach a decode
//! worker: [`Engine::reserve`] pages for the prompt, [`Engine::import_page`] their bytes,
//! [`Engine::start_decode`] with the first token. Then each [`Engine::step`] is timed by wall
//! clock with the backend synchronized: scheduling, the model's forward pass over the batch
//! (embedding; per layer RMSNorm, Q/K/V projections, RoPE, quantize-on-write of the new token and
//! paged attention over the whole context, output projection, RMSNorm, SwiGLU FFN; final norm, LM
//! head), the logits' copy to the host, sampling and detokenization. That is a server's decode
//! step, nothing left out.
//!
//! The shortcut: the pages hold real quantized K/V of random values, not the model's K/V of a
//! prefilled prompt. [`random_pages`] writes a few distinct pages through the reference
//! quantize-on-write ([`HostPages::write_kv`], which the CUDA kernel matches byte for byte) and
//! they are imported round-robin into every page of every sequence, instead of prefilling
//! `batch × context` tokens through the model. Decode reads every byte of every page the same way
//! whatever the values. Each sequence has its own prompt ids and its own pages (no page is shared
//! between sequences); batches run in ascending order with the same prompts, so a larger batch
//! finds the smaller one's prompt pages in the prefix cache and imports only the rest.
//!
//! Invariants checked on every run: each step decodes exactly one token for every sequence of the
//! batch (nothing preempted, nothing finished early, so the batch measured is the batch asked
//! for); every token is a valid id; imported pages read back as imported.
//!
//! The optional baseline runs the same batch at a short context; `1 − baseline / main` step time
//! estimates the share of a step that grows with the context: the attention's reading of the KV
//! pages (and its page tables).

use std::sync::Arc;
use std::time::Instant;

use nibble_kvcache::{GlobalScales, HostPages, PageId, PagePool, PoolPlan, SlotId};
use nibble_kvfmt::{KvDtype, PageLayout, ScaleRule};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::Backend;
use crate::engine::{Engine, EngineConfig, Event, RequestError, StepPhases};
use crate::error::Error;
use crate::model::Model;
use crate::sampling::SamplingParams;
use crate::scheduler::{SchedulerConfig, SeqId};
use crate::session::KvConfig;
use crate::tokenizer::Tokenizer;
use nibble_kvfmt::nvfp4::feedback::KeyFactors;

/// Why a measurement could not be made.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The measurement asked for is inconsistent (the message says how).
    #[error("decode bench: {0}")]
    Config(String),
    #[error(transparent)]
    Engine(#[from] Error),
    #[error("request refused: {0}")]
    Request(#[from] RequestError),
    /// A step did not decode the whole batch.
    #[error("step {step} decoded {decoded} of the batch's {batch} sequences")]
    BatchShrank {
        step: usize,
        decoded: usize,
        batch: usize,
    },
    /// The engine ended a request with an error.
    #[error("the engine failed a step: {0}")]
    StepFailed(String),
    #[error("token {token} is outside the vocabulary of {vocab}")]
    InvalidToken { token: u32, vocab: usize },
    #[error("page {page} does not read back the bytes imported into it")]
    PageMismatch { page: PageId },
}

/// What to measure. Every batch runs `warmup` untimed then `steps` timed decode steps.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeBench {
    /// Sequences decoded together, each measured on its own.
    pub batches: Vec<usize>,
    /// Tokens of K/V each sequence holds when decoding starts.
    pub context: usize,
    /// Untimed decode steps first.
    pub warmup: usize,
    /// Timed decode steps.
    pub steps: usize,
    /// Context of the baseline run of the same batch (shorter than `context`); `None` skips it.
    pub baseline_context: Option<usize>,
    /// Distinct random pages written by the quantizer, imported round-robin.
    pub distinct_pages: usize,
    /// Seeds the prompts, first tokens and page values.
    pub seed: u64,
    /// Rotate Q, K, V and the output by the Hadamard matrix in attention (`--hadamard`).
    pub hadamard: bool,
    /// An nvfp4 cache chooses K's codes for the queries (`--k-codes`), with factors that mix
    /// every channel ([`KeyFactors::mixing`] of `seed`): what the encoder costs a step, not
    /// what it gains (that needs a calibration's, docs/ACCURACY.md).
    pub k_codes: bool,
}

/// Wall-clock time of one run's timed steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Tokens each sequence held when decoding started.
    pub context: usize,
    pub batch: usize,
    pub steps: usize,
    pub seconds: f64,
    /// The timed steps' phases, summed.
    pub phases: StepPhases,
}

impl Timing {
    /// Decoded tokens per second: batch × steps / seconds.
    pub fn tokens_per_s(&self) -> f64 {
        (self.batch * self.steps) as f64 / self.seconds
    }

    pub fn ms_per_step(&self) -> f64 {
        1e3 * self.seconds / self.steps as f64
    }
}

/// The hand-off of one run's prompt pages.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fill {
    /// Pages imported.
    pub pages: usize,
    /// Prompt pages found in the prefix cache (imported by an earlier, smaller batch).
    pub cached_pages: usize,
    pub bytes: usize,
    /// Reservation and import time, the device synchronized.
    pub seconds: f64,
}

/// One batch of one KV dtype, measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub dtype: KvDtype,
    pub batch: usize,
    /// Bytes of the engine's page pool.
    pub pool_bytes: usize,
    /// KV bytes one sequence holds at its longest.
    pub seq_kv_bytes: usize,
    pub main: Timing,
    pub baseline: Option<Timing>,
    pub fill: Fill,
    /// Per sequence: the first token, then every decoded one.
    pub tokens: Vec<Vec<u32>>,
}

impl Run {
    /// `1 − baseline / main` time per step: the share of a step that grows with the context.
    pub fn context_share(&self) -> Option<f64> {
        self.baseline
            .map(|b| 1.0 - b.ms_per_step() / self.main.ms_per_step())
    }
}

/// One batch's result: measured, or too large for the memory budget.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Ran(Box<Run>),
    DoesNotFit {
        dtype: KvDtype,
        batch: usize,
        /// Pool bytes the batch needs.
        needed_bytes: usize,
        budget_bytes: usize,
    },
}

impl DecodeBench {
    /// The cache a `dtype` run of `model` decodes over: the dtype's defaults, rotated when
    /// [`Self::hadamard`], K's codes chosen for the queries when [`Self::k_codes`] (nvfp4).
    pub fn kv_config<B: Backend>(&self, model: &Model<B>, dtype: KvDtype) -> KvConfig {
        let c = model.config();
        let k_codes = (self.k_codes && dtype == KvDtype::Nvfp4).then(|| {
            let factors = KeyFactors::mixing(c.num_layers, c.num_kv_heads, c.head_dim, self.seed);
            Arc::new(factors)
        });
        KvConfig {
            hadamard: self.hadamard,
            k_codes,
            ..KvConfig::new(dtype)
        }
    }

    /// Tokens a sequence of the main run holds at most: the context plus one per step.
    pub fn max_tokens_held(&self) -> usize {
        self.context + self.warmup + self.steps
    }

    /// Pages of `layout` one sequence of the main run and one of the baseline run hold at most,
    /// its recent window's (the dtype's default) included.
    fn pages_per_seq(&self, layout: &PageLayout) -> (usize, usize) {
        let p = layout.page_size();
        let decoded = self.warmup + self.steps;
        let window = KvConfig::new(layout.dtype())
            .window_layout(layout)
            .map_or(0, |w| w.pages());
        (
            self.max_tokens_held().div_ceil(p) + window,
            self.baseline_context
                .map_or(0, |c| (c + decoded).div_ceil(p) + window),
        )
    }

    /// Which of the source pages (`distinct_pages` random pages, then one page of BF16 values for
    /// every recent window) page `page` of sequence `seq`'s reservation gets: its prompt has
    /// `prompt_pages` pages, and the window's follow them.
    fn source_of(&self, seq: usize, page: usize, prompt_pages: usize) -> usize {
        if page < prompt_pages {
            self.source_page(seq, page)
        } else {
            self.distinct_pages
        }
    }

    /// Pool bytes that run `batch` sequences (and the baseline of as many).
    pub fn pool_bytes(&self, layout: &PageLayout, batch: usize) -> usize {
        let (main, baseline) = self.pages_per_seq(layout);
        batch * (main + baseline) * layout.page_bytes()
    }

    fn check(&self, model_context: usize) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::Config(m));
        if self.context == 0 || self.steps == 0 || self.distinct_pages == 0 {
            return bad(format!(
                "context {}, steps {} and distinct pages {} must be positive",
                self.context, self.steps, self.distinct_pages
            ));
        }
        if let Some(b) = self.baseline_context {
            if b == 0 || b >= self.context {
                return bad(format!(
                    "baseline context {b} must be between 1 and the context {} (exclusive)",
                    self.context
                ));
            }
        }
        if self.max_tokens_held() > model_context {
            return bad(format!(
                "context {} plus {} steps exceeds the model's context length {model_context}",
                self.context,
                self.warmup + self.steps
            ));
        }
        Ok(())
    }

    /// Sequence `index`'s prompt (`context` ids) and first token: uniform random ids, a function
    /// of (seed, context, index) only, so a sequence is the same in every batch.
    pub fn sequence(&self, vocab: usize, index: usize, context: usize) -> (Vec<u32>, u32) {
        let stream = self.seed ^ ((context as u64) << 32) ^ index as u64;
        let mut rng = StdRng::seed_from_u64(stream);
        let prompt = (0..context)
            .map(|_| rng.gen_range(0..vocab as u32))
            .collect();
        (prompt, rng.gen_range(0..vocab as u32))
    }

    /// Which of the distinct pages fills page `page` of sequence `seq`.
    pub fn source_page(&self, seq: usize, page: usize) -> usize {
        (seq + page) % self.distinct_pages
    }

    /// Measures every batch with `dtype` KV, in ascending order, in one engine whose pool fits
    /// the largest batch that `budget_bytes` allows; larger batches are reported as not fitting.
    /// `sync` waits for the device's queued work. `report` sees each outcome as soon as it is
    /// known.
    pub fn run<B: Backend>(
        &self,
        model: &Model<B>,
        tokenizer: &Arc<Tokenizer>,
        dtype: KvDtype,
        budget_bytes: usize,
        sync: &dyn Fn(),
        report: &mut dyn FnMut(&Outcome),
    ) -> Result<Vec<Outcome>, BenchError> {
        self.check(model.config().max_context)?;
        let mut batches = self.batches.clone();
        batches.sort_unstable();
        batches.dedup();
        if batches.first() == Some(&0) {
            return Err(BenchError::Config("a batch of 0 sequences".into()));
        }
        let kv = self.kv_config(model, dtype);
        let layout = kv.layout(model)?;
        let fits = |b: &usize| self.pool_bytes(&layout, *b) <= budget_bytes;
        let mut outcomes = Vec::new();
        if let Some(&largest) = batches.iter().filter(|b| fits(b)).max() {
            let pool_bytes = self.pool_bytes(&layout, largest);
            let config = EngineConfig {
                kv: kv.clone(),
                kv_budget_bytes: pool_bytes,
                scheduler: SchedulerConfig {
                    max_batch_tokens: largest.max(16),
                    max_running: largest,
                    max_context: model.config().max_context,
                    ..SchedulerConfig::default()
                },
            };
            let mut engine = Engine::new(model.clone(), Arc::clone(tokenizer), config)?;
            let scales = kv.scales_for(layout.layers())?;
            let mut pages = random_pages(layout, &scales, self.distinct_pages, self.seed)?;
            pages.push(window_page(&layout, self.seed));
            let mut ids = 0;
            for &batch in batches.iter().filter(|b| fits(b)) {
                let (main, fill, tokens) =
                    self.run_batch(&mut engine, &pages, batch, self.context, &mut ids, sync)?;
                let baseline = match self.baseline_context {
                    Some(c) => Some(
                        self.run_batch(&mut engine, &pages, batch, c, &mut ids, sync)?
                            .0,
                    ),
                    None => None,
                };
                let outcome = Outcome::Ran(Box::new(Run {
                    dtype,
                    batch,
                    pool_bytes,
                    seq_kv_bytes: self.pages_per_seq(&layout).0 * layout.page_bytes(),
                    main,
                    baseline,
                    fill,
                    tokens,
                }));
                report(&outcome);
                outcomes.push(outcome);
            }
        }
        for &batch in batches.iter().filter(|b| !fits(b)) {
            let outcome = Outcome::DoesNotFit {
                dtype,
                batch,
                needed_bytes: self.pool_bytes(&layout, batch),
                budget_bytes,
            };
            report(&outcome);
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    /// Hands `batch` sequences of `context` tokens to the engine and decodes them; returns the
    /// timed steps, the hand-off and every sequence's tokens.
    fn run_batch<B: Backend>(
        &self,
        engine: &mut Engine<B>,
        pages: &[Vec<u8>],
        batch: usize,
        context: usize,
        ids: &mut u64,
        sync: &dyn Fn(),
    ) -> Result<(Timing, Fill, Vec<Vec<u32>>), BenchError> {
        let vocab = engine.model().config().vocab_size;
        let page_size = engine.state().pool.layout().page_size();
        let base = *ids;
        *ids += batch as u64;

        // The hand-off: reserve, import the pages the prefix cache lacks.
        let started = Instant::now();
        let mut fill = Fill::default();
        let mut firsts = Vec::with_capacity(batch);
        // The last page imported for each sequence, and which source page it holds.
        let mut landed = Vec::new();
        for i in 0..batch {
            let (prompt, first) = self.sequence(vocab, i, context);
            let reservation = engine.reserve(SeqId(base + i as u64), &prompt)?;
            let cached = reservation.cached_tokens / page_size;
            let prompt_pages = prompt.len().div_ceil(page_size);
            fill.cached_pages += cached;
            for (j, &page) in reservation.pages.iter().enumerate().skip(cached) {
                let bytes = &pages[self.source_of(i, j, prompt_pages)];
                engine.import_page(page, bytes)?;
                fill.pages += 1;
                fill.bytes += bytes.len();
            }
            if let Some(&page) = reservation.pages.get(cached..).and_then(<[_]>::last) {
                let last = reservation.pages.len() - 1;
                landed.push((page, self.source_of(i, last, prompt_pages)));
            }
            firsts.push(first);
        }
        sync();
        fill.seconds = started.elapsed().as_secs_f64();
        let mut out = Vec::new();
        for (page, source) in landed {
            engine.export_page(page, &mut out)?;
            if out != pages[source] {
                return Err(BenchError::PageMismatch { page });
            }
        }

        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy((1 + self.warmup + self.steps) as u32)
        };
        let mut tokens = vec![Vec::with_capacity(1 + self.warmup + self.steps); batch];
        for (i, &first) in firsts.iter().enumerate() {
            let events = engine.start_decode(SeqId(base + i as u64), first, params.clone())?;
            collect(&events, base, vocab, &mut tokens)?;
        }
        let mut timed_from = Instant::now();
        let mut phases = StepPhases::default();
        for step in 0..self.warmup + self.steps {
            if step == self.warmup {
                sync();
                timed_from = Instant::now();
            }
            let decoded = collect(&engine.step(), base, vocab, &mut tokens)?;
            if step >= self.warmup {
                phases += engine.last_step_phases();
            }
            if decoded != batch {
                return Err(BenchError::BatchShrank {
                    step,
                    decoded,
                    batch,
                });
            }
        }
        sync();
        let seconds = timed_from.elapsed().as_secs_f64();
        if engine.has_work() {
            return Err(BenchError::Config(
                "requests still running after their last step".into(),
            ));
        }
        let timing = Timing {
            context,
            batch,
            steps: self.steps,
            seconds,
            phases,
        };
        Ok((timing, fill, tokens))
    }
}

/// Appends each token event's token to its sequence; returns how many there were.
fn collect(
    events: &[Event],
    base: u64,
    vocab: usize,
    tokens: &mut [Vec<u32>],
) -> Result<usize, BenchError> {
    let mut n = 0;
    for event in events {
        match event {
            Event::Token { id, token, .. } => {
                if *token as usize >= vocab {
                    return Err(BenchError::InvalidToken {
                        token: *token,
                        vocab,
                    });
                }
                let seq =
                    id.0.checked_sub(base)
                        .and_then(|i| tokens.get_mut(i as usize));
                let Some(seq) = seq else {
                    return Err(BenchError::Config(format!(
                        "a token for unknown request {id:?}"
                    )));
                };
                seq.push(*token);
                n += 1;
            }
            Event::Finished {
                error: Some(error), ..
            } => return Err(BenchError::StepFailed(error.to_string())),
            Event::Finished { .. } | Event::PromptLogprobs { .. } => {}
            Event::Prefilled { id, .. } => {
                return Err(BenchError::Config(format!(
                    "request {id:?} was prefilled; the bench only decodes"
                )))
            }
        }
    }
    Ok(n)
}

/// `n` pages of `layout` holding random K/V (uniform in ±2) quantized by the reference
/// quantize-on-write, [`HostPages::write_kv`], with `scales` (the pool's).
pub fn random_pages(
    layout: PageLayout,
    scales: &GlobalScales,
    n: usize,
    seed: u64,
) -> Result<Vec<Vec<u8>>, BenchError> {
    let plan = PoolPlan::for_pages(layout, n).map_err(Error::from)?;
    let mut pool = PagePool::new(plan);
    let ids = pool.alloc(n).map_err(Error::from)?;
    let mut host =
        HostPages::new(plan, scales.clone(), ScaleRule::default()).map_err(Error::from)?;
    let page_size = layout.page_size();
    let slots: Vec<Option<SlotId>> = ids
        .iter()
        .flat_map(|&p| (0..page_size).map(move |o| Some(SlotId::new(p, o, page_size))))
        .collect();
    let values = slots.len() * layout.kv_heads() * layout.head_dim();
    let mut rng = StdRng::seed_from_u64(seed ^ 0xA5A5_A5A5_A5A5_A5A5);
    let mut k = vec![0.0f32; values];
    let mut v = vec![0.0f32; values];
    for layer in 0..layout.layers() {
        k.iter_mut().for_each(|x| *x = rng.gen_range(-2.0..2.0));
        v.iter_mut().for_each(|x| *x = rng.gen_range(-2.0..2.0));
        host.write_kv(&pool, layer, &k, &v, &slots)
            .map_err(Error::from)?;
    }
    ids.iter()
        .map(|&p| Ok(host.page(p).map_err(Error::from)?.to_vec()))
        .collect()
}

/// One page of `layout`'s size holding BF16 values in [-2, 2): what a recent window's pages hold
/// (every 16-bit word a finite BF16, whatever the window's unit layout).
pub fn window_page(layout: &PageLayout, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5A5A_5A5A_5A5A_5A5A);
    (0..layout.page_bytes() / 2)
        .flat_map(|_| nibble_kvfmt::bf16::encode(rng.gen_range(-2.0f32..2.0)).to_le_bytes())
        .collect()
}
