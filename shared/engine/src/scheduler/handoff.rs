//! Prefill/decode hand-off on the scheduler's side.
//!
//! A prefill worker runs a request with `prefill_only`: when its prompt is done the sequence
//! leaves the batch with its first token ([`Outcome::Prefilled`](super::Outcome::Prefilled)) and
//! its pages stay held for export until [`State::release_held`]. A decode worker
//! [`reserve`](State::reserve)s pages for a prompt — reusing its own cached prefix, allocating the
//! rest — receives the missing pages' bytes, and [`activate`](State::activate)s the sequence with
//! the first token, after which it decodes like any other. A resumed request is activated with
//! all the output it already has, which it then computes one token at a time through the decode
//! path before it samples (see [`NewRequest::output`](super::NewRequest::output)). Held sequences count against the pool
//! like running ones, and [`State::abort`] frees them.

use nibble_kvcache::{hash_blocks, PageId, PageTable};

use super::{FinishReason, SeqId, Sequence, State, SubmitError};

/// Pages reserved on a decode worker for one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// Leading prompt tokens already in this worker's cache: their pages need no transfer.
    pub cached_tokens: usize,
    /// Every page of the prompt, in order, then the recent window's pages (as many as the
    /// sender's, the KV format being the same): `pages[cached_tokens / page_size..]` await
    /// bytes.
    pub pages: Vec<PageId>,
}

impl State {
    /// Reserves pages for `prompt`'s K/V, which a prefill worker will send. Nothing is held on
    /// error.
    pub fn reserve(&mut self, id: SeqId, prompt: &[u32]) -> Result<Reservation, SubmitError> {
        if prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if self.exists(id) {
            return Err(SubmitError::Duplicate(id));
        }
        let page_size = self.page_size();
        let needed = prompt.len().div_ceil(page_size) + self.window_pages;
        if needed > self.pool.total_pages() {
            return Err(SubmitError::TooLarge {
                needed,
                total: self.pool.total_pages(),
            });
        }
        let hashes = hash_blocks(prompt, page_size);
        // Every cached page can be reused: the window's bytes come from the sender whatever
        // this worker holds.
        let cached = self.cache.match_prefix(&hashes);
        let hit = hashes[..cached.len()].to_vec();
        self.cache.lock(&hit).expect("just matched");
        let mut table = PageTable::from_shared(&mut self.pool, &cached).expect("cached pages");
        let rest = prompt.len() - table.len();
        let window = Self::take_window(&mut self.pool, &mut self.cache, self.window_pages);
        let grown = window.is_some()
            && Self::grow(&mut self.pool, &mut self.cache, &mut table, rest).is_some();
        if !grown {
            if let Some(window) = &window {
                self.pool.release_all(window).expect("just allocated");
            }
            table.release(&mut self.pool).expect("held pages");
            self.cache.unlock(&hit).expect("locked above");
            return Err(SubmitError::NoRoom {
                needed: needed - cached.len(),
                free: self.pool.free_pages(),
            });
        }
        let window = window.expect("checked above");
        let mut pages = table.pages().to_vec();
        pages.extend_from_slice(&window);
        let reservation = Reservation {
            cached_tokens: cached.len() * page_size,
            pages,
        };
        self.held.insert(
            id,
            Sequence {
                id,
                tokens: prompt.to_vec(),
                prompt_len: prompt.len(),
                max_tokens: 0,
                stop_tokens: Vec::new(),
                computed: cached.len() * page_size,
                prefilled: prompt.len(),
                table,
                window,
                locked: hit,
                cached_pages: cached.len(),
                hashes,
                prefix_hit: cached.len() * page_size,
                prefill_only: false,
                reuse_prefix: true,
                replay: false,
            },
        );
        Ok(reservation)
    }

    /// Starts decoding a reserved sequence whose pages now hold the whole prompt, from its
    /// `output` so far: the first token the prefill worker sampled or, for a resumed request,
    /// everything already generated (replayed through the decode path, see
    /// [`NewRequest::output`](super::NewRequest::output)). Returns the finish reason when that
    /// output already ends it (its last token a stop token, or `max_tokens` reached); its pages
    /// are then released.
    pub fn activate(
        &mut self,
        id: SeqId,
        output: &[u32],
        max_tokens: usize,
        stop_tokens: Vec<u32>,
    ) -> Result<Option<FinishReason>, SubmitError> {
        let Some(&last) = output.last() else {
            return Err(SubmitError::EmptyOutput(id));
        };
        let mut seq = self.held.remove(&id).ok_or(SubmitError::Unknown(id))?;
        seq.computed = seq.prompt_len;
        seq.tokens.extend_from_slice(output);
        seq.max_tokens = max_tokens;
        seq.stop_tokens = stop_tokens;
        seq.replay = output.len() > 1;
        let finished = if seq.stop_tokens.contains(&last) {
            Some(FinishReason::Stop)
        } else if seq.generated() >= seq.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        if finished.is_some() {
            self.release(&mut seq);
        } else {
            self.cache_full_pages(&mut seq);
            self.running.push(seq);
        }
        Ok(finished)
    }

    /// Releases a held sequence (exported, or a reservation given up). Returns false if `id` is
    /// not held.
    pub fn release_held(&mut self, id: SeqId) -> bool {
        match self.held.remove(&id) {
            Some(mut seq) => {
                self.release(&mut seq);
                true
            }
            None => false,
        }
    }

    /// Sequences holding pages outside the batch.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}
