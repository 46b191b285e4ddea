//! The three attention paths over the paged KV cache — the CPU reference every other backend is
//! compared with.
//!
//! 1. [`prefill`]: initial prefill, no cached prefix. Attention runs over BF16 Q and the prompt's
//!    K/V rounded to the *work dtype* ([`WorkDtype`]: BF16 by default, FP8 on request for fp8
//!    and nvfp4 caches); the same K/V (from f32) are quantized into pages. Nothing is read from
//!    the cache.
//! 2. [`extend`]: a chunk after a cached prefix. The prefix is gathered from pages and dequantized
//!    into one work-dtype [`Workspace`] — one layer's worth, reused by every layer — the chunk's
//!    K/V are appended, attention runs over both, and the chunk is quantized into pages.
//! 3. [`decode`]: one new token per sequence. Its K/V are written to pages first; attention then
//!    reads every token from the pages, dequantizing one head vector at a time as it goes, with an
//!    online softmax per page: no staging copy of the cache and no buffer that grows with context.
//!
//! Shapes are token-major: q is `[token][q_head][head_dim]`, k and v `[token][kv_head][head_dim]`,
//! the output like q. Query head `h` attends with KV head `h / (q_heads / kv_heads)` (GQA).

use crate::backend::cpu::{causal_gqa, CpuTensor};
use crate::backend::{AttentionArgs, AttnGeometry};
use nibble_kvcache::{HostPages, PageBytes, PageId, PagePool, SlotId};
use nibble_kvfmt::{bf16, e2m1, e4m3, fp8, KvDtype, KvPart, PageLayout};

/// Errors of the attention paths: shape mismatches and cache errors.
#[derive(Debug, thiserror::Error)]
pub enum AttentionError {
    #[error("{what}: expected {expected} values, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("query heads ({q_heads}) must be a positive multiple of KV heads ({kv_heads})")]
    Heads { q_heads: usize, kv_heads: usize },
    #[error(transparent)]
    Cache(#[from] nibble_kvcache::Error),
}

type Result<T> = std::result::Result<T, AttentionError>;

/// The element type attention reads K/V in during prefill and extend. The default is BF16 for
/// every cache (docs/ACCURACY.md, "What the prompt paths lose": FP8 costs a prompt about 1% of
/// perplexity whatever the cache; docs/ARCHITECTURE.md, "Decisions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WorkDtype {
    /// E4M3 with the (layer, K|V) global scale (fp8 and nvfp4 caches; `--prefill-work fp8`).
    Fp8,
    /// BF16.
    #[default]
    Bf16,
}

impl From<WorkDtype> for KvDtype {
    /// The workspace's element type as the cache dtypes name it.
    fn from(work: WorkDtype) -> Self {
        match work {
            WorkDtype::Fp8 => KvDtype::Fp8,
            WorkDtype::Bf16 => KvDtype::Bf16,
        }
    }
}

impl WorkDtype {
    /// Whether a `cache`-dtype cache can work in this dtype: FP8 takes its scales from an fp8
    /// or nvfp4 cache's global scales, so a bf16 cache works in BF16 only. The error says why,
    /// after the dtype's name, for the flag that asked.
    pub fn check_cache(self, cache: KvDtype) -> std::result::Result<(), &'static str> {
        if cache == KvDtype::Bf16 && self == WorkDtype::Fp8 {
            return Err(
                "needs an fp8 or nvfp4 cache (its global scales); a bf16 cache works in bf16",
            );
        }
        Ok(())
    }

    /// The dtype's name, as flags and reports spell it.
    pub fn name(self) -> &'static str {
        match self {
            WorkDtype::Fp8 => "fp8",
            WorkDtype::Bf16 => "bf16",
        }
    }

    /// The dtype named `name` (`fp8` or `bf16`).
    pub fn parse(name: &str) -> std::result::Result<Self, String> {
        [WorkDtype::Fp8, WorkDtype::Bf16]
            .into_iter()
            .find(|w| w.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("unknown work dtype {name:?}: expected fp8 or bf16"))
    }

    /// Bytes of one value in the workspace.
    pub fn bytes(self) -> usize {
        match self {
            WorkDtype::Fp8 => 1,
            WorkDtype::Bf16 => 2,
        }
    }
}

