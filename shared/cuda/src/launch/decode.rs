//! [`Kernels::decode`]: paged split-KV decode attention, and how it splits each context over
//! the device ([`split_plan`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchConfig};
use nibble_kvfmt::KvDtype;

use super::{check, fmt_factor, DecodeOut, Kernels, KvScales};
use crate::geom::dtype_code;
use crate::{Error, PageGeom, Result, WindowGeom};

/// `DecodeArgs` of `cu/decode.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeArgs {
    q_heads: u32,
    group: u32,
    max_pages: u32,
    splits: u32,
    tokens_per_split: u32,
    score_scale: f32,
    v_scale: f32,
    window_s_mul: f32,
    window_p_mul: f32,
}

// SAFETY: #[repr(C)], plain numbers, the same layout as the CUDA struct.
unsafe impl DeviceRepr for DecodeArgs {}

/// Threads per decode block (4 warps) and tokens per warp tile, as in `cu/decode.cu`.
pub(super) const DECODE_THREADS: u32 = 128;
const DECODE_WARPS: usize = DECODE_THREADS as usize / 32;
pub(crate) const DECODE_TILE: usize = 16;
/// Whether `decode_combine_groups` (four thread groups, `COMBINE_GROUPS` in `cu/decode.cu`)
/// merges `splits` splits rather than `decode_combine` (one group): above 16 splits (a batch of
/// one sequence: dozens), where one group would take several rounds of loads.
fn merges_in_groups(splits: usize) -> bool {
    splits > 16
}
/// `COMBINE_GROUPS` in `cu/decode.cu`.
const COMBINE_GROUPS: u32 = 4;

