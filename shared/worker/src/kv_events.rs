//! Publishing the prefix cache's changes as numbered [`KvEvent`]s (the domain type; the
//! `Worker` service puts them on the wire).
//!
//! The engine thread calls [`KvPublisher::publish`] after every step and command. When the
//! cache's counters moved, it compares the cache's snapshot with the set it last published and
//! emits the difference: one `removed` event for blocks that left, then `stored` events for new
//! blocks grouped into parent-to-child chains. Ids are this publisher's own, consecutive from 1
//! within one `instance_id`; [`KvPublisher::snapshot`] reports exactly the published set with the
//! last id, so a subscriber that repairs a gap from it and continues with later events converges.

use std::collections::{HashMap, HashSet};
use std::time::{SystemTime, UNIX_EPOCH};

use nibble_engine::scheduler::State;
use nibble_kvcache::{BlockHash, KvEvent, KvEventData, KvSnapshot};
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
    /// The published set, parents before children.
    blocks: Vec<(BlockHash, Option<BlockHash>)>,
}

impl KvPublisher {
    pub(crate) fn new(sender: broadcast::Sender<KvEventBatch>) -> Self {
        Self {
            sender,
            instance_id: new_instance_id(),
            last_id: 0,
            signature: (0, 0, 0),
            blocks: Vec::new(),
        }
    }

    /// Publishes what changed in `state`'s prefix cache since the last call.
    pub(crate) fn publish(&mut self, state: &State) {
        let stats = state.cache.stats();
        let signature = (
            stats.inserted_blocks,
            stats.evicted_blocks,
            state.cache.len(),
        );
        if signature == self.signature {
            return;
        }
        self.signature = signature;
        let now = state.cache.snapshot().blocks;
        let events = self.diff(&now);
        self.blocks = now;
        if !events.is_empty() {
            // No subscriber is not an error: the snapshot covers whoever comes later.
            let _ = self.sender.send(KvEventBatch {
                instance_id: self.instance_id,
                events,
            });
        }
    }

    /// The events that turn the published set into `now`.
    fn diff(&mut self, now: &[(BlockHash, Option<BlockHash>)]) -> Vec<KvEvent> {
        let old: HashSet<BlockHash> = self.blocks.iter().map(|(h, _)| *h).collect();
        let new: HashSet<BlockHash> = now.iter().map(|(h, _)| *h).collect();
        let mut data = Vec::new();
        let removed: Vec<BlockHash> = self
            .blocks
            .iter()
            .filter(|(h, _)| !new.contains(h))
            .map(|(h, _)| *h)
            .collect();
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
                blocks: self.blocks.clone(),
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
        p.blocks = first;
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
        p.blocks = second;
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
}
