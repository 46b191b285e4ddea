//! KV events: what a worker's prefix cache tells the router.
//!
//! Every change to the set of cached blocks is one [`KvEvent`] with an id one greater than the
//! last. A consumer that sees a gap in ids (it missed events, or the worker's bounded buffer
//! dropped them) asks for a [`KvSnapshot`] and continues from its `last_event_id`.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::BlockHash;

/// What happened to the cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEventData {
    /// Blocks became cached: a chain, each block the child of the one before it, the first the
    /// child of `parent` (`None` for a prompt's first block).
    Stored {
        parent: Option<BlockHash>,
        blocks: Vec<BlockHash>,
    },
    /// Blocks left the cache.
    Removed { blocks: Vec<BlockHash> },
}

/// One numbered change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// Monotonically increasing, starting at 1, without gaps at the source.
    pub id: u64,
    pub data: KvEventData,
}

/// The whole cached set at one moment, for gap repair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSnapshot {
    /// The id of the last event reflected in `blocks` (0 before any event).
    pub last_event_id: u64,
    /// Every cached block with its parent, parents before children.
    pub blocks: Vec<(BlockHash, Option<BlockHash>)>,
}

/// A bounded buffer of events waiting to be published. When full, the oldest are dropped; the
/// consumer notices the gap in ids and resynchronizes from a snapshot.
#[derive(Debug)]
pub(crate) struct EventLog {
    next_id: u64,
    buffer: VecDeque<KvEvent>,
    capacity: usize,
}

impl EventLog {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            next_id: 1,
            buffer: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    pub(crate) fn push(&mut self, data: KvEventData) {
        if self.buffer.len() == self.capacity {
            self.buffer.pop_front();
        }
        self.buffer.push_back(KvEvent {
            id: self.next_id,
            data,
        });
        self.next_id += 1;
    }

    pub(crate) fn last_id(&self) -> u64 {
        self.next_id - 1
    }

    pub(crate) fn drain(&mut self) -> Vec<KvEvent> {
        self.buffer.drain(..).collect()
    }

    /// The events after `id`, or `None` when the buffer no longer holds all of them (or `id`
    /// is not one of this log's).
    pub(crate) fn after(&self, id: u64) -> Option<impl Iterator<Item = &KvEvent>> {
        let oldest = self.buffer.front().map_or(self.next_id, |e| e.id);
        (id <= self.last_id() && id + 1 >= oldest)
            .then(|| self.buffer.iter().skip_while(move |e| e.id <= id))
    }
}

/// `blocks` (each with its parent) ordered parents before children, then by hash; a block whose
/// parent is not among them counts as a root. Each block's depth is found once, so a set of
/// long chains (a 32K-token prompt is 2,048 blocks deep) costs O(n), not O(n · depth).
pub fn parents_first(
    blocks: impl IntoIterator<Item = (BlockHash, Option<BlockHash>)>,
) -> Vec<(BlockHash, Option<BlockHash>)> {
    let parent: HashMap<BlockHash, Option<BlockHash>> = blocks.into_iter().collect();
    let mut depth: HashMap<BlockHash, usize> = HashMap::with_capacity(parent.len());
    let mut path = Vec::new();
    for &start in parent.keys() {
        // Walk up to a block whose depth is known (or past a root), then number the way down.
        let mut at = start;
        let mut next = loop {
            if let Some(d) = depth.get(&at) {
                break d + 1;
            }
            path.push(at);
            match parent[&at] {
                Some(p) if parent.contains_key(&p) => at = p,
                _ => break 0,
            }
        };
        for hash in path.drain(..).rev() {
            depth.insert(hash, next);
            next += 1;
        }
    }
    let mut ordered: Vec<_> = parent.iter().map(|(h, p)| (depth[h], *h, *p)).collect();
    ordered.sort_unstable();
    ordered.into_iter().map(|(_, h, p)| (h, p)).collect()
}
