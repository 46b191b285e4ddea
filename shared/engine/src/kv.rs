//! The KV seam between the forward pass and whatever stores the sequences' keys and values.
//!
//! For every layer, the forward pass hands a [`KvBatch`] the whole step's Q, K and V (after
//! RoPE), every sequence's rows concatenated, and gets back their attention output; how K/V are
//! kept and which attention path runs (initial prefill, extend, decode) is the batch's business.
//! A batch-level seam lets a paged cache attend for all sequences at once (one kernel launch per
//! layer on a GPU). [`PerSequence`] turns per-sequence [`KvStore`]s — the contiguous f32
//! [`ContiguousKv`] reference — into a batch. The protocol for one forward step of `n` tokens of
//! one store is
//! [`KvStore::reserve`]`(n)`, then [`KvStore::attend`] once per layer in order, then
//! [`KvStore::commit`]`(n)`. A step that fails before `commit` leaves `len()` unchanged; what it
//! reserved may stay reserved (see [`KvStore::reserve`]).

use crate::backend::{AttentionArgs, AttnGeometry, Backend, PagedSeq};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use nibble_kvcache::PagePool;
use std::ops::Range;

/// One layer's new tokens for a whole step.
pub struct StepTokens<'a, T> {
    /// Queries after RoPE, `[rows, num_heads * head_dim]`.
    pub q: &'a T,
    /// Keys after RoPE, `[rows, num_kv_heads * head_dim]`.
    pub k: &'a T,
    /// Values, `[rows, num_kv_heads * head_dim]`.
    pub v: &'a T,
    /// Sequence `i`'s rows; row `spans[i].start + j` is its token at position `stored(i) + j`.
    pub spans: &'a [Range<usize>],
    /// Head layout.
    pub geometry: AttnGeometry,
}

/// The caches of every sequence of one forward step.
///
/// Protocol: [`reserve`](Self::reserve), then [`attend`](Self::attend) once per layer in order,
/// then [`commit`](Self::commit). A step that fails before `commit` changes no `stored` count.
pub trait KvBatch<B: Backend>: Send {
    /// Sequences in the step.
    fn sequences(&self) -> usize;

    /// Tokens sequence `seq` already has cached: the position of its first new token.
    fn stored(&self, seq: usize) -> usize;

    /// Makes room for `new[i]` tokens of sequence `i`, or fails.
    fn reserve(&mut self, backend: &B, new: &[usize]) -> Result<()>;

    /// Stores layer `layer`'s K/V of every new token and writes their causal attention over
    /// each sequence's context into the matching rows of `out`.
    fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        step: &StepTokens<'_, B::Tensor>,
        out: &mut B::Tensor,
    ) -> Result<()>;

    /// Makes the step's tokens visible: `stored(i)` grows by `new[i]`.
    fn commit(&mut self, new: &[usize]);

    /// Whether [`attend`](Self::attend) may be called again for the same layer and step with
    /// the same effect (its host side keeps no count of calls), which
    /// [`Backend::decode_layers`] needs.
    fn repeatable(&self) -> bool {
        false
    }
}

/// Per-sequence stores as one batch, attending one sequence at a time.
pub struct PerSequence<'a, 'b, B: Backend>(pub &'a mut [&'b mut dyn KvStore<B>]);

impl<B: Backend> KvBatch<B> for PerSequence<'_, '_, B> {
    fn sequences(&self) -> usize {
        self.0.len()
    }

    fn stored(&self, seq: usize) -> usize {
        self.0[seq].len()
    }

    fn reserve(&mut self, backend: &B, new: &[usize]) -> Result<()> {
        for (store, n) in self.0.iter_mut().zip(new) {
            store.reserve(backend, *n)?;
        }
        Ok(())
    }

    fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        step: &StepTokens<'_, B::Tensor>,
        out: &mut B::Tensor,
    ) -> Result<()> {
        for (store, rows) in self.0.iter_mut().zip(step.spans) {
            let new = NewTokens {
                q: step.q,
                k: step.k,
                v: step.v,
                rows: rows.clone(),
                geometry: step.geometry,
            };
            store.attend(backend, layer, &new, out)?;
        }
        Ok(())
    }

    fn commit(&mut self, new: &[usize]) {
        for (store, n) in self.0.iter_mut().zip(new) {
            store.commit(*n);
        }
    }
}

/// A step over the paged cache: every sequence's page table and new slots are already allocated
/// (by the scheduler), so `reserve` only checks them and `commit` has nothing to do — the owner
/// of the page tables records the new lengths.
pub struct PagedBatch<'a, B: Backend> {
    pub pages: &'a mut B::Pages,
    pub pool: &'a PagePool,
    pub seqs: Vec<PagedSeq<'a>>,
}

