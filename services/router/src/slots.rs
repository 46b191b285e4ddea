//! Worker slots and sets of them.
//!
//! The router numbers the workers it knows with small integers, [`WorkerSlot`]s, assigned on
//! registration and reused after a worker leaves. A [`WorkerSet`] is a bitmask over slots (one
//! `u128`), so the prefix index stores one per cached block and a prefix walk narrows the set of
//! workers still matching with one `AND` per block.
//!
//! Invariant: a slot is always below [`MAX_WORKERS`]; a set never has a bit at or above it.

use std::fmt;

/// The most workers (prefill and decode together) one router tracks.
pub const MAX_WORKERS: usize = 128;

/// A worker's number in the router, below [`MAX_WORKERS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerSlot(u8);

impl WorkerSlot {
    /// The slot numbered `index`, if it is below [`MAX_WORKERS`].
    pub fn new(index: usize) -> Option<Self> {
        u8::try_from(index)
            .ok()
            .filter(|_| index < MAX_WORKERS)
            .map(Self)
    }

    /// The slot's number, usable as an index into per-slot arrays.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    fn bit(self) -> u128 {
        1u128 << self.0
    }
}

impl fmt::Display for WorkerSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {}", self.0)
    }
}

/// A set of worker slots.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct WorkerSet(u128);

impl WorkerSet {
    /// No workers.
    pub const EMPTY: WorkerSet = WorkerSet(0);

    /// The set holding only `slot`.
    pub fn only(slot: WorkerSlot) -> Self {
        Self(slot.bit())
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    pub fn contains(self, slot: WorkerSlot) -> bool {
        self.0 & slot.bit() != 0
    }

    pub fn insert(&mut self, slot: WorkerSlot) {
        self.0 |= slot.bit();
    }

    pub fn remove(&mut self, slot: WorkerSlot) {
        self.0 &= !slot.bit();
    }

    /// Slots in both sets.
    #[must_use]
    pub fn intersection(self, other: WorkerSet) -> WorkerSet {
        WorkerSet(self.0 & other.0)
    }

    /// Slots in `self` but not in `other`.
    #[must_use]
    pub fn difference(self, other: WorkerSet) -> WorkerSet {
        WorkerSet(self.0 & !other.0)
    }

    /// Slots in either set.
    #[must_use]
    pub fn union(self, other: WorkerSet) -> WorkerSet {
        WorkerSet(self.0 | other.0)
    }

    /// The lowest slot not in the set, if any is left.
    pub fn first_absent(self) -> Option<WorkerSlot> {
        WorkerSlot::new((!self.0).trailing_zeros() as usize)
    }

    /// The slots in ascending order.
    pub fn iter(self) -> Slots {
        Slots(self.0)
    }
}

impl FromIterator<WorkerSlot> for WorkerSet {
    fn from_iter<I: IntoIterator<Item = WorkerSlot>>(iter: I) -> Self {
        let mut set = WorkerSet::EMPTY;
        for slot in iter {
            set.insert(slot);
        }
        set
    }
}

impl IntoIterator for WorkerSet {
    type Item = WorkerSlot;
    type IntoIter = Slots;

    fn into_iter(self) -> Slots {
        self.iter()
    }
}

impl fmt::Debug for WorkerSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter().map(|s| s.0)).finish()
    }
}

/// The slots of a [`WorkerSet`], lowest first.
#[derive(Debug, Clone)]
pub struct Slots(u128);

impl Iterator for Slots {
    type Item = WorkerSlot;

    fn next(&mut self) -> Option<WorkerSlot> {
        if self.0 == 0 {
            return None;
        }
        let index = self.0.trailing_zeros() as u8;
        self.0 &= self.0 - 1;
        Some(WorkerSlot(index))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.0.count_ones() as usize;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Slots {}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(i: usize) -> WorkerSlot {
        WorkerSlot::new(i).unwrap()
    }

    #[test]
    fn slots_are_bounded() {
        assert!(WorkerSlot::new(MAX_WORKERS - 1).is_some());
        assert!(WorkerSlot::new(MAX_WORKERS).is_none());
    }

    #[test]
    fn set_operations() {
        let a: WorkerSet = [slot(0), slot(5), slot(127)].into_iter().collect();
        let b: WorkerSet = [slot(5), slot(6)].into_iter().collect();
        assert_eq!(a.len(), 3);
        assert!(a.contains(slot(127)) && !a.contains(slot(6)));
        assert_eq!(a.intersection(b).iter().collect::<Vec<_>>(), [slot(5)]);
        assert_eq!(
            a.difference(b).iter().collect::<Vec<_>>(),
            [slot(0), slot(127)]
        );
        assert_eq!(a.union(b).len(), 4);
        let mut c = a;
        c.remove(slot(0));
        assert_eq!(c.first_absent(), Some(slot(0)));
        assert_eq!(a.first_absent(), Some(slot(1)));
        assert_eq!(format!("{a:?}"), "{0, 5, 127}");
    }

    #[test]
    fn full_set_has_no_free_slot() {
        let full: WorkerSet = (0..MAX_WORKERS).map(slot).collect();
        assert_eq!(full.len(), MAX_WORKERS);
        assert_eq!(full.first_absent(), None);
        assert_eq!(full.iter().len(), MAX_WORKERS);
    }
}
