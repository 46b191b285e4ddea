//! nibble's paged KV cache, independent of where the bytes live.
//!
//! * [`pool`]: the page pool — a [`PoolPlan`] sized from the one byte-accounting function and an
//!   allocator with a free list and reference counts.
//! * [`store`]: page bytes in host memory and quantize-on-write of K/V into slots.
//! * [`page_table`]: one sequence's pages and the slots its next tokens go to.
//! * [`hash`]: chained block hashes of full pages of token ids — the key every worker and the
//!   router agree on.
//! * [`radix`]: the worker-local prefix cache over full pages (match, insert, lock, LRU eviction)
//!   that emits [`events`] for the router's prefix index.
//!
//! Invariants: a page is either on the free list with reference count 0 or off it with count ≥ 1;
//! every holder (a page table, the prefix cache) owns exactly one reference; a page returns to the
//! free list when its last reference is released.

mod error;
pub mod events;
pub mod hash;
pub mod page_table;
pub mod pool;
pub mod radix;
pub mod store;

pub use error::{Error, Result};
pub use events::{KvEvent, KvEventData, KvSnapshot};
pub use hash::{extend_hashes, hash_block, hash_blocks, BlockHash};
pub use page_table::PageTable;
pub use pool::{PageId, PagePool, PoolPlan, SlotId};
pub use radix::{CacheStats, RadixCache};
pub use store::{check_key_factors, GlobalScales, HostPages, PageBytes};
