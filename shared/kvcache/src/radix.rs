//! The worker-local prefix cache: a radix tree over full pages, keyed by chained block hashes.
//!
//! Because a block's hash covers every token before it, a map from hash to node *is* the radix
//! tree: a node's parent is the block before it, and matching a prompt walks its hashes until the
//! first miss. Each cached node owns one reference on its page. While a request uses a cached
//! prefix it locks those nodes; eviction takes least-recently-used leaves that are unlocked and
//! whose page only the cache still holds, so eviction never frees a page in use. Every insertion
//! and removal is recorded as a [`KvEvent`](crate::KvEvent).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use serde::Serialize;

use crate::events::{parents_first, EventLog, KvEventData};
use crate::{BlockHash, Error, KvEvent, KvSnapshot, PageId, PagePool, Result};

/// Events kept for publishing before the oldest are dropped.
pub const DEFAULT_EVENT_CAPACITY: usize = 1 << 16;

#[derive(Debug, Clone)]
struct Node {
    page: PageId,
    parent: Option<BlockHash>,
    children: u32,
    locks: u32,
    last_access: u64,
}

/// Query and hit counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    /// Calls to [`RadixCache::match_prefix`].
    pub queries: u64,
    /// Blocks asked for across all queries.
    pub query_blocks: u64,
    /// Blocks found across all queries.
    pub hit_blocks: u64,
    /// Blocks inserted.
    pub inserted_blocks: u64,
    /// Blocks evicted.
    pub evicted_blocks: u64,
    /// Calls to [`RadixCache::evict`] that asked for pages: each walks every cached block.
    pub eviction_scans: u64,
}

/// The prefix cache of one worker.
#[derive(Debug)]
pub struct RadixCache {
    nodes: HashMap<BlockHash, Node>,
    clock: u64,
    stats: CacheStats,
    events: EventLog,
}

impl Default for RadixCache {
    fn default() -> Self {
        Self::new(DEFAULT_EVENT_CAPACITY)
    }
}

