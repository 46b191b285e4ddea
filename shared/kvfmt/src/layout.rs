//! Page layout and byte accounting.
//!
//! A page holds `page_size` tokens of every layer's K and V, contiguously, so a page is one unit of
//! allocation, eviction, hashing and transfer. Inside a page, for each layer and each of K then V,
//! one *part*:
//!
//! ```text
//! data   [kv_head][token][data_bytes(D)]     nvfp4: D/2, fp8: D, bf16: 2D
//! scales [kv_head][token][D/16]              nvfp4 only
//! ```
//!
//! Head-major, so a decode CTA reading one head streams contiguous bytes. [`kv_bytes`] is the one
//! byte-accounting function; everything that sizes or carves memory calls it.

use serde::Serialize;

use crate::interchange::check_head_dim;
use crate::{Error, KvDtype, Result};

/// Largest number of layers, KV heads or tokens per page nibble accepts.
pub const MAX_DIMENSION: usize = 4096;

/// K or V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvPart {
    K = 0,
    V = 1,
}

/// What one token and one page cost, from [`kv_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvBytes {
    /// K and V of one token in one layer.
    pub per_token_per_layer: usize,
    /// K and V of one token in every layer.
    pub per_token: usize,
    /// One page: `page_size` tokens of every layer.
    pub per_page: usize,
}

/// The byte accounting of DESIGN.md, per token and layer: BF16 4·H·D, FP8 2·H·D,
/// NVFP4 2·H·(D/2 + D/16). The pool planner and the allocator both call this.
pub fn kv_bytes(
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    page_size: usize,
    dtype: KvDtype,
) -> KvBytes {
    let per_token_per_layer = 2 * kv_heads * dtype.vector_bytes(head_dim);
    let per_token = layers * per_token_per_layer;
    KvBytes {
        per_token_per_layer,
        per_token,
        per_page: page_size * per_token,
    }
}

/// The validated geometry of one page, with offsets into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct PageLayout {
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    page_size: usize,
    dtype: KvDtype,
}

fn check_dimension(what: &'static str, value: usize) -> Result<()> {
    if value == 0 || value > MAX_DIMENSION {
        Err(Error::BadGeometry {
            what,
            value,
            max: MAX_DIMENSION,
        })
    } else {
        Ok(())
    }
}

