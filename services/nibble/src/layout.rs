//! `nibble kv layout`: the byte accounting of one model geometry, as one JSON object.
//!
//! Every number comes from [`PageLayout`] and [`WindowLayout`] (and so from the one accounting
//! function in `nibble-kvfmt` that the pool planner and the allocator share); the ratios compare
//! the same geometry in fp8 and bf16. With `--context`, what one sequence of that many tokens
//! holds: the pages the scheduler allocates for it (its tokens' pages and its recent window's)
//! and the bytes a prefill-to-decode hand-off moves for it when the decode worker has none of it
//! cached, which are the same pages.

use std::io::Write;

use nibble_engine::KvConfig;
use nibble_kvfmt::{KvDtype, PageLayout, WindowLayout};
use serde::Serialize;

use crate::{Error, Result};

/// What `nibble kv layout` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayoutReport {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Values per head vector (D).
    pub head_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Cache dtype.
    pub dtype: KvDtype,
    /// Bytes of one head vector: data, then scales (nvfp4).
    pub vector_bytes: usize,
    /// K and V of one token in one layer.
    pub bytes_per_token_per_layer: usize,
    /// K and V of one token in every layer.
    pub bytes_per_token: usize,
    /// One (layer, K|V) region of a page.
    pub part_bytes: usize,
    /// One page: `page_size` tokens of every layer's K and V.
    pub page_bytes: usize,
    /// `bytes_per_token` over the same geometry's fp8 `bytes_per_token`.
    pub ratio_vs_fp8: f64,
    /// `bytes_per_token` over the same geometry's bf16 `bytes_per_token`.
    pub ratio_vs_bf16: f64,
    /// Tokens of each sequence's BF16 recent window (`--kv-window`; the dtype's default).
    pub window_tokens: usize,
    /// Pages of the pool one sequence's window takes.
    pub window_pages: usize,
    /// One sequence of `--context` tokens, when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sequence: Option<SequenceBytes>,
}

/// What one sequence of `context` tokens costs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SequenceBytes {
    pub context: usize,
    /// Pages the scheduler holds for it: its tokens' and its window's.
    pub pages: usize,
    /// Their bytes: what the pool gives it, and what a hand-off moves.
    pub bytes: usize,
    /// KV tokens one GiB of pages holds in sequences of this length (2^30 · context / bytes,
    /// rounded down).
    pub tokens_per_gib: usize,
    /// `bytes` over the same sequence's in fp8 (without a window, fp8's default).
    pub bytes_vs_fp8: f64,
    /// `tokens_per_gib` over fp8's.
    pub tokens_vs_fp8: f64,
}

impl SequenceBytes {
    fn new(layout: &PageLayout, window: &WindowLayout, context: usize) -> Self {
        let pages = context.div_ceil(layout.page_size()) + window.pages();
        let bytes = pages * layout.page_bytes();
        let fp8 = layout.with_dtype(KvDtype::Fp8);
        let fp8_bytes = context.div_ceil(fp8.page_size()) * fp8.page_bytes();
        let per_gib = |bytes: usize| ((1u128 << 30) * context as u128 / bytes as u128) as usize;
        Self {
            context,
            pages,
            bytes,
            tokens_per_gib: per_gib(bytes),
            bytes_vs_fp8: bytes as f64 / fp8_bytes as f64,
            tokens_vs_fp8: per_gib(bytes) as f64 / per_gib(fp8_bytes) as f64,
        }
    }
}

