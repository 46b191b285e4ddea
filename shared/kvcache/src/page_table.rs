//! One sequence's pages: which pages hold its tokens, and which slots its next tokens go to.
//!
//! A page table owns one reference on each of its pages. Pages shared from a cached prefix are
//! full and never written again; new tokens always go to pages the table allocated itself, so
//! sharing needs no copy-on-write. [`PageTable::release`] gives every reference back.

use crate::pool::{PageId, PagePool, SlotId};
use crate::{Error, Result};

/// The pages and length of one sequence.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PageTable {
    pages: Vec<PageId>,
    tokens: usize,
}

impl PageTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// A table that starts with full, cached `pages` of `page_size` tokens each, taking a
    /// reference on each.
    pub fn from_shared(pool: &mut PagePool, pages: &[PageId]) -> Result<Self> {
        for (i, page) in pages.iter().enumerate() {
            if let Err(e) = pool.retain(*page) {
                pool.release_all(&pages[..i])?;
                return Err(e);
            }
        }
        Ok(Self {
            pages: pages.to_vec(),
            tokens: pages.len() * pool.layout().page_size(),
        })
    }

    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// Tokens stored.
    pub fn len(&self) -> usize {
        self.tokens
    }

    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// Pages needed to grow by `n` tokens.
    pub fn pages_needed(&self, n: usize, page_size: usize) -> usize {
        (self.tokens + n).div_ceil(page_size) - self.pages.len()
    }

    /// Reserves room for `n` more tokens and returns their slots, in order. Allocates the pages it
    /// needs all at once; on exhaustion nothing changes.
    pub fn append(&mut self, pool: &mut PagePool, n: usize) -> Result<Vec<SlotId>> {
        let page_size = pool.layout().page_size();
        let new_pages = pool.alloc(self.pages_needed(n, page_size))?;
        self.pages.extend(new_pages);
        let slots = (self.tokens..self.tokens + n)
            .map(|t| SlotId::new(self.pages[t / page_size], t % page_size, page_size))
            .collect();
        self.tokens += n;
        Ok(slots)
    }

    /// The slot of token `index`.
    pub fn slot(&self, index: usize, page_size: usize) -> Result<SlotId> {
        if index >= self.tokens {
            return Err(Error::BadLength {
                what: "token index within the sequence",
                expected: self.tokens,
                actual: index,
            });
        }
        Ok(SlotId::new(
            self.pages[index / page_size],
            index % page_size,
            page_size,
        ))
    }

    /// Gives back every page reference; the table is empty afterwards.
    pub fn release(&mut self, pool: &mut PagePool) -> Result<()> {
        let pages = std::mem::take(&mut self.pages);
        self.tokens = 0;
        pool.release_all(&pages)
    }
}