impl<B: Backend> KvBatch<B> for PagedBatch<'_, B> {
    fn sequences(&self) -> usize {
        self.seqs.len()
    }

    fn stored(&self, seq: usize) -> usize {
        self.seqs[seq].stored
    }

    fn reserve(&mut self, _backend: &B, new: &[usize]) -> Result<()> {
        let page_size = self.pool.layout().page_size();
        for (i, (seq, n)) in self.seqs.iter().zip(new).enumerate() {
            let needed = (seq.stored + n).div_ceil(page_size);
            if seq.slots.len() != *n || seq.pages.len() < needed {
                return Err(Error::InvalidInput(format!(
                    "sequence {i}: {n} new tokens but {} slots and {} of {needed} pages",
                    seq.slots.len(),
                    seq.pages.len()
                )));
            }
        }
        Ok(())
    }

    fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        step: &StepTokens<'_, B::Tensor>,
        out: &mut B::Tensor,
    ) -> Result<()> {
        backend.paged_attention(self.pages, self.pool, layer, step, &self.seqs, out)
    }

    fn commit(&mut self, _new: &[usize]) {}

    fn repeatable(&self) -> bool {
        true
    }
}

/// One layer's new tokens for one sequence.
pub struct NewTokens<'a, T> {
    /// Queries after RoPE, `[batch_rows, num_heads * head_dim]`.
    pub q: &'a T,
    /// Keys after RoPE, `[batch_rows, num_kv_heads * head_dim]`.
    pub k: &'a T,
    /// Values, `[batch_rows, num_kv_heads * head_dim]`.
    pub v: &'a T,
    /// This sequence's rows in `q`, `k`, `v` and the output; row `rows.start + i` is the token
    /// at position `len() + i`.
    pub rows: Range<usize>,
    /// Head layout.
    pub geometry: AttnGeometry,
}

/// A sequence's cached keys and values across all layers.
pub trait KvStore<B: Backend>: Send {
    /// Tokens stored and committed (the position of the next new token).
    fn len(&self) -> usize;

    /// True when nothing is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes sure positions `len()..len() + n` have room (allocating pages, growing buffers),
    /// or fails. It is idempotent for a given `len()`: after a failed step (another sequence's
    /// reserve or a later layer failed) the next step reserves again, and whatever the failed
    /// step wrote past `len()` is overwritten.
    fn reserve(&mut self, backend: &B, n: usize) -> Result<()>;

    /// Stores layer `layer`'s K/V for the new tokens and writes their causal attention over the
    /// whole context (stored tokens plus new ones) into rows `new.rows` of `out`.
    fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        new: &NewTokens<'_, B::Tensor>,
        out: &mut B::Tensor,
    ) -> Result<()>;

    /// Makes the `n` tokens of the step visible: `len()` grows by `n`.
    fn commit(&mut self, n: usize);
}

/// The simplest store: per layer, one contiguous f32 K and V tensor of `capacity` rows,
/// growing by doubling.
pub struct ContiguousKv<B: Backend> {
    k: Vec<B::Tensor>,
    v: Vec<B::Tensor>,
    len: usize,
    capacity: usize,
    max_len: usize,
    kv_dim: usize,
}

impl<B: Backend> ContiguousKv<B> {
    /// A store for a model with `config`, with room for `initial` tokens before it grows. It
    /// never holds more than the model's context length.
    pub fn new(backend: &B, config: &ModelConfig, initial: usize) -> Self {
        let kv_dim = config.kv_dim();
        let capacity = initial.clamp(1, config.max_context);
        let alloc = || {
            (0..config.num_layers)
                .map(|_| backend.zeros(capacity, kv_dim))
                .collect()
        };
        Self {
            k: alloc(),
            v: alloc(),
            len: 0,
            capacity,
            max_len: config.max_context,
            kv_dim,
        }
    }

    /// Forgets every token after the first `len` (keeps the storage).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    fn grow(&mut self, backend: &B, needed: usize) -> Result<()> {
        let new_cap = needed.max(self.capacity * 2).min(self.max_len);
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut bigger = backend.zeros(new_cap, self.kv_dim);
            backend.copy_rows(t, 0, &mut bigger, 0, self.len)?;
            *t = bigger;
        }
        self.capacity = new_cap;
        Ok(())
    }
}

impl<B: Backend> KvStore<B> for ContiguousKv<B> {
    fn len(&self) -> usize {
        self.len
    }

    fn reserve(&mut self, backend: &B, n: usize) -> Result<()> {
        let needed = self.len + n;
        if needed > self.max_len {
            return Err(Error::InvalidInput(format!(
                "context of {needed} tokens exceeds the model's {}",
                self.max_len
            )));
        }
        if needed > self.capacity {
            self.grow(backend, needed)?;
        }
        Ok(())
    }

    fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        new: &NewTokens<'_, B::Tensor>,
        out: &mut B::Tensor,
    ) -> Result<()> {
        let n = new.rows.len();
        if self.len + n > self.capacity {
            return Err(Error::InvalidInput(format!(
                "attend of {n} tokens without reserve (len {}, capacity {})",
                self.len, self.capacity
            )));
        }
        let (k, v) = (&mut self.k[layer], &mut self.v[layer]);
        backend.copy_rows(new.k, new.rows.start, k, self.len, n)?;
        backend.copy_rows(new.v, new.rows.start, v, self.len, n)?;
        backend.attention(
            &AttentionArgs {
                q: new.q,
                q_rows: new.rows.clone(),
                k,
                v,
                kv_len: self.len + n,
                geometry: new.geometry,
            },
            out,
        )?;
        Ok(())
    }

    fn commit(&mut self, n: usize) {
        self.len += n;
    }
}
