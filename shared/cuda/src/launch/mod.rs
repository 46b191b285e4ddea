//! [`Kernels`]: one device's context, stream and compiled kernels, with a typed launch per
//! kernel. Every launch checks the shapes it is given before anything runs on the device.

use std::sync::Arc;

use cudarc::driver::{
    sys::CUdevice_attribute, CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView,
    LaunchConfig,
};
use nibble_kvfmt::{KvDtype, ScaleRule};

use crate::geom::{dtype_code, scale_rule_code};
use crate::launcher::Launch;
use crate::{nvrtc, Error, PageGeom, Result, WindowGeom};

mod args;
mod checks;

pub(crate) use checks::{check, check_write_slots};
use checks::{check_new_kv, check_page_copy, check_window_rows};
mod decode;
pub(crate) mod prefill;

pub use args::{CachedPrefix, DecodeOut, KvScales, KvWorkspace, NewKv, PrefillBatch, WindowRows};

pub(crate) use decode::DecodeArgs;
use decode::DECODE_THREADS;
pub(crate) use decode::DECODE_TILE;
pub use decode::{DecodeBatch, DecodeWorkspace};
use prefill::PrefillKernels;
pub use prefill::{PrefillKernel, WgmmaTuning};

/// The compiled kernels on one device.
pub struct Kernels {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: &'static str,
    sms: u32,
    /// Launches use programmatic dependent launch (`launcher`): sm_90 and newer, unless
    /// `NIBBLE_CUDA_PDL=0`.
    programmatic: bool,
    quantize: CudaFunction,
    quantize_nvfp4_mse: CudaFunction,
    k_codes: CudaFunction,
    gather: CudaFunction,
    fill: CudaFunction,
    /// [dtype code][0: head dim 64, 1: 128]
    decode: [[CudaFunction; 2]; 3],
    /// Decode blocks resident on the whole device at once, per kernel of `decode`.
    decode_slots: [[usize; 2]; 3],
    /// The prefill/extend attention kernels and which of them runs.
    prefill: PrefillKernels,
    combine: CudaFunction,
    combine_groups: CudaFunction,
    pages_gather: CudaFunction,
    pages_scatter: CudaFunction,
}

/// The NVRTC target of a compute capability: the newest the kernels are written for, at most
/// the device's own.
fn arch_for(major: i32, minor: i32) -> Result<&'static str> {
    Ok(match (major, minor) {
        (9, _) | (10.., _) => "sm_90",
        (8, 9) => "sm_89",
        (8, _) => "sm_80",
        _ => {
            return Err(Error::Unsupported(format!(
                "compute capability {major}.{minor} (the kernels need 8.0 or newer)"
            )))
        }
    })
}

/// `NIBBLE_CUDA_PDL`: unset or `1` launches kernels programmatically where the device can
/// (sm_90 and newer), `0` serializes them (for comparing the two); anything else is an error
/// naming the variable.
fn programmatic_launch_allowed() -> Result<bool> {
    match std::env::var("NIBBLE_CUDA_PDL") {
        Err(std::env::VarError::NotPresent) => Ok(true),
        Ok(v) if v == "1" => Ok(true),
        Ok(v) if v == "0" => Ok(false),
        Ok(v) => Err(Error::Unsupported(format!(
            "NIBBLE_CUDA_PDL={v:?} (expected 0 or 1)"
        ))),
        Err(e) => Err(Error::Unsupported(format!("NIBBLE_CUDA_PDL: {e}"))),
    }
}