/// Reusable buffers for the attention paths: the work-dtype K/V workspace of one layer (shared
/// by all layers, grown only when a longer context arrives) and small per-head scratch.
#[derive(Debug)]
pub struct Workspace {
    dtype: WorkDtype,
    /// K then V bytes of `[token][kv_head][head_dim]` in the work dtype.
    k: Vec<u8>,
    v: Vec<u8>,
    /// The workspace's K and V decoded to f32 `[token][kv_head · head_dim]`, what attention reads.
    k_tile: CpuTensor,
    v_tile: CpuTensor,
    /// One token of every KV head, for gathering the prefix.
    token: Vec<f32>,
    /// The new tokens' queries rounded to BF16, and attention's output.
    q: CpuTensor,
    out: CpuTensor,
    decode: DecodeScratch,
}

impl Default for Workspace {
    /// A workspace of the default work dtype.
    fn default() -> Self {
        Self::with_dtype(WorkDtype::default())
    }
}

impl Workspace {
    /// A workspace holding K/V in `dtype`.
    pub fn with_dtype(dtype: WorkDtype) -> Self {
        Self {
            dtype,
            k: Vec::new(),
            v: Vec::new(),
            k_tile: CpuTensor::default(),
            v_tile: CpuTensor::default(),
            token: Vec::new(),
            q: CpuTensor::default(),
            out: CpuTensor::default(),
            decode: DecodeScratch::default(),
        }
    }

    /// Bytes the K/V workspace holds now.
    pub fn workspace_bytes(&self) -> usize {
        self.k.capacity() + self.v.capacity()
    }

    fn reserve(&mut self, tokens: usize, layout: &PageLayout) {
        let bytes = tokens * layout.kv_heads() * layout.head_dim() * self.dtype.bytes();
        self.k.resize(bytes, 0);
        self.v.resize(bytes, 0);
    }

    /// Encodes `x` (f32, whole tokens) into the workspace at token `at`.
    fn store(&mut self, part: KvPart, at: usize, layout: &PageLayout, g: f32, x: &[f32]) {
        let per_token = layout.kv_heads() * layout.head_dim() * self.dtype.bytes();
        let dtype = self.dtype;
        let buf = match part {
            KvPart::K => &mut self.k,
            KvPart::V => &mut self.v,
        };
        let dst = &mut buf[at * per_token..at * per_token + x.len() * dtype.bytes()];
        match dtype {
            WorkDtype::Fp8 => fp8::quantize_unchecked(x, g, dst),
            WorkDtype::Bf16 => bf16::encode_le(x, dst),
        }
    }

    /// Decodes tokens `0..tokens` of every KV head into the f32 tiles `[token][kv_head][dim]`.
    fn load_tiles(&mut self, tokens: usize, layout: &PageLayout, g: (f32, f32)) {
        let values = tokens * layout.kv_heads() * layout.head_dim();
        let width = self.dtype.bytes();
        let kv_row = layout.kv_heads() * layout.head_dim();
        self.k_tile.resize(tokens, kv_row);
        self.v_tile.resize(tokens, kv_row);
        for (src, tile, g) in [
            (&self.k, self.k_tile.as_mut_slice(), g.0),
            (&self.v, self.v_tile.as_mut_slice(), g.1),
        ] {
            let bytes = &src[..values * width];
            match self.dtype {
                WorkDtype::Fp8 => {
                    for (o, b) in tile.iter_mut().zip(bytes) {
                        *o = e4m3::decode(*b) * g;
                    }
                }
                WorkDtype::Bf16 => bf16::decode_le(bytes, tile),
            }
        }
    }
}

