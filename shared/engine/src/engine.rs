//! The serving engine: continuous batching over the paged cache, sampling and text streaming.
//!
//! [`Engine`] owns one model, one page pool with its bytes in the backend, the prefix cache and
//! the scheduler [`State`]. Callers [`submit`](Engine::submit) requests and call
//! [`step`](Engine::step) in a loop; each step runs one batched forward pass and returns
//! [`Event`]s: text deltas with their token ids, and one `Finished` per request. Everything is
//! synchronous; a service runs the loop on its own thread and talks to it over channels.
//!
//! Invariant: a request holds pages only while it is in the scheduler; finishing, stopping on a
//! stop string, aborting and a failed step all release them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nibble_kvcache::{PageId, PagePool, PoolPlan, RadixCache};

use crate::backend::{Backend, PagedSeq};
use crate::detok::Detokenizer;
use crate::error::{Error, Result};
use crate::grammar::Grammar;
use crate::kv::PagedBatch;
use crate::model::{Logits, Model, Workspace};
use crate::sampling::{InvalidParam, Param, Sampled, Sampler, SamplingParams, TokenLogprobs};
use crate::scheduler::{
    Batch, FinishReason, NewRequest, Outcome, Reservation, SchedulerConfig, SeqId, State,
    SubmitError,
};
use crate::session::KvConfig;
use crate::stop::{StopMatcher, StopStep};
use crate::tokenizer::Tokenizer;

mod resume;
mod scoring;
use scoring::Scoring;

/// Everything an engine is built with.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub kv: KvConfig,
    /// Bytes of KV pages to allocate.
    pub kv_budget_bytes: usize,
    pub scheduler: SchedulerConfig,
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Param(#[from] InvalidParam),
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    Token { token: u32, vocab: usize },
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// What a step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token and the text it completed (possibly empty). `logprobs` is set when the
    /// request asked for them and this engine sampled the token (not for the first token of
    /// [`Engine::start_decode`], which the prefill engine sampled).
    Token {
        id: SeqId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        text: String,
    },
    /// A prefill-only request finished its prompt: its first token, and the pages holding the
    /// prompt's K/V, held until [`Engine::release`].
    Prefilled {
        id: SeqId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        pages: Vec<PageId>,
        usage: Usage,
    },
    /// Log-probabilities of prompt tokens (token, its values), in prompt order from the second
    /// token, for a request with `prompt_logprobs`; reported before its first token, in one or
    /// more events as its prompt's chunks run.
    PromptLogprobs {
        id: SeqId,
        logprobs: Vec<(u32, TokenLogprobs)>,
    },
    /// The request ended; `text` is what was held back (the tail of a stop-string candidate or
    /// an unfinished character).
    Finished {
        id: SeqId,
        reason: FinishReason,
        text: String,
        usage: Usage,
        /// Set when the request ended because the engine failed.
        error: Option<Failure>,
    },
}

/// Why a step failed its requests, classified where it happened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The device failed ([`Error::Device`]): the engine's state is unknown and it takes no
    /// more work ([`Engine::device_failure`]); the requests can run on another worker.
    #[error("{0}")]
    Device(String),
    /// The step failed for another reason (a bug or bad state); the engine goes on.
    #[error("{0}")]
    Step(String),
}

/// Per-request state beside the scheduler's.
struct Request {
    sampler: Sampler,
    detok: Detokenizer,
    stop: StopMatcher,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Prompt tokens the prefix cache supplied, known once the request is first scheduled.
    cached_tokens: Option<usize>,
    /// Whether special tokens are left out of the text.
    skip_special: bool,
    /// Set for a request that scores its prompt (`prompt_logprobs`).
    scoring: Option<Scoring>,
    /// `max_tokens` 0: the request only scores its prompt, and its sampled token is dropped.
    score_only: bool,
}

impl Request {
    /// A request's state; `sampler` carries its constraint, if it has one.
    fn new(prompt: &[u32], params: &SamplingParams, sampler: Sampler) -> Self {
        Self {
            detok: Detokenizer::new(prompt),
            stop: StopMatcher::new(params.stop.clone()),
            prompt_tokens: prompt.len(),
            completion_tokens: 0,
            cached_tokens: None,
            skip_special: params.skip_special_tokens,
            scoring: params.prompt_logprobs.map(Scoring::new),
            score_only: params.max_tokens == 0,
            sampler: sampler.after_prompt(prompt.len()),
        }
    }
}

