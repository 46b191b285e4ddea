//! Causal GQA attention on the CPU, over token-major f32 K/V.
//!
//! * Many new rows (prefill, extend): for each (query head, block of query rows), scores by
//!   GEMM against the head's KV group, masked softmax, then a GEMM with V written straight into
//!   the head's columns of the output.
//! * A few new rows (decode): the visible keys are split across threads and each span streams
//!   whole K/V rows once for all heads; spans merge by log-sum-exp.
//!
//! Scores live in per-thread scratch buffers reused across calls, so nothing proportional to
//! the context is allocated once they have grown (a decode step allocates only the
//! `threads × heads × (head_dim + 2)` span partials).

use super::simd;
use super::CpuTensor;
use crate::backend::AttentionArgs;
use rayon::prelude::*;
use std::cell::RefCell;

/// Query rows per task: bounds scratch to `Q_BLOCK × context` floats per thread.
const Q_BLOCK: usize = 64;

/// Up to this many new rows, streaming dot products and AXPYs beat small GEMMs (decode steps).
const FEW_ROWS: usize = 4;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A raw output pointer shared by tasks that write disjoint regions.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint (row block, head) regions of the output; see `causal_gqa`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Taking `self` makes closures capture the whole (Send) wrapper, not the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

pub(crate) fn causal_gqa(args: &AttentionArgs<'_, CpuTensor>, out: &mut CpuTensor) {
    let g = args.geometry;
    let d = g.head_dim;
    let n = args.q_rows.len();
    let group = g.num_heads / g.num_kv_heads;
    assert!(n <= args.kv_len, "attention: more new tokens than context");
    assert_eq!(args.q.cols, g.num_heads * d, "attention: q width");
    assert_eq!(args.k.cols, g.num_kv_heads * d, "attention: k width");
    assert_eq!(args.v.cols, args.k.cols, "attention: v width");
    assert!(
        args.k.rows >= args.kv_len && args.v.rows >= args.kv_len,
        "attention: context rows"
    );
    assert!(
        args.q_rows.end <= args.q.rows && args.q_rows.end <= out.rows,
        "attention: q rows"
    );
    assert_eq!(out.cols, args.q.cols, "attention: out width");
    if n == 0 {
        return;
    }
    if n <= FEW_ROWS {
        few_rows(args, out);
        return;
    }
    let past = args.kv_len - n;
    let (q_stride, kv_stride, out_stride) = (args.q.cols, args.k.cols, out.cols);
    let blocks = n.div_ceil(Q_BLOCK);
    let out_ptr = OutPtr(out.as_mut_slice().as_mut_ptr());
    let (q, k, v) = (args.q.as_slice(), args.k.as_slice(), args.v.as_slice());
    let row0 = args.q_rows.start;

    (0..g.num_heads * blocks).into_par_iter().for_each(|task| {
        let (h, b) = (task / blocks, task % blocks);
        let kv_head = h / group;
        let (i0, i1) = (b * Q_BLOCK, ((b + 1) * Q_BLOCK).min(n));
        let rows = i1 - i0;
        let ctx = past + i1; // keys visible to the last row of the block
        SCRATCH.with_borrow_mut(|scores| {
            scores.resize(rows * ctx, 0.0);
            // SAFETY: all pointers stay inside their buffers: q rows row0+i0..row0+i1 with
            // head h's d columns; k/v rows 0..ctx (ctx <= kv_len <= rows) with head kv_head's
            // columns; scores is rows×ctx. The output region (rows row0+i0..row0+i1, columns
            // h*d..h*d+d) belongs to this task alone.
            unsafe {
                gemm::gemm(
                    rows,
                    ctx,
                    d,
                    scores.as_mut_ptr(),
                    1,
                    ctx as isize,
                    false,
                    q.as_ptr().add((row0 + i0) * q_stride + h * d),
                    1,
                    q_stride as isize,
                    k.as_ptr().add(kv_head * d),
                    kv_stride as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            for (r, row) in scores.chunks_exact_mut(ctx).enumerate() {
                simd::softmax_prefix(row, past + i0 + r + 1, g.scale);
            }
            // SAFETY: as above.
            unsafe {
                gemm::gemm(
                    rows,
                    d,
                    ctx,
                    out_ptr.get().add((row0 + i0) * out_stride + h * d),
                    1,
                    out_stride as isize,
                    false,
                    scores.as_ptr(),
                    1,
                    ctx as isize,
                    v.as_ptr().add(kv_head * d),
                    1,
                    kv_stride as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    });
}

/// Smallest span of keys worth giving its own thread in a decode step.
const MIN_KEYS_PER_SPLIT: usize = 128;

/// Attention for a few query rows (decode steps), one row at a time. The visible keys are split
/// into spans, one per thread; each span streams whole K and V rows once for all heads
/// (token-major rows are contiguous) and leaves, per head, its score max, exp-sum and
/// unnormalized output; the spans are then merged with the usual log-sum-exp rescaling.
fn few_rows(args: &AttentionArgs<'_, CpuTensor>, out: &mut CpuTensor) {
    let g = args.geometry;
    let (d, heads) = (g.head_dim, g.num_heads);
    let n = args.q_rows.len();
    let past = args.kv_len - n;
    let part_len = heads * (d + 2);
    let (q, k, v) = (args.q.as_slice(), args.k.as_slice(), args.v.as_slice());
    let (q_stride, out_stride) = (args.q.cols, out.cols);
    let threads = rayon::current_num_threads();
    for i in 0..n {
        let row = args.q_rows.start + i;
        let visible = past + i + 1;
        let splits = (visible / MIN_KEYS_PER_SPLIT).clamp(1, threads);
        // Per split: maxima [heads], sums [heads], outputs [heads][d].
        let mut partials = vec![0.0f32; splits * part_len];
        let span = |s: usize| visible * s / splits..visible * (s + 1) / splits;
        let query = &q[row * q_stride..(row + 1) * q_stride];
        partials
            .par_chunks_mut(part_len)
            .enumerate()
            .for_each(|(s, part)| {
                SCRATCH.with_borrow_mut(|scores| {
                    let keys = span(s);
                    scores.resize(heads * keys.len(), 0.0);
                    let span = simd::KeySpan {
                        q: query,
                        k,
                        v,
                        stride: args.k.cols,
                        keys,
                        group: heads / g.num_kv_heads,
                        head_dim: d,
                        scale: g.scale,
                    };
                    simd::attend_key_span(&span, scores, part);
                });
            });
        let dst = &mut out.as_mut_slice()[row * out_stride..][..heads * d];
        for h in 0..heads {
            let max = partials
                .chunks_exact(part_len)
                .fold(f32::NEG_INFINITY, |m, p| m.max(p[h]));
            let o = &mut dst[h * d..(h + 1) * d];
            o.fill(0.0);
            let mut denom = 0.0f32;
            for p in partials.chunks_exact(part_len) {
                let w = (p[h] - max).exp();
                denom += w * p[heads + h];
                let acc = &p[2 * heads + h * d..2 * heads + (h + 1) * d];
                for (x, &a) in o.iter_mut().zip(acc) {
                    *x += w * a;
                }
            }
            let inv = 1.0 / denom;
            for x in o.iter_mut() {
                *x *= inv;
            }
        }
    }
}
