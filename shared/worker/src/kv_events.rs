//! Publishing the prefix cache's changes as numbered [`KvEvent`]s (the domain type; the
//! `Worker` service puts them on the wire).
//!
//! The engine thread calls [`KvPublisher::publish`] after every step and command. When the
//! cache's counters moved, it forwards the cache's own events since the last publish
//! ([`RadixCache::events_after`](nibble_kvcache::RadixCache::events_after)), so a step costs what
//! changed, not what the cache holds (a pool of hundreds of thousands of pages publishes every
//! prompt block). Only when the cache's bounded event buffer has dropped some does it compare the
//! cache's snapshot with the set it last published and emit the difference: one `removed` event
//! for blocks that left, then `stored` events for new blocks grouped into parent-to-child chains.
//! Ids are this publisher's own, consecutive from 1 within one `instance_id`;
//! [`KvPublisher::snapshot`] reports exactly the published set with the last id, so a subscriber
//! that repairs a gap from it and continues with later events converges.

use std::collections::{HashMap, HashSet};
use std::time::{SystemTime, UNIX_EPOCH};

use nibble_engine::scheduler::State;
use nibble_kvcache::events::parents_first;
use nibble_kvcache::{BlockHash, KvEvent, KvEventData, KvSnapshot, RadixCache};
use tokio::sync::broadcast;

/// One publish's events, from one life (`instance_id`) of the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventBatch {
    pub instance_id: u64,
    pub events: Vec<KvEvent>,
}

/// The published set at one moment, from one life of the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheSnapshot {
    pub instance_id: u64,
    pub snapshot: KvSnapshot,
}

/// The engine thread's publishing state.
pub(crate) struct KvPublisher {
    sender: broadcast::Sender<KvEventBatch>,
    instance_id: u64,
    last_id: u64,
    /// Cache counters at the last publish: (inserted, evicted, len).
    signature: (u64, u64, usize),
    /// The last of the cache's own event ids the published set reflects.
    cache_event_id: u64,
    /// The published set: each block's parent.
    blocks: HashMap<BlockHash, Option<BlockHash>>,
}

impl KvPublisher {
    pub(crate) fn new(sender: broadcast::Sender<KvEventBatch>) -> Self {
        Self {
            sender,
            instance_id: new_instance_id(),
            last_id: 0,
            signature: (0, 0, 0),
            cache_event_id: 0,
            blocks: HashMap::new(),
        }
    }

    /// Publishes what changed in `state`'s prefix cache since the last call.
    pub(crate) fn publish(&mut self, state: &State) {
        self.publish_cache(&state.cache);
    }

    fn publish_cache(&mut self, cache: &RadixCache) {
        let stats = cache.stats();
        let signature = (stats.inserted_blocks, stats.evicted_blocks, cache.len());
        if signature == self.signature {
            return;
        }
        self.signature = signature;
        let events = match cache.events_after(self.cache_event_id) {
            Some(changes) => self.forward(changes),
            None => {
                let now = cache.snapshot().blocks;
                let events = self.diff(&now);
                self.blocks = now.into_iter().collect();
                events
            }
        };
        self.cache_event_id = cache.last_event_id();
        if !events.is_empty() {
            // No subscriber is not an error: the snapshot covers whoever comes later.
            let _ = self.sender.send(KvEventBatch {
                instance_id: self.instance_id,
                events,
            });
        }
    }

    /// The cache's `changes` applied to the published set, as this publisher's events.
    fn forward(&mut self, changes: Vec<KvEvent>) -> Vec<KvEvent> {
        let mut data = Vec::with_capacity(changes.len());
        for change in changes {
            match change.data {
                KvEventData::Stored { parent, blocks } => {
                    let mut above = parent;
                    for &hash in &blocks {
                        self.blocks.insert(hash, above);
                        above = Some(hash);
                    }
                    data.push(KvEventData::Stored { parent, blocks });
                }
                KvEventData::Removed { blocks } => {
                    let blocks: Vec<BlockHash> = blocks
                        .into_iter()
                        .filter(|h| self.blocks.remove(h).is_some())
                        .collect();
                    if !blocks.is_empty() {
                        data.push(KvEventData::Removed { blocks });
                    }
                }
            }
        }
        self.number(data)
    }

    /// The events that turn the published set into `now` (parents first).
    fn diff(&mut self, now: &[(BlockHash, Option<BlockHash>)]) -> Vec<KvEvent> {
        let old: HashSet<BlockHash> = self.blocks.keys().copied().collect();
        let new: HashSet<BlockHash> = now.iter().map(|(h, _)| *h).collect();
        let mut data = Vec::new();
        let mut removed: Vec<BlockHash> = old.difference(&new).copied().collect();
        removed.sort_unstable();
        if !removed.is_empty() {
            data.push(KvEventData::Removed { blocks: removed });
        }
        // `now` lists parents first, so a chain grows at its tail: (parent, blocks).
        let mut chains: Vec<(Option<BlockHash>, Vec<BlockHash>)> = Vec::new();
        let mut tails: HashMap<BlockHash, usize> = HashMap::new();
        for (hash, parent) in now.iter().filter(|(h, _)| !old.contains(h)) {
            match parent.and_then(|p| tails.remove(&p)) {
                Some(i) => {
                    chains[i].1.push(*hash);
                    tails.insert(*hash, i);
                }
                None => {
                    chains.push((*parent, vec![*hash]));
                    tails.insert(*hash, chains.len() - 1);
                }
            }
        }
        data.extend(
            chains
                .into_iter()
                .map(|(parent, blocks)| KvEventData::Stored { parent, blocks }),
        );
        self.number(data)
    }