/// Rows sampled per thread at least: below this, a thread costs more than the rows it takes
/// (a greedy row of a 128K vocabulary is ~0.1-0.2 ms).
const ROWS_PER_THREAD: usize = 4;

/// Samples every row with its own sampler, in order. Large batches spread over the machine's
/// cores: the rows are independent and each sampler owns its random state, so the result does
/// not depend on how they are split.
fn sample_rows(mut work: Vec<(SeqId, &mut Sampler, &mut [f32], &[u32])>) -> Vec<(SeqId, Sampled)> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(work.len() / ROWS_PER_THREAD)
        .max(1);
    let sample = |chunk: &mut [(SeqId, &mut Sampler, &mut [f32], &[u32])]| {
        chunk
            .iter_mut()
            .map(|(id, sampler, row, seen)| (*id, sampler.sample(row, seen)))
            .collect::<Vec<_>>()
    };
    if threads == 1 {
        return sample(&mut work);
    }
    let per_thread = work.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .chunks_mut(per_thread)
            .map(|chunk| scope.spawn(move || sample(chunk)))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a sampling thread panicked"))
            .collect()
    })
}

/// Where the wall time of one [`Engine::step`] went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepPhases {
    /// Choosing the batch, its new slots and pages.
    pub schedule: Duration,
    /// The model's forward pass over the batch, until its logits are on the host (the device
    /// synchronized); for a greedy batch, until its tokens are (`Backend::argmax_rows`).
    pub forward: Duration,
    /// Sampling each sequence's next token from its logits (nothing for a greedy batch).
    pub sample: Duration,
    /// Recording the tokens: scheduler state, detokenization, stop strings, events.
    pub finish: Duration,
}

impl std::ops::AddAssign for StepPhases {
    fn add_assign(&mut self, other: Self) {
        self.schedule += other.schedule;
        self.forward += other.forward;
        self.sample += other.sample;
        self.finish += other.finish;
    }
}

/// The engine.
pub struct Engine<B: Backend> {
    model: Model<B>,
    tokenizer: Arc<Tokenizer>,
    state: State,
    pages: B::Pages,
    ws: Workspace<B>,
    logits: Vec<f32>,
    requests: HashMap<SeqId, Request>,
    /// Token ids that end every request (the model's end of sequence).
    eos: Vec<u32>,
    /// The last step's phases.
    phases: StepPhases,
    /// The first device failure, after which the engine's state is unknown.
    device_failure: Option<String>,
}

