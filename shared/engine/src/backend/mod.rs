//! The compute seam: [`Backend`] owns tensors and the handful of kernels a Llama-family forward
//! pass needs. The model code is written against this trait only, so the CPU reference
//! ([`cpu::CpuBackend`]) and a CUDA backend are interchangeable.
//!
//! Tensors are 2-D, row-major, f32 (`rows × cols`); token-major activations have one row per
//! token. Kernels write into caller-owned outputs so a forward pass can reuse its buffers, and
//! the shapes they expect are stated on each method (the CPU backend checks them with asserts:
//! a mismatch is a bug in the caller, not a runtime condition). Every kernel returns a
//! `Result`: a device backend's launch, copy or allocation can fail at run time, and that is
//! [`Error::Device`](crate::Error::Device), classified where it happens and passed up through the
//! forward pass to the engine, which stops (the worker then stops serving). Only `zeros` and
//! `resize` stay infallible; a device allocation failing there panics, and the worker's engine
//! thread turns that panic into the same stop.

pub mod cpu;

use crate::config::RopeStyle;
use crate::error::{Error, Result};
use crate::gguf::{dequant, GgmlType};
use crate::kv::StepTokens;
use crate::paged::WorkDtype;
use nibble_kvcache::{GlobalScales, PageId, PagePool, PoolPlan, SlotId};
use nibble_kvfmt::ScaleRule;
use std::ops::Range;

/// Shape of a GQA attention: query heads share KV heads in groups of
/// `num_heads / num_kv_heads`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnGeometry {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// Score scale, normally `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// Causal attention of one sequence's new queries over its context.
///
/// Query row `q_rows.start + i` is the token at position `kv_len - n + i` (n = `q_rows.len()`)
/// and attends to context rows `0..=kv_len - n + i` of `k` and `v`. The context, new tokens
/// included, is rows `0..kv_len` of `k`/`v`.
pub struct AttentionArgs<'a, T> {
    /// Queries after RoPE, `[rows, num_heads * head_dim]`.
    pub q: &'a T,
    /// This sequence's rows of `q` (and of the output).
    pub q_rows: Range<usize>,
    /// Keys after RoPE, `[>= kv_len, num_kv_heads * head_dim]`.
    pub k: &'a T,
    /// Values, same shape as `k`.
    pub v: &'a T,
    /// Context length including the new tokens.
    pub kv_len: usize,
    /// Head layout and scale.
    pub geometry: AttnGeometry,
}

/// RoPE tables and pairing for [`Backend::rope`].
pub struct RopeArgs<'a, T> {
    /// `cos(pos * theta^(-2i/d))`, `[max_positions, head_dim / 2]`.
    pub cos: &'a T,
    /// The matching sines.
    pub sin: &'a T,
    /// Which dims are rotated together.
    pub style: RopeStyle,
    /// Dims per head; each row of the rotated tensor is a whole number of heads.
    pub head_dim: usize,
}

/// How a pool writes its pages, fixed for its life: what a [`Backend::new_pages`] needs
/// besides the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PageEncoding {
    /// Per-(layer, K|V) dequantization multipliers.
    pub scales: GlobalScales,
    /// Head vectors stored rotated by the normalized Hadamard matrix (see [`crate::hadamard`]).
    pub hadamard: bool,
    /// How NVFP4 block scales are chosen on write.
    pub scale_rule: ScaleRule,
    /// K's NVFP4 codes chosen for the queries that read them
    /// ([`nibble_kvfmt::nvfp4::feedback`]), one factor per layer and KV head; `None`: the
    /// nearest codes. Readers need not know.
    pub k_codes: Option<std::sync::Arc<nibble_kvfmt::nvfp4::feedback::KeyFactors>>,
    /// Tokens of each sequence's high-precision recent window (0: none); see
    /// [`nibble_kvfmt::window`].
    pub window: usize,
    /// The dtype prefill and extend attention hold K/V in ([`WorkDtype::default`] unless
    /// `--prefill-work` says otherwise).
    pub prefill_work: WorkDtype,
}

