//! Page bytes in host memory: the CPU backend's page store, and quantize-on-write.
//!
//! [`HostPages`] holds `pages × page_bytes` bytes carved with the same accounting as the
//! [`PoolPlan`] that sized them. [`HostPages::write_kv`] quantizes one layer's K and V into slots
//! of pages the [`PagePool`] has allocated, validating everything before it writes a byte; reads
//! dequantize one head vector at a time. Global scales are fixed for the life of the store:
//! changing them would silently reinterpret every live byte.

use std::fmt;
use std::sync::Arc;

use nibble_kvfmt::nvfp4::feedback::{quantize_for_queries, KeyFactors};
use nibble_kvfmt::{
    bf16, check_global_scale, fp8, nvfp4, KvDtype, KvPart, PageLayout, ScaleRule, WindowLayout,
};
use serde::{Deserialize, Serialize};

use crate::pool::{PageId, PagePool, PoolPlan, SlotId};
use crate::{Error, Result};

/// Per-(layer, K|V) dequantization multipliers, fixed for the life of a pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GlobalScales {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl GlobalScales {
    /// 1.0 everywhere: uncalibrated.
    pub fn ones(layers: usize) -> Self {
        Self {
            k: vec![1.0; layers],
            v: vec![1.0; layers],
        }
    }

    /// The scales of a `dtype` cache without a calibration: those that give every dtype FP8's
    /// range at scale 1 (an amax of 448). That is 1.0 for fp8 and bf16, and 1/6 for nvfp4,
    /// whose global scale maps a layer's amax onto 6 · 448 (largest E2M1 value times largest
    /// block scale). So an uncalibrated nvfp4 cache's FP8 work dtype has scale 1, exactly an
    /// uncalibrated fp8 cache's, and a prompt prefilled in one go sees the same keys under
    /// either cache; and a block's scale code is its amax itself rather than amax / 6, which
    /// keeps blocks of small values out of E4M3's subnormals six times longer.
    pub fn uncalibrated(dtype: KvDtype, layers: usize) -> Self {
        let g = match dtype {
            KvDtype::Nvfp4 => 1.0 / nibble_kvfmt::e2m1::MAX,
            KvDtype::Fp8 | KvDtype::Bf16 => 1.0,
        };
        Self {
            k: vec![g; layers],
            v: vec![g; layers],
        }
    }

    /// The scale of (layer, part).
    pub fn get(&self, layer: usize, part: KvPart) -> f32 {
        match part {
            KvPart::K => self.k[layer],
            KvPart::V => self.v[layer],
        }
    }

    pub(crate) fn validate(&self, layers: usize) -> Result<()> {
        if self.k.len() != layers || self.v.len() != layers {
            return Err(Error::BadScales(format!(
                "expected {layers} K and {layers} V scales, got {} and {}",
                self.k.len(),
                self.v.len()
            )));
        }
        for (name, scales) in [("K", &self.k), ("V", &self.v)] {
            for (layer, g) in scales.iter().enumerate() {
                check_global_scale(*g)
                    .map_err(|e| Error::BadScales(format!("{name} scale of layer {layer}: {e}")))?;
            }
        }
        Ok(())
    }
}

/// Whether `factors` fit `layout`: an nvfp4 layout, one factor per layer and KV head, of its
/// head dimension.
pub fn check_key_factors(layout: &PageLayout, factors: &KeyFactors) -> Result<()> {
    let what = if layout.dtype() != KvDtype::Nvfp4 {
        format!("a {} cache (they are for nvfp4 keys)", layout.dtype())
    } else if (factors.layers(), factors.kv_heads(), factors.head_dim())
        != (layout.layers(), layout.kv_heads(), layout.head_dim())
    {
        format!(
            "{} layers x {} KV heads x {} (the factors are for {} x {} x {})",
            layout.layers(),
            layout.kv_heads(),
            layout.head_dim(),
            factors.layers(),
            factors.kv_heads(),
            factors.head_dim()
        )
    } else {
        return Ok(());
    };
    Err(Error::BadKeyFactors(format!(
        "K codes chosen for the queries do not fit {what}"
    )))
}

/// The bytes of every page, in host memory.
pub struct HostPages {
    layout: PageLayout,
    window: WindowLayout,
    scales: GlobalScales,
    rule: ScaleRule,
    /// K's codes chosen for the queries ([`nvfp4::feedback`]) when set (nvfp4 only).
    k_codes: Option<Arc<KeyFactors>>,
    storage: Vec<u8>,
}

impl fmt::Debug for HostPages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPages")
            .field("layout", &self.layout)
            .field("bytes", &self.storage.len())
            .finish()
    }
}

impl HostPages {
    /// Zeroed storage for the plan's pages; NVFP4 blocks are written under `rule`.
    pub fn new(plan: PoolPlan, scales: GlobalScales, rule: ScaleRule) -> Result<Self> {
        scales.validate(plan.layout.layers())?;
        Ok(Self {
            layout: plan.layout,
            window: WindowLayout::none(&plan.layout),
            scales,
            rule,
            k_codes: None,
            storage: vec![0u8; plan.pages * plan.layout.page_bytes()],
        })
    }

