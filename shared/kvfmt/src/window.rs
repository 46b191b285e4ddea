//! The high-precision recent window: the last `W` tokens of a sequence kept in BF16 besides its
//! pages.
//!
//! Every token is quantized into its page when it is computed, as without a window, so pages are
//! always complete (the prefix cache and transfers need nothing else). A sequence with a window
//! also writes each token's K and V in BF16 to a ring of `W` token slots; attention reads a token
//! from the ring while it is one of the sequence's last `W`, and from its page after that. The
//! ring lives in ordinary pages of the same pool, `pages()` of them per sequence, so the one
//! byte-accounting function ([`crate::layout::kv_bytes`]) sizes them too and the planner and the
//! allocator still agree. Inside those pages, one *unit* holds one ring slot of one layer:
//!
//! ```text
//! unit (layer, slot) = layer · W + slot        slot = position mod W
//! unit bytes         = [K|V][kv_head][head_dim] BF16 = 4 · H · D
//! page of a unit     = unit / units_per_page   units never straddle a page
//! ```

use serde::Serialize;

use crate::{Error, KvPart, PageLayout, Result};

/// The geometry of a sequence's window over its pool's pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct WindowLayout {
    tokens: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    page_bytes: usize,
}

impl WindowLayout {
    /// A window of `tokens` tokens (0: none) over pages of `page`. The window must be a whole
    /// number of pages and one unit must fit in a page.
    pub fn new(page: &PageLayout, tokens: usize) -> Result<Self> {
        let window = Self {
            tokens,
            layers: page.layers(),
            kv_heads: page.kv_heads(),
            head_dim: page.head_dim(),
            page_bytes: page.page_bytes(),
        };
        if !tokens.is_multiple_of(page.page_size()) {
            return Err(Error::BadWindow(format!(
                "a window of {tokens} tokens is not a multiple of the page size ({})",
                page.page_size()
            )));
        }
        if tokens > 0 && window.unit_bytes() > window.page_bytes {
            return Err(Error::BadWindow(format!(
                "one window unit ({} bytes) does not fit in a page of {} bytes; use larger pages",
                window.unit_bytes(),
                window.page_bytes
            )));
        }
        Ok(window)
    }

    /// No window.
    pub fn none(page: &PageLayout) -> Self {
        Self::new(page, 0).expect("an empty window always fits")
    }

    /// Tokens the window holds (0: none).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn is_none(&self) -> bool {
        self.tokens == 0
    }

    /// Bytes of one (layer, slot) unit: K then V, every KV head, BF16.
    pub fn unit_bytes(&self) -> usize {
        4 * self.kv_heads * self.head_dim
    }

    /// Units one page holds.
    pub fn units_per_page(&self) -> usize {
        self.page_bytes / self.unit_bytes()
    }

    /// Pages one sequence's window takes (0 without a window).
    pub fn pages(&self) -> usize {
        if self.tokens == 0 {
            0
        } else {
            (self.layers * self.tokens).div_ceil(self.units_per_page())
        }
    }

    /// Whether the token at `position` of a sequence of `len` tokens is read from the window.
    pub fn holds(&self, position: usize, len: usize) -> bool {
        position < len && position + self.tokens >= len
    }

    /// Where the BF16 head vector of (layer, part, head) of the token at `position` lives: the
    /// index into the sequence's window pages and the byte offset within that page.
    pub fn locate(
        &self,
        layer: usize,
        part: KvPart,
        head: usize,
        position: usize,
    ) -> (usize, usize) {
        debug_assert!(self.tokens > 0 && layer < self.layers && head < self.kv_heads);
        let unit = layer * self.tokens + position % self.tokens;
        let upp = self.units_per_page();
        let vector = 2 * self.head_dim;
        let within = (part as usize * self.kv_heads + head) * vector;
        (unit / upp, (unit % upp) * self.unit_bytes() + within)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDtype;

    fn smollm(dtype: KvDtype) -> PageLayout {
        PageLayout::new(30, 3, 64, 16, dtype).unwrap()
    }

    #[test]
    fn sizes_for_smollm() {
        let w = WindowLayout::new(&smollm(KvDtype::Nvfp4), 64).unwrap();
        assert_eq!(w.unit_bytes(), 768);
        // 103,680-byte pages hold 135 units; 30 layers x 64 slots = 1,920 units.
        assert_eq!(w.units_per_page(), 135);
        assert_eq!(w.pages(), 15);
        assert_eq!(WindowLayout::none(&smollm(KvDtype::Nvfp4)).pages(), 0);
    }

    #[test]
    fn units_tile_without_straddling() {
        let w = WindowLayout::new(&smollm(KvDtype::Nvfp4), 32).unwrap();
        let mut seen = std::collections::HashSet::new();
        for layer in 0..30 {
            for pos in 100..132 {
                for part in [KvPart::K, KvPart::V] {
                    for head in 0..3 {
                        let (page, off) = w.locate(layer, part, head, pos);
                        assert!(page < w.pages());
                        assert!(off + 128 <= smollm(KvDtype::Nvfp4).page_bytes());
                        assert!(seen.insert((page, off)), "two vectors share bytes");
                    }
                }
            }
        }
        assert_eq!(seen.len(), 30 * 32 * 2 * 3);
        // The ring wraps: position p and p + W share a slot.
        assert_eq!(w.locate(3, KvPart::V, 1, 5), w.locate(3, KvPart::V, 1, 37));
    }

    #[test]
    fn holds_the_last_tokens() {
        let w = WindowLayout::new(&smollm(KvDtype::Nvfp4), 16).unwrap();
        assert!(!w.holds(3, 20));
        assert!(w.holds(4, 20));
        assert!(w.holds(19, 20));
        assert!(!w.holds(20, 20));
        assert!(w.holds(0, 5));
    }

    #[test]
    fn refuses_bad_windows() {
        let err = WindowLayout::new(&smollm(KvDtype::Nvfp4), 40).unwrap_err();
        assert_eq!(
            err.to_string(),
            "bad KV window: a window of 40 tokens is not a multiple of the page size (16)"
        );
        let tiny = PageLayout::new(1, 8, 128, 1, KvDtype::Nvfp4).unwrap();
        let err = WindowLayout::new(&tiny, 1).unwrap_err();
        assert!(err.to_string().contains("does not fit in a page"), "{err}");
    }
}
