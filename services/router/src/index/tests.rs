use nibble_kvcache::hash_blocks;

use super::sync::{Gap, SyncStatus};
use super::*;

const INSTANCE: u64 = 0xfeed;

fn stored(id: u64, parent: Option<BlockHash>, blocks: &[BlockHash]) -> KvEvent {
    KvEvent {
        id,
        data: KvEventData::Stored {
            parent,
            blocks: blocks.to_vec(),
        },
    }
}

fn removed(id: u64, blocks: &[BlockHash]) -> KvEvent {
    KvEvent {
        id,
        data: KvEventData::Removed {
            blocks: blocks.to_vec(),
        },
    }
}

/// Chained hashes of a prompt of `pages` full pages of 16 tokens starting at token `start`.
fn chain(start: u32, pages: usize) -> Vec<BlockHash> {
    let tokens: Vec<u32> = (start..start + 16 * pages as u32).collect();
    hash_blocks(&tokens, 16)
}

/// The two views of the index agree (the module invariant).
fn check_invariants(index: &PrefixIndex) {
    let mut from_workers: HashMap<BlockHash, WorkerSet> = HashMap::new();
    for slot in index.workers() {
        let worker = index.worker(slot).expect("registered slots have blocks");
        for hash in &worker.blocks {
            from_workers.entry(*hash).or_default().insert(slot);
        }
    }
    let from_holders: HashMap<BlockHash, WorkerSet> =
        index.holders.iter().map(|(h, s)| (*h, *s)).collect();
    assert_eq!(from_holders, from_workers);
    assert!(index.holders.values().all(|s| !s.is_empty()));
}

fn in_sync(applied: usize) -> SyncReport {
    SyncReport {
        applied,
        skipped: 0,
        restarted: false,
        status: SyncStatus::InSync,
    }
}

#[test]
fn stored_and_removed_events_apply_in_order() {
    let mut index = PrefixIndex::default();
    let w = index.register().unwrap();
    let h = chain(0, 4);
    let report = index
        .apply_events(
            w,
            INSTANCE,
            &[
                stored(1, None, &h[..2]),
                stored(2, Some(h[1]), &h[2..]),
                removed(3, &h[3..]),
            ],
        )
        .unwrap();
    assert_eq!(report, in_sync(3));
    assert_eq!(index.block_count(w), 3);
    assert_eq!(index.len(), 3);
    assert_eq!(index.holders(h[3]), WorkerSet::EMPTY);
    assert_eq!(index.last_event_id(w), Some(3));
    check_invariants(&index);
}

#[test]
fn redelivered_events_are_skipped() {
    let mut index = PrefixIndex::default();
    let w = index.register().unwrap();
    let h = chain(0, 2);
    index
        .apply_events(w, INSTANCE, &[stored(1, None, &h)])
        .unwrap();
    let report = index
        .apply_events(w, INSTANCE, &[stored(1, None, &h), removed(2, &h[1..])])
        .unwrap();
    assert_eq!((report.applied, report.skipped), (1, 1));
    assert_eq!(index.block_count(w), 1);
}

#[test]
fn a_gap_asks_for_one_snapshot_and_buffers_until_it_comes() {
    let mut index = PrefixIndex::default();
    let w = index.register().unwrap();
    let h = chain(0, 8);
    index
        .apply_events(w, INSTANCE, &[stored(1, None, &h[..1])])
        .unwrap();

    // Events 2 and 3 are lost.
    let report = index
        .apply_events(w, INSTANCE, &[stored(4, Some(h[2]), &h[3..4])])
        .unwrap();
    assert_eq!(
        report.status,
        SyncStatus::SnapshotNeeded(Gap {
            expected: 2,
            got: 4
        })
    );
    assert_eq!(report.applied, 0);
    assert!(index.needs_snapshot(w));
    // Nothing after the gap is applied before the snapshot.
    assert_eq!(index.block_count(w), 1);

    let report = index
        .apply_events(w, INSTANCE, &[stored(5, Some(h[3]), &h[4..5])])
        .unwrap();
    assert_eq!(report.status, SyncStatus::AwaitingSnapshot);
    assert!(report.status.needs_snapshot());

    // The snapshot reflects events up to 3; the buffered 4 and 5 are replayed after it.
    let snapshot = KvSnapshot {
        last_event_id: 3,
        blocks: vec![(h[0], None), (h[1], Some(h[0])), (h[2], Some(h[1]))],
    };
    let report = index.apply_snapshot(w, INSTANCE, &snapshot).unwrap();
    assert_eq!(report, in_sync(2));
    assert!(!index.needs_snapshot(w));
    assert_eq!(index.block_count(w), 5);
    assert_eq!(index.prefix_depths(&h, index.workers()).get(w), 5);
    assert_eq!(index.last_event_id(w), Some(5));
    check_invariants(&index);

    // The stream continues from the replayed events.
    let report = index
        .apply_events(w, INSTANCE, &[removed(6, &h[4..5])])
        .unwrap();
    assert_eq!(report, in_sync(1));
}

