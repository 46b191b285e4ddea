//! Keeping up with one worker's KV-event stream: ordering, gaps, restarts and snapshot repair.
//!
//! `StreamState` decides, for each incoming event, whether it is applied, skipped (already
//! reflected) or reveals a gap; it does not touch the index itself. Its rules:
//!
//! * A worker's cache has *lives*, named by an instance id. A life starts with an empty cache and
//!   event ids counting from 1 without gaps, so the events of a life from id 1 on are its whole
//!   history. On first contact, and when the instance id changes (the worker restarted), the
//!   worker's blocks are dropped and the stream is expected to continue at id 1; anything else is
//!   a gap.
//! * Events with an id at or below the last applied one are skipped (re-delivery after a
//!   snapshot). The next id applies. A larger id is a gap: the stream stops applying, reports that
//!   a snapshot is needed once, and buffers (bounded, oldest dropped) what arrives until the
//!   snapshot does.
//! * A snapshot replaces the worker's blocks and sets the last applied id; buffered events of the
//!   same life are then replayed under the same rules, so a snapshot older than the buffer's
//!   start, or a buffer that overflowed, reports the next gap.

use std::collections::VecDeque;

use nibble_kvcache::{KvEvent, KvEventData};

/// Events a worker sent after its last applied one and before the one that arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    /// The id that should have come next.
    pub expected: u64,
    /// The id that came.
    pub got: u64,
}

/// Where a worker's stream stands after a batch or a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncStatus {
    /// Every event so far is applied; the index is exact for this worker.
    InSync,
    /// Events are missing: ask the worker for a snapshot now (reported once per gap).
    SnapshotNeeded(Gap),
    /// A snapshot was already asked for; the batch was buffered for replay after it.
    AwaitingSnapshot,
}

impl SyncStatus {
    /// Whether the worker's blocks in the index wait on a snapshot.
    pub fn needs_snapshot(self) -> bool {
        !matches!(self, SyncStatus::InSync)
    }
}

/// What applying a batch or a snapshot did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncReport {
    /// Events applied to the index.
    pub applied: usize,
    /// Events skipped because they were already reflected.
    pub skipped: usize,
    /// Whether the worker restarted (a new instance id): its old blocks were dropped.
    pub restarted: bool,
    /// Where the stream stands now.
    pub status: SyncStatus,
}

/// A gap was seen; events wait here for the snapshot.
#[derive(Debug)]
struct Awaiting {
    buffer: VecDeque<KvEvent>,
}

/// The event-stream position of one worker.
#[derive(Debug)]
pub(crate) struct StreamState {
    instance: Option<u64>,
    last_event_id: u64,
    awaiting: Option<Awaiting>,
    max_buffered: usize,
}

/// What [`StreamState::begin`] found about the batch's instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Life {
    /// The life the stream was following.
    Same,
    /// The first life seen for this worker.
    First,
    /// A new life: the worker restarted.
    Restarted,
}

impl StreamState {
    pub(crate) fn new(max_buffered: usize) -> Self {
        Self {
            instance: None,
            last_event_id: 0,
            awaiting: None,
            max_buffered: max_buffered.max(1),
        }
    }

    pub(crate) fn needs_snapshot(&self) -> bool {
        self.awaiting.is_some()
    }

    pub(crate) fn last_event_id(&self) -> u64 {
        self.last_event_id
    }

    /// Enters life `instance`. On [`Life::First`] or [`Life::Restarted`] the caller drops the
    /// worker's blocks: the stream now expects id 1.
    pub(crate) fn begin(&mut self, instance: u64) -> Life {
        let life = match self.instance {
            Some(current) if current == instance => return Life::Same,
            Some(_) => Life::Restarted,
            None => Life::First,
        };
        self.instance = Some(instance);
        self.last_event_id = 0;
        self.awaiting = None;
        life
    }

    /// Feeds a batch of the current life, calling `apply` for each event to apply, in order.
    pub(crate) fn feed(
        &mut self,
        events: &[KvEvent],
        mut apply: impl FnMut(&KvEventData),
    ) -> SyncReport {
        let mut report = SyncReport {
            applied: 0,
            skipped: 0,
            restarted: false,
            status: SyncStatus::InSync,
        };
        if let Some(awaiting) = &mut self.awaiting {
            for event in events {
                push_bounded(&mut awaiting.buffer, event.clone(), self.max_buffered);
            }
            report.status = SyncStatus::AwaitingSnapshot;
            return report;
        }
        for (i, event) in events.iter().enumerate() {
            if event.id <= self.last_event_id {
                report.skipped += 1;
            } else if event.id == self.last_event_id + 1 {
                apply(&event.data);
                self.last_event_id = event.id;
                report.applied += 1;
            } else {
                let gap = Gap {
                    expected: self.last_event_id + 1,
                    got: event.id,
                };
                let mut buffer = VecDeque::new();
                for event in &events[i..] {
                    push_bounded(&mut buffer, event.clone(), self.max_buffered);
                }
                self.awaiting = Some(Awaiting { buffer });
                report.status = SyncStatus::SnapshotNeeded(gap);
                return report;
            }
        }
        report
    }

    /// A snapshot of life `instance` reflecting events up to `last_event_id` was applied (the
    /// caller replaced the worker's blocks). Returns the buffered events to replay with
    /// [`feed`](Self::feed), and whether this snapshot started a new life.
    pub(crate) fn restore(&mut self, instance: u64, last_event_id: u64) -> (Vec<KvEvent>, Life) {
        let life = match self.instance {
            Some(current) if current == instance => Life::Same,
            Some(_) => Life::Restarted,
            None => Life::First,
        };
        // Events buffered from another life describe a cache this snapshot does not.
        let buffered = match (self.awaiting.take(), life) {
            (Some(awaiting), Life::Same) => awaiting.buffer.into(),
            _ => Vec::new(),
        };
        self.instance = Some(instance);
        self.last_event_id = last_event_id;
        (buffered, life)
    }
}

fn push_bounded(buffer: &mut VecDeque<KvEvent>, event: KvEvent, max: usize) {
    if buffer.len() == max {
        buffer.pop_front();
    }
    buffer.push_back(event);
}