/// Dot product written so the compiler vectorizes it.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[inline]
fn axpy(acc: &mut [f32], alpha: f32, x: &[f32]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += alpha * v;
    }
}

/// The geometry of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    fn of(layout: &PageLayout, q_heads: usize) -> Result<Self> {
        let kv_heads = layout.kv_heads();
        if q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(AttentionError::Heads { q_heads, kv_heads });
        }
        Ok(Self {
            q_heads,
            kv_heads,
            head_dim: layout.head_dim(),
        })
    }

    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }
}

fn check(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(AttentionError::Shape {
            what,
            expected,
            actual,
        })
    }
}

/// One layer's new tokens for one sequence: their projections after RoPE.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    pub layer: usize,
    pub q_heads: usize,
    /// `[token][q_head][head_dim]`.
    pub q: &'a [f32],
    /// `[token][kv_head][head_dim]`.
    pub k: &'a [f32],
    /// `[token][kv_head][head_dim]`.
    pub v: &'a [f32],
}

impl Step<'_> {
    /// Checks the shapes for `n` new tokens and returns the geometry.
    fn heads(&self, layout: &PageLayout, n: usize, out: &[f32]) -> Result<Heads> {
        let heads = Heads::of(layout, self.q_heads)?;
        let qn = n * heads.q_heads * heads.head_dim;
        let kn = n * heads.kv_heads * heads.head_dim;
        check("q", qn, self.q.len())?;
        check("k", kn, self.k.len())?;
        check("v", kn, self.v.len())?;
        check("output", qn, out.len())?;
        Ok(heads)
    }
}

/// Rounds q to BF16 (the precision the attention paths take Q in) into the workspace.
fn bf16_q(ws: &mut Workspace, q: &[f32], heads: Heads) {
    let row = heads.q_heads * heads.head_dim;
    ws.q.resize(q.len() / row, row);
    for (r, x) in ws.q.as_mut_slice().iter_mut().zip(q) {
        *r = bf16::round(*x);
    }
}

/// Causal attention of `n` queries at positions `start..start + n` over the workspace's first
/// `start + n` tokens, decoded to f32 and handed to the CPU backend's attention kernel.
fn attend_workspace(
    ws: &mut Workspace,
    layout: &PageLayout,
    heads: Heads,
    g: (f32, f32),
    start: usize,
    out: &mut [f32],
) {
    let row = heads.q_heads * heads.head_dim;
    let n = out.len() / row;
    ws.load_tiles(start + n, layout, g);
    ws.out.resize(n, row);
    let args = AttentionArgs {
        q: &ws.q,
        q_rows: 0..n,
        k: &ws.k_tile,
        v: &ws.v_tile,
        kv_len: start + n,
        geometry: AttnGeometry {
            num_heads: heads.q_heads,
            num_kv_heads: heads.kv_heads,
            head_dim: heads.head_dim,
            scale: 1.0 / (heads.head_dim as f32).sqrt(),
        },
    };
    causal_gqa(&args, &mut ws.out);
    out.copy_from_slice(ws.out.as_slice());
}

fn global_scales(store: &HostPages, layer: usize) -> (f32, f32) {
    let scales = store.scales();
    (scales.get(layer, KvPart::K), scales.get(layer, KvPart::V))
}

/// The (K, V) global scales of the FP8 work dtype of a `cache`-dtype cache whose (layer, K|V)
/// global scales are `global`: those that cover the same range as the cache. An fp8 cache's
/// scale is used as is. An nvfp4 global scale maps a layer's amax onto 6 · 448 (largest E2M1
/// value times largest block scale), so the work dtype takes it times 6, mapping the same amax
/// onto 448; using it unchanged would saturate FP8 at amax / 6 once calibrated. (A bf16
/// workspace ignores the scale.) The CUDA backend's workspace takes the same scales.
pub fn work_scales(cache: KvDtype, global: (f32, f32)) -> (f32, f32) {
    let (k, v) = global;
    match cache {
        KvDtype::Nvfp4 => (k * e2m1::MAX, v * e2m1::MAX),
        KvDtype::Fp8 | KvDtype::Bf16 => (k, v),
    }
}

