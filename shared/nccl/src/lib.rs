//! nibble's GPU-to-GPU page transfer: NCCL, opened at run time (unique ids, two-rank
//! communicators, rank 0 the prefill worker that sends, rank 1 the decode worker that receives,
//! and the send/receive of device buffers that moves a request's pages from one GPU to another),
//! and the device-link seam over it ([`link`]: [`link::LinkFactory`] and [`link::Link`], NCCL's
//! [`link::NcclLinks`] and the in-process [`link::MemoryLinks`]), and the [`staging::Staging`]
//! buffers they move, kept for reuse by a [`staging::StagingPool`].
//!
//! * [`available`] / [`version`]: whether the library loads (the worker advertises NCCL only
//!   then).
//! * [`UniqueId`]: `ncclGetUniqueId`'s 128 bytes, made by rank 0 and carried to the other rank
//!   through the coordination store.
//! * [`Communicator`]: a non-blocking communicator on its own stream; every wait has a deadline.
//!
//! Pages reach a communicator through a contiguous *staging* buffer (pooled, never zeroed): the sender gathers a
//! request's scattered pages into one buffer with [`nibble_cuda::Kernels::gather_pages`] and sends it
//! whole, the receiver receives one buffer and scatters it into its own page ids with
//! [`nibble_cuda::Kernels::scatter_pages`]. Each page is one contiguous range of the pool (every layer's
//! K and V data and scales, docs/FORMAT.md), so gather and scatter copy whole pages.

mod comm;
mod error;
mod ffi;
pub mod link;
pub mod staging;

pub use comm::Communicator;
pub use error::{Error, Result};

/// Whether NCCL (2.17 or newer) loads on this machine.
pub fn available() -> bool {
    ffi::api().is_ok()
}

/// The loaded library's version (`"2.27.3"`) and path, or why it does not load.
pub fn version() -> Result<(String, std::path::PathBuf)> {
    let api = api()?;
    Ok((ffi::version_string(api.version), api.path.clone()))
}

pub(crate) fn api() -> Result<&'static ffi::Api> {
    ffi::api().map_err(Error::NotFound)
}

/// An NCCL unique id: names one communicator; every rank joins with the same id.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; UniqueId::LEN]);

impl UniqueId {
    /// Bytes of an id.
    pub const LEN: usize = 128;

    /// A fresh id from `ncclGetUniqueId` (it also starts NCCL's bootstrap listener, which the
    /// other ranks dial while joining).
    pub fn new() -> Result<Self> {
        let api = api()?;
        let mut raw = ffi::RawUniqueId { internal: [0; 128] };
        // SAFETY: writes one ncclUniqueId.
        let code = unsafe { (api.get_unique_id)(&mut raw) };
        if code != ffi::NCCL_SUCCESS {
            return Err(Error::Nccl {
                op: "ncclGetUniqueId",
                code,
                message: api.error_string(code),
            });
        }
        Ok(Self(raw.internal.map(|c| c as u8)))
    }

    /// The id's bytes, as they travel between ranks.
    pub fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }

    /// An id received from another rank; exactly [`LEN`](Self::LEN) bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let array: [u8; Self::LEN] = bytes.try_into().map_err(|_| Error::Shape {
            what: "NCCL unique id bytes",
            expected: Self::LEN,
            actual: bytes.len(),
        })?;
        Ok(Self(array))
    }

    fn raw(&self) -> ffi::RawUniqueId {
        ffi::RawUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The bytes hold the bootstrap address; print a short digest only.
        let sum = self
            .0
            .iter()
            .fold(0u32, |h, b| h.rotate_left(5) ^ u32::from(*b));
        write!(f, "UniqueId({sum:08x})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_bytes() {
        let mut bytes = [0u8; UniqueId::LEN];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        let id = UniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.as_bytes(), &bytes);
        assert_eq!(id.raw().internal[5] as u8, 35);
        assert!(UniqueId::from_bytes(&bytes[..127]).is_err());
    }
}
