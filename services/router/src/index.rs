//! The router's prefix index: which worker holds which prefix.
//!
//! Keys are the chained [`BlockHash`]es workers emit in their KV events, so one hash names a
//! whole prefix and a map from hash to holders *is* a radix tree over pages. The index keeps two
//! views that always agree:
//!
//! * `holders`: block hash → the [`WorkerSet`] of workers caching it (never an empty set: a block
//!   nobody holds is removed), for queries;
//! * per worker, the set of its blocks, so removing a worker, applying `Removed` events and
//!   diffing a snapshot touch only that worker's blocks.
//!
//! Invariant: `slot ∈ holders[h]` exactly when `h` is in `slot`'s block set, and only registered
//! slots appear anywhere.
//!
//! A query walks a prompt's hashes once with the set of still-matching workers shrinking: a
//! worker's count stops at its first miss, and the walk ends when no worker matches.
//! Each worker's event stream is followed by a `StreamState` ([`sync`]: ordering, gaps, restarts,
//! snapshot repair).

mod hasher;
pub mod sync;

use std::collections::{HashMap, HashSet};

use nibble_kvcache::{BlockHash, KvEvent, KvEventData, KvSnapshot};

use crate::slots::{WorkerSet, WorkerSlot, MAX_WORKERS};
use hasher::BuildBlockHasher;
use sync::{Life, StreamState, SyncReport};

/// Block hash → the workers holding it (never empty).
type Holders = HashMap<BlockHash, WorkerSet, BuildBlockHasher>;
/// One worker's blocks.
type BlockSet = HashSet<BlockHash, BuildBlockHasher>;

/// Events buffered per worker while a snapshot is awaited, by default.
pub const DEFAULT_MAX_BUFFERED_EVENTS: usize = 4096;

/// For each worker, how many leading blocks of a prompt it holds.
#[derive(Clone, PartialEq, Eq)]
pub struct PrefixDepths {
    depths: [u32; MAX_WORKERS],
}

impl PrefixDepths {
    /// Leading blocks of the prompt that `slot` holds (0 for slots outside the query).
    pub fn get(&self, slot: WorkerSlot) -> usize {
        self.depths[slot.index()] as usize
    }
}

impl std::fmt::Debug for PrefixDepths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nonzero = self
            .depths
            .iter()
            .enumerate()
            .filter(|(_, d)| **d > 0)
            .map(|(slot, d)| (slot, *d));
        f.debug_map().entries(nonzero).finish()
    }
}

/// One worker's blocks and its event-stream position.
#[derive(Debug)]
struct WorkerBlocks {
    blocks: BlockSet,
    stream: StreamState,
}

/// A slot the index does not track.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0} is not registered in the prefix index")]
pub struct UnknownSlot(pub WorkerSlot);

/// Which worker holds which prefix (see the module docs).
#[derive(Debug)]
pub struct PrefixIndex {
    holders: Holders,
    workers: Vec<Option<WorkerBlocks>>,
    registered: WorkerSet,
    max_buffered_events: usize,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_BUFFERED_EVENTS)
    }
}

impl PrefixIndex {
    /// An empty index; each worker buffers up to `max_buffered_events` events while it waits for
    /// a snapshot.
    pub fn new(max_buffered_events: usize) -> Self {
        Self {
            holders: HashMap::default(),
            workers: (0..MAX_WORKERS).map(|_| None).collect(),
            registered: WorkerSet::EMPTY,
            max_buffered_events,
        }
    }

    /// Assigns the lowest free slot to a new worker with no blocks; `None` when all
    /// [`MAX_WORKERS`] are taken.
    pub fn register(&mut self) -> Option<WorkerSlot> {
        let slot = self.registered.first_absent()?;
        self.registered.insert(slot);
        self.workers[slot.index()] = Some(WorkerBlocks {
            blocks: HashSet::default(),
            stream: StreamState::new(self.max_buffered_events),
        });
        Some(slot)
    }

    /// Forgets a worker and all its blocks, freeing its slot. Returns how many blocks it held
    /// (`None` if the slot was not registered).
    pub fn remove_worker(&mut self, slot: WorkerSlot) -> Option<usize> {
        let worker = self.workers[slot.index()].take()?;
        self.registered.remove(slot);
        for hash in &worker.blocks {
            unset_holder(&mut self.holders, *hash, slot);
        }
        Some(worker.blocks.len())
    }

    /// The registered slots.
    pub fn workers(&self) -> WorkerSet {
        self.registered
    }

    /// Distinct blocks held by any worker.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Blocks `slot` holds (0 when not registered).
    pub fn block_count(&self, slot: WorkerSlot) -> usize {
        self.worker(slot).map_or(0, |w| w.blocks.len())
    }

    /// The workers holding `hash`.
    pub fn holders(&self, hash: BlockHash) -> WorkerSet {
        self.holders.get(&hash).copied().unwrap_or_default()
    }