/// [`work_scales`] of `store`'s layer `layer`.
fn layer_work_scales(store: &HostPages, layer: usize) -> (f32, f32) {
    work_scales(store.layout().dtype(), global_scales(store, layer))
}

/// The slot of token `t` of a sequence whose pages are `pages`.
fn slot_of(pages: &[PageId], t: usize, page_size: usize) -> Result<SlotId> {
    let page = pages.get(t / page_size).ok_or(AttentionError::Shape {
        what: "pages covering the context",
        expected: t / page_size + 1,
        actual: pages.len(),
    })?;
    Ok(SlotId::new(*page, t % page_size, page_size))
}

/// The page pool, the page bytes and the workspace one attention call works with.
pub struct PagedCache<'a> {
    pub pool: &'a PagePool,
    pub store: &'a mut HostPages,
    pub ws: &'a mut Workspace,
}

impl PagedCache<'_> {
    /// Path 1: initial prefill of `slots.len()` tokens at positions `0..n`, with no cached prefix.
    pub fn prefill(
        &mut self,
        step: Step<'_>,
        slots: &[Option<SlotId>],
        window: &[PageId],
        out: &mut [f32],
    ) -> Result<()> {
        let (pool, store, ws) = (self.pool, &mut *self.store, &mut *self.ws);
        let layout = *store.layout();
        let n = slots.len();
        let heads = step.heads(&layout, n, out)?;
        let g = layer_work_scales(store, step.layer);
        ws.reserve(n, &layout);
        ws.store(KvPart::K, 0, &layout, g.0, step.k);
        ws.store(KvPart::V, 0, &layout, g.1, step.v);
        bf16_q(ws, step.q, heads);
        attend_workspace(ws, &layout, heads, g, 0, out);
        store.write_kv(pool, step.layer, step.k, step.v, slots)?;
        store.write_window(pool, window, step.layer, step.k, step.v, 0..n, n)?;
        Ok(())
    }

    /// Path 2: a chunk of `slots.len()` tokens at positions `prefix..prefix + n` after `prefix`
    /// tokens already in the sequence's `pages`. The prefix is read from the pages, never from
    /// the window: a sequence that started from a cached prefix has nothing of it there.
    pub fn extend(
        &mut self,
        step: Step<'_>,
        seq: SeqPages<'_>,
        prefix: usize,
        slots: &[Option<SlotId>],
        out: &mut [f32],
    ) -> Result<()> {
        let pages = seq.pages;
        let (pool, store, ws) = (self.pool, &mut *self.store, &mut *self.ws);
        let layout = *store.layout();
        let n = slots.len();
        let heads = step.heads(&layout, n, out)?;
        let g = layer_work_scales(store, step.layer);
        let (kv_heads, dim, page_size) = (layout.kv_heads(), layout.head_dim(), layout.page_size());
        ws.reserve(prefix + n, &layout);
        // Gather: dequantize the cached prefix token by token into the work dtype.
        ws.token.resize(kv_heads * dim, 0.0);
        let mut token = std::mem::take(&mut ws.token);
        for t in 0..prefix {
            let slot = slot_of(pages, t, page_size)?;
            for (part, gp) in [(KvPart::K, g.0), (KvPart::V, g.1)] {
                for (head, x) in token.chunks_exact_mut(dim).enumerate() {
                    store.read_head(step.layer, part, slot, head, x)?;
                }
                ws.store(part, t, &layout, gp, &token);
            }
        }
        ws.token = token;
        ws.store(KvPart::K, prefix, &layout, g.0, step.k);
        ws.store(KvPart::V, prefix, &layout, g.1, step.v);
        bf16_q(ws, step.q, heads);
        attend_workspace(ws, &layout, heads, g, prefix, out);
        store.write_kv(pool, step.layer, step.k, step.v, slots)?;
        let positions = prefix..prefix + n;
        store.write_window(
            pool,
            seq.window,
            step.layer,
            step.k,
            step.v,
            positions,
            prefix + n,
        )?;
        Ok(())
    }

    /// Path 3: one new token at position `context - 1` of a sequence whose `pages` cover `context`
    /// tokens; `slot` is the new token's slot. The new K/V go to the page (and the window) first,
    /// then attention reads all `context` tokens straight from the pages, the window's last ones
    /// from the window.
    pub fn decode(
        &mut self,
        step: Step<'_>,
        seq: SeqPages<'_>,
        context: usize,
        slot: SlotId,
        out: &mut [f32],
    ) -> Result<()> {
        let pages = seq.pages;
        let (pool, store, ws) = (self.pool, &mut *self.store, &mut *self.ws);
        let layout = *store.layout();
        let heads = step.heads(&layout, 1, out)?;
        let page_size = layout.page_size();
        check("context pages", context.div_ceil(page_size), pages.len())?;
        if slot_of(pages, context - 1, page_size)? != slot {
            return Err(AttentionError::Shape {
                what: "new token's slot (the context's last position)",
                expected: slot_of(pages, context - 1, page_size)?.0 as usize,
                actual: slot.0 as usize,
            });
        }
        store.write_kv(pool, step.layer, step.k, step.v, &[Some(slot)])?;
        let last = context - 1..context;
        store.write_window(pool, seq.window, step.layer, step.k, step.v, last, context)?;
        let q: Vec<f32> = step.q.iter().map(|x| bf16::round(*x)).collect();
        let query = DecodeQuery {
            layer: step.layer,
            heads,
            q: &q,
        };
        ws.decode.attend(store, query, seq, context, out)
    }
}