impl LayoutReport {
    /// Validates the geometry (see [`PageLayout::new`]) and the window and accounts for them;
    /// `window` `None` is the dtype's default, `context` adds one sequence's cost.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        page_size: usize,
        dtype: KvDtype,
        window: Option<usize>,
        context: Option<usize>,
    ) -> Result<Self> {
        let layout = PageLayout::new(layers, kv_heads, head_dim, page_size, dtype)?;
        let window = WindowLayout::new(
            &layout,
            window.unwrap_or(KvConfig::default_window(dtype, page_size)),
        )?;
        let bytes = layout.bytes();
        let ratio = |other: KvDtype| {
            bytes.per_token as f64 / layout.with_dtype(other).bytes().per_token as f64
        };
        Ok(Self {
            layers,
            kv_heads,
            head_dim,
            page_size,
            dtype,
            vector_bytes: dtype.vector_bytes(head_dim),
            bytes_per_token_per_layer: bytes.per_token_per_layer,
            bytes_per_token: bytes.per_token,
            part_bytes: layout.part_bytes(),
            page_bytes: bytes.per_page,
            ratio_vs_fp8: ratio(KvDtype::Fp8),
            ratio_vs_bf16: ratio(KvDtype::Bf16),
            window_tokens: window.tokens(),
            window_pages: window.pages(),
            sequence: context.map(|c| SequenceBytes::new(&layout, &window, c)),
        })
    }

    /// Writes the report as one line of JSON.
    pub fn write_json(&self, out: &mut impl Write) -> Result<()> {
        let json = serde_json::to_string(self).map_err(|e| Error::Stdout(e.into()))?;
        writeln!(out, "{json}").map_err(Error::Stdout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2() {
        let r = LayoutReport::new(30, 3, 64, 16, KvDtype::Nvfp4, Some(0), None)
            .expect("valid geometry");
        assert_eq!(r.vector_bytes, 36);
        assert_eq!(r.bytes_per_token_per_layer, 2 * 3 * 36);
        assert_eq!(r.bytes_per_token, 30 * 2 * 3 * 36);
        assert_eq!(r.part_bytes, 3 * 16 * 36);
        assert_eq!(r.page_bytes, 16 * 30 * 2 * 3 * 36);
        assert_eq!(r.page_bytes, 103_680);
        assert_eq!(r.ratio_vs_fp8, 0.5625);
        assert_eq!(r.ratio_vs_bf16, 0.28125);
    }

    #[test]
    fn llama3_8b_per_dtype() {
        let per_token = |dtype| {
            LayoutReport::new(32, 8, 128, 16, dtype, None, None)
                .expect("valid geometry")
                .bytes_per_token
        };
        assert_eq!(per_token(KvDtype::Bf16), 131_072);
        assert_eq!(per_token(KvDtype::Fp8), 65_536);
        assert_eq!(per_token(KvDtype::Nvfp4), 36_864);
        let fp8 =
            LayoutReport::new(32, 8, 128, 16, KvDtype::Fp8, None, None).expect("valid geometry");
        assert_eq!((fp8.ratio_vs_fp8, fp8.ratio_vs_bf16), (1.0, 0.5));
    }

    #[test]
    fn json_is_one_object_on_one_line() {
        let r = LayoutReport::new(30, 3, 64, 16, KvDtype::Fp8, None, None).expect("valid geometry");
        let mut out = Vec::new();
        r.write_json(&mut out).expect("writes");
        let text = String::from_utf8(out).expect("utf-8");
        assert_eq!(text.lines().count(), 1);
        let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(v["dtype"], "fp8");
        assert_eq!(v["page_bytes"], 16 * 30 * 2 * 3 * 64);
        assert_eq!(v["ratio_vs_bf16"], 0.5);
    }

    #[test]
    fn a_sequence_with_the_default_window() {
        // SmolLM2: 11 window pages; a 32K sequence holds 2,048 + 11 pages.
        let r = LayoutReport::new(30, 3, 64, 16, KvDtype::Nvfp4, None, Some(32768)).unwrap();
        assert_eq!((r.window_tokens, r.window_pages), (48, 11));
        let s = r.sequence.unwrap();
        assert_eq!((s.pages, s.bytes), (2059, 2059 * 103_680));
        assert!(s.tokens_vs_fp8 >= 1.75 && s.bytes_vs_fp8 <= 0.58, "{s:?}");
        // A 4K sequence: 256 + 11 pages, 1.7x FP8's tokens in the same bytes.
        let r = LayoutReport::new(30, 3, 64, 16, KvDtype::Nvfp4, None, Some(4096)).unwrap();
        let s = r.sequence.unwrap();
        assert_eq!(s.pages, 267);
        assert!(s.tokens_vs_fp8 >= 1.70, "{s:?}");
        let fp8 = LayoutReport::new(30, 3, 64, 16, KvDtype::Fp8, None, Some(4096)).unwrap();
        assert_eq!(fp8.window_pages, 0);
        assert_eq!(fp8.sequence.unwrap().bytes_vs_fp8, 1.0);
        let err = LayoutReport::new(30, 3, 64, 16, KvDtype::Nvfp4, Some(24), None).unwrap_err();
        assert!(
            err.to_string().contains("multiple of the page size"),
            "{err}"
        );
    }

    #[test]
    fn bad_geometry_is_named() {
        let err =
            LayoutReport::new(30, 0, 64, 16, KvDtype::Nvfp4, None, None).expect_err("no heads");
        assert_eq!(
            err.to_string(),
            "kv heads must be between 1 and 4096, got 0"
        );
    }
}
