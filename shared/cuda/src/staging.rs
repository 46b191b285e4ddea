//! [`DeviceStaging`]: a reusable device buffer holding a transfer's pages back to back.
//!
//! A staging buffer is allocated once (uninitialized: every byte a transfer reads was written
//! by the gather or the receive of that transfer first) and reused by later transfers, so its
//! *capacity* (the allocation) and its *length* (the bytes of the transfer it holds now) differ.
//! Kernels and NCCL read and write only `..len`.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView};

use crate::{Error, Result};

/// A device buffer of `capacity` bytes of which the first `len` hold a transfer's pages.
pub struct DeviceStaging {
    buf: CudaSlice<u8>,
    len: usize,
}

impl DeviceStaging {
    /// A new buffer of `capacity` bytes (at least one), not zeroed, holding nothing yet,
    /// usable on any stream once this returns.
    pub fn alloc(stream: &Arc<CudaStream>, capacity: usize) -> Result<Self> {
        // SAFETY: the bytes are uninitialized; `len` is 0 until a gather or a receive wrote
        // `..len`, and nothing reads past `len`.
        let buf = unsafe { stream.alloc::<u8>(capacity.max(1)) }?;
        // A stream-ordered allocation is ordered only on `stream`, and cudarc records no event
        // for it: wait for it here, so the engine's and NCCL's streams may use it at once.
        // Allocations are rare (a pool miss), so the wait costs little.
        stream.synchronize()?;
        Ok(Self { buf, len: 0 })
    }

    /// A buffer holding all of `buf`.
    pub fn from_slice(buf: CudaSlice<u8>) -> Self {
        let len = buf.len();
        Self { buf, len }
    }

    /// Bytes the transfer it holds now.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Sets the length before a gather or a receive writes `..len`.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.capacity() {
            return Err(Error::Shape {
                what: "staging bytes within the buffer's capacity",
                expected: self.capacity(),
                actual: len,
            });
        }
        self.len = len;
        Ok(())
    }

    /// The whole allocation (kernels and NCCL are given `len` separately).
    pub fn buffer(&self) -> &CudaSlice<u8> {
        &self.buf
    }

    pub fn buffer_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.buf
    }

    /// The bytes it holds.
    pub fn view(&self) -> CudaView<'_, u8> {
        self.buf.slice(..self.len)
    }
}
