//! The named arguments of the launches: K/V scales ([`KvScales`]) and what one launch reads or
//! writes.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use nibble_engine::paged::work_scales;
use nibble_kvcache::GlobalScales;
use nibble_kvfmt::{KvDtype, KvPart, ScaleRule};

use crate::WindowGeom;

#[cfg(doc)]
use super::Kernels;

/// One sequence's prefill or extend step over the work-dtype workspace, on the device.
pub struct PrefillBatch<'a> {
    /// The new tokens' queries after RoPE, `[row][q_head][head_dim]` f32 (rounded to BF16 by
    /// the kernel).
    pub q: &'a CudaSlice<f32>,
    pub n: usize,
    /// Tokens before the first query (a cached prefix, already gathered into the workspace).
    pub start: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The workspace, `[token][kv_head][head_dim]`, at least `start + n` tokens: E4M3 bytes or
    /// little-endian BF16.
    pub k: &'a CudaSlice<u8>,
    pub v: &'a CudaSlice<u8>,
    /// `Fp8` or `Bf16`: the workspace's element type.
    pub work: KvDtype,
    /// The E4M3 workspace's dequantization multipliers (a BF16 workspace has none).
    pub work_scales: KvScales,
    /// Normally 1 / sqrt(head_dim).
    pub softmax_scale: f32,
}

/// A layer's K and V multipliers: the pool's (layer, K|V) global scales, or the work dtype's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvScales {
    pub k: f32,
    pub v: f32,
}

impl KvScales {
    /// The global scales of `layer`.
    pub fn of_layer(scales: &GlobalScales, layer: usize) -> Self {
        Self {
            k: scales.get(layer, KvPart::K),
            v: scales.get(layer, KvPart::V),
        }
    }

    /// The work dtype's scales of a `cache` pool with these global scales: the engine's rule
    /// ([`nibble_engine::paged::work_scales`]), so both backends fill the same workspace.
    pub fn work(self, cache: KvDtype) -> Self {
        let (k, v) = work_scales(cache, (self.k, self.v));
        Self { k, v }
    }
}

/// The new tokens of a quantize-on-write ([`Kernels::quantize`]): K and V, f32
/// `[token][kv_head][head_dim]`, one token per slot, with the layer's global scales and the
/// NVFP4 block-scale rule.
pub struct NewKv<'a> {
    pub k: CudaView<'a, f32>,
    pub v: CudaView<'a, f32>,
    pub scales: KvScales,
    pub rule: ScaleRule,
    /// The layer's factors K's NVFP4 codes are chosen with (`[kv_head][d][d]`, each `U` of
    /// [`nibble_kvfmt::nvfp4::feedback::QueryFactor`]), or `None` for the nearest codes.
    pub k_codes: Option<CudaView<'a, f32>>,
}

/// The work-dtype workspace a launch writes ([`Kernels::gather_work`]): K and V bytes,
/// `[token][kv_head][head_dim]`.
pub struct KvWorkspace<'a> {
    pub k: &'a mut CudaSlice<u8>,
    pub v: &'a mut CudaSlice<u8>,
}

/// A cached prefix of one sequence, for the extend gather ([`Kernels::gather_work`]): its
/// first `tokens` tokens in the pages of `page_table`, stored at the global `scales` and
/// gathered into a `work` workspace (fp8 at `work_scales`, see [`KvScales::work`], or bf16).
#[derive(Clone, Copy)]
pub struct CachedPrefix<'a> {
    pub page_table: &'a CudaSlice<u32>,
    pub tokens: usize,
    pub scales: KvScales,
    pub work: KvDtype,
    pub work_scales: KvScales,
}

/// The recent windows a quantize-on-write also writes its tokens into, in BF16
/// ([`Kernels::quantize_unchecked`]; `HostPages::write_window` on the CPU): the tokens are
/// `rows_per_seq` per sequence, each sequence's context length in `lens` (its new tokens
/// included) and its `geom.pages` window page ids in `table`. A token older than the window's
/// last `geom.tokens` is not written.
pub struct WindowRows<'a> {
    pub geom: WindowGeom,
    pub table: CudaView<'a, u32>,
    pub lens: CudaView<'a, u32>,
    pub rows_per_seq: usize,
}

/// Where a decode writes ([`Kernels::decode`]): the outputs, `[seq][q_head][head_dim]` f32,
/// and, when given (at least as long), their BF16 cast (`nibble_kvfmt::bf16::encode`).
pub struct DecodeOut<'a> {
    pub values: CudaViewMut<'a, f32>,
    pub bf16: Option<&'a mut CudaSlice<u16>>,
}