    /// The same store writing K's NVFP4 codes for the queries `factors` describe (one per layer
    /// and KV head of the layout, of its head dimension); `None` writes the nearest codes.
    pub fn with_k_codes(mut self, factors: Option<Arc<KeyFactors>>) -> Result<Self> {
        if let Some(f) = &factors {
            check_key_factors(&self.layout, f)?;
        }
        self.k_codes = factors;
        Ok(self)
    }

    /// The factors K's codes are chosen with, if any.
    pub fn k_codes(&self) -> Option<&Arc<KeyFactors>> {
        self.k_codes.as_ref()
    }

    /// The same store with a recent window of `tokens` tokens (0: none) for its sequences.
    pub fn with_window(mut self, tokens: usize) -> Result<Self> {
        self.window = WindowLayout::new(&self.layout, tokens)?;
        Ok(self)
    }

    /// The recent window's geometry.
    pub fn window(&self) -> &WindowLayout {
        &self.window
    }

    /// How NVFP4 block scales are chosen on write.
    pub fn scale_rule(&self) -> ScaleRule {
        self.rule
    }

    pub fn layout(&self) -> &PageLayout {
        &self.layout
    }

    pub fn scales(&self) -> &GlobalScales {
        &self.scales
    }

    /// Bytes of page storage actually allocated.
    pub fn storage_bytes(&self) -> usize {
        self.storage.len()
    }

    fn check_page(&self, page: PageId) -> Result<()> {
        let total = self.storage.len() / self.layout.page_bytes();
        if (page.0 as usize) < total {
            Ok(())
        } else {
            Err(Error::PageOutOfRange { page, total })
        }
    }

    /// The bytes of one page.
    pub fn page(&self, page: PageId) -> Result<&[u8]> {
        self.check_page(page)?;
        let size = self.layout.page_bytes();
        let start = page.0 as usize * size;
        Ok(&self.storage[start..start + size])
    }

    /// The bytes of one page `pool` has allocated, for receiving a transfer.
    pub fn page_mut(&mut self, pool: &PagePool, page: PageId) -> Result<&mut [u8]> {
        if pool.refcount(page)? == 0 {
            return Err(Error::NotAllocated(page));
        }
        let size = self.layout.page_bytes();
        let start = page.0 as usize * size;
        Ok(&mut self.storage[start..start + size])
    }

    /// Quantizes one layer's K and V for `slots.len()` tokens into their slots.
    ///
    /// `k` and `v` are token-major, `[token][kv_head][head_dim]`. A `None` slot is padding and is
    /// skipped. Every slot must lie in an allocated page and appear at most once; nothing is
    /// written unless every check passes. Values are assumed finite (the engine's fast path).
    pub fn write_kv(
        &mut self,
        pool: &PagePool,
        layer: usize,
        k: &[f32],
        v: &[f32],
        slots: &[Option<SlotId>],
    ) -> Result<()> {
        let layout = self.layout;
        if layer >= layout.layers() {
            return Err(Error::LayerOutOfRange {
                layer,
                layers: layout.layers(),
            });
        }
        let token_values = layout.kv_heads() * layout.head_dim();
        for (what, buf) in [("K values", k), ("V values", v)] {
            if buf.len() != slots.len() * token_values {
                return Err(Error::BadLength {
                    what,
                    expected: slots.len() * token_values,
                    actual: buf.len(),
                });
            }
        }
        pool.check_slots(slots)?;
        for (part, values) in [(KvPart::K, k), (KvPart::V, v)] {
            let g = self.scales.get(layer, part);
            for (token, slot) in slots.iter().enumerate() {
                let Some(slot) = slot else { continue };
                let x = &values[token * token_values..(token + 1) * token_values];
                self.write_token(layer, part, *slot, g, x);
            }
        }
        Ok(())
    }

    /// Quantizes one token's heads of (layer, part) into `slot`.
    fn write_token(&mut self, layer: usize, part: KvPart, slot: SlotId, g: f32, x: &[f32]) {
        let layout = self.layout;
        let (page_size, dim) = (layout.page_size(), layout.head_dim());
        let page = slot.page(page_size);
        let offset = slot.offset(page_size);
        let base = page.0 as usize * layout.page_bytes();
        let (data_bytes, scale_bytes) = (layout.data_bytes(), layout.scale_bytes());
        for (head, hx) in x.chunks_exact(dim).enumerate() {
            let d = base + layout.data_offset(layer, part, head, offset);
            let data = d..d + data_bytes;
            match layout.dtype() {
                KvDtype::Nvfp4 => {
                    let s = base + layout.scale_offset(layer, part, head, offset);
                    let (lo, hi) = self.storage.split_at_mut(s);
                    let (packed, scales) = (&mut lo[data], &mut hi[..scale_bytes]);
                    match (&self.k_codes, part) {
                        (Some(f), KvPart::K) => quantize_for_queries(
                            hx,
                            g,
                            self.rule,
                            f.get(layer, head),
                            packed,
                            scales,
                        ),
                        _ => nvfp4::quantize_unchecked_with(hx, g, self.rule, packed, scales),
                    }
                }
                KvDtype::Fp8 => fp8::quantize_unchecked(hx, g, &mut self.storage[data]),
                KvDtype::Bf16 => bf16::encode_le(hx, &mut self.storage[data]),
            }
        }
    }

