//! Continuous batching: which tokens of which sequences run in the next forward step.
//!
//! [`State`] is plain data, owned by the engine's step loop and tested without a model or a
//! runtime. Each step:
//!
//! 1. every running sequence that has finished its prompt gets one decode token;
//! 2. sequences still in their prompt get the next chunk, within the step's token budget
//!    (chunked prefill);
//! 3. waiting requests are admitted in arrival order while the budget, the running limit and the
//!    free pages allow: each first takes the longest cached prefix from the radix cache, then
//!    pages for its first chunk.
//!
//! When a page cannot be had, the prefix cache evicts unused blocks; when that is not enough for a
//! running decode, the most recently admitted sequence is preempted by recompute: its pages are
//! released and it rejoins the front of the queue with its prompt and output so far, to be
//! prefilled again (often largely from the prefix cache). A resumed request (one another worker
//! started and could not finish, [`NewRequest::output`]) computes its prompt in blocks and then
//! its output so far one token at a time through the decode path, as that output was first
//! computed, without sampling; it samples after the last of them. After the model runs,
//! [`State::complete`] appends the sampled tokens, caches newly filled pages, and retires finished
//! sequences. [`State::abort`] frees a request's pages at any point.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use nibble_kvcache::{
    extend_hashes, hash_blocks, BlockHash, PageId, PagePool, PageTable, RadixCache, SlotId,
};
use nibble_kvfmt::WindowLayout;

/// An eviction frees at least 1/`EVICTION_BATCH` of the pool (`State::make_room`).
const EVICTION_BATCH: usize = 128;

/// Limits of the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens processed per step, decode and prefill together.
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Requests waiting for admission before new ones are refused.
    pub max_waiting: usize,
    /// Longest sequence (prompt + output) the engine accepts. `Engine::new` caps it at the
    /// model's context length, so the default (no limit of its own) serves the model's whole
    /// context, as the router's check and `/v1/models`' `max_model_len` say.
    pub max_context: usize,
    /// Prompts are computed in blocks of this many tokens from position 0 (a multiple of the
    /// page size; rounded down to one, and to what the step budget leaves beside a decode of
    /// every running sequence): a step's chunk of a prompt is one whole block (or the prompt's
    /// last, partial one), and a cached prefix is reused only up to a block boundary. A prompt's
    /// K/V and first token then do not depend on what the cache held, how the budget fell or
    /// which worker prefilled it (docs/ARCHITECTURE.md, "Prompt blocks").
    pub prefill_block: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            max_running: 64,
            max_waiting: 256,
            max_context: usize::MAX,
            prefill_block: 256,
        }
    }
}

impl SchedulerConfig {
    /// The prompt block `State` uses with pages of `page_size` tokens: `prefill_block` rounded
    /// down to whole pages, at most what `max_batch_tokens` leaves beside one decode token of
    /// each of `max_running` sequences (so a block always fits a step), at least one page.
    pub fn block(&self, page_size: usize) -> usize {
        let room = self.max_batch_tokens.saturating_sub(self.max_running);
        let block = self.prefill_block.min(room) / page_size * page_size;
        block.max(page_size)
    }
}

/// A request's id, unique within one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced `max_tokens` tokens.
    Length,
    /// It produced a stop token (or the engine found a stop string).
    Stop,
    /// The caller aborted it.
    Aborted,
}

/// Refusals at submission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("prompt is empty")]
    EmptyPrompt,
    /// The prompt plus `max_tokens` does not fit the context.
    #[error(transparent)]
    TooLong(#[from] crate::sampling::InvalidParam),
    #[error("request needs {needed} KV pages but the pool has only {total}")]
    TooLarge { needed: usize, total: usize },
    #[error("{waiting} requests are already waiting; try again later")]
    QueueFull { waiting: usize },
    #[error("request {0:?} already exists")]
    Duplicate(SeqId),
    #[error("request {0:?} is not held by this worker")]
    Unknown(SeqId),
    #[error("{needed} KV pages needed, {free} free after eviction")]
    NoRoom { needed: usize, free: usize },
    #[error("request {0:?} already generated all its tokens")]
    Finished(SeqId),
    #[error("request {0:?} starts decoding without a first token")]
    EmptyOutput(SeqId),
}

