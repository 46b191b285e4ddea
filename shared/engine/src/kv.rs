//! The KV seam between the forward pass and whatever stores a sequence's keys and values.
//!
//! For every layer, the forward pass hands a [`KvStore`] the new tokens' Q, K and V (after
//! RoPE) and gets back their attention output; how K/V are kept (contiguous f32 here; paged
//! BF16/FP8/NVFP4 later) and which attention path runs (initial prefill, extend, decode) is the
//! store's business. The protocol for one forward step of `n` tokens is
//! [`KvStore::reserve`]`(n)`, then [`KvStore::attend`] once per layer in order, then
//! [`KvStore::commit`]`(n)`. A step that fails before `commit` leaves `len()` unchanged; what it
//! reserved may stay reserved (see [`KvStore::reserve`]).

use crate::backend::{AttentionArgs, AttnGeometry, Backend};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use std::ops::Range;

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

    fn grow(&mut self, backend: &B, needed: usize) {
        let new_cap = needed.max(self.capacity * 2).min(self.max_len);
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut bigger = backend.zeros(new_cap, self.kv_dim);
            backend.copy_rows(t, 0, &mut bigger, 0, self.len);
            *t = bigger;
        }
        self.capacity = new_cap;
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
            self.grow(backend, needed);
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
        backend.copy_rows(new.k, new.rows.start, k, self.len, n);
        backend.copy_rows(new.v, new.rows.start, v, self.len, n);
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
        );
        Ok(())
    }

    fn commit(&mut self, n: usize) {
        self.len += n;
    }
}
