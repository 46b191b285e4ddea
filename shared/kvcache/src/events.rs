//! KV events: what a worker's prefix cache tells the router.
//!
//! Every change to the set of cached blocks is one [`KvEvent`] with an id one greater than the
//! last. A consumer that sees a gap in ids (it missed events, or the worker's bounded buffer
//! dropped them) asks for a [`KvSnapshot`] and continues from its `last_event_id`.

use std::collections::VecDeque;

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
}