/// Which attention path an item runs through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The sequence's first tokens: nothing cached.
    Prefill,
    /// More tokens after a prefix already in pages.
    Extend,
    /// One token after a prefix already in pages.
    Decode,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub seq: SeqId,
    /// Positions of the tokens processed now.
    pub positions: Range<usize>,
    /// Their token ids.
    pub tokens: Vec<u32>,
    /// Their cache slots, in order.
    pub slots: Vec<SlotId>,
    pub path: Path,
    /// Whether the step must sample a token after the last position (the prompt is done).
    pub sample: bool,
}

/// What the model runs next.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Batch {
    pub items: Vec<Item>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn tokens(&self) -> usize {
        self.items.iter().map(|i| i.tokens.len()).sum()
    }
}

/// What happened to a sequence after a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It produced this token and goes on.
    Token(u32),
    /// It produced this token (or none, when aborted or stopped by the caller) and finished.
    Finished(Option<u32>, FinishReason),
    /// A prefill-only request finished its prompt and produced its first token; its pages are
    /// held until [`State::release_held`].
    Prefilled(u32),
}

#[derive(Debug)]
struct Sequence {
    id: SeqId,
    /// Prompt then output so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    /// Tokens whose K/V are in `table`.
    computed: usize,
    /// Tokens this life computes as prompt blocks (its tokens when admitted): pages only of those
    /// go to the prefix cache, never pages of tokens decoded one at a time.
    prefilled: usize,
    table: PageTable,
    /// Its recent window's pages while it holds any (see [`State::with_window`]).
    window: Vec<PageId>,
    /// Cached blocks this sequence locked when it was admitted.
    locked: Vec<BlockHash>,
    /// Full pages already offered to the prefix cache.
    cached_pages: usize,
    /// Chained hashes of the first full blocks of `tokens` (at least `cached_pages` of them),
    /// extended as pages fill: `tokens` only grows, so they stay valid.
    hashes: Vec<BlockHash>,
    /// Cached tokens it started from, for usage reporting.
    prefix_hit: usize,
    prefill_only: bool,
    /// Whether admission may start it from cached pages (not for a scoring request, which needs
    /// every prompt position's logits).
    reuse_prefix: bool,
    /// Whether its output is computed one token at a time through the decode path, as first
    /// computed, whenever it is (re)admitted, and only its prompt in blocks: a resumed request
    /// ([`NewRequest::output`]), so that its K/V, and its next token, are exactly those of an
    /// undisturbed run. Otherwise a preempted sequence computes its output as prompt blocks.
    replay: bool,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens an admission computes as prompt blocks: the prompt of a replaying sequence,
    /// else every token it has.
    fn blocks(&self) -> usize {
        match self.replay {
            true => self.prompt_len,
            false => self.tokens.len(),
        }
    }

    /// Whether its next token runs through the decode path: it is past its prompt blocks (or at
    /// their last token, which runs as one) and has a token to compute.
    fn decodes(&self) -> bool {
        self.computed < self.tokens.len()
            && (self.computed >= self.prefilled || self.computed + 1 == self.tokens.len())
    }
}

/// A request to start.
#[derive(Debug, Clone)]
pub struct NewRequest {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub stop_tokens: Vec<u32>,
    /// Stop after the prompt: sample the first token and hold the pages for export to a decode
    /// worker (see [`State::release_held`]).
    pub prefill_only: bool,
    /// Start from the longest cached prefix (false: compute the whole prompt, so every position
    /// has logits; its pages are still offered to the cache).
    pub reuse_prefix: bool,
    /// Output a previous worker already generated (a resumed request; usually empty): it counts
    /// toward `max_tokens` and is computed one token at a time through the decode path, without
    /// sampling, before the first new token is sampled.
    pub output: Vec<u32>,
}

/// The scheduler's state: queues, pages, prefix cache.
#[derive(Debug)]
pub struct State {
    config: SchedulerConfig,
    pub pool: PagePool,
    pub cache: RadixCache,
    waiting: VecDeque<Sequence>,
    /// In admission order: preemption takes from the back.
    running: Vec<Sequence>,
    /// Sequences holding pages outside the batch: prefilled ones awaiting export and
    /// reservations awaiting their pages.
    held: HashMap<SeqId, Sequence>,
    preemptions: u64,
    /// Tokens of every sequence's recent window, and the pages one takes.
    window_tokens: usize,
    window_pages: usize,
    /// Tokens per prompt block (`SchedulerConfig::block`).
    block: usize,
}