impl Kernels {
    /// Paged decode attention for one layer: one query token per sequence over its whole
    /// context, read straight from the pages. Writes `out` (`[seq][q_head][head_dim]` f32) and,
    /// when given `out_bf16` (at least as long), its BF16 cast (`nibble_kvfmt::bf16::encode`).
    pub fn decode(
        &self,
        pages: &CudaSlice<u8>,
        geom: PageGeom,
        dtype: KvDtype,
        batch: &DecodeBatch<'_>,
        ws: &mut DecodeWorkspace,
        out: DecodeOut<'_>,
    ) -> Result<()> {
        let DecodeOut {
            values: mut out,
            mut bf16,
        } = out;
        let out = &mut out;
        let d = geom.head_dim as usize;
        let dim_index = match d {
            64 => 0,
            128 => 1,
            _ => {
                return Err(Error::Unsupported(format!(
                    "decode with head dim {d} (64 or 128)"
                )))
            }
        };
        let kv_heads = geom.kv_heads as usize;
        let q_heads = batch.q_heads;
        if let Some(reason) = crate::device::group_unsupported(q_heads, kv_heads) {
            return Err(Error::Unsupported(reason));
        }
        let seqs = batch.context.len();
        check("queries", seqs * q_heads * d, batch.q.len())?;
        check("outputs", seqs * q_heads * d, out.len())?;
        if let Some(cast) = &bf16 {
            if cast.len() < out.len() {
                return Err(Error::Shape {
                    what: "BF16 cast of the outputs",
                    expected: out.len(),
                    actual: cast.len(),
                });
            }
        }
        check("page table", seqs * batch.max_pages, batch.page_table.len())?;
        if batch.max_context > batch.max_pages * geom.page_size as usize {
            return Err(Error::Shape {
                what: "page-table row covering the longest context",
                expected: batch.max_context.div_ceil(geom.page_size as usize),
                actual: batch.max_pages,
            });
        }
        if geom.page_size < DECODE_TILE as u32 {
            return Err(Error::Unsupported(format!(
                "decode with page size {} (at least {DECODE_TILE}: a tile reads one page)",
                geom.page_size
            )));
        }
        // BF16 pages carry no scale (docs/FORMAT.md): the pool's global scales do not apply.
        let (gk, gv) = match dtype {
            KvDtype::Bf16 => (1.0, 1.0),
            KvDtype::Fp8 | KvDtype::Nvfp4 => (batch.scales.k, batch.scales.v),
        };
        let slots = self.decode_slots[dtype_code(dtype) as usize][dim_index];
        let plan = split_plan(slots, seqs * kv_heads, batch.max_context);
        ws.reserve(&self.stream, seqs * q_heads * plan.splits, d)?;
        let args = DecodeArgs {
            q_heads: q_heads as u32,
            group: (q_heads / kv_heads) as u32,
            max_pages: batch.max_pages as u32,
            splits: plan.splits as u32,
            tokens_per_split: plan.tokens_per_split as u32,
            // Positive, as the kernel needs (masked scores are -inf times it); only an underflow
            // of the product could make it 0.
            score_scale: (batch.softmax_scale * gk * fmt_factor(dtype) * std::f32::consts::LOG2_E)
                .max(f32::MIN_POSITIVE),
            v_scale: gv * fmt_factor(dtype),
            window_s_mul: 1.0 / (gk * fmt_factor(dtype)),
            window_p_mul: 1.0 / (gv * fmt_factor(dtype)),
        };
        let window_table = match (&batch.window_table, batch.window.tokens) {
            (_, 0) => &batch.page_table,
            (Some(table), _) => {
                check(
                    "window table",
                    seqs * batch.window.pages as usize,
                    table.len(),
                )?;
                table
            }
            (None, _) => {
                return Err(Error::Shape {
                    what: "window table of a pool with a recent window",
                    expected: seqs * batch.window.pages as usize,
                    actual: 0,
                })
            }
        };
        let cfg = LaunchConfig {
            grid_dim: (plan.splits as u32, kv_heads as u32, seqs as u32),
            block_dim: (DECODE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = &self.decode[dtype_code(dtype) as usize][dim_index];
        let mut b = self.builder(f);
        b.arg(pages)
            .arg(&batch.q)
            .arg(&batch.page_table)
            .arg(&batch.context);
        b.arg(&mut ws.part_o)
            .arg(&mut ws.part_ml)
            .arg(&mut *out)
            .arg(bf16.as_deref_mut())
            .arg(&geom)
            .arg(&args)
            .arg(window_table)
            .arg(&batch.window);
        // SAFETY: matches decode_*'s signature; q, out (and the cast, or null), the page table
        // and the window table were checked against the batch, the workspace was sized for the
        // plan, and page ids come from the pool (the window table is not read without a
        // window).
        unsafe { b.launch(cfg) }?;
        if plan.splits == 1 {
            return Ok(()); // the blocks wrote the output themselves
        }
        let (qh, splits, dim) = (q_heads as u32, plan.splits as u32, d as u32);
        let (combine, groups) = if merges_in_groups(plan.splits) {
            (&self.combine_groups, COMBINE_GROUPS)
        } else {
            (&self.combine, 1)
        };
        let mut c = self.builder(combine);
        c.arg(&ws.part_o)
            .arg(&ws.part_ml)
            .arg(out)
            .arg(bf16)
            .arg(&qh)
            .arg(&splits)
            .arg(&dim)
            .arg(&args.v_scale);
        let cfg = LaunchConfig {
            grid_dim: (qh, seqs as u32, 1),
            block_dim: (dim, groups, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches decode_combine(_groups); the workspace holds seqs * q_heads * splits rows, out
        // (and the cast, or null) seqs * q_heads.
        unsafe { c.launch(cfg) }?;
        Ok(())
    }
}

#[derive(Debug, PartialEq)]
struct SplitPlan {
    splits: usize,
    tokens_per_split: usize,
}

/// The fixed work of one decode block (loading Q, the first tile's latency, merging the warps,
/// writing the partials), in tiles of one warp, for `split_plan`'s cost model.
const BLOCK_OVERHEAD_TILES: usize = 2;
/// The fewest tokens one split covers.
const MIN_SPLIT_TOKENS: usize = 128;
/// The most waves `split_plan` considers.
const MAX_WAVES: usize = 8;

/// How to split each sequence's context over `slots` resident blocks (multiprocessors times
/// blocks per multiprocessor), `blocks_per_split` blocks per split (sequences times KV heads).
///
/// Every block of a launch does about the same work, so a launch takes `ceil(blocks / slots)`
/// waves of one block's time (tiles per warp plus a fixed cost). A split count that leaves the
/// last wave nearly empty costs a whole wave: at 32 sequences x 8 heads x 32K tokens on 528
/// slots, 5 splits (1,280 blocks) take 3 waves of 103 tiles where 4 splits take 2 of 128. So
/// for each wave count the most splits that fill it are compared, and the cheapest plan wins
/// (fewer splits on a tie: less to combine). Splits are whole 16-token tiles.
fn split_plan(slots: usize, blocks_per_split: usize, max_context: usize) -> SplitPlan {
    let slots = slots.max(1);
    let blocks_per_split = blocks_per_split.max(1);
    let max_splits = max_context.div_ceil(MIN_SPLIT_TOKENS).max(1);
    let plan = |wanted: usize| {
        let per_split = max_context
            .div_ceil(wanted)
            .next_multiple_of(DECODE_TILE)
            .max(DECODE_TILE);
        let splits = max_context.div_ceil(per_split).max(1);
        let waves = (splits * blocks_per_split).div_ceil(slots);
        let warp_tiles = per_split.div_ceil(DECODE_TILE * DECODE_WARPS);
        let cost = waves * (warp_tiles + BLOCK_OVERHEAD_TILES);
        (
            cost,
            SplitPlan {
                splits,
                tokens_per_split: per_split,
            },
        )
    };
    (1..=MAX_WAVES)
        .map(|waves| (waves * slots / blocks_per_split).clamp(1, max_splits))
        .map(plan)
        .min_by_key(|(cost, p)| (*cost, p.splits))
        .map(|(_, p)| p)
        .expect("at least one wave count")
}

/// One decode step's sequences, all on the device.
pub struct DecodeBatch<'a> {
    /// Queries after RoPE, `[seq][q_head][head_dim]` f32 (rounded to BF16 by the kernel).
    pub q: CudaView<'a, f32>,
    pub q_heads: usize,
    /// `[seq][max_pages]` page ids; row i covers sequence i's context.
    pub page_table: CudaView<'a, u32>,
    pub max_pages: usize,
    /// Context length of each sequence (the new token, already written, included); >= 1.
    pub context: CudaView<'a, u32>,
    /// The largest entry of `context` (sizes the split).
    pub max_context: usize,
    /// The layer's global scales (ignored for BF16 pages, which have none).
    pub scales: KvScales,
    /// Normally 1 / sqrt(head_dim).
    pub softmax_scale: f32,
    /// The recent window: its geometry (`tokens == 0`: none) and `[seq][window.pages]` page
    /// ids; the last `window.tokens` tokens of each context are read from it in BF16.
    pub window: WindowGeom,
    pub window_table: Option<CudaView<'a, u32>>,
}

/// Split-KV partial results, reused across calls and grown on demand.
pub struct DecodeWorkspace {
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
}

impl DecodeWorkspace {
    pub fn new(kernels: &Kernels) -> Result<Self> {
        Ok(Self {
            part_o: kernels.stream.alloc_zeros(1)?,
            part_ml: kernels.stream.alloc_zeros(2)?,
        })
    }

    fn reserve(&mut self, stream: &Arc<CudaStream>, rows: usize, head_dim: usize) -> Result<()> {
        if self.part_o.len() < rows * head_dim {
            self.part_o = stream.alloc_zeros(rows * head_dim)?;
        }
        if self.part_ml.len() < rows * 2 {
            self.part_ml = stream.alloc_zeros(rows * 2)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_context_in_whole_tiles() {
        for (slots, blocks, ctx) in [
            (528, 8, 4096),
            (528, 64, 32768),
            (396, 1024, 131072),
            (528, 8, 1),
            (528, 24, 17),
            (1, 1, 1 << 20),
            (100_000, 1, 4096),
        ] {
            let plan = split_plan(slots, blocks, ctx);
            assert_eq!(plan.tokens_per_split % DECODE_TILE, 0);
            assert!(plan.tokens_per_split >= MIN_SPLIT_TOKENS.min(ctx.next_multiple_of(16)));
            assert!(plan.splits * plan.tokens_per_split >= ctx);
            assert!((plan.splits - 1) * plan.tokens_per_split < ctx);
        }
    }

    #[test]
    fn splits_fill_whole_waves() {
        // 8 sequences x 8 KV heads on 132 SMs x 4 blocks: 8 splits (512 blocks, one wave of 64
        // tiles per warp) beat 17 (1,088 blocks: two full waves and a 32-block third).
        assert_eq!(split_plan(528, 64, 32768).splits, 8);
        // 32 sequences: 2 splits, one wave, rather than 5 splits in 2.4 waves.
        let plan = split_plan(528, 256, 32768);
        assert_eq!((plan.splits * 256).div_ceil(528), 1);
        // One sequence: as many splits as fill the device, down to the shortest split.
        assert_eq!(split_plan(528, 8, 32768).splits, 64);
        assert_eq!(split_plan(528, 8, 4096).splits, 32);
        // Enough sequences to fill the device alone: no split.
        assert_eq!(split_plan(528, 1024, 32768).splits, 1);
    }

    #[test]
    fn many_splits_merge_in_four_groups() {
        assert!(!merges_in_groups(2));
        assert!(!merges_in_groups(16));
        assert!(merges_in_groups(17));
        assert!(merges_in_groups(64));
        // gpu_check's batch of its longest sequence alone (2,100 tokens, 8 or 3 KV heads) must
        // take the four-group merge on any device of at least 136 slots, or that path goes
        // unchecked against the CPU.
        for (slots, kv_heads) in [(528, 8), (396, 8), (528, 3), (136, 8)] {
            let splits = split_plan(slots, kv_heads, 2100).splits;
            assert!(merges_in_groups(splits), "{splits} splits on {slots} slots");
        }
    }
}
