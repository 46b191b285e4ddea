//! Staging buffers: a request's pages back to back, as a device link sends and receives them,
//! and the [`StagingPool`] that keeps them for the next transfer.
//!
//! A buffer has a *capacity* (its allocation) and a *length* (the bytes of the transfer it holds
//! now). Buffers are allocated uninitialized and never cleared: a transfer writes `..len` (the
//! gather on the sender, the receive on the receiver) before anything reads it. The pool hands
//! out the smallest idle buffer that fits, allocates a new one rounded up to a size class when
//! none does, and keeps what comes back while the idle bytes stay within its bound.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use nibble_cuda::DeviceStaging;

use crate::Result;

/// A request's pages, contiguous, in the order of the transfer: in device memory on a CUDA
/// worker, in host memory on a CPU worker. Its length is the transfer's bytes; the allocation
/// behind it may be larger ([`capacity`](Self::capacity)).
pub enum Staging {
    Host(Vec<u8>),
    Device(DeviceStaging),
}

/// A backend's staging buffer (`Backend::Staging`) as the links carry it: host bytes for the
/// CPU backend, a device buffer for the CUDA backend.
pub trait Stageable: Send + Sized + 'static {
    fn into_staging(self) -> Staging;
    /// The backend's buffer from a link's; the other kind comes back as it was.
    fn from_staging(staging: Staging) -> std::result::Result<Self, Staging>;
}

impl Stageable for Vec<u8> {
    fn into_staging(self) -> Staging {
        Staging::Host(self)
    }

    fn from_staging(staging: Staging) -> std::result::Result<Self, Staging> {
        match staging {
            Staging::Host(bytes) => Ok(bytes),
            other => Err(other),
        }
    }
}

impl Stageable for DeviceStaging {
    fn into_staging(self) -> Staging {
        Staging::Device(self)
    }

    fn from_staging(staging: Staging) -> std::result::Result<Self, Staging> {
        match staging {
            Staging::Device(buf) => Ok(buf),
            other => Err(other),
        }
    }
}

impl Staging {
    /// A device buffer holding all of `buf`.
    pub fn device(buf: CudaSlice<u8>) -> Self {
        Staging::Device(DeviceStaging::from_slice(buf))
    }

    /// Bytes of the transfer it holds.
    pub fn len(&self) -> usize {
        match self {
            Staging::Host(v) => v.len(),
            Staging::Device(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        match self {
            Staging::Host(v) => v.capacity(),
            Staging::Device(d) => d.capacity(),
        }
    }
}

/// Allocates a staging buffer of at least the given capacity (uninitialized on a device).
pub type Allocate = Arc<dyn Fn(usize) -> Result<Staging> + Send + Sync>;

/// What a [`StagingPool`] did so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Buffers allocated (a buffer reused is not counted again).
    pub allocations: u64,
    /// Takes served by an idle buffer.
    pub reuses: u64,
    /// Idle buffers and their bytes (capacities), at most the pool's bound.
    pub idle_buffers: usize,
    pub idle_bytes: usize,
    /// Bytes (capacities) of buffers taken and not yet given back or dropped.
    pub lent_bytes: usize,
}

/// Staging buffers kept for reuse (see the module header). Shared by every pair of a worker, on
/// both sides of a transfer.
pub struct StagingPool {
    allocate: Allocate,
    max_idle_bytes: usize,
    state: Mutex<Idle>,
    allocations: AtomicU64,
    reuses: AtomicU64,
}

#[derive(Default)]
struct Idle {
    /// Idle buffers, ordered by capacity.
    buffers: Vec<Staging>,
    bytes: usize,
    lent: usize,
}

impl StagingPool {
    /// A pool allocating through `allocate` and keeping at most `max_idle_bytes` idle.
    pub fn new(allocate: Allocate, max_idle_bytes: usize) -> Self {
        Self {
            allocate,
            max_idle_bytes,
            state: Mutex::default(),
            allocations: AtomicU64::new(0),
            reuses: AtomicU64::new(0),
        }
    }