impl Kernels {
    /// Opens device `ordinal`, compiles every kernel for it and loads them. Fails (never panics)
    /// when there is no driver, no device or no NVRTC.
    pub fn new(ordinal: usize) -> Result<Self> {
        nvrtc::load()?;
        // SAFETY: only tries to open the driver library by name.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::NoDevice(
                "the CUDA driver library (libcuda.so.1) is not loadable".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| Error::NoDevice(format!("device {ordinal}: {e}")))?;
        keep_freed_memory(&ctx, POOL_KEEP_BYTES)?;
        let major =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let arch = arch_for(major, minor)?;
        // The one slow step of a GPU start after the weights: say so before it begins.
        tracing::info!(
            "compiling the CUDA kernels for {arch} with NVRTC ({} sources; once per start)",
            crate::SOURCES.len()
        );
        let started = std::time::Instant::now();
        let mut modules = Vec::new();
        for compiled in nvrtc::compile_all(arch)? {
            modules.push((compiled.name, ctx.load_module(compiled.ptx)?));
        }
        tracing::info!(
            "compiled the CUDA kernels in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let function = |source: &str, name: &str| -> Result<CudaFunction> {
            let module = &modules
                .iter()
                .find(|(n, _)| *n == source)
                .expect("compiled")
                .1;
            Ok(module.load_function(name)?)
        };
        let decode_fns = |dtype: &str| -> Result<[CudaFunction; 2]> {
            Ok([
                function("decode", &format!("decode_{dtype}_d64"))?,
                function("decode", &format!("decode_{dtype}_d128"))?,
            ])
        };
        let stream = ctx.default_stream();
        let decode = [
            decode_fns("nvfp4")?,
            decode_fns("fp8")?,
            decode_fns("bf16")?,
        ];
        let mut decode_slots = [[0usize; 2]; 3];
        for (fns, slots) in decode.iter().zip(&mut decode_slots) {
            for (f, slot) in fns.iter().zip(slots.iter_mut()) {
                let per_sm =
                    f.occupancy_max_active_blocks_per_multiprocessor(DECODE_THREADS, 0, None)?;
                *slot = sms as usize * per_sm.max(1) as usize;
            }
        }
        let kernels = Self {
            quantize: function("quantize", "kv_quantize")?,
            quantize_nvfp4_mse: function("quantize", "kv_quantize_nvfp4_mse")?,
            k_codes: function("quantize", "kv_k_codes")?,
            gather: function("quantize", "kv_gather_work")?,
            fill: function("quantize", "fill_random_pages")?,
            decode,
            decode_slots,
            combine: function("decode", "decode_combine")?,
            combine_groups: function("decode", "decode_combine_groups")?,
            pages_gather: function("pages", "pages_gather")?,
            pages_scatter: function("pages", "pages_scatter")?,
            prefill: PrefillKernels::load(&ctx, (major, minor), |name| function("prefill", name))?,
            ctx,
            stream,
            arch,
            sms,
            programmatic: major >= 9 && programmatic_launch_allowed()?,
        };
        Ok(kernels.with_working_launches())
    }

    /// Keeps programmatic launch only if the driver takes it: one launch of `pages_gather` over no
    /// pages (a block that waits and returns) with the attribute. A driver that refuses the
    /// attribute refuses the launch itself, without a sticky error, and kernels are then
    /// launched serialized, with a notice.
    fn with_working_launches(mut self) -> Self {
        if !self.programmatic {
            return self;
        }
        let (null, none, page_bytes) = (0u64, 0u32, 16u64);
        let mut b = self.builder(&self.pages_gather);
        b.arg(&null)
            .arg(&null)
            .arg(&null)
            .arg(&none)
            .arg(&page_bytes);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: pages_gather's signature (staging, pool, page_ids, n, page_bytes); with n = 0
        // it reads and writes nothing, so the null pointers are never dereferenced.
        let probe = unsafe { b.launch(cfg) }.and_then(|()| self.stream.synchronize());
        if let Err(e) = probe {
            eprintln!(
                "nibble: programmatic dependent launch refused ({e}); kernels run serialized"
            );
            self.programmatic = false;
        }
        self
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A launch of `func` on this device's stream, programmatic where the device has it.
    pub(crate) fn builder<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a> {
        Launch::new(&self.stream, func, self.programmatic)
    }

    /// Whether kernels are launched with programmatic dependent launch.
    pub fn programmatic_launch(&self) -> bool {
        self.programmatic
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The NVRTC target the kernels were compiled for.
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// Streaming multiprocessors on the device.
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }

    /// Quantize-on-write: writes the tokens of `kv` (f32 `[token][kv_head][head_dim]`) of
    /// `geom.layer` into their `slots` (`page * page_size + offset`; `u32::MAX` is padding), one
    /// slot per token. The bytes equal `HostPages::write_kv`'s under the same rule. Every slot is
    /// checked against `pages` (and `geom` against `dtype`) before the slots are uploaded and
    /// anything is launched: an error names what is out of range.
    pub fn quantize(
        &self,
        pages: &mut CudaSlice<u8>,
        geom: PageGeom,
        dtype: KvDtype,
        kv: &NewKv<'_>,
        slots: &[u32],
    ) -> Result<()> {
        check_write_slots(pages.len(), &geom, dtype, slots)?;
        if slots.is_empty() {
            return check_new_kv(&geom, kv, 0);
        }
        let slots = self.stream.clone_htod(slots)?;
        // SAFETY: every slot was checked above against the pages and the geometry; no window.
        unsafe { self.quantize_unchecked(pages, geom, dtype, kv, &slots.as_view(), None) }
    }

    /// [`quantize`](Self::quantize) with the slots already on the device (a decode step's,
    /// uploaded once for every layer), which are not checked, and the tokens also written in
    /// BF16 into their sequences' recent windows when `window` is given (the bytes
    /// `HostPages::write_window` writes), in the same launch. Padding slots write nothing.
    ///
    /// # Safety
    ///
    /// `geom` passes the checks of [`quantize`](Self::quantize) for `dtype` and `pages` (as the
    /// [`PageGeom::new`] of the layout `pages` is made of does), and every entry of `slots` is
    /// `u32::MAX` or a slot of one of the whole pages of `pages`:
    /// `slot / geom.page_size < pages.len() / geom.page_bytes`. With a window, its geometry is
    /// that of the layout of `pages`, every id in `window.table` is a page of `pages` and every
    /// `window.lens[s] >= window.rows_per_seq`.
    pub unsafe fn quantize_unchecked(
        &self,
        pages: &mut CudaSlice<u8>,
        geom: PageGeom,
        dtype: KvDtype,
        kv: &NewKv<'_>,
        slots: &CudaView<'_, u32>,
        window: Option<&WindowRows<'_>>,
    ) -> Result<()> {
        let n = slots.len();
        check_new_kv(&geom, kv, n)?;
        let groups = n as u64 * 2 * (geom.kv_heads * geom.head_dim / 16) as u64;
        if groups == 0 {
            return Ok(());
        }
        let window = window.filter(|w| w.geom.tokens > 0 && w.rows_per_seq > 0);
        if let Some(w) = window {
            check_window_rows(w, n, geom.kv_heads)?;
        }
        let (wgeom, per_seq) =
            window.map_or((WindowGeom::none(), 1), |w| (w.geom, w.rows_per_seq as u32));
        let (wtable, wlens) = (window.map(|w| &w.table), window.map(|w| &w.lens));
        let n32 = n as u32;
        let (k, v, scales) = (&kv.k, &kv.v, kv.scales);
        let mse_lanes =
            dtype == KvDtype::Nvfp4 && kv.rule == ScaleRule::Mse && groups <= MSE_LANES_MAX_BLOCKS;
        let (code, rule) = (dtype_code(dtype), scale_rule_code(kv.rule));
        // Eight lanes per 16 values (see kv_quantize_nvfp4_mse), or one thread per 16 values
        // of any dtype and rule.
        let mut b = self.builder(if mse_lanes {
            &self.quantize_nvfp4_mse
        } else {
            &self.quantize
        });
        b.arg(&mut *pages)
            .arg(k)
            .arg(v)
            .arg(slots)
            .arg(&n32)
            .arg(&geom);
        if !mse_lanes {
            b.arg(&code).arg(&rule);
        }
        b.arg(&scales.k).arg(&scales.v);
        b.arg(wtable).arg(wlens).arg(&per_seq).arg(&wgeom);
        let threads = if mse_lanes { groups * 8 } else { groups };
        // SAFETY: the argument list matches kv_quantize_nvfp4_mse's or kv_quantize's signature;
        // sizes were checked above, every slot is in the pages and every window page in the
        // pool (the caller's contract); without a window its table and lengths are not read.
        unsafe { b.launch(grid_1d(threads)) }?;
        match &kv.k_codes {
            Some(u) if dtype == KvDtype::Nvfp4 => {
                // SAFETY: as above; `u` was checked by check_new_kv.
                unsafe { self.k_codes(pages, geom, kv, slots, u) }
            }
            _ => Ok(()),
        }
    }

    /// kv_k_codes: K's codes rewritten for the queries `u` describes (the layer's factors,
    /// `[kv_head][d][d]`), after the tokens were quantized (see [`Self::quantize_unchecked`]).
    unsafe fn k_codes(
        &self,
        pages: &mut CudaSlice<u8>,
        geom: PageGeom,
        kv: &NewKv<'_>,
        slots: &CudaView<'_, u32>,
        u: &CudaView<'_, f32>,
    ) -> Result<()> {
        let n32 = slots.len() as u32;
        let rule = scale_rule_code(kv.rule);
        let mut b = self.builder(&self.k_codes);
        b.arg(pages).arg(&kv.k).arg(slots).arg(&n32).arg(&geom);
        b.arg(&rule).arg(&kv.scales.k).arg(u);
        // SAFETY: the argument list matches kv_k_codes's signature; the caller checked the
        // rest. One warp per (token, KV head).
        unsafe { b.launch(grid_1d(slots.len() as u64 * geom.kv_heads as u64 * 32)) }?;
        Ok(())
    }

    /// Extend gather: the first `tokens` tokens of one sequence (pages in `page_table`) into
    /// the `prefix.work` workspace `[token][kv_head][head_dim]`: E4M3 bytes with the work
    /// scales (nvfp4 and fp8 caches), or BF16 bytes (any cache; `ws_k`/`ws_v` then hold 2 bytes
    /// per value). The bytes equal the CPU extend path's workspace.
    pub fn gather_work(
        &self,
        ws: KvWorkspace<'_>,
        pages: &CudaSlice<u8>,
        geom: PageGeom,
        dtype: KvDtype,
        prefix: &CachedPrefix<'_>,
    ) -> Result<()> {
        let CachedPrefix {
            page_table,
            tokens,
            scales,
            work,
            work_scales,
        } = *prefix;
        let width = match work {
            KvDtype::Fp8 if dtype != KvDtype::Bf16 => 1,
            KvDtype::Bf16 => 2,
            _ => {
                return Err(Error::Unsupported(format!(
                    "gathering a {dtype} cache into a {work} workspace (fp8 or bf16; bf16 for a \
                     bf16 cache)"
                )))
            }
        };
        let bytes = tokens * (geom.kv_heads * geom.head_dim) as usize * width;
        if ws.k.len() < bytes || ws.v.len() < bytes {
            return Err(Error::Shape {
                what: "workspace bytes (at least)",
                expected: bytes,
                actual: ws.k.len().min(ws.v.len()),
            });
        }
        if page_table.len() * (geom.page_size as usize) < tokens {
            return Err(Error::Shape {
                what: "pages covering the prefix",
                expected: tokens.div_ceil(geom.page_size as usize),
                actual: page_table.len(),
            });
        }
        let threads = tokens as u64 * 2 * (geom.kv_heads * geom.head_dim / 16) as u64;
        if threads == 0 {
            return Ok(());
        }
        let (n32, code) = (tokens as u32, dtype_code(dtype));
        let work_bf16 = u32::from(width == 2);
        let mut b = self.builder(&self.gather);
        b.arg(ws.k)
            .arg(ws.v)
            .arg(pages)
            .arg(page_table)
            .arg(&n32)
            .arg(&geom)
            .arg(&code)
            .arg(&work_bf16);
        b.arg(&scales.k)
            .arg(&scales.v)
            .arg(&work_scales.k)
            .arg(&work_scales.v);
        // SAFETY: matches kv_gather_work's signature; sizes checked above.
        unsafe { b.launch(grid_1d(threads)) }?;
        Ok(())
    }

    /// Fills `pages` with valid random codes of `dtype` (benchmark and test inputs).
    pub fn fill_random(
        &self,
        pages: &mut CudaSlice<u8>,
        geom: PageGeom,
        dtype: KvDtype,
        seed: u32,
    ) -> Result<()> {
        let n = pages.len() as u64;
        let code = dtype_code(dtype);
        let mut b = self.builder(&self.fill);
        b.arg(pages).arg(&n).arg(&code).arg(&seed).arg(&geom);
        // SAFETY: matches fill_random_pages's signature; n is the slice's length.
        unsafe { b.launch(grid_1d(n)) }?;
        Ok(())
    }

    /// Copies whole pages `page_ids` of `pool` (pages of `page_bytes`) into `staging`, in list
    /// order: `staging[i] = page page_ids[i]`. `staging` must hold at least those pages (a
    /// pooled buffer may be larger; bytes past them are left alone), and every id must be a page
    /// of the pool (checked here, before anything is launched).
    pub fn gather_pages(
        &self,
        staging: &mut CudaSlice<u8>,
        pool: &CudaSlice<u8>,
        page_ids: &[u32],
        page_bytes: usize,
    ) -> Result<()> {
        check_page_copy(staging.len(), pool.len(), page_ids, page_bytes)?;
        self.copy_pages(&self.pages_gather, staging, pool, page_ids, page_bytes)
    }

    /// The inverse of [`gather_pages`](Self::gather_pages): `page page_ids[i] = staging[i]`,
    /// reading the first `page_ids.len()` pages of `staging`.
    pub fn scatter_pages(
        &self,
        pool: &mut CudaSlice<u8>,
        staging: &CudaSlice<u8>,
        page_ids: &[u32],
        page_bytes: usize,
    ) -> Result<()> {
        check_page_copy(staging.len(), pool.len(), page_ids, page_bytes)?;
        self.copy_pages(&self.pages_scatter, pool, staging, page_ids, page_bytes)
    }

    /// Launches `pages_gather` or `pages_scatter` (both `(dst, src, ids, n, page_bytes)`), the
    /// sizes already checked.
    fn copy_pages(
        &self,
        kernel: &CudaFunction,
        dst: &mut CudaSlice<u8>,
        src: &CudaSlice<u8>,
        page_ids: &[u32],
        page_bytes: usize,
    ) -> Result<()> {
        if page_ids.is_empty() {
            return Ok(());
        }
        let ids = self.stream.clone_htod(page_ids)?;
        let (n32, pb) = (page_ids.len() as u32, page_bytes as u64);
        let mut b = self.builder(kernel);
        b.arg(dst).arg(src).arg(&ids).arg(&n32).arg(&pb);
        // SAFETY: matches pages_gather's and pages_scatter's signature (dst, src, ids, n,
        // page_bytes); the callers checked the sizes and ids.
        unsafe { b.launch(page_copy_grid(page_ids.len(), page_bytes)) }?;
        Ok(())
    }
}

