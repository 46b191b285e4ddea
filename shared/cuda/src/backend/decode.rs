//! The decode half of paged attention: every decoding sequence of a step (one new token after
//! its stored context) in one batch. The new tokens' K/V go into their slots (one
//! `kv_quantize`) and windows, then one split-KV `decode_*` launch reads every context from the
//! pages. The step's slots, context lengths and page tables ([`DecodeInputs`]) are uploaded at
//! its first layer and reused by the others.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use nibble_engine::backend::PagedSeq;
use nibble_engine::kv::StepTokens;

use super::attention::PagedLayer;
use super::tensor::Uploaded;
use super::{CudaBackend, CudaPages, CudaTensor};
use crate::graph;
use crate::launch::check_write_slots;
use crate::{DecodeBatch, DecodeOut, NewKv, Result, WindowRows};

/// A decoding sequence of the step and its span (one row of Q, K, V and the output).
type Decoding<'s, 'a> = (&'s PagedSeq<'a>, &'s Range<usize>);

/// A decode step's slots, context lengths and page table on the device, with the row length
/// of its page table.
#[derive(Default)]
pub(super) struct DecodeInputs {
    uploaded: Uploaded,
    max_pages: usize,
}

/// Views of [`DecodeInputs`] for one step of `count` sequences.
struct InputViews<'a> {
    slots: CudaView<'a, u32>,
    context: CudaView<'a, u32>,
    table: CudaView<'a, u32>,
    window_table: CudaView<'a, u32>,
}

impl DecodeInputs {
    /// Makes the device copy hold `[slots | context lengths | page table | window table]` of
    /// `decodes` at `layer`, with rows of `max_pages` pages. The inputs are the same for every
    /// layer of a step, so they are built and uploaded at its first layer (`KvBatch`'s protocol:
    /// layers in order from 0) and reused by the others; a step of other sequences (other
    /// slots) rebuilds them.
    fn prepare(
        &mut self,
        stream: &Arc<CudaStream>,
        at: &PagedLayer,
        window_pages: usize,
        decodes: &[Decoding<'_, '_>],
        max_pages: usize,
    ) -> Result<()> {
        let count = decodes.len();
        let slots_now: Vec<u32> = decodes.iter().map(|(seq, _)| seq.slots[0].0).collect();
        let wp = window_pages;
        let table_end = 2 * count + count * max_pages;
        let reuse = at.layer > 0
            && self.max_pages == max_pages
            && self.uploaded.host.len() == table_end + count * wp
            && self.uploaded.host[..count] == slots_now[..];
        if reuse {
            return Ok(());
        }
        let mut inputs = vec![0u32; table_end + count * wp];
        inputs[..count].copy_from_slice(&slots_now);
        for (i, (seq, _)) in decodes.iter().enumerate() {
            let window = table_end + i * wp;
            for (j, p) in seq.window.iter().enumerate() {
                inputs[window + j] = p.0;
            }
            let ctx = seq.stored + 1;
            inputs[count + i] = ctx as u32;
            let row = 2 * count + i * max_pages;
            for (j, p) in seq.pages[..ctx.div_ceil(at.layout.page_size())]
                .iter()
                .enumerate()
            {
                inputs[row + j] = p.0;
            }
        }
        self.max_pages = max_pages;
        self.uploaded.upload(stream, inputs)?;
        Ok(())
    }

    /// The host copy of the slots (the first `count` entries).
    fn host_slots(&self, count: usize) -> &[u32] {
        &self.uploaded.host[..count]
    }

    /// The parts of what [`Self::prepare`] uploaded for `count` sequences.
    fn views(&self, count: usize) -> InputViews<'_> {
        let inputs = self.uploaded.view();
        let table_end = 2 * count + count * self.max_pages;
        InputViews {
            slots: inputs.slice(0..count),
            context: inputs.slice(count..2 * count),
            table: inputs.slice(2 * count..table_end),
            window_table: inputs.slice(table_end..),
        }
    }
}

