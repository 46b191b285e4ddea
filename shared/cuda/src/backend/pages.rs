//! [`CudaPages`]: the paged KV cache in device memory, with exactly the bytes of
//! `nibble_kvfmt::PageLayout` (so the CPU backend reads what this one writes, and the other way
//! round): creating it (`new_pages`), one page to and from the host (`read_page`, `write_page`)
//! and whole pages to and from a (pooled) staging buffer on the device ([`CudaBackend::gather_pages`],
//! [`CudaBackend::scatter_pages`], the NCCL transfer path).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice};
use nibble_engine::backend::PageEncoding;
use nibble_engine::paged::WorkDtype;
use nibble_engine::{Error as EngineError, Result as EngineResult};
use nibble_kvcache::{GlobalScales, PageId, PagePool, PoolPlan};
use nibble_kvfmt::{PageLayout, ScaleRule, WindowLayout};

use super::decode::DecodeInputs;
use super::{engine_err, CudaBackend, CudaTensor};
use crate::{DecodeWorkspace, DeviceStaging, Error, PageGeom, Result};

/// Page bytes in device memory plus the work-dtype workspace and the decode partials.
pub struct CudaPages {
    pub(super) bytes: CudaSlice<u8>,
    pub(super) layout: PageLayout,
    pub(super) scales: GlobalScales,
    pub(super) scale_rule: ScaleRule,
    /// K's codes chosen for the queries: every layer's factors, `[layer][kv_head][d][d]`.
    pub(super) k_codes: Option<CudaSlice<f32>>,
    pub(super) window: WindowLayout,
    /// The element type of the prefill and extend workspace (`ws_k`, `ws_v`).
    pub(super) work: WorkDtype,
    pub(super) ws_k: CudaSlice<u8>,
    pub(super) ws_v: CudaSlice<u8>,
    pub(super) decode: DecodeWorkspace,
    pub(super) decode_inputs: DecodeInputs,
    /// Head vectors are stored rotated by the normalized Hadamard matrix: Q, K and V are
    /// rotated into `rotated` before attention and the output rotated back after it.
    pub(super) hadamard: bool,
    pub(super) rotated: Option<[CudaTensor; 3]>,
}

impl CudaPages {
    /// `layer`'s K codes factors (`[kv_head][d][d]`), if K's codes are chosen for the queries.
    pub(super) fn layer_k_codes<'a>(
        k_codes: &'a Option<CudaSlice<f32>>,
        layout: &PageLayout,
        layer: usize,
    ) -> Option<cudarc::driver::CudaView<'a, f32>> {
        let n = layout.kv_heads() * layout.head_dim() * layout.head_dim();
        k_codes
            .as_ref()
            .map(|u| u.slice(layer * n..(layer + 1) * n))
    }

    /// All page bytes, copied to the host (tests compare them with the CPU backend's).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        Ok(self.bytes.stream().clone_dtoh(&self.bytes)?)
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.layout.page_bytes()
    }
}

/// The `Backend` methods over pages: creation and one page to or from the host.
impl CudaBackend {
    pub(super) fn create_pages(
        &self,
        plan: PoolPlan,
        encoding: PageEncoding,
    ) -> EngineResult<CudaPages> {
        let PageEncoding {
            scales,
            hadamard,
            scale_rule,
            k_codes,
            window,
            prefill_work,
        } = encoding;
        let layout = plan.layout;
        prefill_work.check_cache(layout.dtype()).map_err(|why| {
            EngineError::InvalidInput(format!("prefill work dtype {}: {why}", prefill_work.name()))
        })?;
        let window = WindowLayout::new(&layout, window).map_err(nibble_kvcache::Error::from)?;
        if let Some(reason) =
            crate::device::pages_unsupported(layout.head_dim(), layout.page_size())
        {
            return Err(EngineError::Unsupported(reason));
        }
        PageGeom::new(&layout, 0).map_err(|e| EngineError::Unsupported(e.to_string()))?;
        let layers = layout.layers();
        if scales.k.len() != layers || scales.v.len() != layers {
            return Err(EngineError::InvalidInput(format!(
                "expected {layers} K and V scales, got {} and {}",
                scales.k.len(),
                scales.v.len()
            )));
        }
        self.bind();
        let stream = self.stream();
        let k_codes = match k_codes {
            Some(f) => {
                nibble_kvcache::check_key_factors(&layout, &f).map_err(EngineError::from)?;
                let u: Vec<f32> = f.uppers().flatten().copied().collect();
                Some(stream.clone_htod(&u).map_err(engine_err)?)
            }
            None => None,
        };
        Ok(CudaPages {
            bytes: stream.alloc_zeros(plan.bytes.max(1)).map_err(engine_err)?,
            layout,
            scales,
            scale_rule,
            k_codes,
            window,
            work: prefill_work,
            ws_k: stream.alloc_zeros(1).map_err(engine_err)?,
            ws_v: stream.alloc_zeros(1).map_err(engine_err)?,
            decode: DecodeWorkspace::new(&self.kernels).map_err(engine_err)?,
            decode_inputs: DecodeInputs::default(),
            hadamard,
            rotated: None,
        })
    }