/// Tensor storage and compute kernels.
pub trait Backend: Send + Sync + 'static {
    /// A 2-D f32 buffer owned by this backend.
    type Tensor: Send + Sync;

    /// A short name for logs ("cpu", "cuda:0").
    fn name(&self) -> String;

    /// Runs `f`, a whole forward step, in the backend's execution context (the CPU backend's
    /// thread pool; a device backend would bind its context and stream here). Kernels called
    /// inside it avoid per-call hand-off costs.
    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Runs `layers`, the model's layers over a decode-only step of a paged cache (one new
    /// token per sequence: embedding, every layer, up to the final norm's input). A device
    /// backend may run its host side more than once and its device work once, as a recorded
    /// graph (the CUDA backend's decode-step graphs); `layers` must then issue the same work for
    /// the same inputs each time, and its host side must be repeatable. By default it runs once.
    fn decode_layers(&self, layers: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        layers()
    }

    /// Copies host data (`rows * cols` values, row-major) into a new tensor.
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Self::Tensor>;

    /// Moves host data into a new tensor; backends that keep tensors in host memory can take
    /// the vector without copying.
    fn upload_vec(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<Self::Tensor> {
        self.upload(rows, cols, &data)
    }

    /// A weight matrix, `rows × cols` with one row per output feature, from GGML data: `bytes`
    /// holds the rows in order as values of type `ty`. Such a tensor is only read as the `w` of
    /// [`Backend::matmul_t`] and the table of [`Backend::embed`], so a backend may keep quantized
    /// blocks as they are and decode them inside those kernels (the CPU backend does), provided
    /// every value equals what [`dequant::dequantize`] gives. The default dequantizes to f32.
    fn upload_weight(
        &self,
        rows: usize,
        cols: usize,
        ty: GgmlType,
        bytes: &[u8],
    ) -> Result<Self::Tensor> {
        let mut data = vec![0.0f32; rows * cols];
        if !dequant::dequantize(ty, bytes, &mut data) {
            return Err(Error::InvalidInput(format!(
                "{} bytes of {ty} do not make a {rows}x{cols} matrix",
                bytes.len()
            )));
        }
        self.upload_matrix(rows, cols, data)
    }

    /// A weight matrix (a `matmul_t` operand or the embedding table) given as f32 values, from
    /// any loader (GGUF through `upload_weight`, safetensors, random weights). A backend may keep
    /// it in a narrower type for its GEMMs: the CUDA backend rounds to BF16 by default. The
    /// default keeps f32. Vectors (norm weights, biases) go through `upload_vec`.
    fn upload_matrix(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<Self::Tensor> {
        self.upload_vec(rows, cols, data)
    }

    /// A new zero-filled tensor.
    fn zeros(&self, rows: usize, cols: usize) -> Self::Tensor;

    /// Changes a tensor's shape, reusing its storage when it is large enough. Contents are
    /// unspecified afterwards.
    fn resize(&self, t: &mut Self::Tensor, rows: usize, cols: usize);

    /// `(rows, cols)`.
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);

    /// Copies rows `rows` of `t` to the host, appending to `out`.
    fn download_rows(&self, t: &Self::Tensor, rows: Range<usize>, out: &mut Vec<f32>)
        -> Result<()>;

    /// Appends, for every row of `t`, the first column holding the row's largest value (NaNs
    /// ignored; 0 for a row that starts with a NaN): greedy decoding's token, as
    /// `sampling::argmax` picks it. A device backend computes it where the rows are and copies
    /// back one index per row instead of the rows.
    fn argmax_rows(&self, t: &Self::Tensor, out: &mut Vec<u32>) -> Result<()> {
        let (rows, cols) = self.shape(t);
        let mut host = Vec::with_capacity(rows * cols);
        self.download_rows(t, 0..rows, &mut host)?;
        out.extend(
            host.chunks_exact(cols.max(1))
                .map(|row| crate::sampling::argmax(row) as u32),
        );
        Ok(())
    }

    /// `dst[dst_row + i] = src[src_row + i]` for `i < n`; same column count.
    fn copy_rows(
        &self,
        src: &Self::Tensor,
        src_row: usize,
        dst: &mut Self::Tensor,
        dst_row: usize,
        n: usize,
    ) -> Result<()>;

    /// `out[i] = table[tokens[i]]`; `out` is `[tokens.len(), table.cols]`. Tokens are in range.
    fn embed(&self, table: &Self::Tensor, tokens: &[u32], out: &mut Self::Tensor) -> Result<()>;

    /// `out = x · wᵀ`: `x` is `[n, k]`, `w` is `[m, k]` (a weight matrix, one row per output
    /// feature), `out` is `[n, m]`.
    fn matmul_t(&self, x: &Self::Tensor, w: &Self::Tensor, out: &mut Self::Tensor) -> Result<()>;

    /// `outs[i] = x · ws[i]ᵀ` for several weight matrices of one input (Q, K and V; gate and
    /// up). A backend may serve them in one pass (one launch over all the matrices on a GPU);
    /// each result must equal `matmul_t(x, ws[i], outs[i])`.
    fn matmul_t_many(
        &self,
        x: &Self::Tensor,
        ws: &[&Self::Tensor],
        outs: &mut [&mut Self::Tensor],
    ) -> Result<()> {
        assert_eq!(ws.len(), outs.len(), "matmul_t_many: one output per weight");
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul_t(x, w, out)?;
        }
        Ok(())
    }

    /// `x[r] += bias` for every row; `bias` is `[1, x.cols]`.
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Tensor) -> Result<()>;

    /// `x += y`, same shapes.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;

    /// RMSNorm over consecutive groups of `weight.cols` values (a row, or one head of a row):
    /// `out = x / sqrt(mean(x²) + eps) * weight`. `out` has `x`'s shape.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// The residual add and the next RMSNorm in one: `x += y`, then `out = rms_norm(x)` over
    /// whole rows (`weight` is `[1, x.cols]`). A backend may fuse them (one kernel instead of
    /// two on a GPU); the results must equal `add` then `rms_norm`.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.add(x, y)?;
        self.rms_norm(x, weight, eps, out)
    }

    /// Rotates every head of row `i` of `x` in place by position `positions[i]`.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        positions: &[u32],
        rope: &RopeArgs<'_, Self::Tensor>,
    ) -> Result<()>;

    /// [`Backend::rope`] of the queries and of the keys of the same rows. A backend may rotate
    /// both in one pass (one launch on a GPU); the results must equal two `rope` calls.
    fn rope_qk(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        positions: &[u32],
        rope: &RopeArgs<'_, Self::Tensor>,
    ) -> Result<()> {
        self.rope(q, positions, rope)?;
        self.rope(k, positions, rope)
    }

    /// `x[r][c] *= scale[c]` for every row `r`: a per-channel multiplier (K smoothing).
    fn mul_cols(&self, x: &mut Self::Tensor, scale: &Self::Tensor) -> Result<()>;

    /// `gate = silu(gate) * up`, elementwise, same shapes.
    fn silu_mul(&self, gate: &mut Self::Tensor, up: &Self::Tensor) -> Result<()>;

    /// The first half of a SwiGLU FFN: `up = x · w_upᵀ`, `gate = silu(x · w_gateᵀ) * up`. A
    /// backend may do it in one pass (a GPU: one launch for both products and the activation);
    /// the results must equal `matmul_t_many` of the two matrices followed by `silu_mul`.
    fn matmul_swiglu(
        &self,
        x: &Self::Tensor,
        w_gate: &Self::Tensor,
        w_up: &Self::Tensor,
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
    ) -> Result<()> {
        self.matmul_t_many(x, &[w_gate, w_up], &mut [&mut *gate, &mut *up])?;
        self.silu_mul(gate, up)
    }

    /// Causal GQA attention of one sequence (see [`AttentionArgs`]); writes rows `q_rows` of
    /// `out` (`[rows, num_heads * head_dim]`) and leaves its other rows alone.
    fn attention(
        &self,
        args: &AttentionArgs<'_, Self::Tensor>,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// The bytes of a KV page pool, in this backend's memory.
    type Pages: Send;

    /// Zeroed storage for `plan`'s pages, written as `encoding` says for the pool's life.
    fn new_pages(&self, plan: PoolPlan, encoding: PageEncoding) -> Result<Self::Pages>;

    /// One layer of paged attention for a whole step: writes every new token's K/V into its
    /// slot (quantized to the pool's dtype), and in BF16 into the sequence's recent window when
    /// the pool has one, and runs each sequence's attention path — initial
    /// prefill when it has nothing stored, decode for one new token, extend otherwise — writing
    /// the rows `step.spans[i]` of `out`.
    fn paged_attention(
        &self,
        pages: &mut Self::Pages,
        pool: &PagePool,
        layer: usize,
        step: &StepTokens<'_, Self::Tensor>,
        seqs: &[PagedSeq<'_>],
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// Copies one page's bytes (data and scales) to the host, replacing `out`'s contents.
    fn read_page(&self, pages: &Self::Pages, page: PageId, out: &mut Vec<u8>) -> Result<()>;

    /// Overwrites one allocated page with `bytes` (a page received from a peer).
    fn write_page(
        &self,
        pages: &mut Self::Pages,
        pool: &PagePool,
        page: PageId,
        bytes: &[u8],
    ) -> Result<()>;

    /// Whole pages back to back for a page transfer, in this backend's memory (host bytes on
    /// the CPU, a device buffer on a GPU): what a device link (NCCL) sends and receives.
    type Staging: Send + 'static;

    /// Copies pages `ids` (data and scales) into the staging buffer `into`, in that order, and
    /// sets its length to theirs. `into` is reused from transfer to transfer: its capacity
    /// holds them (the caller sized it), its old bytes are overwritten, never cleared first.
    fn stage_pages(
        &self,
        pages: &Self::Pages,
        ids: &[PageId],
        into: &mut Self::Staging,
    ) -> Result<()>;

    /// Writes `staging` (its length exactly `ids.len()` pages) into the allocated pages `ids`; refuses a
    /// page the allocator does not show allocated.
    fn unstage_pages(
        &self,
        pages: &mut Self::Pages,
        pool: &PagePool,
        ids: &[PageId],
        staging: &Self::Staging,
    ) -> Result<()>;

    /// The bytes a staging buffer holds (its length, not its capacity).
    fn staging_bytes(&self, staging: &Self::Staging) -> usize;

    /// A staging buffer's contents on the host: borrowed where it lives there, copied from a
    /// device (after every write to it) otherwise. A receiver checks pages on it before it
    /// writes them into its pool.
    fn staged_host_bytes<'a>(
        &self,
        staging: &'a Self::Staging,
    ) -> Result<std::borrow::Cow<'a, [u8]>>;
}

/// One sequence's pages in a paged attention step.
#[derive(Clone, Copy, Debug)]
pub struct PagedSeq<'a> {
    /// Its page table: enough pages for `stored + slots.len()` tokens.
    pub pages: &'a [PageId],
    /// Tokens already in the pages.
    pub stored: usize,
    /// The slots of the step's new tokens, in order.
    pub slots: &'a [SlotId],
    /// Its recent window's pages (empty when the pool has no window).
    pub window: &'a [PageId],
}