/// A sequence's page table and its recent window's pages (empty without a window).
#[derive(Clone, Copy, Debug)]
pub struct SeqPages<'a> {
    pub pages: &'a [PageId],
    pub window: &'a [PageId],
}

/// One decode token's query for one layer, BF16-rounded, all query heads.
#[derive(Clone, Copy)]
struct DecodeQuery<'a> {
    layer: usize,
    heads: Heads,
    q: &'a [f32],
}

/// Scratch of decode attention: one head vector, a page of scores per query head of a group,
/// and the online-softmax state. Its size depends on the geometry, never on the context.
#[derive(Debug, Default)]
pub struct DecodeScratch {
    q: Vec<f32>,
    head: Vec<f32>,
    scores: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// One decode token of one sequence, for [`DecodeScratch::decode`].
#[derive(Clone, Copy, Debug)]
pub struct DecodeArgs<'a> {
    pub layer: usize,
    pub q_heads: usize,
    /// The token's queries, all heads (rounded to BF16 here).
    pub q: &'a [f32],
    /// The sequence's pages, covering `context` tokens, and its window's.
    pub seq: SeqPages<'a>,
    /// Tokens to attend over, the new one (already written to its slot) included.
    pub context: usize,
}

impl DecodeScratch {
    /// Decode attention reading `store` only: the new token's K/V must already be in its slot.
    /// Several sequences can run this in parallel, each with its own scratch.
    pub fn decode(
        &mut self,
        store: &HostPages,
        args: DecodeArgs<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        let layout = *store.layout();
        let heads = Heads::of(&layout, args.q_heads)?;
        check("q", heads.q_heads * heads.head_dim, args.q.len())?;
        check("output", args.q.len(), out.len())?;
        check(
            "context pages",
            args.context.div_ceil(layout.page_size()),
            args.seq.pages.len(),
        )?;
        let mut q = std::mem::take(&mut self.q);
        q.clear();
        q.extend(args.q.iter().map(|x| bf16::round(*x)));
        let query = DecodeQuery {
            layer: args.layer,
            heads,
            q: &q,
        };
        let result = self.attend(store, query, args.seq, args.context, out);
        self.q = q;
        result
    }