    pub(super) fn read_page_bytes(
        &self,
        pages: &CudaPages,
        page: PageId,
        out: &mut Vec<u8>,
    ) -> EngineResult<()> {
        let size = pages.layout.page_bytes();
        let total = pages.bytes.len() / size;
        if page.0 as usize >= total {
            return Err(nibble_kvcache::Error::PageOutOfRange { page, total }.into());
        }
        self.bind();
        let start = page.0 as usize * size;
        let host = self
            .stream()
            .clone_dtoh(&pages.bytes.slice(start..start + size))
            .map_err(engine_err)?;
        out.clear();
        out.extend_from_slice(&host);
        Ok(())
    }

    pub(super) fn write_page_bytes(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        page: PageId,
        bytes: &[u8],
    ) -> EngineResult<()> {
        if pool.refcount(page)? == 0 {
            return Err(nibble_kvcache::Error::NotAllocated(page).into());
        }
        let size = pages.layout.page_bytes();
        if bytes.len() != size {
            return Err(EngineError::InvalidInput(format!(
                "page {page} is {size} bytes, received {}",
                bytes.len()
            )));
        }
        self.bind();
        let start = page.0 as usize * size;
        self.stream()
            .memcpy_htod(bytes, &mut pages.bytes.slice_mut(start..start + size))
            .map_err(engine_err)?;
        Ok(())
    }
}

/// Device-side page transfer (the NCCL path): pages move between the pool and a contiguous
/// staging buffer without touching the host.
impl CudaBackend {
    /// The device context (NCCL communicators of this worker live on the same device).
    pub fn context(&self) -> &Arc<CudaContext> {
        self.kernels.context()
    }

    /// Copies `ids` (in order) into `into` (a pooled buffer, not zeroed: its capacity must hold
    /// them) and sets its length, on this backend's stream: ordered after every kernel that
    /// wrote those pages, and after the last use of `into` on any stream (cudarc's event
    /// tracking). Users on other streams wait for the copy the same way.
    pub fn gather_pages(
        &self,
        pages: &CudaPages,
        ids: &[PageId],
        into: &mut DeviceStaging,
    ) -> Result<()> {
        self.bind();
        let size = pages.layout.page_bytes();
        into.set_len(ids.len() * size)?;
        if ids.is_empty() {
            return Ok(());
        }
        let ids: Vec<u32> = ids.iter().map(|p| p.0).collect();
        self.kernels
            .gather_pages(into.buffer_mut(), &pages.bytes, &ids, size)
    }

    /// Writes `staging` (exactly `ids.len()` pages long) into the allocated pages `ids`, on this
    /// backend's stream (so later attention kernels see the bytes).
    pub fn scatter_pages(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        ids: &[PageId],
        staging: &DeviceStaging,
    ) -> Result<()> {
        let size = pages.layout.page_bytes();
        if staging.len() != ids.len() * size {
            return Err(Error::Shape {
                what: "staging bytes (the pages written)",
                expected: ids.len() * size,
                actual: staging.len(),
            });
        }
        for &page in ids {
            match pool.refcount(page) {
                Ok(n) if n > 0 => {}
                _ => {
                    return Err(Error::Unsupported(format!(
                        "page {page} is not allocated: refusing to write into it"
                    )))
                }
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        self.bind();
        let ids: Vec<u32> = ids.iter().map(|p| p.0).collect();
        self.kernels
            .scatter_pages(&mut pages.bytes, staging.buffer(), &ids, size)
    }
}
