//! Attention: the contiguous-cache kernel (`attention_f32`) and paged attention, which mirrors
//! the CPU paths of `nibble_engine::paged`. Per layer, [`CudaBackend::attend`] checks the step
//! against the pages ([`PagedLayer::check`]), runs prefill and extend sequences one by one
//! ([`CudaBackend::prefill_seq`]: the cached prefix gathered into the work-dtype workspace, the
//! new tokens encoded after it, `prefill_*` over both, then the new K/V quantized into pages),
//! and then every decode sequence in one batch (`decode.rs`).

use std::ops::Range;

use cudarc::driver::{CudaSlice, LaunchConfig};
use nibble_engine::backend::{AttentionArgs, PagedSeq};
use nibble_engine::kv::StepTokens;
use nibble_engine::paged::WorkDtype;
use nibble_engine::{Error as EngineError, Result as EngineResult};
use nibble_kvcache::{PagePool, SlotId};
use nibble_kvfmt::{KvDtype, PageLayout};

use super::{engine_err, grid, launched, CudaBackend, CudaPages, CudaTensor};
use crate::graph;
use crate::launch::check_write_slots;
use crate::{
    CachedPrefix, Error, KvScales, KvWorkspace, NewKv, PageGeom, PrefillBatch, Result, WindowGeom,
    WindowRows,
};

/// Largest context of the contiguous-cache attention kernel (its scores sit in 48 KiB of shared
/// memory, next to 1 KiB of reductions).
const MAX_CONTIGUOUS_CONTEXT: usize = 11 * 1024;

/// One layer of a paged attention step, checked against the pages: what the kernels of every
/// sequence of the step share.
pub(super) struct PagedLayer {
    pub(super) layer: usize,
    pub(super) layout: PageLayout,
    pub(super) geom: PageGeom,
    pub(super) window: WindowGeom,
    /// The layer's global scales.
    pub(super) scales: KvScales,
    pub(super) q_heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) softmax_scale: f32,
}