    /// The size class a buffer for `bytes` is allocated at: `bytes` rounded up to the next of
    /// 1, 1.25, 1.5 or 1.75 times a power of two (at most a quarter more than asked), so that
    /// transfers of nearby page counts share buffers.
    pub fn size_class(bytes: usize) -> usize {
        if bytes <= 4096 {
            return bytes.max(1).next_power_of_two();
        }
        let top = usize::BITS - 1 - bytes.leading_zeros();
        let quarter = 1usize << (top - 2);
        bytes.div_ceil(quarter) * quarter
    }

    /// A buffer of at least `bytes` capacity, empty (its length is set by whoever fills it):
    /// the smallest idle one that fits, else a new one of `bytes`' size class. It comes back to
    /// the pool when the [`Pooled`] drops.
    pub fn take(self: &Arc<Self>, bytes: usize) -> Result<Pooled> {
        let reused = {
            let mut idle = self.lock();
            let fits = idle.buffers.iter().position(|b| b.capacity() >= bytes);
            fits.map(|at| {
                let buf = idle.buffers.remove(at);
                idle.bytes -= buf.capacity();
                idle.lent += buf.capacity();
                buf
            })
        };
        let buf = match reused {
            Some(mut buf) => {
                self.reuses.fetch_add(1, Ordering::Relaxed);
                if let Staging::Host(v) = &mut buf {
                    v.clear();
                }
                buf
            }
            None => {
                let buf = (self.allocate)(Self::size_class(bytes))?;
                self.allocations.fetch_add(1, Ordering::Relaxed);
                self.lock().lent += buf.capacity();
                tracing::debug!(
                    bytes = buf.capacity(),
                    "allocated a staging buffer (none idle fits)"
                );
                buf
            }
        };
        Ok(Pooled {
            capacity: buf.capacity(),
            buf: Some(buf),
            pool: Arc::clone(self),
            keep: true,
        })
    }

    /// A lent buffer back: kept idle when the bound allows, freed otherwise.
    fn give_back(&self, buf: Staging) {
        let capacity = buf.capacity();
        let mut idle = self.lock();
        idle.lent = idle.lent.saturating_sub(capacity);
        if idle.bytes + capacity > self.max_idle_bytes {
            drop(idle);
            tracing::debug!(
                bytes = capacity,
                bound = self.max_idle_bytes,
                "freeing a staging buffer: the pool is full"
            );
            return;
        }
        let at = idle.buffers.partition_point(|b| b.capacity() <= capacity);
        idle.buffers.insert(at, buf);
        idle.bytes += capacity;
    }

    /// A lent buffer that will not come back (lost, or discarded).
    fn forget(&self, capacity: usize) {
        let mut idle = self.lock();
        idle.lent = idle.lent.saturating_sub(capacity);
    }

    pub fn stats(&self) -> PoolStats {
        let idle = self.lock();
        PoolStats {
            allocations: self.allocations.load(Ordering::Relaxed),
            reuses: self.reuses.load(Ordering::Relaxed),
            idle_buffers: idle.buffers.len(),
            idle_bytes: idle.bytes,
            lent_bytes: idle.lent,
        }
    }