    /// Whether `slot`'s blocks wait on a snapshot after a gap.
    pub fn needs_snapshot(&self, slot: WorkerSlot) -> bool {
        self.worker(slot).is_some_and(|w| w.stream.needs_snapshot())
    }

    /// The id of the last event applied for `slot` (0 before any).
    pub fn last_event_id(&self, slot: WorkerSlot) -> Option<u64> {
        self.worker(slot).map(|w| w.stream.last_event_id())
    }

    /// Applies a batch of `slot`'s events from the cache life `instance_id`, in id order (see
    /// [`sync`] for gaps and restarts).
    pub fn apply_events(
        &mut self,
        slot: WorkerSlot,
        instance_id: u64,
        events: &[KvEvent],
    ) -> Result<SyncReport, UnknownSlot> {
        let worker = self.workers[slot.index()]
            .as_mut()
            .ok_or(UnknownSlot(slot))?;
        let life = worker.stream.begin(instance_id);
        if life != Life::Same {
            clear_blocks(&mut self.holders, worker, slot);
        }
        let WorkerBlocks { blocks, stream } = worker;
        let holders = &mut self.holders;
        let mut report = stream.feed(events, |data| apply(holders, blocks, slot, data));
        report.restarted = life == Life::Restarted;
        Ok(report)
    }

    /// Replaces `slot`'s blocks with a snapshot of its cache life `instance_id`, then replays the
    /// events buffered since the gap that follow the snapshot.
    pub fn apply_snapshot(
        &mut self,
        slot: WorkerSlot,
        instance_id: u64,
        snapshot: &KvSnapshot,
    ) -> Result<SyncReport, UnknownSlot> {
        let worker = self.workers[slot.index()]
            .as_mut()
            .ok_or(UnknownSlot(slot))?;
        let fresh: BlockSet = snapshot.blocks.iter().map(|(hash, _)| *hash).collect();
        for hash in worker.blocks.difference(&fresh) {
            unset_holder(&mut self.holders, *hash, slot);
        }
        for hash in fresh.difference(&worker.blocks) {
            self.holders.entry(*hash).or_default().insert(slot);
        }
        worker.blocks = fresh;

        let (buffered, life) = worker.stream.restore(instance_id, snapshot.last_event_id);
        let WorkerBlocks { blocks, stream } = worker;
        let holders = &mut self.holders;
        let mut report = stream.feed(&buffered, |data| apply(holders, blocks, slot, data));
        report.restarted = life == Life::Restarted;
        Ok(report)
    }

    /// For every worker in `candidates`, the number of leading `hashes` it holds: the walk stops
    /// at each worker's first miss, and ends once no candidate matches.
    pub fn prefix_depths(&self, hashes: &[BlockHash], candidates: WorkerSet) -> PrefixDepths {
        let mut depths = PrefixDepths {
            depths: [0; MAX_WORKERS],
        };
        let mut alive = candidates.intersection(self.registered);
        for (depth, hash) in hashes.iter().enumerate() {
            if alive.is_empty() {
                return depths;
            }
            let still = alive.intersection(self.holders(*hash));
            for slot in alive.difference(still) {
                depths.depths[slot.index()] = depth as u32;
            }
            alive = still;
        }
        for slot in alive {
            depths.depths[slot.index()] = hashes.len() as u32;
        }
        depths
    }

    fn worker(&self, slot: WorkerSlot) -> Option<&WorkerBlocks> {
        self.workers[slot.index()].as_ref()
    }
}

/// Applies one event's change to `slot`'s blocks and the holders map.
fn apply(holders: &mut Holders, blocks: &mut BlockSet, slot: WorkerSlot, data: &KvEventData) {
    match data {
        // The parent is not needed: a prompt's walk reaches a block only through its parent.
        KvEventData::Stored { blocks: stored, .. } => {
            for hash in stored {
                if blocks.insert(*hash) {
                    holders.entry(*hash).or_default().insert(slot);
                }
            }
        }
        KvEventData::Removed { blocks: removed } => {
            for hash in removed {
                if blocks.remove(hash) {
                    unset_holder(holders, *hash, slot);
                }
            }
        }
    }
}

/// Drops every block of `worker` (it restarted with an empty cache).
fn clear_blocks(holders: &mut Holders, worker: &mut WorkerBlocks, slot: WorkerSlot) {
    for hash in worker.blocks.drain() {
        unset_holder(holders, hash, slot);
    }
}

/// Removes `slot` from `hash`'s holders, and the entry once nobody holds it.
fn unset_holder(holders: &mut Holders, hash: BlockHash, slot: WorkerSlot) {
    if let Some(set) = holders.get_mut(&hash) {
        set.remove(slot);
        if set.is_empty() {
            holders.remove(&hash);
        }
    }
}

#[cfg(test)]
mod tests;
