//! Causal GQA attention on the CPU: for each (query head, block of query rows), scores by GEMM
//! against the head's KV group, masked softmax, then a GEMM with V written straight into the
//! head's columns of the output. Scores live in a per-thread scratch buffer that is reused
//! across calls, so a decode step allocates nothing once the buffer has grown to the context.

use super::simd;
use super::CpuTensor;
use crate::backend::AttentionArgs;
use rayon::prelude::*;
use std::cell::RefCell;

/// Query rows per task: bounds scratch to `Q_BLOCK × context` floats per thread.
const Q_BLOCK: usize = 64;

/// Up to this many new rows, dot products and AXPYs beat two small GEMMs (decode steps).
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

pub(super) fn causal_gqa(args: &AttentionArgs<'_, CpuTensor>, out: &mut CpuTensor) {
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

/// Attention for a few query rows: per (head, row), scores by dot products over the visible
/// keys, softmax, then the weighted sum of value rows accumulated into the output.
fn few_rows(args: &AttentionArgs<'_, CpuTensor>, out: &mut CpuTensor) {
    let g = args.geometry;
    let d = g.head_dim;
    let n = args.q_rows.len();
    let group = g.num_heads / g.num_kv_heads;
    let past = args.kv_len - n;
    let (q_stride, kv_stride, out_stride) = (args.q.cols, args.k.cols, out.cols);
    let out_ptr = OutPtr(out.as_mut_slice().as_mut_ptr());
    let (q, k, v) = (args.q.as_slice(), args.k.as_slice(), args.v.as_slice());
    let row0 = args.q_rows.start;

    // One task per (KV head, row): the query heads of a GQA group run back to back, so the
    // group's keys and values come from DRAM once and from cache for the other heads.
    (0..g.num_kv_heads * n).into_par_iter().for_each(|task| {
        let (kv_head, i) = (task / n, task % n);
        let col = kv_head * d;
        let visible = past + i + 1;
        SCRATCH.with_borrow_mut(|scores| {
            scores.resize(visible, 0.0);
            for h in kv_head * group..(kv_head + 1) * group {
                let qh = &q[(row0 + i) * q_stride + h * d..][..d];
                // SAFETY: row row0+i, columns h*d..h*d+d of the output belong to this task
                // alone (h is in this task's group) and lie inside `out` (asserted above).
                let oh = unsafe {
                    std::slice::from_raw_parts_mut(
                        out_ptr.get().add((row0 + i) * out_stride + h * d),
                        d,
                    )
                };
                let head = simd::OneHead {
                    q: qh,
                    keys: &k[col..],
                    values: &v[col..],
                    stride: kv_stride,
                    visible,
                    scale: g.scale,
                };
                simd::attend_one_head(&head, scores, oh);
            }
        });
    });
}