impl State {
    pub fn new(config: SchedulerConfig, pool: PagePool, cache: RadixCache) -> Self {
        let block = config.block(pool.layout().page_size());
        Self {
            block,
            config,
            pool,
            cache,
            waiting: VecDeque::new(),
            running: Vec::new(),
            held: HashMap::new(),
            preemptions: 0,
            window_tokens: 0,
            window_pages: 0,
        }
    }

    /// Gives every sequence a recent window of `window`'s geometry: each running or held
    /// sequence holds `window.pages()` pages of the pool for it, and a prompt never reuses the
    /// cached pages of its last `window.tokens()` tokens (nor the page they start in), which are
    /// computed again so the window holds them in BF16 when decoding starts.
    pub fn with_window(mut self, window: &WindowLayout) -> Self {
        self.window_tokens = window.tokens();
        self.window_pages = window.pages();
        self
    }

    /// Pages of the pool one sequence's window takes.
    pub fn window_pages(&self) -> usize {
        self.window_pages
    }

    /// Cached pages of `tokens` a sequence may start from: at most `matched`, ending on a prompt
    /// block boundary, and never any that holds one of the last `window_tokens` tokens (nor the
    /// last token, which must be computed for its logits).
    fn reusable_pages(&self, tokens: usize, matched: usize) -> usize {
        let keep = tokens.saturating_sub(1 + self.window_tokens);
        let reused = (matched * self.page_size()).min(keep) / self.block * self.block;
        reused / self.page_size()
    }

    /// Tokens per prompt block.
    pub fn prefill_block(&self) -> usize {
        self.block
    }

    /// The next chunk of a prompt computed from `start` with `remaining` tokens left: up to the
    /// next block boundary.
    fn block_chunk(&self, start: usize, remaining: usize) -> usize {
        (self.block - start % self.block).min(remaining)
    }

    /// Allocates a sequence's window pages, evicting cached blocks if needed; false when the pool
    /// cannot supply them (nothing is then held).
    fn take_window(
        pool: &mut PagePool,
        cache: &mut RadixCache,
        pages: usize,
    ) -> Option<Vec<PageId>> {
        if pages == 0 {
            return Some(Vec::new());
        }
        Self::make_room(pool, cache, pages);
        pool.alloc(pages).ok()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Prompt tokens still to compute: the rest of each running prompt, and each waiting prompt
    /// less the prefix the cache would give it now. What a request queued here waits behind,
    /// in tokens (the router weighs workers by it). It hashes nothing: read on every load poll.
    pub fn prefill_backlog(&self) -> usize {
        let page_size = self.page_size();
        let running: usize = self
            .running
            .iter()
            .map(|seq| seq.prefilled.saturating_sub(seq.computed))
            .sum();
        let waiting: usize = self
            .waiting
            .iter()
            .map(|seq| {
                let len = seq.blocks();
                // Its hashes: the prompt's (from `submit`), or what a preempted sequence had
                // filled, a prefix of its tokens either way.
                let matched = match seq.reuse_prefix {
                    true => seq
                        .hashes
                        .iter()
                        .take_while(|&&hash| self.cache.contains(hash))
                        .count(),
                    false => 0,
                };
                len - self.reusable_pages(len, matched) * page_size
            })
            .sum();
        running + waiting
    }

    /// Sequences preempted by recompute so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    fn page_size(&self) -> usize {
        self.pool.layout().page_size()
    }

    /// Queues a request, or refuses it with the reason.
    pub fn submit(&mut self, request: NewRequest) -> Result<(), SubmitError> {
        if request.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        crate::sampling::check_context(
            request.prompt.len(),
            request.max_tokens,
            self.config.max_context,
        )?;
        if request.output.len() >= request.max_tokens {
            return Err(SubmitError::Finished(request.id));
        }
        let total = request.prompt.len() + request.max_tokens;
        let needed = total.div_ceil(self.page_size()) + self.window_pages;
        if needed > self.pool.total_pages() {
            return Err(SubmitError::TooLarge {
                needed,
                total: self.pool.total_pages(),
            });
        }
        if self.waiting.len() >= self.config.max_waiting {
            return Err(SubmitError::QueueFull {
                waiting: self.waiting.len(),
            });
        }
        if self.exists(request.id) {
            return Err(SubmitError::Duplicate(request.id));
        }
        // Hashed once here, so that the backlog can look its prefix up while it waits.
        let hashes = hash_blocks(
            &request.prompt[..request.prompt.len() - 1],
            self.page_size(),
        );
        let replay = !request.output.is_empty();
        let mut tokens = request.prompt;
        let prompt_len = tokens.len();
        tokens.extend(request.output);
        self.waiting.push_back(Sequence {
            id: request.id,
            prompt_len,
            tokens,
            max_tokens: request.max_tokens,
            stop_tokens: request.stop_tokens,
            computed: 0,
            prefilled: 0,
            table: PageTable::new(),
            window: Vec::new(),
            locked: Vec::new(),
            cached_pages: 0,
            hashes,
            prefix_hit: 0,
            prefill_only: request.prefill_only,
            reuse_prefix: request.reuse_prefix,
            replay,
        });
        Ok(())
    }

