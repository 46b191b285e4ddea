//! Errors of the KV cache: each names the page, slot or count involved.

use crate::pool::{PageId, SlotId};

/// What can go wrong in the page pool, page tables and prefix cache.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Not enough free pages for an allocation; nothing was allocated.
    #[error("KV pool exhausted: {requested} pages requested, {free} free of {total}")]
    Exhausted {
        requested: usize,
        free: usize,
        total: usize,
    },
    /// A page id beyond the pool.
    #[error("page {page} is outside the pool of {total} pages")]
    PageOutOfRange { page: PageId, total: usize },
    /// Releasing or sharing a page nobody holds.
    #[error("page {0} is not allocated (double free or use after free)")]
    NotAllocated(PageId),
    /// A slot beyond the pool.
    #[error("slot {slot} is outside the pool of {total} slots")]
    SlotOutOfRange { slot: SlotId, total: usize },
    /// One write names the same destination slot twice.
    #[error("slot {0} appears more than once in one K/V write")]
    DuplicateSlot(SlotId),
    /// A buffer does not have the length the layout requires.
    #[error("{what}: expected {expected}, got {actual}")]
    BadLength {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A layer index beyond the model.
    #[error("layer {layer} is outside the model's {layers} layers")]
    LayerOutOfRange { layer: usize, layers: usize },
    /// Global scales that do not fit the pool.
    #[error("global scales: {0}")]
    BadScales(String),
    /// Page and hash lists of different lengths given to the prefix cache.
    #[error("{hashes} block hashes but {pages} pages")]
    HashPageMismatch { hashes: usize, pages: usize },
    /// Extending a chain from a block that is not cached.
    #[error("block {0} is not cached: no chain to extend")]
    NotCached(crate::BlockHash),
    /// Unlocking a prefix that is not locked.
    #[error("block {0} is not locked")]
    NotLocked(crate::BlockHash),
    /// Clearing a cache while a request still uses one of its blocks.
    #[error("block {0} is locked by a running request")]
    Locked(crate::BlockHash),
    /// K codes' factors that do not fit the pool.
    #[error("{0}")]
    BadKeyFactors(String),
    /// Invalid geometry or number format.
    #[error(transparent)]
    Format(#[from] nibble_kvfmt::Error),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
