//! The page pool: planning and allocation with reference counts.
//!
//! [`PoolPlan`] turns a byte budget into a page count with [`PageLayout::page_bytes`], the same
//! function every page store ([`HostPages`](crate::HostPages) here, device memory in a GPU
//! backend) carves its storage with, so the planner and the allocator cannot disagree. The pool
//! itself holds no bytes: it decides which pages are whose. Pages are handed out from a LIFO free
//! list; [`PagePool::retain`] shares a page and [`PagePool::release`] drops one reference,
//! returning the page to the free list at zero. Allocation is all or nothing.
//!
//! A slot is one token position: `slot = page · page_size + offset`.

use std::fmt;

use nibble_kvfmt::{PageLayout, WindowLayout};
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

/// Which pages are free and how many holders each allocated page has.
pub struct PagePool {
    layout: PageLayout,
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
    /// A pool of the plan's pages, all free.
    pub fn new(plan: PoolPlan) -> Self {
        // Pages are handed out lowest id first.
        let free = (0..plan.pages as u32).rev().map(PageId).collect();
        Self {
            layout: plan.layout,
            refcounts: vec![0; plan.pages],
            free,
        }
    }

    pub fn layout(&self) -> &PageLayout {
        &self.layout
    }

    pub fn total_pages(&self) -> usize {
        self.refcounts.len()
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
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

    /// Checks a sequence's recent-window pages: as many as `window` takes, each allocated.
    pub fn check_window(&self, window: &WindowLayout, pages: &[PageId]) -> Result<()> {
        if pages.len() != window.pages() {
            return Err(Error::BadLength {
                what: "window pages",
                expected: window.pages(),
                actual: pages.len(),
            });
        }
        for page in pages {
            if self.refcount(*page)? == 0 {
                return Err(Error::NotAllocated(*page));
            }
        }
        Ok(())
    }

    /// Checks that every non-padding slot is in range, in an allocated page, and unique.
    pub fn check_slots(&self, slots: &[Option<SlotId>]) -> Result<()> {
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