    /// Writes one layer's K and V of the tokens at `positions` in BF16 into a sequence of `len`
    /// tokens' window (`pages`), for those the window holds; the rest only live in their pages.
    /// `k` and `v` are `[token][kv_head][head_dim]`. Without a window it does nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn write_window(
        &mut self,
        pool: &PagePool,
        pages: &[PageId],
        layer: usize,
        k: &[f32],
        v: &[f32],
        positions: std::ops::Range<usize>,
        len: usize,
    ) -> Result<()> {
        if self.window.is_none() {
            return Ok(());
        }
        pool.check_window(&self.window, pages)?;
        let layout = self.layout;
        let (heads, dim) = (layout.kv_heads(), layout.head_dim());
        let token_values = heads * dim;
        for (what, buf) in [("K values", k), ("V values", v)] {
            if buf.len() != positions.len() * token_values {
                return Err(Error::BadLength {
                    what,
                    expected: positions.len() * token_values,
                    actual: buf.len(),
                });
            }
        }
        if layer >= layout.layers() {
            return Err(Error::LayerOutOfRange {
                layer,
                layers: layout.layers(),
            });
        }
        let page_bytes = layout.page_bytes();
        for (i, position) in positions.enumerate() {
            if !self.window.holds(position, len) {
                continue;
            }
            for (part, values) in [(KvPart::K, k), (KvPart::V, v)] {
                let token = &values[i * token_values..(i + 1) * token_values];
                for (head, x) in token.chunks_exact(dim).enumerate() {
                    let (index, offset) = self.window.locate(layer, part, head, position);
                    let at = pages[index].0 as usize * page_bytes + offset;
                    bf16::encode_le(x, &mut self.storage[at..at + 2 * dim]);
                }
            }
        }
        Ok(())
    }

    /// The BF16 bytes of the `head` vector of (layer, part) of the token at `position` in a
    /// sequence's window (`pages`, checked by the caller's writes).
    pub fn window_head(
        &self,
        pages: &[PageId],
        layer: usize,
        part: KvPart,
        head: usize,
        position: usize,
    ) -> Result<&[u8]> {
        let (index, offset) = self.window.locate(layer, part, head, position);
        let page = *pages.get(index).ok_or(Error::BadLength {
            what: "window pages",
            expected: self.window.pages(),
            actual: pages.len(),
        })?;
        let bytes = self.page(page)?;
        Ok(&bytes[offset..offset + 2 * self.layout.head_dim()])
    }

    /// Dequantizes the `head` vector of (layer, part) at `slot` into `out` (`head_dim` values).
    pub fn read_head(
        &self,
        layer: usize,
        part: KvPart,
        slot: SlotId,
        head: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let layout = self.layout;
        let (page_size, dim) = (layout.page_size(), layout.head_dim());
        if out.len() != dim {
            return Err(Error::BadLength {
                what: "head vector",
                expected: dim,
                actual: out.len(),
            });
        }
        let view = PageBytes {
            bytes: self.page(slot.page(page_size))?,
            layout: &self.layout,
        };
        view.head(
            layer,
            part,
            head,
            slot.offset(page_size),
            self.scales.get(layer, part),
            out,
        );
        Ok(())
    }
}

/// One page's bytes read through its layout: dequantizes head vectors in place, without copying
/// the page. The decode attention path reads pages through this.
#[derive(Debug, Clone, Copy)]
pub struct PageBytes<'a> {
    pub bytes: &'a [u8],
    pub layout: &'a PageLayout,
}

impl PageBytes<'_> {
    /// Dequantizes the `head` vector of (layer, part) at token `offset` with global scale `g`
    /// into `out` (`head_dim` values).
    pub fn head(
        &self,
        layer: usize,
        part: KvPart,
        head: usize,
        offset: usize,
        g: f32,
        out: &mut [f32],
    ) {
        let layout = self.layout;
        let d = layout.data_offset(layer, part, head, offset);
        let data = &self.bytes[d..d + layout.data_bytes()];
        match layout.dtype() {
            KvDtype::Nvfp4 => {
                let s = layout.scale_offset(layer, part, head, offset);
                let scales = &self.bytes[s..s + layout.scale_bytes()];
                nvfp4::dequantize_unchecked(data, scales, g, out);
            }
            KvDtype::Fp8 => fp8::dequantize_unchecked(data, g, out),
            KvDtype::Bf16 => bf16::decode_le(data, out),
        }
    }
}

#[cfg(test)]
mod tests;