    /// Allocates `n` pages' worth of room for `seq`'s next tokens, evicting cached blocks if
    /// needed. Returns the slots, or None when the pool cannot supply them.
    fn grow(
        pool: &mut PagePool,
        cache: &mut RadixCache,
        table: &mut PageTable,
        n: usize,
    ) -> Option<Vec<SlotId>> {
        Self::make_room(
            pool,
            cache,
            table.pages_needed(n, pool.layout().page_size()),
        );
        table.append(pool, n).ok()
    }

    /// Evicts cached blocks, in one walk of the cache, until `pages` pages are free or nothing
    /// more can go. A walk visits every cached block, so once the cache fills the pool it frees
    /// at least [`EVICTION_BATCH`] of the pool, least recently used first, rather than walk again
    /// for every page a step appends (a GPU pool holds hundreds of thousands of pages).
    fn make_room(pool: &mut PagePool, cache: &mut RadixCache, pages: usize) {
        if let Some(missing) = pages.checked_sub(pool.free_pages()).filter(|m| *m > 0) {
            let batch = pool.total_pages() / EVICTION_BATCH;
            cache
                .evict(pool, missing.max(batch))
                .expect("cache pages are valid");
        }
    }

    /// Releases everything a sequence holds. Its cached blocks count as used now (pages were
    /// offered one at a time, without touching the blocks before them).
    fn release(&mut self, seq: &mut Sequence) {
        self.cache_full_pages(seq);
        self.cache.touch(&seq.hashes[..seq.cached_pages]);
        self.cache.unlock(&seq.locked).expect("locked at admission");
        seq.locked.clear();
        seq.table.release(&mut self.pool).expect("held pages");
        self.pool.release_all(&seq.window).expect("window pages");
        seq.window.clear();
    }

    /// Offers the sequence's newly filled full pages to the prefix cache: only the blocks after
    /// those already offered are hashed and inserted (rehashing and walking the whole chain at
    /// every filled page cost ~17 us per sequence and step at 32K context).
    fn cache_full_pages(&mut self, seq: &mut Sequence) {
        let page_size = self.page_size();
        // A prompt's last block of one token runs through the decode path: its page is not what
        // a longer prompt's block computes, so it is not offered either.
        let last = seq.prefilled % self.block == 1 && seq.prefilled > 1;
        let prefilled = seq.prefilled - usize::from(last);
        let full = seq.computed.min(prefilled) / page_size;
        if full <= seq.cached_pages {
            return;
        }
        extend_hashes(&mut seq.hashes, &seq.tokens[..full * page_size], page_size);
        let from = seq.cached_pages;
        let pages = &seq.table.pages()[..full];
        let parent = from.checked_sub(1).map(|i| seq.hashes[i]);
        let extended = self.cache.extend(
            &mut self.pool,
            parent,
            &seq.hashes[from..full],
            &pages[from..],
        );
        if extended.is_err() {
            // The blocks before them left the cache (it was cleared): offer the whole chain.
            self.cache
                .insert(&mut self.pool, &seq.hashes[..full], pages)
                .expect("pages held by the sequence");
        }
        seq.cached_pages = full;
    }

    /// Preempts the most recently admitted running sequence other than `keep`: its pages go
    /// back and it waits again at the front of the queue. Returns the victim's index.
    fn preempt_one(&mut self, keep: usize) -> Option<usize> {
        let victim = (0..self.running.len()).rev().find(|i| *i != keep)?;
        let seq = self.running.remove(victim);
        self.requeue(seq);
        self.preemptions += 1;
        Some(victim)
    }