impl RadixCache {
    /// An empty cache keeping up to `event_capacity` unpublished events.
    pub fn new(event_capacity: usize) -> Self {
        Self {
            nodes: HashMap::new(),
            clock: 0,
            stats: CacheStats::default(),
            events: EventLog::new(event_capacity),
        }
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Cached pages nothing else holds (no request, no lock): what eviction can give back,
    /// leaves first. A cached page a running request also holds is in use, not reclaimable.
    pub fn reclaimable(&self, pool: &PagePool) -> usize {
        self.nodes
            .values()
            .filter(|n| n.locks == 0 && pool.refcount(n.page).is_ok_and(|c| c == 1))
            .count()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.nodes.contains_key(&hash)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The pages of the longest cached prefix of `hashes`. Marks them recently used and counts
    /// the query.
    pub fn match_prefix(&mut self, hashes: &[BlockHash]) -> Vec<PageId> {
        let now = self.tick();
        let mut pages = Vec::new();
        for hash in hashes {
            let Some(node) = self.nodes.get_mut(hash) else {
                break;
            };
            node.last_access = now;
            pages.push(node.page);
        }
        self.stats.queries += 1;
        self.stats.query_blocks += hashes.len() as u64;
        self.stats.hit_blocks += pages.len() as u64;
        pages
    }

    /// Marks the cached blocks among `hashes` as just used (eviction takes the least recently
    /// used first); blocks not cached are skipped.
    pub fn touch(&mut self, hashes: &[BlockHash]) {
        let now = self.tick();
        for hash in hashes {
            if let Some(node) = self.nodes.get_mut(hash) {
                node.last_access = now;
            }
        }
    }

    /// Locks cached blocks against eviction (one lock per call; nest freely).
    pub fn lock(&mut self, hashes: &[BlockHash]) -> Result<()> {
        if let Some(missing) = hashes.iter().find(|h| !self.nodes.contains_key(h)) {
            return Err(Error::NotLocked(*missing));
        }
        for hash in hashes {
            self.nodes.get_mut(hash).expect("checked").locks += 1;
        }
        Ok(())
    }

    /// Undoes one [`lock`](Self::lock) of each block.
    pub fn unlock(&mut self, hashes: &[BlockHash]) -> Result<()> {
        if let Some(bad) = hashes
            .iter()
            .find(|h| self.nodes.get(h).is_none_or(|n| n.locks == 0))
        {
            return Err(Error::NotLocked(*bad));
        }
        let now = self.tick();
        for hash in hashes {
            let node = self.nodes.get_mut(hash).expect("checked");
            node.locks -= 1;
            node.last_access = now;
        }
        Ok(())
    }

    /// Caches the chain `hashes[i] → pages[i]` (full pages of one sequence, from its first). New
    /// blocks take a reference on the given page. Blocks already cached count as just used, and
    /// when the given page is another copy of the block (a sequence that computed the block
    /// itself, not through a prefix hit) the cache moves to it: its reference on the old copy
    /// goes, freeing that page unless a sequence holds it. Keeping the old copy instead would hold
    /// two pages for one block while the sequence runs, and once the sequence's next block is
    /// cached below it, the old copy could not be evicted either. Returns how many blocks were
    /// new.
    pub fn insert(
        &mut self,
        pool: &mut PagePool,
        hashes: &[BlockHash],
        pages: &[PageId],
    ) -> Result<usize> {
        self.insert_after(pool, None, hashes, pages)
    }

    /// [`insert`](Self::insert) of the blocks that continue a chain after `parent`, a cached
    /// block (or `None` for a chain's first block): a growing sequence offers each newly filled
    /// page without walking, or touching, the blocks before it. The result and the events are
    /// those of inserting the whole chain, apart from the earlier blocks' last use.
    pub fn extend(
        &mut self,
        pool: &mut PagePool,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        pages: &[PageId],
    ) -> Result<usize> {
        if let Some(p) = parent {
            if !self.nodes.contains_key(&p) {
                return Err(Error::NotCached(p));
            }
        }
        self.insert_after(pool, parent, hashes, pages)
    }

    fn insert_after(
        &mut self,
        pool: &mut PagePool,
        mut parent: Option<BlockHash>,
        hashes: &[BlockHash],
        pages: &[PageId],
    ) -> Result<usize> {
        if hashes.len() != pages.len() {
            return Err(Error::HashPageMismatch {
                hashes: hashes.len(),
                pages: pages.len(),
            });
        }
        let now = self.tick();
        let mut stored: Vec<BlockHash> = Vec::new();
        let mut stored_parent = None;
        for (hash, page) in hashes.iter().zip(pages) {
            if let Some(node) = self.nodes.get_mut(hash) {
                node.last_access = now;
                if node.page != *page {
                    pool.retain(*page)?;
                    pool.release(node.page)?;
                    node.page = *page;
                }
            } else {
                pool.retain(*page)?;
                if let Some(p) = parent {
                    self.nodes.get_mut(&p).expect("parent cached").children += 1;
                }
                self.nodes.insert(
                    *hash,
                    Node {
                        page: *page,
                        parent,
                        children: 0,
                        locks: 0,
                        last_access: now,
                    },
                );
                if stored.is_empty() {
                    stored_parent = parent;
                }
                stored.push(*hash);
            }
            parent = Some(*hash);
        }
        let new = stored.len();
        if new > 0 {
            self.stats.inserted_blocks += new as u64;
            self.events.push(KvEventData::Stored {
                parent: stored_parent,
                blocks: stored,
            });
        }
        Ok(new)
    }

    fn evictable(&self, pool: &PagePool, node: &Node) -> bool {
        node.children == 0 && node.locks == 0 && pool.refcount(node.page).is_ok_and(|c| c == 1)
    }

    /// Evicts up to `pages` least-recently-used blocks whose pages nobody else holds, leaves
    /// first, and returns how many pages went back to the pool.
    pub fn evict(&mut self, pool: &mut PagePool, pages: usize) -> Result<usize> {
        if pages == 0 {
            return Ok(0);
        }
        self.stats.eviction_scans += 1;
        let mut heap: BinaryHeap<Reverse<(u64, BlockHash)>> = self
            .nodes
            .iter()
            .filter(|(_, n)| self.evictable(pool, n))
            .map(|(h, n)| Reverse((n.last_access, *h)))
            .collect();
        let mut removed = Vec::new();
        while removed.len() < pages {
            let Some(Reverse((_, hash))) = heap.pop() else {
                break;
            };
            let node = self.nodes.remove(&hash).expect("heap holds cached blocks");
            pool.release(node.page)?;
            removed.push(hash);
            if let Some(parent_hash) = node.parent {
                let parent = self.nodes.get_mut(&parent_hash).expect("parent cached");
                parent.children -= 1;
                let parent = parent.clone();
                if self.evictable(pool, &parent) {
                    heap.push(Reverse((parent.last_access, parent_hash)));
                }
            }
        }
        let freed = removed.len();
        if freed > 0 {
            self.stats.evicted_blocks += freed as u64;
            self.events.push(KvEventData::Removed { blocks: removed });
        }
        Ok(freed)
    }

    /// Takes the events not yet published.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        self.events.drain()
    }

    /// The events after `id` (the last one a consumer has seen), or `None` when the bounded
    /// buffer has dropped some of them (or `id` is not this cache's): the consumer then
    /// resynchronizes from a [`snapshot`](Self::snapshot). Costs what the events are, not what
    /// the cache holds.
    pub fn events_after(&self, id: u64) -> Option<Vec<KvEvent>> {
        self.events
            .after(id)
            .map(|events| events.cloned().collect())
    }

    /// The id of the last event (0 before any).
    pub fn last_event_id(&self) -> u64 {
        self.events.last_id()
    }

    /// Every cached block with its parent, parents first, and the last event id they reflect.
    pub fn snapshot(&self) -> KvSnapshot {
        KvSnapshot {
            last_event_id: self.events.last_id(),
            blocks: parents_first(self.nodes.iter().map(|(h, n)| (*h, n.parent))),
        }
    }

    /// Releases every cached page (the worker is shutting down or resetting). Fails, changing
    /// nothing, if any block is locked.
    pub fn clear(&mut self, pool: &mut PagePool) -> Result<()> {
        if let Some((hash, _)) = self.nodes.iter().find(|(_, n)| n.locks > 0) {
            return Err(Error::Locked(*hash));
        }
        let removed: Vec<BlockHash> = self.nodes.keys().copied().collect();
        for (_, node) in self.nodes.drain() {
            pool.release(node.page)?;
        }
        if !removed.is_empty() {
            self.stats.evicted_blocks += removed.len() as u64;
            self.events.push(KvEventData::Removed { blocks: removed });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