impl PagedLayer {
    /// Checks a step of `seqs` (one per span of `step`) at `layer` against the pages and the
    /// pool before any kernel writes: the geometry, every slot in range, allocated and unique,
    /// every window, and each sequence's slots and pages.
    fn check(
        pages: &CudaPages,
        pool: &PagePool,
        layer: usize,
        step: &StepTokens<'_, CudaTensor>,
        seqs: &[PagedSeq<'_>],
    ) -> Result<Self> {
        if seqs.len() != step.spans.len() {
            return Err(Error::Shape {
                what: "sequences (one per span)",
                expected: step.spans.len(),
                actual: seqs.len(),
            });
        }
        let layout = pages.layout;
        let geometry = step.geometry;
        if geometry.num_kv_heads != layout.kv_heads() || geometry.head_dim != layout.head_dim() {
            return Err(Error::Unsupported(format!(
                "step geometry {geometry:?} does not match the pages' layout"
            )));
        }
        let geom = PageGeom::new(&layout, layer)?;
        let all: Vec<Option<SlotId>> = seqs
            .iter()
            .flat_map(|s| s.slots.iter().copied().map(Some))
            .collect();
        pool.check_slots(&all)
            .map_err(|e| Error::Unsupported(e.to_string()))?;
        let window = WindowGeom::new(&pages.window, &layout, layer);
        for seq in seqs {
            pool.check_window(&pages.window, seq.window)
                .map_err(|e| Error::Unsupported(e.to_string()))?;
        }
        for (seq, span) in seqs.iter().zip(step.spans) {
            if seq.slots.len() != span.len() {
                return Err(Error::Shape {
                    what: "slots of a sequence (one per new token)",
                    expected: span.len(),
                    actual: seq.slots.len(),
                });
            }
            if seq.pages.len() * layout.page_size() < seq.stored + span.len() {
                return Err(Error::Shape {
                    what: "pages covering a sequence's context",
                    expected: (seq.stored + span.len()).div_ceil(layout.page_size()),
                    actual: seq.pages.len(),
                });
            }
        }
        Ok(Self {
            layer,
            layout,
            geom,
            window,
            scales: KvScales::of_layer(&pages.scales, layer),
            q_heads: geometry.num_heads,
            kv_heads: layout.kv_heads(),
            head_dim: geometry.head_dim,
            softmax_scale: geometry.scale,
        })
    }

    pub(super) fn dtype(&self) -> KvDtype {
        self.layout.dtype()
    }

    /// Values of one token's queries (and of its output).
    pub(super) fn q_row(&self) -> usize {
        self.q_heads * self.head_dim
    }

    /// Values of one token's keys (or values).
    pub(super) fn kv_row(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// Whether a sequence of a step decodes (one new token after its stored context) rather than
/// prefills or extends.
fn is_decode(seq: &PagedSeq<'_>) -> bool {
    seq.stored > 0 && seq.slots.len() == 1
}

impl CudaBackend {
    /// Causal attention of rows `q_rows` over the first `kv_len` rows of a contiguous cache.
    pub(super) fn attend_contiguous(
        &self,
        args: &AttentionArgs<'_, CudaTensor>,
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
        let g = args.geometry;
        let n = args.q_rows.len();
        assert!(
            g.num_kv_heads > 0 && g.num_heads.is_multiple_of(g.num_kv_heads),
            "attention: heads"
        );
        assert!(args.kv_len >= n, "attention: kv_len below the new rows");
        assert!(
            args.kv_len <= MAX_CONTIGUOUS_CONTEXT,
            "CUDA contiguous-cache attention supports at most {MAX_CONTIGUOUS_CONTEXT} tokens \
             (use the paged cache)"
        );
        if n == 0 {
            return Ok(());
        }
        self.bind();
        let (row0, n32, kv_len) = (args.q_rows.start as u32, n as u32, args.kv_len as u32);
        let (qh, kvh, hd) = (g.num_heads as u32, g.num_kv_heads as u32, g.head_dim as u32);
        let cfg = LaunchConfig {
            grid_dim: (n32, qh, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: kv_len * 4,
        };
        let mut b = self.kernels.builder(&self.ops.attention);
        b.arg(args.q.f32())
            .arg(args.k.f32())
            .arg(args.v.f32())
            .arg(out.f32_mut())
            .arg(&row0)
            .arg(&n32)
            .arg(&kv_len)
            .arg(&qh)
            .arg(&kvh)
            .arg(&hd)
            .arg(&g.scale);
        // SAFETY: matches attention_f32; q/out rows and the kv_len context rows exist (the
        // caller's contract), and the scores fit the shared memory requested.
        launched(unsafe { b.launch(cfg) }.map(|_| ()), "attention")?;
        Ok(())
    }

    /// `Backend::paged_attention`: [`Self::attend`], between rotations for a Hadamard pool.
    pub(super) fn attend_paged(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        layer: usize,
        step: &StepTokens<'_, CudaTensor>,
        seqs: &[PagedSeq<'_>],
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
        self.bind();
        let unsupported = |e| match e {
            Error::Unsupported(m) => EngineError::Unsupported(m),
            other => engine_err(other),
        };
        if !pages.hadamard {
            return self
                .attend(pages, pool, layer, step, seqs, out)
                .map_err(unsupported);
        }
        // The pages hold rotated vectors: attend with rotated Q, K, V (orthonormal, so the
        // scores are unchanged), then rotate the output back (H is its own inverse).
        let d = step.geometry.head_dim;
        let mut rotated = pages.rotated.take().unwrap_or_else(|| {
            [
                self.zeros_f32(0, 0),
                self.zeros_f32(0, 0),
                self.zeros_f32(0, 0),
            ]
        });
        self.rotate_qkv([step.q, step.k, step.v], &mut rotated, d)?;
        let [q, k, v] = &rotated;
        let step = StepTokens { q, k, v, ..*step };
        let result = self.attend(pages, pool, layer, &step, seqs, out);
        pages.rotated = Some(rotated);
        result.map_err(unsupported)?;
        self.rotate_heads_in_place(out, d)?;
        Ok(())
    }

    /// Paged attention of one layer: every prefill and extend sequence one at a time, then the
    /// decode sequences in one batch. Nothing is written before the whole step is checked.
    fn attend(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        layer: usize,
        step: &StepTokens<'_, CudaTensor>,
        seqs: &[PagedSeq<'_>],
        out: &mut CudaTensor,
    ) -> Result<()> {
        let at = PagedLayer::check(pages, pool, layer, step, seqs)?;
        for (seq, span) in seqs.iter().zip(step.spans) {
            if !is_decode(seq) {
                // Its host-side copies (page tables, lengths) are made at each call.
                graph::block("a one-token prompt")?;
                self.prefill_seq(pages, &at, step, seq, span.clone(), out)?;
            }
        }
        let decodes: Vec<(&PagedSeq<'_>, &Range<usize>)> = seqs
            .iter()
            .zip(step.spans)
            .filter(|(s, _)| is_decode(s))
            .collect();
        if decodes.is_empty() {
            return Ok(());
        }
        self.decode_seqs(pages, &at, step, &decodes, out)
    }

    /// Initial prefill (`seq.stored` = 0) or extend of one sequence, the new tokens being rows
    /// `span` of the step: its context in the work-dtype workspace, causal attention over it
    /// into those rows of `out`, then the new K/V into the pages (and the window).
    fn prefill_seq(
        &self,
        pages: &mut CudaPages,
        at: &PagedLayer,
        step: &StepTokens<'_, CudaTensor>,
        seq: &PagedSeq<'_>,
        span: Range<usize>,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (n, start, q_row) = (span.len(), seq.stored, at.q_row());
        let q = self.rows_of(step.q, span.clone())?;
        let k = self.rows_of(step.k, span.clone())?;
        let v = self.rows_of(step.v, span.clone())?;
        self.fill_workspace(pages, at, seq, &k, &v, n)?;
        let work = pages.work;
        let mut o: CudaSlice<f32> = self.stream().alloc_zeros(n * q_row)?;
        let batch = PrefillBatch {
            q: &q,
            n,
            start,
            q_heads: at.q_heads,
            kv_heads: at.kv_heads,
            head_dim: at.head_dim,
            k: &pages.ws_k,
            v: &pages.ws_v,
            work: work.into(),
            work_scales: at.scales.work(at.dtype()),
            softmax_scale: at.softmax_scale,
        };
        self.kernels.prefill(&batch, &mut o)?;
        self.stream().memcpy_dtod(
            &o,
            &mut out
                .f32_mut()
                .slice_mut(span.start * q_row..span.end * q_row),
        )?;
        self.store_prefill_kv(pages, at, seq, &k, &v, n)
    }

    /// The work-dtype workspace of a prefill or extend: the cached prefix (`seq.stored` tokens)
    /// gathered from the pages, then the `n` new tokens' `k` and `v` encoded after it.
    fn fill_workspace(
        &self,
        pages: &mut CudaPages,
        at: &PagedLayer,
        seq: &PagedSeq<'_>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        let stream = self.stream();
        let (start, dtype, kv_row) = (seq.stored, at.dtype(), at.kv_row());
        let work = pages.work;
        let work_scales = at.scales.work(dtype);
        let bytes = (start + n) * kv_row * work.bytes();
        if pages.ws_k.len() < bytes {
            pages.ws_k = stream.alloc_zeros(bytes)?;
            pages.ws_v = stream.alloc_zeros(bytes)?;
        }
        if start > 0 {
            let table: Vec<u32> = seq.pages[..start.div_ceil(at.layout.page_size())]
                .iter()
                .map(|p| p.0)
                .collect();
            let table = stream.clone_htod(&table)?;
            let prefix = CachedPrefix {
                page_table: &table,
                tokens: start,
                scales: at.scales,
                work: work.into(),
                work_scales,
            };
            let ws = KvWorkspace {
                k: &mut pages.ws_k,
                v: &mut pages.ws_v,
            };
            self.kernels
                .gather_work(ws, &pages.bytes, at.geom, dtype, &prefix)?;
        }
        let (values, at_value) = ((n * kv_row) as u64, (start * kv_row) as u64);
        let bf16 = u32::from(work == WorkDtype::Bf16);
        let mut b = self.kernels.builder(&self.ops.encode_work);
        b.arg(&mut pages.ws_k)
            .arg(&mut pages.ws_v)
            .arg(k)
            .arg(v)
            .arg(&values)
            .arg(&at_value)
            .arg(&bf16)
            .arg(&work_scales.k)
            .arg(&work_scales.v);
        // SAFETY: matches encode_work; the workspace holds (start + n) tokens, k and v n.
        unsafe { b.launch(grid(2 * values)) }?;
        Ok(())
    }

    /// The `n` new tokens of a prefill or extend into their slots and, for a pool with a
    /// recent window, the sequence's window.
    fn store_prefill_kv(
        &self,
        pages: &mut CudaPages,
        at: &PagedLayer,
        seq: &PagedSeq<'_>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        let stream = self.stream();
        if seq.slots.is_empty() {
            return Ok(());
        }
        let slots: Vec<u32> = seq.slots.iter().map(|s| s.0).collect();
        check_write_slots(pages.bytes.len(), &at.geom, at.dtype(), &slots)?;
        let kv = NewKv {
            k: k.as_view(),
            v: v.as_view(),
            scales: at.scales,
            rule: pages.scale_rule,
            k_codes: CudaPages::layer_k_codes(&pages.k_codes, &pages.layout, at.layer),
        };
        let slots = stream.clone_htod(&slots)?;
        let uploads = if pages.window.is_none() {
            None
        } else {
            let table: Vec<u32> = seq.window.iter().map(|p| p.0).collect();
            let lens = [(seq.stored + n) as u32];
            Some((stream.clone_htod(&table)?, stream.clone_htod(&lens)?))
        };
        let window = uploads.as_ref().map(|(table, lens)| WindowRows {
            geom: at.window,
            table: table.as_view(),
            lens: lens.as_view(),
            rows_per_seq: n,
        });
        // SAFETY: every slot was checked above against the pages and the geometry is the
        // layout's (PageGeom::new); the window's pages were checked against the pool
        // (PagedLayer::check) and its length covers the n rows.
        unsafe {
            self.kernels.quantize_unchecked(
                &mut pages.bytes,
                at.geom,
                at.dtype(),
                &kv,
                &slots.as_view(),
                window.as_ref(),
            )
        }
    }
}