    /// Frees every idle buffer.
    pub fn clear(&self) {
        let buffers = {
            let mut idle = self.lock();
            idle.bytes = 0;
            std::mem::take(&mut idle.buffers)
        };
        drop(buffers);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A buffer lent by a [`StagingPool`]; it goes back when dropped. The buffer may be moved out
/// for a call that consumes it ([`take_out`](Self::take_out)) and put back after
/// ([`restore`](Self::restore)); one never put back is forgotten by the pool.
pub struct Pooled {
    pool: Arc<StagingPool>,
    buf: Option<Staging>,
    capacity: usize,
    keep: bool,
}

impl Pooled {
    /// The buffer (taken out by [`take_out`](Self::take_out) and not restored: an error).
    pub fn get(&self) -> Result<&Staging> {
        self.buf.as_ref().ok_or_else(moved_out)
    }

    pub fn get_mut(&mut self) -> Result<&mut Staging> {
        self.buf.as_mut().ok_or_else(moved_out)
    }

    /// Moves the buffer out, for a call that consumes it and hands it back.
    pub fn take_out(&mut self) -> Result<Staging> {
        self.buf.take().ok_or_else(moved_out)
    }

    /// Puts back what [`take_out`](Self::take_out) moved out.
    pub fn restore(&mut self, buf: Staging) {
        self.capacity = buf.capacity();
        self.buf = Some(buf);
    }

    /// Frees the buffer instead of pooling it (a link failed while it used it).
    pub fn discard(mut self) {
        self.keep = false;
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        match self.buf.take() {
            Some(buf) if self.keep => self.pool.give_back(buf),
            _ => self.pool.forget(self.capacity),
        }
    }
}

fn moved_out() -> crate::Error {
    crate::Error::Link("the staging buffer was moved out and not put back".into())
}

/// Host buffers (`Vec::with_capacity`: nothing written until a transfer fills them).
pub fn host_allocator() -> Allocate {
    Arc::new(|bytes| Ok(Staging::Host(Vec::with_capacity(bytes))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(max_idle: usize) -> Arc<StagingPool> {
        Arc::new(StagingPool::new(host_allocator(), max_idle))
    }

    #[test]
    fn size_classes_round_up_by_at_most_a_quarter() {
        assert_eq!(StagingPool::size_class(0), 1);
        assert_eq!(StagingPool::size_class(3000), 4096);
        assert_eq!(StagingPool::size_class(8192), 8192);
        assert_eq!(StagingPool::size_class(8193), 10240);
        assert_eq!(StagingPool::size_class(13_000), 14336);
        for bytes in [5000, 65_537, 1 << 20, (37 * 4) << 20, 1_234_567_891] {
            let class = StagingPool::size_class(bytes);
            assert!(
                class >= bytes && class <= bytes + bytes / 4,
                "{bytes} -> {class}"
            );
        }
    }

    #[test]
    fn buffers_are_reused_not_reallocated() {
        let pool = pool(1 << 20);
        for round in 0..100 {
            let mut buf = pool.take(10_000 + round).unwrap();
            let Staging::Host(v) = buf.get_mut().unwrap() else {
                unreachable!()
            };
            assert!(v.is_empty(), "a taken buffer holds nothing yet");
            v.resize(10_000 + round, 7);
        }
        let stats = pool.stats();
        assert_eq!(stats.allocations, 1, "{stats:?}");
        assert_eq!(stats.reuses, 99);
        assert_eq!((stats.idle_buffers, stats.lent_bytes), (1, 0));
    }

    #[test]
    fn the_smallest_idle_buffer_that_fits_is_taken() {
        let pool = pool(1 << 20);
        let (small, large) = (pool.take(5000).unwrap(), pool.take(50_000).unwrap());
        let small_cap = small.get().unwrap().capacity();
        let large_cap = large.get().unwrap().capacity();
        assert_eq!(pool.stats().lent_bytes, small_cap + large_cap);
        drop((large, small));
        let a = pool.take(4000).unwrap();
        assert_eq!(a.get().unwrap().capacity(), small_cap);
        let b = pool.take(6000).unwrap();
        assert_eq!(b.get().unwrap().capacity(), large_cap);
        let fresh = pool.take(6000).unwrap();
        assert_eq!(
            fresh.get().unwrap().capacity(),
            StagingPool::size_class(6000)
        );
        assert_eq!(pool.stats().allocations, 3);
    }

    #[test]
    fn idle_bytes_stay_within_the_bound() {
        let pool = pool(100_000);
        let bufs: Vec<_> = (0..4).map(|_| pool.take(40_000).unwrap()).collect();
        let capacity = bufs[0].get().unwrap().capacity();
        drop(bufs);
        let stats = pool.stats();
        assert_eq!(stats.idle_buffers, 100_000 / capacity);
        assert!(stats.idle_bytes <= 100_000);
        assert_eq!(stats.lent_bytes, 0, "freed buffers are no longer lent");
        let lost = pool.take(40_000).unwrap();
        lost.discard();
        let mut moved = pool.take(40_000).unwrap();
        let _gone = moved.take_out().unwrap();
        assert!(moved.get().is_err());
        drop(moved);
        assert_eq!(pool.stats().lent_bytes, 0);
        assert_eq!(pool.stats().idle_buffers, 0, "neither came back");
        pool.clear();
        assert_eq!(pool.stats().idle_bytes, 0);
    }
}
