//! [`PageGeom`]: a `PageLayout` and a layer, as the kernels address pages.

use cudarc::driver::DeviceRepr;
use nibble_kvfmt::{KvDtype, PageLayout, ScaleRule, WindowLayout};

use crate::{Error, Result};

/// The geometry of one page plus the layer a launch works on; the `PageGeom` struct of
/// `cu/common.cuh`, field for field. Built only from a validated [`PageLayout`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageGeom {
    pub page_bytes: u64,
    pub part_bytes: u32,
    pub kv_heads: u32,
    pub page_size: u32,
    pub page_shift: u32,
    pub head_dim: u32,
    pub data_bytes: u32,
    pub scale_bytes: u32,
    pub layer: u32,
}

// SAFETY: #[repr(C)], plain integers, the same layout as the CUDA struct.
unsafe impl DeviceRepr for PageGeom {}

impl PageGeom {
    /// The geometry of `layout` at `layer`. The kernels need a power-of-two page size and
    /// 16-byte aligned parts (true for every page size >= 8 with nibble's head dims).
    pub fn new(layout: &PageLayout, layer: usize) -> Result<Self> {
        let page_size = layout.page_size();
        if !page_size.is_power_of_two() {
            return Err(Error::Unsupported(format!(
                "page size {page_size} (the kernels need a power of two)"
            )));
        }
        if layer >= layout.layers() {
            return Err(Error::Shape {
                what: "layer (less than the layout's layers)",
                expected: layout.layers(),
                actual: layer,
            });
        }
        if !layout.part_bytes().is_multiple_of(16) {
            return Err(Error::Unsupported(format!(
                "{} bytes per (layer, K|V) part: the kernels need a multiple of 16 (a larger page)",
                layout.part_bytes()
            )));
        }
        // The kernels address within a page in 32 bits (decode's page address is one
        // 32-bit-by-32-bit wide multiply).
        let Ok(page_bytes) = u32::try_from(layout.page_bytes()) else {
            return Err(Error::Unsupported(format!(
                "pages of {} bytes (the kernels address at most 4 GiB per page: fewer tokens \
                 per page)",
                layout.page_bytes()
            )));
        };
        Ok(Self {
            page_bytes: page_bytes as u64,
            part_bytes: layout.part_bytes() as u32,
            kv_heads: layout.kv_heads() as u32,
            page_size: page_size as u32,
            page_shift: page_size.trailing_zeros(),
            head_dim: layout.head_dim() as u32,
            data_bytes: layout.data_bytes() as u32,
            scale_bytes: layout.scale_bytes() as u32,
            layer: layer as u32,
        })
    }
}

/// A sequence's recent window over its pages (kvfmt's `WindowLayout`) at one layer. Matches
/// `WindowGeom` in `cu/common.cuh`. `tokens == 0`: no window.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowGeom {
    pub page_bytes: u64,
    pub tokens: u32,
    pub units_per_page: u32,
    pub unit_bytes: u32,
    /// Window pages per sequence: the row length of a window table.
    pub pages: u32,
    pub kv_heads: u32,
    pub layer: u32,
}

// SAFETY: #[repr(C)], plain integers, the same layout as the CUDA struct.
unsafe impl DeviceRepr for WindowGeom {}

impl WindowGeom {
    /// No window.
    pub fn none() -> Self {
        Self {
            page_bytes: 0,
            tokens: 0,
            units_per_page: 1,
            unit_bytes: 0,
            pages: 0,
            kv_heads: 0,
            layer: 0,
        }
    }

    /// The geometry of `window` over `layout`'s pages at `layer` (checked by [`PageGeom::new`]).
    pub fn new(window: &WindowLayout, layout: &PageLayout, layer: usize) -> Self {
        let count = |n: usize| u32::try_from(n).expect("bounded by the page layout");
        Self {
            page_bytes: layout.page_bytes() as u64,
            tokens: count(window.tokens()),
            units_per_page: count(if window.is_none() {
                1
            } else {
                window.units_per_page()
            }),
            unit_bytes: count(window.unit_bytes()),
            pages: count(window.pages()),
            kv_heads: count(layout.kv_heads()),
            layer: count(layer),
        }
    }
}

/// The dtype code of `cu/common.cuh` (`NIBBLE_NVFP4`, `NIBBLE_FP8`, `NIBBLE_BF16`).
pub(crate) fn dtype_code(dtype: KvDtype) -> u32 {
    match dtype {
        KvDtype::Nvfp4 => 0,
        KvDtype::Fp8 => 1,
        KvDtype::Bf16 => 2,
    }
}

/// The block scale rule code of `cu/common.cuh` (`NIBBLE_SCALE_AMAX`, `NIBBLE_SCALE_MSE`).
pub(crate) fn scale_rule_code(rule: ScaleRule) -> u32 {
    match rule {
        ScaleRule::Amax => 0,
        ScaleRule::Mse => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mse_kernels_try_kvfmts_candidates_in_kvfmts_order() {
        let offsets = &nibble_kvfmt::nvfp4::MSE_CANDIDATES;
        let list: Vec<String> = offsets.iter().map(i32::to_string).collect();
        let expected = format!(
            "const int offsets[{}] = {{{}}};",
            list.len(),
            list.join(", ")
        );
        for (file, source) in [
            ("quantize.cu", include_str!("cu/quantize.cu")),
            ("common.cuh", crate::PRELUDE),
        ] {
            assert!(source.contains(&expected), "{file} lacks {expected}");
        }
        // Five candidates fit the lane kernel's eight lanes per block.
        assert!(offsets.len() <= 8 && offsets[0] == 0);
        assert!(crate::PRELUDE.contains("#define NIBBLE_SCALE_AMAX 0u"));
        assert!(crate::PRELUDE.contains("#define NIBBLE_SCALE_MSE 1u"));
        assert_eq!(scale_rule_code(ScaleRule::Amax), 0);
        assert_eq!(scale_rule_code(ScaleRule::Mse), 1);
    }

    #[test]
    fn matches_the_layout() {
        let layout = PageLayout::new(32, 8, 128, 16, KvDtype::Nvfp4).unwrap();
        let g = PageGeom::new(&layout, 3).unwrap();
        assert_eq!(g.page_bytes, 589_824);
        assert_eq!(g.part_bytes, 8 * 16 * 72);
        assert_eq!((g.page_shift, g.data_bytes, g.scale_bytes), (4, 64, 8));
        assert_eq!(std::mem::size_of::<PageGeom>(), 40);
    }

    #[test]
    fn rejects_what_the_kernels_cannot_address() {
        let odd = PageLayout::new(1, 1, 16, 12, KvDtype::Fp8).unwrap();
        assert!(PageGeom::new(&odd, 0).is_err());
        let small = PageLayout::new(1, 1, 16, 1, KvDtype::Nvfp4).unwrap();
        assert!(PageGeom::new(&small, 0).is_err());
        let layout = PageLayout::new(2, 1, 64, 16, KvDtype::Bf16).unwrap();
        assert!(PageGeom::new(&layout, 2).is_err());
        // 128 layers x 64 KV heads x head dim 256 in BF16 at 2,048 tokens a page: 16 GiB.
        let huge = PageLayout::new(128, 64, 256, 2048, KvDtype::Bf16).unwrap();
        let e = PageGeom::new(&huge, 0).unwrap_err().to_string();
        assert!(e.contains("at most 4 GiB per page"), "{e}");
    }
}