    /// `data` as events with this publisher's next ids.
    fn number(&mut self, data: Vec<KvEventData>) -> Vec<KvEvent> {
        data.into_iter()
            .map(|data| {
                self.last_id += 1;
                KvEvent {
                    id: self.last_id,
                    data,
                }
            })
            .collect()
    }

    /// The published set and the last event id it reflects.
    pub(crate) fn snapshot(&self) -> KvCacheSnapshot {
        KvCacheSnapshot {
            instance_id: self.instance_id,
            snapshot: KvSnapshot {
                last_event_id: self.last_id,
                blocks: parents_first(self.blocks.iter().map(|(h, p)| (*h, *p))),
            },
        }
    }
}

/// An id for this life of the cache: the clock and the process id, mixed.
fn new_instance_id() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = nanos ^ (u64::from(std::process::id()) << 32);
    // splitmix64 finalizer
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_become_chains_and_removals() {
        let (tx, _) = broadcast::channel(4);
        let mut p = KvPublisher::new(tx);
        let b = |n| BlockHash(n);
        let first = vec![(b(1), None), (b(2), Some(b(1))), (b(3), Some(b(2)))];
        let events = p.diff(&first);
        p.blocks = first.into_iter().collect();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].id, 1);
        assert_eq!(
            events[0].data,
            KvEventData::Stored {
                parent: None,
                blocks: vec![b(1), b(2), b(3)]
            }
        );
        let second = vec![(b(1), None), (b(2), Some(b(1))), (b(4), Some(b(2)))];
        let events = p.diff(&second);
        p.blocks = second.into_iter().collect();
        assert_eq!(
            events.iter().map(|e| e.id).collect::<Vec<_>>(),
            vec![2, 3],
            "ids continue without gaps"
        );
        assert_eq!(events[0].data, KvEventData::Removed { blocks: vec![b(3)] });
        assert_eq!(
            events[1].data,
            KvEventData::Stored {
                parent: Some(b(2)),
                blocks: vec![b(4)]
            }
        );
        let snap = p.snapshot().snapshot;
        assert_eq!(snap.last_event_id, 3);
        assert_eq!(snap.blocks.len(), 3);
    }

    /// A subscriber's view: the set the events build, from a snapshot onwards.
    fn apply(set: &mut HashSet<BlockHash>, events: &[KvEvent]) {
        for event in events {
            match &event.data {
                KvEventData::Stored { blocks, .. } => set.extend(blocks),
                KvEventData::Removed { blocks } => blocks.iter().for_each(|h| {
                    set.remove(h);
                }),
            }
        }
    }

    #[test]
    fn a_subscriber_follows_the_cache_whether_events_are_forwarded_or_diffed() {
        use nibble_kvcache::{hash_blocks, PagePool, PageTable, PoolPlan};
        use nibble_kvfmt::{KvDtype, PageLayout};
        const PAGE: usize = 4;
        let layout = PageLayout::new(1, 1, 16, PAGE, KvDtype::Nvfp4).unwrap();
        let mut pool = PagePool::new(PoolPlan::for_pages(layout, 24).unwrap());
        // A buffer of 3 events: the long run below overflows it between publishes.
        let mut cache = RadixCache::new(3);
        let (tx, mut rx) = broadcast::channel(64);
        let mut p = KvPublisher::new(tx);
        let mut seen = HashSet::new();
        let mut last_id = 0;
        let serve = |cache: &mut RadixCache, pool: &mut PagePool, start: u32, len: u32| {
            let tokens: Vec<u32> = (start..start + len).collect();
            let hashes = hash_blocks(&tokens, PAGE);
            let mut table = PageTable::default();
            if pool.free_pages() < hashes.len() {
                cache.evict(pool, hashes.len() - pool.free_pages()).unwrap();
            }
            table.append(pool, tokens.len()).unwrap();
            cache
                .insert(pool, &hashes, &table.pages()[..hashes.len()])
                .unwrap();
            table.release(pool).unwrap();
        };
        // (first token, tokens, publish after): one prompt at a time, then three unpublished.
        let plan = [
            (0, 16, true),
            (100, 12, true),
            (0, 24, true),
            (200, 20, true),
        ];
        let burst = [(300, 16, false), (400, 16, false), (500, 16, true)];
        let mut before_burst = 0;
        for (start, len, publish) in plan.into_iter().chain(burst) {
            if start == burst[0].0 {
                before_burst = cache.last_event_id();
            }
            serve(&mut cache, &mut pool, start, len);
            if !publish {
                continue;
            }
            p.publish_cache(&cache);
            while let Ok(batch) = rx.try_recv() {
                for e in &batch.events {
                    assert_eq!(e.id, last_id + 1, "the publisher's ids have no gaps");
                    last_id = e.id;
                }
                apply(&mut seen, &batch.events);
            }
            let cached: HashSet<BlockHash> =
                cache.snapshot().blocks.iter().map(|(h, _)| *h).collect();
            assert_eq!(seen, cached, "after serving from {start}");
            let published = p.snapshot().snapshot;
            assert_eq!(published.last_event_id, last_id);
            let mut order = HashSet::new();
            for (h, parent) in &published.blocks {
                assert!(parent.is_none_or(|q| order.contains(&q)), "parents first");
                order.insert(*h);
            }
            assert_eq!(order, cached);
        }
        assert!(cache.stats().evicted_blocks > 0, "the run evicted");
        assert!(
            cache.events_after(before_burst).is_none(),
            "the burst overflowed the buffer, so its publish took the snapshot's difference"
        );
    }
}