#[test]
fn a_snapshot_newer_than_the_buffer_skips_what_it_reflects() {
    let mut index = PrefixIndex::default();
    let w = index.register().unwrap();
    let h = chain(0, 4);
    index
        .apply_events(w, INSTANCE, &[stored(3, None, &h[..1])])
        .unwrap();
    index
        .apply_events(w, INSTANCE, &[stored(4, Some(h[0]), &h[1..2])])
        .unwrap();
    let snapshot = KvSnapshot {
        last_event_id: 4,
        blocks: vec![(h[0], None), (h[1], Some(h[0]))],
    };
    let report = index.apply_snapshot(w, INSTANCE, &snapshot).unwrap();
    assert_eq!((report.applied, report.skipped), (0, 2));
    assert_eq!(report.status, SyncStatus::InSync);
    assert_eq!(index.block_count(w), 2);
}

#[test]
fn a_snapshot_older_than_the_buffer_reports_the_next_gap() {
    let mut index = PrefixIndex::default();
    let w = index.register().unwrap();
    let h = chain(0, 4);
    index
        .apply_events(w, INSTANCE, &[stored(9, None, &h[..1])])
        .unwrap();
    let stale = KvSnapshot {
        last_event_id: 5,
        blocks: vec![],
    };
    let report = index.apply_snapshot(w, INSTANCE, &stale).unwrap();
    assert_eq!(
        report.status,
        SyncStatus::SnapshotNeeded(Gap {
            expected: 6,
            got: 9
        })
    );
    assert!(index.needs_snapshot(w));
}

#[test]
fn an_overflowing_buffer_drops_the_oldest_and_repair_finds_the_hole() {
    let mut index = PrefixIndex::new(2);
    let w = index.register().unwrap();
    let h = chain(0, 8);
    index
        .apply_events(w, INSTANCE, &[stored(2, None, &h[..1])])
        .unwrap();
    let later: Vec<KvEvent> = (3..=5)
        .map(|id| stored(id, None, &h[id as usize..id as usize + 1]))
        .collect();
    index.apply_events(w, INSTANCE, &later).unwrap();
    // The buffer kept 4 and 5; a snapshot at 2 cannot bridge to 4.
    let snapshot = KvSnapshot {
        last_event_id: 2,
        blocks: vec![(h[0], None)],
    };
    let report = index.apply_snapshot(w, INSTANCE, &snapshot).unwrap();
    assert_eq!(
        report.status,
        SyncStatus::SnapshotNeeded(Gap {
            expected: 3,
            got: 4
        })
    );
}

#[test]
fn a_new_instance_drops_the_old_blocks() {
    let mut index = PrefixIndex::default();
    let w = index.register().unwrap();
    let h = chain(0, 4);
    index
        .apply_events(w, INSTANCE, &[stored(1, None, &h)])
        .unwrap();

    // The worker restarted and its new life's stream starts at 1: nothing is missing.
    let report = index
        .apply_events(w, INSTANCE + 1, &[stored(1, None, &h[..1])])
        .unwrap();
    assert!(report.restarted);
    assert_eq!(report.status, SyncStatus::InSync);
    assert_eq!(index.block_count(w), 1);
    check_invariants(&index);

    // Restarted again, but the first event seen is 7: events 1..=6 of the new life are missing.
    let report = index
        .apply_events(w, INSTANCE + 2, &[stored(7, None, &h[..1])])
        .unwrap();
    assert!(report.restarted);
    assert_eq!(
        report.status,
        SyncStatus::SnapshotNeeded(Gap {
            expected: 1,
            got: 7
        })
    );
    assert_eq!(index.block_count(w), 0, "the old life's blocks are gone");
    check_invariants(&index);
}

#[test]
fn first_contact_mid_stream_needs_a_snapshot() {
    let mut index = PrefixIndex::default();
    let w = index.register().unwrap();
    let h = chain(0, 2);
    let report = index
        .apply_events(w, INSTANCE, &[stored(40, None, &h)])
        .unwrap();
    assert!(!report.restarted);
    assert_eq!(
        report.status,
        SyncStatus::SnapshotNeeded(Gap {
            expected: 1,
            got: 40
        })
    );
}

