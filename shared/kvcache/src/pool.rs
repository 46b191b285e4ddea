//! The page pool: planning, allocation with reference counts, host storage and quantize-on-write.
//!
//! [`PoolPlan`] turns a byte budget into a page count with [`PageLayout::page_bytes`], the same
//! function [`PagePool::new`] carves its storage with, so the planner and the allocator cannot
//! disagree. Pages are handed out from a LIFO free list; [`PagePool::retain`] shares a page and
//! [`PagePool::release`] drops one reference, returning the page to the free list at zero.
//! Allocation is all or nothing.
//!
//! A slot is one token position: `slot = page · page_size + offset`. [`PagePool::write_kv`]
//! quantizes K and V of one layer into slots of allocated pages, validating everything before it
//! writes a byte. Global scales are fixed for the life of the pool: changing them would silently
//! reinterpret every live byte.

use std::fmt;

use nibble_kvfmt::{bf16, check_global_scale, fp8, nvfp4, KvDtype, KvPart, PageLayout};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Index of a page in its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PageId(pub u32);

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One token position in the pool: `page · page_size + offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SlotId(pub u32);

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl SlotId {
    /// The slot at `offset` within `page`.
    pub fn new(page: PageId, offset: usize, page_size: usize) -> Self {
        debug_assert!(offset < page_size);
        SlotId(page.0 * page_size as u32 + offset as u32)
    }

    pub fn page(self, page_size: usize) -> PageId {
        PageId(self.0 / page_size as u32)
    }

    pub fn offset(self, page_size: usize) -> usize {
        (self.0 % page_size as u32) as usize
    }
}

/// How many pages a pool gets and how many bytes they take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PoolPlan {
    pub layout: PageLayout,
    pub pages: usize,
    pub bytes: usize,
}

/// Largest pool: slot ids must fit in u32.
const MAX_SLOTS: usize = u32::MAX as usize;

impl PoolPlan {
    /// A pool of exactly `pages` pages.
    pub fn for_pages(layout: PageLayout, pages: usize) -> Result<Self> {
        if pages == 0 || pages.saturating_mul(layout.page_size()) > MAX_SLOTS {
            return Err(Error::BadLength {
                what: "pool pages (at least 1, at most 2^32 slots)",
                expected: 1,
                actual: pages,
            });
        }
        Ok(Self {
            layout,
            pages,
            bytes: pages * layout.page_bytes(),
        })
    }

    /// As many whole pages as fit in `budget_bytes`.
    pub fn for_budget(layout: PageLayout, budget_bytes: usize) -> Result<Self> {
        let page_bytes = layout.page_bytes();
        if budget_bytes < page_bytes {
            return Err(Error::BadLength {
                what: "KV budget bytes (at least one page)",
                expected: page_bytes,
                actual: budget_bytes,
            });
        }
        let max_pages = MAX_SLOTS / layout.page_size();
        Self::for_pages(layout, (budget_bytes / page_bytes).min(max_pages))
    }

    /// Tokens this pool can hold.
    pub fn tokens(&self) -> usize {
        self.pages * self.layout.page_size()
    }
}

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

    /// The scale of (layer, part).
    pub fn get(&self, layer: usize, part: KvPart) -> f32 {
        match part {
            KvPart::K => self.k[layer],
            KvPart::V => self.v[layer],
        }
    }

    fn validate(&self, layers: usize) -> Result<()> {
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

/// Pages, their reference counts, and their bytes in host memory.
pub struct PagePool {
    layout: PageLayout,
    scales: GlobalScales,
    storage: Vec<u8>,
    refcounts: Vec<u32>,
    free: Vec<PageId>,
}

impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("layout", &self.layout)
            .field("pages", &self.refcounts.len())
            .field("free", &self.free.len())
            .finish()
    }
}

impl PagePool {
    /// Carves a pool from a plan. Storage is zeroed.
    pub fn new(plan: PoolPlan, scales: GlobalScales) -> Result<Self> {
        scales.validate(plan.layout.layers())?;
        let storage = vec![0u8; plan.pages * plan.layout.page_bytes()];
        // Pages are handed out lowest id first.
        let free = (0..plan.pages as u32).rev().map(PageId).collect();
        Ok(Self {
            layout: plan.layout,
            scales,
            storage,
            refcounts: vec![0; plan.pages],
            free,
        })
    }

    pub fn layout(&self) -> &PageLayout {
        &self.layout
    }

    pub fn scales(&self) -> &GlobalScales {
        &self.scales
    }

    pub fn total_pages(&self) -> usize {
        self.refcounts.len()
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Bytes of page storage actually allocated.
    pub fn storage_bytes(&self) -> usize {
        self.storage.len()
    }

    /// References held on `page` (0 when free).
    pub fn refcount(&self, page: PageId) -> Result<u32> {
        self.check_page(page)?;
        Ok(self.refcounts[page.0 as usize])
    }

    fn check_page(&self, page: PageId) -> Result<()> {
        if (page.0 as usize) < self.refcounts.len() {
            Ok(())
        } else {
            Err(Error::PageOutOfRange {
                page,
                total: self.refcounts.len(),
            })
        }
    }

    /// Allocates `n` pages, each with one reference, or none at all.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>> {
        if n > self.free.len() {
            return Err(Error::Exhausted {
                requested: n,
                free: self.free.len(),
                total: self.total_pages(),
            });
        }
        let pages = self.free.split_off(self.free.len() - n);
        for page in &pages {
            self.refcounts[page.0 as usize] = 1;
        }
        Ok(pages)
    }

    /// Adds a reference to an allocated page (sharing it).
    pub fn retain(&mut self, page: PageId) -> Result<()> {
        self.check_page(page)?;
        let count = &mut self.refcounts[page.0 as usize];
        if *count == 0 {
            return Err(Error::NotAllocated(page));
        }
        *count += 1;
        Ok(())
    }

    /// Drops one reference; returns true when that freed the page.
    pub fn release(&mut self, page: PageId) -> Result<bool> {
        self.check_page(page)?;
        let count = &mut self.refcounts[page.0 as usize];
        match *count {
            0 => Err(Error::NotAllocated(page)),
            1 => {
                *count = 0;
                self.free.push(page);
                Ok(true)
            }
            _ => {
                *count -= 1;
                Ok(false)
            }
        }
    }

    /// Releases one reference on each page; stops at the first error.
    pub fn release_all(&mut self, pages: &[PageId]) -> Result<()> {
        pages.iter().try_for_each(|p| self.release(*p).map(|_| ()))
    }

    /// The bytes of one page.
    pub fn page(&self, page: PageId) -> Result<&[u8]> {
        self.check_page(page)?;
        let size = self.layout.page_bytes();
        let start = page.0 as usize * size;
        Ok(&self.storage[start..start + size])
    }

    /// The bytes of one allocated page, for receiving a transfer.
    pub fn page_mut(&mut self, page: PageId) -> Result<&mut [u8]> {
        if self.refcount(page)? == 0 {
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
        self.check_slots(slots)?;
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

    /// Checks that every non-padding slot is in range, in an allocated page, and unique.
    fn check_slots(&self, slots: &[Option<SlotId>]) -> Result<()> {
        let page_size = self.layout.page_size();
        let total = self.total_pages() * page_size;
        let mut seen: Vec<SlotId> = Vec::with_capacity(slots.len());
        for slot in slots.iter().flatten() {
            if slot.0 as usize >= total {
                return Err(Error::SlotOutOfRange { slot: *slot, total });
            }
            let page = slot.page(page_size);
            if self.refcounts[page.0 as usize] == 0 {
                return Err(Error::NotAllocated(page));
            }
            seen.push(*slot);
        }
        seen.sort_unstable();
        if let Some(pair) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::DuplicateSlot(pair[0]));
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
                    nvfp4::quantize_unchecked(hx, g, &mut lo[data], &mut hi[..scale_bytes]);
                }
                KvDtype::Fp8 => fp8::quantize_unchecked(hx, g, &mut self.storage[data]),
                KvDtype::Bf16 => {
                    for (pair, value) in self.storage[data].chunks_exact_mut(2).zip(hx) {
                        pair.copy_from_slice(&bf16::encode(*value).to_le_bytes());
                    }
                }
            }
        }
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
        let page = slot.page(page_size);
        let bytes = self.page(page)?;
        let offset = slot.offset(page_size);
        let g = self.scales.get(layer, part);
        let d = layout.data_offset(layer, part, head, offset);
        let data = &bytes[d..d + layout.data_bytes()];
        match layout.dtype() {
            KvDtype::Nvfp4 => {
                let s = layout.scale_offset(layer, part, head, offset);
                nvfp4::dequantize_unchecked(data, &bytes[s..s + layout.scale_bytes()], g, out);
            }
            KvDtype::Fp8 => fp8::dequantize_unchecked(data, g, out),
            KvDtype::Bf16 => {
                for (value, pair) in out.iter_mut().zip(data.chunks_exact(2)) {
                    *value = bf16::decode(u16::from_le_bytes([pair[0], pair[1]]));
                }
            }
        }
        Ok(())
    }

    /// Verifies the allocator's invariants: every page is either free with count 0 (once on the
    /// free list) or held with count ≥ 1. Used by tests and debug checks.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut on_free_list = vec![false; self.total_pages()];
        for page in &self.free {
            let i = page.0 as usize;
            if on_free_list[i] {
                return Err(format!("page {page} is on the free list twice"));
            }
            on_free_list[i] = true;
        }
        for (i, (count, free)) in self.refcounts.iter().zip(&on_free_list).enumerate() {
            if (*count == 0) != *free {
                return Err(format!("page {i}: refcount {count}, on free list {free}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