impl<B: Backend> Engine<B> {
    /// An engine for `model` with a pool of `config.kv_budget_bytes`.
    pub fn new(model: Model<B>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Result<Self> {
        let layout = config.kv.layout(&model)?;
        let window = config.kv.window_layout(&layout)?;
        let mut scheduler = config.scheduler;
        scheduler.max_context = scheduler.max_context.min(model.config().max_context);
        if window.tokens() > scheduler.max_context {
            return Err(Error::InvalidInput(format!(
                "a KV window of {} tokens is larger than the context of {} tokens",
                window.tokens(),
                scheduler.max_context
            )));
        }
        let plan = PoolPlan::for_budget(layout, config.kv_budget_bytes)?;
        if window.pages() >= plan.pages {
            return Err(Error::InvalidInput(format!(
                "a KV budget of {} pages leaves no room beside one sequence's window ({} pages)",
                plan.pages,
                window.pages()
            )));
        }
        let pages = model
            .backend()
            .new_pages(plan, config.kv.encoding(layout.layers())?)?;
        // The cache holds K as the config smooths it: the model must smooth alike.
        let model = model.with_k_smoothing(config.kv.k_smoothing.as_ref())?;
        let ws = model.workspace();
        let state = State::new(scheduler, PagePool::new(plan), RadixCache::default());
        tokenizer.warm_grammars();
        Ok(Self {
            state: state.with_window(&window),
            eos: tokenizer.eos_token_id().into_iter().collect(),
            model,
            tokenizer,
            pages,
            ws,
            logits: Vec::new(),
            requests: HashMap::new(),
            phases: StepPhases::default(),
            device_failure: None,
        })
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The scheduler's state: pool, prefix cache, queue lengths.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Queues a request. `params` are validated here; nothing is queued on error.
    pub fn submit(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> std::result::Result<(), RequestError> {
        self.submit_request(id, prompt, params, false)
    }

    /// The request's stop tokens plus, unless it ignores them, the model's end of sequence.
    fn stop_tokens(&self, params: &SamplingParams) -> Vec<u32> {
        let mut stop = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop.extend(&self.eos);
        }
        stop
    }

    fn check_tokens(&self, prompt: &[u32]) -> std::result::Result<(), RequestError> {
        let vocab = self.model.config().vocab_size;
        match prompt.iter().find(|t| **t as usize >= vocab) {
            Some(&token) => Err(RequestError::Token { token, vocab }),
            None => Ok(()),
        }
    }

    /// The sampler of `params` after `generated` tokens of output another engine sampled: its
    /// random stream as many draws on, its constraint (if any) started after them, compiled and
    /// its first mask computed off this thread ([`Grammar::start`]).
    fn sampler(
        &self,
        params: &SamplingParams,
        generated: &[u32],
    ) -> std::result::Result<Sampler, RequestError> {
        let sampler = Sampler::new(params.clone()).skip_draws(generated.len());
        let Some(constraint) = &params.constraint else {
            return Ok(sampler);
        };
        let compiler = self.tokenizer.grammars().map_err(|e| InvalidParam {
            field: Param::Constraint,
            expected: "a constraint this model's tokenizer can follow".into(),
            got: e.to_string(),
        })?;
        let grammar = Grammar::start(Arc::clone(compiler), constraint.clone(), generated);
        Ok(sampler.with_grammar(grammar))
    }

    fn submit_request(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        prefill_only: bool,
    ) -> std::result::Result<(), RequestError> {
        params.validate()?;
        if prefill_only {
            params.check_not_scoring()?;
        }
        self.check_tokens(&prompt)?;
        let sampler = self.sampler(&params, &[])?;
        let stop_tokens = self.stop_tokens(&params);
        self.state.submit(NewRequest {
            id,
            prompt: prompt.clone(),
            // A request that only scores its prompt runs one step past it; the token is dropped.
            max_tokens: params.max_tokens.max(1) as usize,
            stop_tokens,
            prefill_only,
            reuse_prefix: params.prompt_logprobs.is_none(),
            output: Vec::new(),
        })?;
        self.requests
            .insert(id, Request::new(&prompt, &params, sampler));
        Ok(())
    }

    /// Ends a request and frees its pages. Returns false if it is unknown.
    pub fn abort(&mut self, id: SeqId) -> bool {
        self.requests.remove(&id);
        self.state.abort(id)
    }

    /// Whether any request is queued or running.
    pub fn has_work(&self) -> bool {
        self.state.running() + self.state.waiting() > 0
    }

    /// Runs one batched forward pass and returns what it produced.
    pub fn step(&mut self) -> Vec<Event> {
        let started = Instant::now();
        self.phases = StepPhases::default();
        let batch = self.state.schedule();
        self.phases.schedule = started.elapsed();
        if batch.is_empty() {
            return Vec::new();
        }
        match self.run(&batch) {
            Ok(sampled) => {
                let finishing = Instant::now();
                let events = self.finish_step(&batch, sampled);
                self.phases.finish = finishing.elapsed();
                events
            }
            Err(e) => self.fail(&batch, &e),
        }
    }

    /// The device failure that failed a step, if one did: the engine's device state is unknown
    /// from then on, and its owner should stop it (a worker stops serving).
    pub fn device_failure(&self) -> Option<&str> {
        self.device_failure.as_deref()
    }

    /// Where the last [`step`](Self::step)'s time went.
    pub fn last_step_phases(&self) -> StepPhases {
        self.phases
    }

    /// The forward pass and sampling of one batch.
    fn run(&mut self, batch: &Batch) -> Result<Vec<(SeqId, Sampled)>> {
        let seqs = batch
            .items
            .iter()
            .map(|item| {
                let missing =
                    || Error::InvalidInput(format!("request {:?} has no pages", item.seq));
                let table = self.state.table(item.seq).ok_or_else(missing)?;
                Ok(PagedSeq {
                    pages: table.pages(),
                    stored: item.positions.start,
                    slots: &item.slots,
                    window: self.state.window(item.seq).ok_or_else(missing)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for item in &batch.items {
            if let Some(request) = self.requests.get_mut(&item.seq) {
                if request.cached_tokens.is_none() {
                    request.cached_tokens = self.state.prefix_hit(item.seq);
                }
            }
        }
        let tokens: Vec<&[u32]> = batch.items.iter().map(|i| i.tokens.as_slice()).collect();
        let forwarding = Instant::now();
        let mut kv = PagedBatch::<B> {
            pages: &mut self.pages,
            pool: &self.state.pool,
            seqs,
        };
        // A prompt chunk of a scoring request needs every row's logits; the others need only
        // their last row.
        let every: Vec<bool> = (batch.items.iter())
            .map(|i| {
                self.requests.get(&i.seq).is_some_and(|r| {
                    (r.scoring.as_ref())
                        .is_some_and(|s| s.needs(i.positions.start, r.prompt_tokens))
                })
            })
            .collect();
        let scores = every.contains(&true);
        // A batch whose every sampled sequence decodes greedily needs only each row's argmax:
        // the backend finds it where the logits are, and they never come to the host.
        let greedy = !scores
            && batch.items.iter().filter(|i| i.sample).all(|i| {
                self.requests
                    .get(&i.seq)
                    .is_some_and(|r| r.sampler.is_greedy())
            });
        if greedy {
            let mut tokens_out = Vec::with_capacity(batch.items.len());
            self.model
                .forward_batch_greedy(&mut self.ws, &tokens, &mut kv, &mut tokens_out)?;
            self.phases.forward = forwarding.elapsed();
            return Ok(batch
                .items
                .iter()
                .zip(tokens_out)
                .filter(|(item, _)| item.sample)
                .map(|(item, token)| {
                    let logprobs = None;
                    (item.seq, Sampled { token, logprobs })
                })
                .collect());
        }
        let which = match scores {
            true => Logits::Select(&every),
            false => Logits::Last,
        };
        self.model
            .forward_batch(&mut self.ws, &tokens, &mut kv, which, &mut self.logits)?;
        self.phases.forward = forwarding.elapsed();
        let sampling = Instant::now();
        let vocab = self.model.config().vocab_size;
        // Each item's last row (its only one unless scored); scoring reads the raw rows first.
        let mut ends = Vec::with_capacity(batch.items.len());
        let mut row = 0;
        for (item, every) in batch.items.iter().zip(&every) {
            let rows = if *every { item.tokens.len() } else { 1 };
            if let Some(r) = self.requests.get_mut(&item.seq) {
                if let (true, Some(s)) = (*every, r.scoring.as_mut()) {
                    let seen = self.state.tokens(item.seq).unwrap_or_default();
                    let logits = &self.logits[row * vocab..(row + rows) * vocab];
                    s.score(logits, vocab, item.positions.start, seen, r.prompt_tokens);
                }
            }
            row += rows;
            ends.push(row - 1);
        }
        let mut last_rows = (self.logits.chunks_exact_mut(vocab).enumerate())
            .filter(|(i, _)| ends.binary_search(i).is_ok())
            .map(|(_, row)| row);
        // The sampled rows in batch order, each with its request's sampler and the tokens it
        // has seen; the requests are disjoint, so rows can be sampled on several threads.
        let mut samplers: HashMap<SeqId, &mut Sampler> = self
            .requests
            .iter_mut()
            .map(|(id, r)| (*id, &mut r.sampler))
            .collect();
        let mut work = Vec::new();
        for (item, row) in batch.items.iter().zip(&mut last_rows) {
            if item.sample {
                let sampler = samplers.remove(&item.seq).expect("submitted requests");
                let seen = self.state.tokens(item.seq).unwrap_or_default();
                work.push((item.seq, sampler, row, seen));
            }
        }
        let sampled = sample_rows(work);
        self.phases.sample = sampling.elapsed();
        Ok(sampled)
    }

    fn finish_step(&mut self, batch: &Batch, sampled: Vec<(SeqId, Sampled)>) -> Vec<Event> {
        let pairs: Vec<(SeqId, u32)> = sampled.iter().map(|(id, s)| (*id, s.token)).collect();
        let outcomes = self.state.complete(batch, &pairs);
        let mut events = Vec::new();
        for item in &batch.items {
            let scored = (self.requests.get_mut(&item.seq))
                .and_then(|r| r.scoring.as_mut())
                .map(Scoring::take);
            if let Some(logprobs) = scored.filter(|l| !l.is_empty()) {
                let id = item.seq;
                events.push(Event::PromptLogprobs { id, logprobs });
            }
        }
        for ((id, outcome), (_, s)) in outcomes.into_iter().zip(sampled) {
            let grammar_error = self
                .requests
                .get(&id)
                .and_then(|r| r.sampler.grammar_error())
                .map(str::to_string);
            match grammar_error {
                // The constraint failed while choosing this token: the output ends before it.
                Some(e) if !matches!(outcome, Outcome::Prefilled(_)) => {
                    self.state.abort(id);
                    let failure = Failure::Step(format!("the output's constraint failed: {e}"));
                    events.push(self.close(id, FinishReason::Stop, Some(failure), true));
                }
                _ => self.emit(id, outcome, s.logprobs, &mut events),
            }
        }
        events
    }

    /// Turns one scheduler outcome into events: the token's text, and the end if it came.
    fn emit(
        &mut self,
        id: SeqId,
        outcome: Outcome,
        logprobs: Option<TokenLogprobs>,
        events: &mut Vec<Event>,
    ) {
        let (token, finished) = match outcome {
            Outcome::Token(t) => (Some(t), None),
            Outcome::Finished(t, reason) => (t, Some(reason)),
            Outcome::Prefilled(token) => {
                events.push(self.prefilled(id, token, logprobs));
                return;
            }
        };
        if self.requests.get(&id).is_some_and(|r| r.score_only) {
            // max_tokens 0: the prompt is scored; the token sampled after it is not output.
            if finished.is_none() {
                self.state.abort(id);
            }
            events.push(self.close(id, FinishReason::Length, None, false));
            return;
        }
        let tokenizer = Arc::clone(&self.tokenizer);
        let Some(request) = self.requests.get_mut(&id) else {
            return;
        };
        let skip = request.skip_special;
        let decode = |ids: &[u32]| tokenizer.decode(ids, skip);
        let mut stopped = false;
        if let Some(token) = token {
            request.completion_tokens += 1;
            // Spelling special tokens out never spells the stop token that ends the output.
            let ends = matches!(finished, Some(FinishReason::Stop));
            let delta = if !skip && ends {
                String::new()
            } else {
                request.detok.push(token, decode).unwrap_or_default()
            };
            let text = match request.stop.push(&delta) {
                StopStep::Continue(text) => text,
                StopStep::Stop(text) => {
                    stopped = true;
                    text
                }
            };
            events.push(Event::Token {
                id,
                token,
                logprobs,
                text,
            });
        }
        let reason = if stopped {
            // A stop string ended it: the scheduler still runs it, so abort frees its pages.
            self.state.abort(id);
            Some(FinishReason::Stop)
        } else {
            finished
        };
        if let Some(reason) = reason {
            events.push(self.close(id, reason, None, !stopped));
        }
    }

    /// Removes a request and describes its end.
    fn close(
        &mut self,
        id: SeqId,
        reason: FinishReason,
        error: Option<Failure>,
        flush: bool,
    ) -> Event {
        let mut text = String::new();
        let mut usage = Usage::default();
        if let Some(mut request) = self.requests.remove(&id) {
            if flush {
                let tokenizer = Arc::clone(&self.tokenizer);
                let skip = request.skip_special;
                let tail = request
                    .detok
                    .finish(|ids: &[u32]| tokenizer.decode(ids, skip))
                    .unwrap_or_default();
                text = match request.stop.push(&tail) {
                    StopStep::Continue(t) => t + &request.stop.finish(),
                    StopStep::Stop(t) => t,
                };
            }
            usage.prompt_tokens = request.prompt_tokens;
            usage.completion_tokens = request.completion_tokens;
            usage.cached_tokens = request.cached_tokens.unwrap_or(0);
        }
        Event::Finished {
            id,
            reason,
            text,
            usage,
            error,
        }
    }

    /// Describes a prefill-only request whose prompt is done; its pages stay held for export.
    fn prefilled(&mut self, id: SeqId, token: u32, logprobs: Option<TokenLogprobs>) -> Event {
        let request = self.requests.remove(&id);
        // The prompt's pages, then its window's: what a decode worker's reservation lists.
        let mut pages = self
            .state
            .table(id)
            .map(|t| t.pages().to_vec())
            .unwrap_or_default();
        pages.extend_from_slice(self.state.window(id).unwrap_or_default());
        let usage = Usage {
            prompt_tokens: request.as_ref().map_or(0, |r| r.prompt_tokens),
            completion_tokens: 1,
            cached_tokens: request.and_then(|r| r.cached_tokens).unwrap_or(0),
        };
        Event::Prefilled {
            id,
            token,
            logprobs,
            pages,
            usage,
        }
    }

    /// Queues a request that stops after its prompt: the step that finishes the prompt reports
    /// [`Event::Prefilled`] with the first token and the pages, which stay held until
    /// [`release`](Self::release) (after they were exported).
    pub fn submit_prefill(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> std::result::Result<(), RequestError> {
        self.submit_request(id, prompt, params, true)
    }

    /// Copies one page's bytes (data and scales) out, for a transfer.
    pub fn export_page(&self, page: PageId, out: &mut Vec<u8>) -> Result<()> {
        self.model.backend().read_page(&self.pages, page, out)
    }

    /// Frees what a prefilled request or an unused reservation holds. False if nothing is held.
    pub fn release(&mut self, id: SeqId) -> bool {
        self.state.release_held(id)
    }

    /// Reserves pages for a prompt whose K/V a prefill worker will send; the reservation says
    /// which leading pages this worker already has.
    pub fn reserve(
        &mut self,
        id: SeqId,
        prompt: &[u32],
    ) -> std::result::Result<Reservation, RequestError> {
        self.check_tokens(prompt)?;
        Ok(self.state.reserve(id, prompt)?)
    }

    /// Pages `ids` into a (reused) staging buffer in the backend's memory, for a device link
    /// (GPU to GPU) to send.
    pub fn stage_pages(&self, ids: &[PageId], into: &mut B::Staging) -> Result<()> {
        self.model.backend().stage_pages(&self.pages, ids, into)
    }

    /// Writes a received staging buffer into the reserved pages `ids`.
    pub fn unstage_pages(&mut self, ids: &[PageId], staging: &B::Staging) -> Result<()> {
        self.model
            .backend()
            .unstage_pages(&mut self.pages, &self.state.pool, ids, staging)
    }

    /// A staging buffer's bytes on the host (borrowed on the CPU, copied from a device), to
    /// check received pages before they are written.
    pub fn staged_host_bytes<'a>(
        &self,
        staging: &'a B::Staging,
    ) -> Result<std::borrow::Cow<'a, [u8]>> {
        self.model.backend().staged_host_bytes(staging)
    }

    /// The bytes of a staging buffer.
    pub fn staging_bytes(&self, staging: &B::Staging) -> usize {
        self.model.backend().staging_bytes(staging)
    }

    /// Writes one received page into a reserved page.
    pub fn import_page(&mut self, page: PageId, bytes: &[u8]) -> Result<()> {
        self.model
            .backend()
            .write_page(&mut self.pages, &self.state.pool, page, bytes)
    }

    /// Starts decoding a reservation whose pages now hold the prompt, from the prefill worker's
    /// first token. Returns the events of that token (and the request's end, if it already ends).
    pub fn start_decode(
        &mut self,
        id: SeqId,
        first_token: u32,
        params: SamplingParams,
    ) -> std::result::Result<Vec<Event>, RequestError> {
        params.validate()?;
        params.check_not_scoring()?;
        let prompt = self
            .state
            .tokens(id)
            .ok_or(SubmitError::Unknown(id))?
            .to_vec();
        let sampler = self.sampler(&params, &[first_token])?;
        let stop_tokens = self.stop_tokens(&params);
        let max_tokens = params.max_tokens as usize;
        let cached = self.state.prefix_hit(id);
        self.requests
            .insert(id, Request::new(&prompt, &params, sampler));
        if let Some(r) = self.requests.get_mut(&id) {
            r.cached_tokens = cached;
        }
        let finished = (self.state).activate(id, &[first_token], max_tokens, stop_tokens)?;
        let mut events = Vec::new();
        let outcome = match finished {
            Some(reason) => Outcome::Finished(Some(first_token), reason),
            None => Outcome::Token(first_token),
        };
        self.emit(id, outcome, None, &mut events);
        Ok(events)
    }

    /// A failed step ends every request in it, releasing their pages.
    fn fail(&mut self, batch: &Batch, error: &Error) -> Vec<Event> {
        let failure = match error {
            Error::Device(message) => Failure::Device(message.clone()),
            other => Failure::Step(other.to_string()),
        };
        if let Failure::Device(message) = &failure {
            self.device_failure.get_or_insert_with(|| message.clone());
        }
        let mut events = Vec::new();
        for item in &batch.items {
            let event = self.close(
                item.seq,
                FinishReason::Aborted,
                Some(failure.clone()),
                false,
            );
            self.state.abort(item.seq);
            events.push(event);
        }
        events
    }
}

#[cfg(test)]
mod tests;