#[test]
fn a_snapshot_of_a_new_life_discards_the_old_buffer() {
    let mut index = PrefixIndex::default();
    let w = index.register().unwrap();
    let h = chain(0, 4);
    index
        .apply_events(w, INSTANCE, &[stored(5, None, &h[..1])])
        .unwrap();
    let snapshot = KvSnapshot {
        last_event_id: 2,
        blocks: vec![(h[1], None)],
    };
    let report = index.apply_snapshot(w, INSTANCE + 1, &snapshot).unwrap();
    assert_eq!(
        report,
        SyncReport {
            restarted: true,
            ..in_sync(0)
        }
    );
    assert_eq!(index.holders(h[0]), WorkerSet::EMPTY);
    assert_eq!(index.holders(h[1]), WorkerSet::only(w));
    // The new life continues at 3.
    let report = index
        .apply_events(w, INSTANCE + 1, &[removed(3, &h[1..2])])
        .unwrap();
    assert_eq!(report, in_sync(1));
    assert!(index.is_empty());
}

#[test]
fn snapshot_replaces_blocks_and_keeps_other_workers() {
    let mut index = PrefixIndex::default();
    let a = index.register().unwrap();
    let b = index.register().unwrap();
    let h = chain(0, 6);
    index
        .apply_events(a, INSTANCE, &[stored(1, None, &h[..4])])
        .unwrap();
    index
        .apply_events(b, INSTANCE, &[stored(1, None, &h[..2])])
        .unwrap();
    let snapshot = KvSnapshot {
        last_event_id: 10,
        blocks: (1..6).map(|i| (h[i], Some(h[i - 1]))).collect(),
    };
    index.apply_snapshot(a, INSTANCE, &snapshot).unwrap();
    assert_eq!(index.holders(h[0]), WorkerSet::only(b));
    assert_eq!(index.block_count(a), 5);
    assert_eq!(index.len(), 6);
    check_invariants(&index);
}

#[test]
fn removing_a_worker_frees_its_blocks_and_slot() {
    let mut index = PrefixIndex::default();
    let a = index.register().unwrap();
    let b = index.register().unwrap();
    let h = chain(0, 3);
    index
        .apply_events(a, INSTANCE, &[stored(1, None, &h)])
        .unwrap();
    index
        .apply_events(b, INSTANCE, &[stored(1, None, &h[..1])])
        .unwrap();
    assert_eq!(index.remove_worker(a), Some(3));
    assert_eq!(index.remove_worker(a), None);
    assert_eq!(index.len(), 1);
    assert_eq!(index.holders(h[0]), WorkerSet::only(b));
    check_invariants(&index);
    assert_eq!(
        index.apply_events(a, INSTANCE, &[]).unwrap_err(),
        UnknownSlot(a)
    );

    // The slot is reused, empty.
    let c = index.register().unwrap();
    assert_eq!(c, a);
    assert_eq!(index.block_count(c), 0);
    assert_eq!(index.prefix_depths(&h, index.workers()).get(c), 0);
}

#[test]
fn prefix_depths_stop_at_each_workers_first_miss() {
    let mut index = PrefixIndex::default();
    let [a, b, c, d] = [(); 4].map(|_| index.register().unwrap());
    let h = chain(0, 8);
    let other = chain(1000, 8);
    index
        .apply_events(a, INSTANCE, &[stored(1, None, &h)])
        .unwrap();
    index
        .apply_events(b, INSTANCE, &[stored(1, None, &h[..3])])
        .unwrap();
    // c holds blocks 0, 1 and 3 (block 2 evicted): only the first two count.
    index
        .apply_events(
            c,
            INSTANCE,
            &[stored(1, None, &h[..4]), removed(2, &h[2..3])],
        )
        .unwrap();
    index
        .apply_events(d, INSTANCE, &[stored(1, None, &other)])
        .unwrap();

    let depths = index.prefix_depths(&h, index.workers());
    assert_eq!(
        [a, b, c, d].map(|s| depths.get(s)),
        [8, 3, 2, 0],
        "{depths:?}"
    );
    // Only candidates are reported.
    let depths = index.prefix_depths(&h, WorkerSet::only(b));
    assert_eq!([a, b].map(|s| depths.get(s)), [0, 3]);
    // A prompt sharing the first five blocks, then diverging.
    let mut fork = h[..5].to_vec();
    fork.extend(chain(5000, 3));
    let depths = index.prefix_depths(&fork, index.workers());
    assert_eq!([a, b, c, d].map(|s| depths.get(s)), [5, 3, 2, 0]);
    // An empty prompt matches nothing.
    assert_eq!(index.prefix_depths(&[], index.workers()).get(a), 0);
}

#[test]
fn every_slot_can_be_used() {
    let mut index = PrefixIndex::default();
    let slots: Vec<WorkerSlot> = (0..MAX_WORKERS)
        .map(|_| index.register().unwrap())
        .collect();
    assert!(index.register().is_none());
    let h = chain(0, 2);
    let last = slots[MAX_WORKERS - 1];
    index
        .apply_events(last, INSTANCE, &[stored(1, None, &h)])
        .unwrap();
    assert_eq!(index.prefix_depths(&h, index.workers()).get(last), 2);
    assert_eq!(index.prefix_depths(&h, index.workers()).get(slots[0]), 0);
}