    /// Attention of one query token over `context` tokens read straight from the sequence's
    /// pages (the tokens its window holds from the window), written to `out`.
    fn attend(
        &mut self,
        store: &HostPages,
        query: DecodeQuery<'_>,
        seq: SeqPages<'_>,
        context: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let DecodeQuery { layer, heads, q } = query;
        let (pages, window) = (seq.pages, *store.window());
        let layout = *store.layout();
        // One head vector of the token at `position` (offset `t` in page `view`): from the window
        // when it holds it, else dequantized from the page.
        let read = |view: &PageBytes<'_>, part, kv_head, position, t, g, head: &mut [f32]| {
            if window.holds(position, context) {
                let bytes = store.window_head(seq.window, layer, part, kv_head, position)?;
                bf16::decode_le(bytes, head);
            } else {
                view.head(layer, part, kv_head, t, g, head);
            }
            Ok::<(), AttentionError>(())
        };
        let page_size = layout.page_size();
        let g = global_scales(store, layer);
        let (dim, group) = (heads.head_dim, heads.group());
        let scale = 1.0 / (dim as f32).sqrt();
        self.head.resize(dim, 0.0);
        self.scores.resize(group * page_size, 0.0);
        // Online softmax per query head of the group: running max, running sum, and the
        // unnormalized output accumulated in `out`.
        self.max.resize(group, 0.0);
        self.sum.resize(group, 0.0);
        let (max, sum, scores, head) = (
            &mut self.max,
            &mut self.sum,
            &mut self.scores,
            &mut self.head,
        );
        for kv_head in 0..heads.kv_heads {
            let hq = kv_head * group;
            let q = &q[hq * dim..(hq + group) * dim];
            let acc = &mut out[hq * dim..(hq + group) * dim];
            acc.fill(0.0);
            max.fill(f32::NEG_INFINITY);
            sum.fill(0.0);
            for (p, page) in pages.iter().enumerate() {
                let view = PageBytes {
                    bytes: store.page(*page)?,
                    layout: &layout,
                };
                let tokens = (context - p * page_size).min(page_size);
                // Scores of this page's tokens for every query head of the group: each K vector is
                // dequantized once for the whole group.
                for t in 0..tokens {
                    read(&view, KvPart::K, kv_head, p * page_size + t, t, g.0, head)?;
                    for j in 0..group {
                        scores[j * page_size + t] = dot(&q[j * dim..(j + 1) * dim], head) * scale;
                    }
                }
                for j in 0..group {
                    let page_scores = &mut scores[j * page_size..j * page_size + tokens];
                    let page_max = page_scores.iter().fold(f32::NEG_INFINITY, |m, s| m.max(*s));
                    let new_max = max[j].max(page_max);
                    let correction = (max[j] - new_max).exp();
                    sum[j] *= correction;
                    for a in acc[j * dim..(j + 1) * dim].iter_mut() {
                        *a *= correction;
                    }
                    for s in page_scores.iter_mut() {
                        *s = (*s - new_max).exp();
                        sum[j] += *s;
                    }
                    max[j] = new_max;
                }
                for t in 0..tokens {
                    read(&view, KvPart::V, kv_head, p * page_size + t, t, g.1, head)?;
                    for j in 0..group {
                        axpy(
                            &mut acc[j * dim..(j + 1) * dim],
                            scores[j * page_size + t],
                            head,
                        );
                    }
                }
            }
            for j in 0..group {
                for a in acc[j * dim..(j + 1) * dim].iter_mut() {
                    *a /= sum[j];
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