impl CudaBackend {
    /// Decode of `decodes` at one layer: their K/V into the pages and windows, then one batched
    /// split-KV launch into their rows of `out`.
    pub(super) fn decode_seqs(
        &self,
        pages: &mut CudaPages,
        at: &PagedLayer,
        step: &StepTokens<'_, CudaTensor>,
        decodes: &[Decoding<'_, '_>],
        out: &mut CudaTensor,
    ) -> Result<()> {
        let stream = self.stream();
        let count = decodes.len();
        // The split is planned for the longest context's bucket, and the page-table rows are
        // that wide, so that a decode-step graph (`crate::graph`) serves many steps; each
        // sequence's own length is exact.
        let longest = decodes.iter().map(|(s, _)| s.stored + 1).max().unwrap_or(1);
        let max_context = graph::context_bucket(longest);
        let max_pages = max_context.div_ceil(at.layout.page_size());
        pages
            .decode_inputs
            .prepare(stream, at, pages.window.pages(), decodes, max_pages)?;
        let inputs = pages.decode_inputs.views(count);
        let (q_row, kv_row) = (at.q_row(), at.kv_row());

        // A decode-only step has its rows in order: Q, K and V are read and the output written
        // in place. Otherwise the decode rows are gathered into buffers of their own.
        let first = decodes[0].1.start;
        let in_place = decodes
            .iter()
            .enumerate()
            .all(|(i, (_, span))| span.start == first + i && span.len() == 1);
        let rows = first..first + count;
        let gathered = if in_place {
            None
        } else {
            graph::block("decode rows gathered from a mixed step")?;
            let gather = |t, row| self.gather_decode_rows(t, row, decodes);
            Some((
                gather(step.q, q_row)?,
                gather(step.k, kv_row)?,
                gather(step.v, kv_row)?,
            ))
        };
        let (q, k, v) = match &gathered {
            Some((q, k, v)) => (q.as_view(), k.as_view(), v.as_view()),
            None => (
                step.q.f32().slice(rows.start * q_row..rows.end * q_row),
                step.k.f32().slice(rows.start * kv_row..rows.end * kv_row),
                step.v.f32().slice(rows.start * kv_row..rows.end * kv_row),
            ),
        };

        // The new tokens' K/V, into their slots and windows.
        let slots = pages.decode_inputs.host_slots(count);
        check_write_slots(pages.bytes.len(), &at.geom, at.dtype(), slots)?;
        let kv = NewKv {
            k: k.slice(..),
            v: v.slice(..),
            scales: at.scales,
            rule: pages.scale_rule,
            k_codes: CudaPages::layer_k_codes(&pages.k_codes, &pages.layout, at.layer),
        };
        let window = WindowRows {
            geom: at.window,
            table: inputs.window_table.slice(..),
            lens: inputs.context.slice(..),
            rows_per_seq: 1,
        };
        // SAFETY: the slots' host copy, which the device one holds, was just checked against
        // the pages, and the geometry is the layout's (PageGeom::new); the window pages were
        // checked against the pool (PagedLayer::check) and each context length is at least 1
        // (the new token).
        unsafe {
            self.kernels.quantize_unchecked(
                &mut pages.bytes,
                at.geom,
                at.dtype(),
                &kv,
                &inputs.slots,
                Some(&window),
            )
        }?;

        let batch = DecodeBatch {
            q,
            q_heads: at.q_heads,
            page_table: inputs.table,
            max_pages,
            context: inputs.context,
            max_context,
            scales: at.scales,
            softmax_scale: at.softmax_scale,
            window: at.window,
            window_table: Some(inputs.window_table),
        };
        let (dtype, geom) = (at.dtype(), at.geom);
        if gathered.is_none() {
            // When the decode rows are the whole output (a decode-only step), the decode also
            // writes the output's BF16 cast, which the output projection then reads.
            let whole = rows.start == 0 && out.len() == count * q_row;
            let mut cast = if whole {
                self.cast_target(out.len())
            } else {
                None
            };
            let o = DecodeOut {
                values: out
                    .f32_mut()
                    .slice_mut(rows.start * q_row..rows.end * q_row),
                bf16: cast.as_mut().map(|c| &mut c.buf),
            };
            self.kernels
                .decode(&pages.bytes, geom, dtype, &batch, &mut pages.decode, o)?;
            if let Some(c) = &mut cast {
                c.of = Some(out.stamp());
            }
            return Ok(());
        }
        let mut o: CudaSlice<f32> = stream.alloc_zeros(count * q_row)?;
        let values = DecodeOut {
            values: o.as_view_mut(),
            bf16: None,
        };
        self.kernels
            .decode(&pages.bytes, geom, dtype, &batch, &mut pages.decode, values)?;
        for (i, (_, span)) in decodes.iter().enumerate() {
            let r = span.start;
            stream.memcpy_dtod(
                &o.slice(i * q_row..(i + 1) * q_row),
                &mut out.f32_mut().slice_mut(r * q_row..(r + 1) * q_row),
            )?;
        }
        Ok(())
    }

    /// The decode rows of `t` (one per sequence, in order, `row` values each) into a buffer of
    /// their own.
    fn gather_decode_rows(
        &self,
        t: &CudaTensor,
        row: usize,
        decodes: &[Decoding<'_, '_>],
    ) -> Result<CudaSlice<f32>> {
        let stream = self.stream();
        let mut buf = stream.alloc_zeros(decodes.len() * row)?;
        for (i, (_, span)) in decodes.iter().enumerate() {
            let r = span.start;
            stream.memcpy_dtod(
                &t.f32().slice(r * row..(r + 1) * row),
                &mut buf.slice_mut(i * row..(i + 1) * row),
            )?;
        }
        Ok(buf)
    }
}