impl PageLayout {
    /// Validates the geometry: every count in 1..=4096, head dim a multiple of 16 up to 1024.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        page_size: usize,
        dtype: KvDtype,
    ) -> Result<Self> {
        check_dimension("layers", layers)?;
        check_dimension("kv heads", kv_heads)?;
        check_head_dim(head_dim)?;
        check_dimension("page size", page_size)?;
        Ok(Self {
            layers,
            kv_heads,
            head_dim,
            page_size,
            dtype,
        })
    }

    pub fn layers(&self) -> usize {
        self.layers
    }
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// The same geometry with another dtype.
    pub fn with_dtype(&self, dtype: KvDtype) -> Self {
        Self { dtype, ..*self }
    }

    /// The byte accounting of this geometry.
    pub fn bytes(&self) -> KvBytes {
        kv_bytes(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.page_size,
            self.dtype,
        )
    }

    pub fn bytes_per_token(&self) -> usize {
        self.bytes().per_token
    }

    pub fn page_bytes(&self) -> usize {
        self.bytes().per_page
    }

    /// Element-data bytes of one head vector.
    pub fn data_bytes(&self) -> usize {
        self.dtype.data_bytes(self.head_dim)
    }

    /// Scale bytes of one head vector (0 unless nvfp4).
    pub fn scale_bytes(&self) -> usize {
        self.dtype.scale_bytes(self.head_dim)
    }

    /// Bytes of one (layer, K|V) part of a page: data then scales for every head and token.
    pub fn part_bytes(&self) -> usize {
        self.kv_heads * self.page_size * self.dtype.vector_bytes(self.head_dim)
    }

    /// Offset of the (layer, part) region within a page.
    pub fn part_offset(&self, layer: usize, part: KvPart) -> usize {
        debug_assert!(layer < self.layers);
        (2 * layer + part as usize) * self.part_bytes()
    }

    /// Offset within a page of the data of (layer, part, head, token).
    pub fn data_offset(&self, layer: usize, part: KvPart, head: usize, token: usize) -> usize {
        debug_assert!(head < self.kv_heads && token < self.page_size);
        self.part_offset(layer, part) + (head * self.page_size + token) * self.data_bytes()
    }

    /// Offset within a page of the scales of (layer, part, head, token).
    pub fn scale_offset(&self, layer: usize, part: KvPart, head: usize, token: usize) -> usize {
        debug_assert!(head < self.kv_heads && token < self.page_size);
        self.part_offset(layer, part)
            + self.kv_heads * self.page_size * self.data_bytes()
            + (head * self.page_size + token) * self.scale_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm(dtype: KvDtype) -> PageLayout {
        PageLayout::new(30, 3, 64, 16, dtype).unwrap()
    }

    #[test]
    fn ratios_are_exact() {
        for (layers, heads, dim) in [(30, 3, 64), (32, 8, 128), (1, 1, 16), (80, 8, 128)] {
            let at = |d| kv_bytes(layers, heads, dim, 16, d);
            let (b, f, n) = (at(KvDtype::Bf16), at(KvDtype::Fp8), at(KvDtype::Nvfp4));
            assert_eq!(n.per_token * 16, f.per_token * 9, "nvfp4 / fp8 = 0.5625");
            assert_eq!(n.per_token * 32, b.per_token * 9, "nvfp4 / bf16 = 0.28125");
            assert_eq!(n.per_token as f64 / f.per_token as f64, 0.5625);
            assert_eq!(n.per_token as f64 / b.per_token as f64, 0.28125);
        }
    }

    #[test]
    fn design_formulas() {
        let (h, d) = (8, 128);
        assert_eq!(kv_bytes(1, h, d, 1, KvDtype::Bf16).per_token, 4 * h * d);
        assert_eq!(kv_bytes(1, h, d, 1, KvDtype::Fp8).per_token, 2 * h * d);
        assert_eq!(
            kv_bytes(1, h, d, 1, KvDtype::Nvfp4).per_token,
            2 * h * (d / 2 + d / 16)
        );
        assert_eq!(smollm(KvDtype::Nvfp4).page_bytes(), 16 * 30 * 2 * 3 * 36);
    }

    #[test]
    fn parts_tile_the_page_exactly() {
        for dtype in KvDtype::ALL {
            let layout = smollm(dtype);
            let last = layout.part_offset(29, KvPart::V) + layout.part_bytes();
            assert_eq!(last, layout.page_bytes(), "{dtype}");
            // The last scale (or data) byte of the page is its final byte.
            let end = if dtype == KvDtype::Nvfp4 {
                layout.scale_offset(29, KvPart::V, 2, 15) + layout.scale_bytes()
            } else {
                layout.data_offset(29, KvPart::V, 2, 15) + layout.data_bytes()
            };
            assert_eq!(end, layout.page_bytes(), "{dtype}");
        }
    }

    #[test]
    fn data_is_head_major_and_scales_follow_data() {
        let layout = smollm(KvDtype::Nvfp4);
        let k0 = layout.part_offset(0, KvPart::K);
        assert_eq!(layout.data_offset(0, KvPart::K, 0, 1), k0 + 32);
        assert_eq!(layout.data_offset(0, KvPart::K, 1, 0), k0 + 16 * 32);
        assert_eq!(layout.scale_offset(0, KvPart::K, 0, 0), k0 + 3 * 16 * 32);
        assert_eq!(
            layout.scale_offset(0, KvPart::K, 1, 2),
            k0 + 3 * 16 * 32 + 18 * 4
        );
        assert_eq!(layout.part_offset(0, KvPart::V), k0 + 3 * 16 * 36);
    }

    #[test]
    fn rejects_bad_geometry() {
        let err = PageLayout::new(0, 3, 64, 16, KvDtype::Fp8).unwrap_err();
        assert_eq!(err.to_string(), "layers must be between 1 and 4096, got 0");
        assert!(PageLayout::new(30, 3, 72, 16, KvDtype::Fp8).is_err());
        assert!(PageLayout::new(30, 3, 64, 0, KvDtype::Fp8).is_err());
    }
}
