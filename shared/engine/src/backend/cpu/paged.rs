//! The CPU backend's paged KV: page bytes in host memory and the three attention paths of
//! [`crate::paged`] run for a whole step.
//!
//! Per layer: prefill and extend sequences run one after another (each parallel over its query
//! rows); decode sequences first write their new K/V, then attend in parallel, one sequence per
//! task, each reading the pages directly. With the Hadamard option, Q, K and V are rotated per
//! head before anything else and the output rotated back, so pages hold rotated vectors.

use std::ops::Range;

use nibble_kvcache::{HostPages, PagePool, PoolPlan};
use rayon::prelude::*;

use super::CpuTensor;
use crate::backend::{PageEncoding, PagedSeq};
use crate::error::{Error, Result};
use crate::hadamard;
use crate::kv::StepTokens;
use crate::paged::{DecodeArgs, DecodeScratch, PagedCache, SeqPages, Step, Workspace};

/// Host page bytes plus the reusable buffers of the attention paths.
#[derive(Debug)]
pub struct CpuPages {
    store: HostPages,
    ws: Workspace,
    hadamard: bool,
    rotated: [Vec<f32>; 3],
}

impl CpuPages {
    pub(super) fn new(plan: PoolPlan, encoding: PageEncoding) -> Result<Self> {
        let PageEncoding {
            scales,
            hadamard,
            scale_rule,
            k_codes,
            window,
            prefill_work,
        } = encoding;
        let head_dim = plan.layout.head_dim();
        if hadamard && !hadamard::supported(head_dim) {
            return Err(Error::InvalidInput(format!(
                "the Hadamard rotation needs a power-of-two head dim, got {head_dim}"
            )));
        }
        Ok(Self {
            ws: Workspace::with_dtype(prefill_work),
            store: HostPages::new(plan, scales, scale_rule)?
                .with_window(window)?
                .with_k_codes(k_codes)?,
            hadamard,
            rotated: Default::default(),
        })
    }

    /// The page bytes.
    pub fn store(&self) -> &HostPages {
        &self.store
    }

    pub(super) fn store_mut(&mut self) -> &mut HostPages {
        &mut self.store
    }

    /// One layer for a whole step; see [`crate::Backend::paged_attention`].
    pub(super) fn attend(
        &mut self,
        pool: &PagePool,
        layer: usize,
        step: &StepTokens<'_, CpuTensor>,
        seqs: &[PagedSeq<'_>],
        out: &mut CpuTensor,
    ) -> Result<()> {
        if seqs.len() != step.spans.len() {
            return Err(Error::InvalidInput(format!(
                "{} sequences for {} spans",
                seqs.len(),
                step.spans.len()
            )));
        }
        let geometry = step.geometry;
        let (q_row, kv_row) = (
            geometry.num_heads * geometry.head_dim,
            geometry.num_kv_heads * geometry.head_dim,
        );
        let [rq, rk, rv] = &mut self.rotated;
        let (q, k, v) = if self.hadamard {
            for (buf, t) in [(&mut *rq, step.q), (&mut *rk, step.k), (&mut *rv, step.v)] {
                buf.clear();
                buf.extend_from_slice(t.as_slice());
                hadamard::rotate(buf, geometry.head_dim);
            }
            (rq.as_slice(), rk.as_slice(), rv.as_slice())
        } else {
            (step.q.as_slice(), step.k.as_slice(), step.v.as_slice())
        };
        let out_all = out.as_mut_slice();
        // Split the output into each sequence's rows (spans are in order and disjoint).
        let mut outs: Vec<&mut [f32]> = Vec::with_capacity(seqs.len());
        let mut rest = &mut out_all[..];
        let mut at = 0;
        for span in step.spans {
            let (_, tail) = rest.split_at_mut((span.start - at) * q_row);
            let (mine, tail) = tail.split_at_mut(span.len() * q_row);
            outs.push(mine);
            rest = tail;
            at = span.end;
        }
        let is_decode = |s: &PagedSeq<'_>| s.stored > 0 && s.slots.len() == 1;
        // Prefill and extend, then the decode writes.
        for ((seq, span), o) in seqs.iter().zip(step.spans).zip(outs.iter_mut()) {
            let s = Step {
                layer,
                q_heads: geometry.num_heads,
                q: &q[span.start * q_row..span.end * q_row],
                k: &k[span.start * kv_row..span.end * kv_row],
                v: &v[span.start * kv_row..span.end * kv_row],
            };
            let slots: Vec<_> = seq.slots.iter().copied().map(Some).collect();
            let pages = SeqPages {
                pages: seq.pages,
                window: seq.window,
            };
            if is_decode(seq) {
                self.store.write_kv(pool, layer, s.k, s.v, &slots)?;
                let last = seq.stored..seq.stored + 1;
                let len = seq.stored + 1;
                self.store
                    .write_window(pool, seq.window, layer, s.k, s.v, last, len)?;
                continue;
            }
            let mut cache = PagedCache {
                pool,
                store: &mut self.store,
                ws: &mut self.ws,
            };
            if seq.stored == 0 {
                cache.prefill(s, &slots, seq.window, o)?;
            } else {
                cache.extend(s, pages, seq.stored, &slots, o)?;
            }
        }
        // Decode attention, one sequence per task.
        let store = &self.store;
        let decodes: Vec<(&PagedSeq<'_>, &Range<usize>, &mut [f32])> = seqs
            .iter()
            .zip(step.spans)
            .zip(outs)
            .filter(|((seq, _), _)| is_decode(seq))
            .map(|((seq, span), o)| (seq, span, o))
            .collect();
        decodes
            .into_par_iter()
            .map_init(DecodeScratch::default, |scratch, (seq, span, o)| {
                let args = DecodeArgs {
                    layer,
                    q_heads: geometry.num_heads,
                    q: &q[span.start * q_row..span.end * q_row],
                    seq: SeqPages {
                        pages: seq.pages,
                        window: seq.window,
                    },
                    context: seq.stored + 1,
                };
                scratch.decode(store, args, o)
            })
            .collect::<std::result::Result<(), _>>()?;
        if self.hadamard {
            for span in step.spans {
                let rows = &mut out.as_mut_slice()[span.start * q_row..span.end * q_row];
                hadamard::rotate(rows, geometry.head_dim);
            }
        }
        Ok(())
    }
}