    /// Releases a sequence's pages and puts it at the front of the queue to be recomputed.
    fn requeue(&mut self, mut seq: Sequence) {
        self.release(&mut seq);
        seq.computed = 0;
        seq.prefilled = 0;
        seq.cached_pages = 0;
        self.waiting.push_front(seq);
    }

    /// Chooses the next step's work.
    pub fn schedule(&mut self) -> Batch {
        let mut budget = self.config.max_batch_tokens;
        let mut items = Vec::new();
        let page_size = self.page_size();
        // 1. Decodes, oldest first; preempt from the newest when pages run out. The pages this
        // step's decodes start are evicted for in one pass first: an eviction walks the whole
        // cache, and with a full pool (the steady state of a server whose cache holds every
        // finished prefix) a pass per sequence crossing a page boundary cost ~1 ms per step at
        // batch 64 over 131K cached blocks.
        let starting = self
            .running
            .iter()
            .filter(|s| s.decodes())
            .take(budget)
            .filter(|s| s.table.pages_needed(1, page_size) > 0)
            .count();
        Self::make_room(&mut self.pool, &mut self.cache, starting);
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if !self.running[i].decodes() {
                i += 1;
                continue;
            }
            let (pool, cache) = (&mut self.pool, &mut self.cache);
            let seq = &mut self.running[i];
            match Self::grow(pool, cache, &mut seq.table, 1) {
                Some(slots) => {
                    let p = seq.computed;
                    items.push(Item {
                        seq: seq.id,
                        positions: p..p + 1,
                        tokens: vec![seq.tokens[p]],
                        slots,
                        path: Path::Decode,
                        // A replayed token's successor is known: nothing to sample.
                        sample: p + 1 == seq.tokens.len(),
                    });
                    budget -= 1;
                    i += 1;
                }
                None => {
                    let Some(victim) = self.preempt_one(i) else {
                        break;
                    };
                    if victim < i {
                        // It was scheduled already: drop its item and follow the shift.
                        let gone = items
                            .iter()
                            .position(|it: &Item| !self.running.iter().any(|s| s.id == it.seq));
                        if let Some(gone) = gone {
                            budget += items.remove(gone).tokens.len();
                        }
                        i -= 1;
                    }
                }
            }
        }
        // 2. Prompt chunks of sequences already running.
        for idx in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            let seq = &self.running[idx];
            if seq.computed >= seq.prefilled || (seq.decodes() && seq.computed > 0) {
                continue; // decoding (or the prompt's last token, as one), handled above
            }
            let n = self.block_chunk(seq.computed, seq.prefilled - seq.computed);
            if n > budget {
                continue; // a block is never split: it waits for a step with room
            }
            if let Some(item) = self.chunk(idx, n) {
                budget -= item.tokens.len();
                items.push(item);
            } else {
                break;
            }
        }
        // 3. Admissions.
        while budget > 0 && self.running.len() < self.config.max_running {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            let blocks = seq.blocks();
            if self.block_chunk(0, blocks).min(self.block) > budget {
                // Even an uncached start needs a whole first block.
                self.waiting.push_front(seq);
                break;
            }
            // Reuse the longest cached prefix, keeping at least one token to compute so the step
            // produces logits.
            let hashes = hash_blocks(&seq.tokens[..blocks - 1], page_size);
            let mut pages = match seq.reuse_prefix {
                true => self.cache.match_prefix(&hashes),
                false => Vec::new(),
            };
            pages.truncate(self.reusable_pages(blocks, pages.len()));
            let hit = &hashes[..pages.len()];
            self.cache.lock(hit).expect("just matched");
            seq.table = PageTable::from_shared(&mut self.pool, &pages).expect("cached pages");
            seq.locked = hit.to_vec();
            seq.hashes = hashes;
            seq.computed = pages.len() * page_size;
            seq.prefilled = blocks;
            seq.cached_pages = pages.len();
            if seq.prefix_hit == 0 {
                seq.prefix_hit = seq.computed;
            }
            let window = self.window_pages;
            match Self::take_window(&mut self.pool, &mut self.cache, window) {
                Some(pages) => seq.window = pages,
                None => {
                    self.requeue(seq);
                    break;
                }
            }
            self.running.push(seq);
            let idx = self.running.len() - 1;
            let (computed, blocks) = (self.running[idx].computed, self.running[idx].prefilled);
            let n = self.block_chunk(computed, blocks - computed);
            let chunk = if n <= budget {
                self.chunk(idx, n)
            } else {
                None
            };
            match chunk {
                Some(item) => {
                    budget -= item.tokens.len();
                    items.push(item);
                }
                None => {
                    // No room: back to the front of the queue, holding nothing.
                    let seq = self.running.pop().expect("just pushed");
                    self.requeue(seq);
                    break;
                }
            }
        }
        Batch { items }
    }

    /// Allocates and describes the next `n` prompt tokens of running sequence `idx`.
    fn chunk(&mut self, idx: usize, n: usize) -> Option<Item> {
        let (pool, cache) = (&mut self.pool, &mut self.cache);
        let seq = &mut self.running[idx];
        let slots = Self::grow(pool, cache, &mut seq.table, n)?;
        let start = seq.computed;
        let path = match (start, n) {
            (0, _) => Path::Prefill,
            (_, 1) => Path::Decode,
            _ => Path::Extend,
        };
        Some(Item {
            seq: seq.id,
            positions: start..start + n,
            tokens: seq.tokens[start..start + n].to_vec(),
            slots,
            path,
            sample: start + n == seq.tokens.len(),
        })
    }

    /// Records a step's results: the batch that ran and, for items that sampled, the token.
    /// Returns each sampling sequence's outcome.
    pub fn complete(&mut self, batch: &Batch, sampled: &[(SeqId, u32)]) -> Vec<(SeqId, Outcome)> {
        for item in &batch.items {
            if let Some(seq) = self.running.iter_mut().find(|s| s.id == item.seq) {
                seq.computed = item.positions.end;
            }
        }
        let mut outcomes = Vec::new();
        for (id, token) in sampled {
            let Some(idx) = self.running.iter().position(|s| s.id == *id) else {
                continue;
            };
            let seq = &mut self.running[idx];
            seq.tokens.push(*token);
            if seq.prefill_only {
                let seq = self.running.remove(idx);
                outcomes.push((*id, Outcome::Prefilled(*token)));
                self.held.insert(*id, seq);
                continue;
            }
            let reason = if seq.stop_tokens.contains(token) {
                Some(FinishReason::Stop)
            } else if seq.generated() >= seq.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            match reason {
                Some(reason) => {
                    let mut seq = self.running.remove(idx);
                    self.release(&mut seq);
                    outcomes.push((*id, Outcome::Finished(Some(*token), reason)));
                }
                None => outcomes.push((*id, Outcome::Token(*token))),
            }
        }
        let mut running = std::mem::take(&mut self.running);
        for seq in running.iter_mut() {
            self.cache_full_pages(seq);
        }
        self.running = running;
        outcomes
    }

    /// Ends a request wherever it is, freeing its pages. Returns false if it is unknown.
    pub fn abort(&mut self, id: SeqId) -> bool {
        if let Some(idx) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(idx);
            self.release(&mut seq);
            return true;
        }
        if self.release_held(id) {
            return true;
        }
        if let Some(idx) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(idx);
            return true;
        }
        false
    }

    /// Cached prompt tokens a running or held sequence started from.
    pub fn prefix_hit(&self, id: SeqId) -> Option<usize> {
        self.find(id).map(|s| s.prefix_hit)
    }

    /// The tokens of a running or held sequence (prompt then output).
    pub fn tokens(&self, id: SeqId) -> Option<&[u32]> {
        self.find(id).map(|s| s.tokens.as_slice())
    }

    fn find(&self, id: SeqId) -> Option<&Sequence> {
        self.running
            .iter()
            .find(|s| s.id == id)
            .or_else(|| self.held.get(&id))
    }

    fn exists(&self, id: SeqId) -> bool {
        self.find(id).is_some() || self.waiting.iter().any(|s| s.id == id)
    }

    /// The page table of a running or held sequence.
    pub fn table(&self, id: SeqId) -> Option<&PageTable> {
        self.find(id).map(|s| &s.table)
    }

    /// The recent window's pages of a running or held sequence (empty without a window).
    pub fn window(&self, id: SeqId) -> Option<&[PageId]> {
        self.find(id).map(|s| s.window.as_slice())
    }
}

mod handoff;
pub use handoff::Reservation;

#[cfg(test)]
mod tests;