/// The power of two the decode kernels leave out of their f16 operands (see `cu/decode.cu`):
/// NVFP4 elements are read as e2m1 * s * 2^-7, FP8 as e4m3 * 2^-8.
fn fmt_factor(dtype: KvDtype) -> f32 {
    match dtype {
        KvDtype::Nvfp4 => 128.0,
        KvDtype::Fp8 => 256.0,
        KvDtype::Bf16 => 1.0,
    }
}

/// Grid of a page copy: y over pages (at most 65535, the kernel strides), x over a page's
/// 16-byte words.
fn page_copy_grid(pages: usize, page_bytes: usize) -> LaunchConfig {
    const BLOCK: u32 = 256;
    let words = (page_bytes / 16) as u64;
    LaunchConfig {
        grid_dim: (
            words.div_ceil(BLOCK as u64).clamp(1, 64) as u32,
            pages.clamp(1, 65_535) as u32,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Up to this many 16-value blocks (a decode step's: 32 sequences of a Llama-3-8B layer, or 256
/// tokens), NVFP4 quantize-on-write under the mse rule runs eight lanes per block (one wave of an
/// H200 at most); past it, one thread per block, which keeps more of the GPU busy per byte.
const MSE_LANES_MAX_BLOCKS: u64 = 32_768;

fn grid_1d(threads: u64) -> LaunchConfig {
    const BLOCK: u64 = 256;
    LaunchConfig {
        grid_dim: (threads.div_ceil(BLOCK) as u32, 1, 1),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Freed device memory the stream-ordered allocator keeps for the next allocation instead of
/// handing it back to the driver at each synchronization (its default). The engine allocates its
/// activations and a prefill launch its split partials per call, and a re-mapped allocation costs
/// tens of microseconds where a pooled one costs one (docs/ARCHITECTURE.md, "The CUDA backend").
const POOL_KEEP_BYTES: u64 = 1 << 30;

/// Sets the release threshold of the device's default memory pool (what `cuMemAllocAsync`
/// draws from) to `bytes`. A driver without memory pools allocates synchronously and has none.
fn keep_freed_memory(ctx: &Arc<CudaContext>, bytes: u64) -> Result<()> {
    use cudarc::driver::sys;
    let supported =
        ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?;
    if supported == 0 {
        return Ok(());
    }
    let device = cudarc::driver::result::device::get(ctx.ordinal() as i32)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut value = bytes;
    // SAFETY: `pool` receives the device's default pool, which lives as long as the device; the
    // attribute's value is a cuuint64_t, read during the call.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, device).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut value as *mut u64).cast(),
        )
        .result()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_scales_follow_the_engine() {
        let g = KvScales { k: 0.5, v: 2.0 };
        assert_eq!(g.work(KvDtype::Fp8), g);
        assert_eq!(g.work(KvDtype::Bf16), g);
        assert_eq!(g.work(KvDtype::Nvfp4), KvScales { k: 3.0, v: 12.0 });
    }

    #[test]
    fn arch_follows_the_device() {
        assert_eq!(arch_for(9, 0).unwrap(), "sm_90");
        assert_eq!(arch_for(8, 0).unwrap(), "sm_80");
        assert_eq!(arch_for(8, 9).unwrap(), "sm_89");
        assert!(arch_for(7, 5).is_err());
    }
}
