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

use nibble_kvcache::{PagePool, PoolPlan, RadixCache};

use crate::backend::{Backend, PagedSeq};
use crate::detok::Detokenizer;
use crate::error::{Error, Result};
use crate::kv::PagedBatch;
use crate::model::{Logits, Model, Workspace};
use crate::sampling::{InvalidParam, Sampler, SamplingParams};
use crate::scheduler::{
    Batch, FinishReason, NewRequest, Outcome, SchedulerConfig, SeqId, State, SubmitError,
};
use crate::session::KvConfig;
use crate::stop::{StopMatcher, StopStep};
use crate::tokenizer::Tokenizer;

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
    /// A new token and the text it completed (possibly empty).
    Token {
        id: SeqId,
        token: u32,
        logprob: Option<f32>,
        text: String,
    },
    /// The request ended; `text` is what was held back (the tail of a stop-string candidate or
    /// an unfinished character).
    Finished {
        id: SeqId,
        reason: FinishReason,
        text: String,
        usage: Usage,
        /// Set when the request ended because the engine failed.
        error: Option<String>,
    },
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
}

impl<B: Backend> Engine<B> {
    /// An engine for `model` with a pool of `config.kv_budget_bytes`.
    pub fn new(model: Model<B>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Result<Self> {
        let layout = config.kv.layout(&model)?;
        let plan = PoolPlan::for_budget(layout, config.kv_budget_bytes)?;
        let scales = config.kv.scales_for(layout.layers())?;
        let pages = model
            .backend()
            .new_pages(plan, scales, config.kv.hadamard)?;
        let mut scheduler = config.scheduler;
        scheduler.max_context = scheduler.max_context.min(model.config().max_context);
        let ws = model.workspace();
        Ok(Self {
            state: State::new(scheduler, PagePool::new(plan), RadixCache::default()),
            eos: tokenizer.eos_token_id().into_iter().collect(),
            model,
            tokenizer,
            pages,
            ws,
            logits: Vec::new(),
            requests: HashMap::new(),
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
        params.validate()?;
        let vocab = self.model.config().vocab_size;
        if let Some(&token) = prompt.iter().find(|t| **t as usize >= vocab) {
            return Err(RequestError::Token { token, vocab });
        }
        let mut stop_tokens = params.stop_token_ids.clone();
        stop_tokens.extend(&self.eos);
        self.state.submit(NewRequest {
            id,
            prompt: prompt.clone(),
            max_tokens: params.max_tokens as usize,
            stop_tokens,
        })?;
        self.requests.insert(
            id,
            Request {
                detok: Detokenizer::new(&prompt),
                stop: StopMatcher::new(params.stop.clone()),
                sampler: Sampler::new(params),
                prompt_tokens: prompt.len(),
                completion_tokens: 0,
                cached_tokens: None,
            },
        );
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
        let batch = self.state.schedule();
        if batch.is_empty() {
            return Vec::new();
        }
        match self.run(&batch) {
            Ok(sampled) => self.finish_step(&batch, &sampled),
            Err(e) => self.fail(&batch, &e),
        }
    }

    /// The forward pass and sampling of one batch.
    fn run(&mut self, batch: &Batch) -> Result<Vec<(SeqId, u32, Option<f32>)>> {
        let seqs = batch
            .items
            .iter()
            .map(|item| {
                let table = self.state.table(item.seq).ok_or_else(|| {
                    Error::InvalidInput(format!("request {:?} has no pages", item.seq))
                })?;
                Ok(PagedSeq {
                    pages: table.pages(),
                    stored: item.positions.start,
                    slots: &item.slots,
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
        let mut kv = PagedBatch::<B> {
            pages: &mut self.pages,
            pool: &self.state.pool,
            seqs,
        };
        self.model.forward_batch(
            &mut self.ws,
            &tokens,
            &mut kv,
            Logits::Last,
            &mut self.logits,
        )?;
        let vocab = self.model.config().vocab_size;
        let mut sampled = Vec::new();
        for (item, row) in batch.items.iter().zip(self.logits.chunks_exact_mut(vocab)) {
            if !item.sample {
                continue;
            }
            let request = self
                .requests
                .get_mut(&item.seq)
                .expect("submitted requests");
            let seen = self.state.tokens(item.seq).unwrap_or_default();
            let s = request.sampler.sample(row, seen);
            sampled.push((item.seq, s.token, s.logprob));
        }
        Ok(sampled)
    }

    fn finish_step(&mut self, batch: &Batch, sampled: &[(SeqId, u32, Option<f32>)]) -> Vec<Event> {
        let pairs: Vec<(SeqId, u32)> = sampled.iter().map(|(id, t, _)| (*id, *t)).collect();
        let outcomes = self.state.complete(batch, &pairs);
        let mut events = Vec::new();
        for ((id, outcome), (_, _, logprob)) in outcomes.into_iter().zip(sampled) {
            let (token, finished) = match outcome {
                Outcome::Token(t) => (Some(t), None),
                Outcome::Finished(t, reason) => (t, Some(reason)),
            };
            let tokenizer = Arc::clone(&self.tokenizer);
            let decode = |ids: &[u32]| tokenizer.decode(ids, true);
            let Some(request) = self.requests.get_mut(&id) else {
                continue;
            };
            let mut stopped = false;
            if let Some(token) = token {
                request.completion_tokens += 1;
                let delta = request.detok.push(token, decode).unwrap_or_default();
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
                    logprob: *logprob,
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
        events
    }

    /// Removes a request and describes its end.
    fn close(
        &mut self,
        id: SeqId,
        reason: FinishReason,
        error: Option<String>,
        flush: bool,
    ) -> Event {
        let mut text = String::new();
        let mut usage = Usage::default();
        if let Some(mut request) = self.requests.remove(&id) {
            if flush {
                let tokenizer = Arc::clone(&self.tokenizer);
                let tail = request
                    .detok
                    .finish(|ids: &[u32]| tokenizer.decode(ids, true))
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

    /// A failed step ends every request in it, releasing their pages.
    fn fail(&mut self, batch: &Batch, error: &Error) -> Vec<Event> {
        let mut events = Vec::new();
        for item in &batch.items {
            let event = self.close(
                item.seq,
                FinishReason::Aborted,
                Some(error.to_string()),
                false,
            );
            self.state.abort(item.seq);
            events.push(event);
        }
        events
    }
}
