//! Prefill and extend attention: the `mma.sync` kernels of `cu/prefill.cu` on every device, and
//! on Hopper (compute capability 9.0) the warpgroup-MMA kernels of `cu/prefill_hopper.cu`
//! (compiled for sm_90a), which run there by default. `NIBBLE_PREFILL_KERNEL=mma` (or
//! [`Kernels::set_prefill_kernel`]) keeps the fallback, to compare the two.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig};
use nibble_kvfmt::KvDtype;

use super::{check, fmt_factor, Kernels};
use crate::{nvrtc, Error, PrefillBatch, Result};

/// `PrefillArgs` of `cu/common.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillArgs {
    n: u32,
    start: u32,
    q_heads: u32,
    kv_heads: u32,
    score_scale: f32,
    v_scale: f32,
    pingpong: u32,
    tma: u32,
}

// SAFETY: #[repr(C)], plain numbers, the same layout as the CUDA struct.
unsafe impl DeviceRepr for PrefillArgs {}

/// Query rows per block of `cu/prefill.cu` (4 warps of 16).
const MMA_ROWS: u32 = 64;
/// Query rows per block of `cu/prefill_hopper.cu` (2 consumer warpgroups of 64), its threads
/// (with the producer warpgroup) and its shared-memory geometry (`H_*` there).
const WGMMA_ROWS: u32 = 128;
const WGMMA_THREADS: u32 = 384;
const WGMMA_KEYS: u32 = 128;
/// K/V stages: 3 for a BF16 workspace, 2 for E4M3 (whose raw staging takes the third's room).
const WGMMA_STAGES: [u32; 2] = [2, 3];

/// Which prefill/extend attention kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    /// `mma.sync` (m16n8k16), every supported device.
    Mma,
    /// Hopper's warpgroup MMA with a producer warpgroup staging K/V through shared memory.
    Wgmma,
}

impl std::fmt::Display for PrefillKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Mma => "mma",
            Self::Wgmma => "wgmma",
        })
    }
}

impl std::str::FromStr for PrefillKernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mma" => Ok(Self::Mma),
            "wgmma" => Ok(Self::Wgmma),
            other => Err(Error::Unsupported(format!(
                "prefill kernel {other:?} (expected mma or wgmma)"
            ))),
        }
    }
}

/// [0: E4M3 workspace, 1: BF16][0: head dim 64, 1: 128]
type Table = [[CudaFunction; 2]; 2];

/// The sm_90a kernels: attention, and the merge of its key splits.
struct Hopper {
    attention: Table,
    combine: CudaFunction,
    /// The partial-output argument of a launch of one split, which never touches it.
    unused: CudaSlice<f32>,
}

/// The loaded prefill kernels and the one that runs.
pub(super) struct PrefillKernels {
    mma: Table,
    wgmma: Option<Hopper>,
    chosen: PrefillKernel,
    tuning: WgmmaTuning,
}

/// How the wgmma kernel runs its launches where a benchmark or a check wants one way rather
/// than the launch's own choice; `None` (the default) leaves a field to the launch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WgmmaTuning {
    /// Over a BF16 workspace the two consumer warpgroups take turns issuing their MMAs
    /// (ping-pong), which a launch does by default; E4M3 never does. With TMA tiles turns are
    /// 4-19% faster on every shape; with `cp.async` tiles they made no difference (run 122,
    /// docs/KERNEL-LAB.md).
    pub pingpong: Option<bool>,
    /// Key splits (at least 1; see [`wgmma_splits`] for the launch's choice).
    pub splits: Option<u32>,
    /// A BF16 workspace's K/V tiles copied by the tensor memory accelerator (one thread of the
    /// producer issues them) rather than by the producer's 128 threads with `cp.async`; see
    /// [`WGMMA_TMA`] for the default. E4M3 tiles are converted as they are staged, so never.
    pub tma: Option<bool>,
}

/// Whether BF16 tiles come by the tensor memory accelerator unless a tuning says otherwise: yes,
/// 10-20% faster on whole prompts and long blocks than the producer's `cp.async` (run 122).
const WGMMA_TMA: bool = true;

/// `TensorMap` of `cu/prefill_hopper.cu`: a `CUtensorMap` as `cuTensorMapEncodeTiled` writes it.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct TensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: 128 plain bytes, aligned as the CUDA struct.
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// The argument of a launch that reads no map (E4M3 tiles, or BF16 ones by `cp.async`).
    fn unused() -> Self {
        Self(cudarc::driver::sys::CUtensorMap { opaque: [0; 16] })
    }

    /// The map of a BF16 workspace's first `keys` key vectors of `width` elements each (every KV
    /// head's), in boxes of 64 elements by `WGMMA_KEYS` keys in the 128-byte swizzle, so a box
    /// lands as `cu/prefill_hopper.cu`'s `tile_offset` lays an atom out. Keys past `keys` read as
    /// zeros.
    fn bf16_workspace(base: u64, width: usize, keys: usize) -> Result<Self> {
        use cudarc::driver::sys;
        let mut map = Self::unused();
        let dims = [width as u64, keys as u64];
        let strides = [(width * 2) as u64];
        let boxes = [64u32, WGMMA_KEYS];
        let elements = [1u32, 1];
        // SAFETY: the arrays hold rank (2) entries, rank - 1 for the strides; `base` is a device
        // allocation of at least `keys * width` BF16 values (checked by the caller), 16-byte
        // aligned, and the row stride a multiple of 16 (head dims of 64 or 128).
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map.0,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                base as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elements.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()?;
        }
        Ok(map)
    }
}

/// Key splits of a wgmma launch: one unless its blocks (128 query rows of one head) leave the
/// device less than full. The extend blocks of a long prompt (256 queries after thousands of
/// keys) are such launches: 64 blocks for 32 heads on 132 multiprocessors. A block takes a whole
/// multiprocessor (its registers and shared memory), so a launch runs in waves of `sms` blocks,
/// and a wave lasts as long as its longest split: the splits chosen are those of the fewest
/// waves × (tiles per split + one tile of pipeline fill and output), fewer on a tie (less to
/// merge), each keeping at least two 128-key tiles to pipeline. 64 blocks over 34 tiles thus
/// take 2 splits (one wave of 18), not 5 (three waves of 8, the last half empty).
fn wgmma_splits(n: usize, start: usize, q_heads: usize, sms: u32) -> u32 {
    let blocks = n.div_ceil(WGMMA_ROWS as usize) * q_heads;
    let sms = (sms as usize).max(1);
    if blocks >= sms {
        return 1;
    }
    let tiles = (start + n).div_ceil(WGMMA_KEYS as usize);
    let cost = |splits: usize| (blocks * splits).div_ceil(sms) * (tiles.div_ceil(splits) + 1);
    (1..=(tiles / 2).max(1))
        .min_by_key(|&splits| (cost(splits), splits))
        .unwrap_or(1) as u32
}

/// Dynamic shared memory of a `cu/prefill_hopper.cu` block (`H_SMEM` there): the f16/BF16
/// stages of K and V tiles, two E4M3 staging buffers, alignment slack and the barriers (full
/// and empty, of K and of V, per stage).
fn wgmma_smem(work_index: usize, head_dim: u32) -> u32 {
    let count = WGMMA_STAGES[work_index];
    let stages = count * 2 * (head_dim / 64) * WGMMA_KEYS * 128;
    let raw = if work_index == 1 {
        0
    } else {
        4 * WGMMA_KEYS * head_dim
    };
    stages + raw + 1024 + count * 4 * 8
}

/// Compiles `cu/prefill_hopper.cu` for sm_90a and loads its kernels, each allowed the shared
/// memory its blocks take.
fn load_hopper(ctx: &Arc<CudaContext>) -> Result<Hopper> {
    let compiled = nvrtc::compile_hopper()?;
    let module = ctx.load_module(compiled.ptx)?;
    let f = |work_index: usize, d: u32| -> Result<CudaFunction> {
        let work = ["fp8", "bf16"][work_index];
        let f = module.load_function(&format!("prefill_hopper_{work}_d{d}"))?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            wgmma_smem(work_index, d) as i32,
        )?;
        Ok(f)
    };
    Ok(Hopper {
        attention: [[f(0, 64)?, f(0, 128)?], [f(1, 64)?, f(1, 128)?]],
        combine: module.load_function("prefill_combine")?,
        unused: ctx.default_stream().alloc_zeros(1)?,
    })
}

impl PrefillKernels {
    /// The `mma.sync` kernels from the compiled `prefill` module (`function`), and on compute
    /// capability 9.0 the sm_90a kernels, compiled here; then the choice of
    /// `NIBBLE_PREFILL_KERNEL` (unset: the fastest the device has).
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        capability: (i32, i32),
        function: impl Fn(&str) -> Result<CudaFunction>,
    ) -> Result<Self> {
        let mma = [
            [function("prefill_fp8_d64")?, function("prefill_fp8_d128")?],
            [
                function("prefill_bf16_d64")?,
                function("prefill_bf16_d128")?,
            ],
        ];
        // sm_90a code runs on compute capability 9.0 alone. A driver that cannot load it leaves
        // prefill on mma.sync, with a warning, rather than the device unusable.
        let wgmma = if capability == (9, 0) {
            match load_hopper(ctx) {
                Ok(hopper) => Some(hopper),
                Err(e) => {
                    tracing::warn!("the wgmma prefill kernel did not load ({e}); prefill attention runs on mma.sync");
                    None
                }
            }
        } else {
            None
        };
        let best = if wgmma.is_some() {
            PrefillKernel::Wgmma
        } else {
            PrefillKernel::Mma
        };
        let mut kernels = Self {
            mma,
            wgmma,
            chosen: best,
            tuning: WgmmaTuning::default(),
        };
        match std::env::var("NIBBLE_PREFILL_KERNEL") {
            Err(std::env::VarError::NotPresent) => {}
            Ok(v) => kernels.choose(v.parse()?)?,
            Err(e) => return Err(Error::Unsupported(format!("NIBBLE_PREFILL_KERNEL: {e}"))),
        }
        Ok(kernels)
    }

    fn choose(&mut self, kernel: PrefillKernel) -> Result<()> {
        if kernel == PrefillKernel::Wgmma && self.wgmma.is_none() {
            return Err(Error::Unsupported(
                "the wgmma prefill kernel (it needs compute capability 9.0 and a driver that \
                 loads sm_90a code)"
                    .into(),
            ));
        }
        self.chosen = kernel;
        Ok(())
    }
}

impl Kernels {
    /// The prefill/extend kernels this device has, fastest last.
    pub fn prefill_kernels(&self) -> Vec<PrefillKernel> {
        let mut all = vec![PrefillKernel::Mma];
        if self.prefill.wgmma.is_some() {
            all.push(PrefillKernel::Wgmma);
        }
        all
    }

    /// The prefill/extend kernel that runs.
    pub fn prefill_kernel(&self) -> PrefillKernel {
        self.prefill.chosen
    }

    /// Runs `kernel` for prefill and extend from now on; an error if the device lacks it.
    pub fn set_prefill_kernel(&mut self, kernel: PrefillKernel) -> Result<()> {
        self.prefill.choose(kernel)
    }

    /// Overrides the wgmma kernel's own choices (ping-pong, key splits, TMA tiles) from now on,
    /// for benchmarks and checks of each way; the default tuning leaves them to each launch.
    pub fn set_wgmma_tuning(&mut self, tuning: WgmmaTuning) -> Result<()> {
        if tuning.splits == Some(0) {
            return Err(Error::Unsupported("a wgmma launch of 0 key splits".into()));
        }
        self.prefill.tuning = tuning;
        Ok(())
    }

    /// The overrides [`Kernels::set_wgmma_tuning`] set (none by default).
    pub fn wgmma_tuning(&self) -> WgmmaTuning {
        self.prefill.tuning
    }

    /// Causal attention of one sequence's `n` new queries (positions `start..start + n`) over
    /// the work-dtype workspace holding its first `start + n` tokens (E4M3 for fp8 and nvfp4
    /// caches, BF16 for a bf16 cache): the initial prefill (`start` = 0) and extend paths.
    /// Writes `out` (`[row][q_head][head_dim]` f32).
    pub fn prefill(&self, batch: &PrefillBatch<'_>, out: &mut CudaSlice<f32>) -> Result<()> {
        let d = batch.head_dim;
        let dim_index = match d {
            64 => 0,
            128 => 1,
            _ => {
                return Err(Error::Unsupported(format!(
                    "prefill with head dim {d} (64 or 128)"
                )))
            }
        };
        let (q_heads, kv_heads) = (batch.q_heads, batch.kv_heads);
        if kv_heads == 0 || q_heads == 0 || q_heads % kv_heads != 0 {
            return Err(Error::Unsupported(format!(
                "{q_heads} query heads over {kv_heads} KV heads"
            )));
        }
        let (work_index, width, (gk, gv)) = match batch.work {
            KvDtype::Fp8 => (0, 1, (batch.work_scales.k, batch.work_scales.v)),
            // a BF16 workspace has no scale (docs/FORMAT.md)
            KvDtype::Bf16 => (1, 2, (1.0, 1.0)),
            KvDtype::Nvfp4 => {
                return Err(Error::Unsupported(
                    "an nvfp4 workspace (the work dtype of an nvfp4 cache is fp8)".into(),
                ))
            }
        };
        let n = batch.n;
        check("queries", n * q_heads * d, batch.q.len())?;
        check("outputs", n * q_heads * d, out.len())?;
        let context = (batch.start + n) * kv_heads * d * width;
        if batch.k.len() < context || batch.v.len() < context {
            return Err(Error::Shape {
                what: "workspace bytes (at least)",
                expected: context,
                actual: batch.k.len().min(batch.v.len()),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let args = PrefillArgs {
            n: n as u32,
            start: batch.start as u32,
            q_heads: q_heads as u32,
            kv_heads: kv_heads as u32,
            score_scale: batch.softmax_scale
                * gk
                * fmt_factor(batch.work)
                * std::f32::consts::LOG2_E,
            v_scale: gv * fmt_factor(batch.work),
            pingpong: 0,
            tma: 0,
        };
        match (self.prefill.chosen, &self.prefill.wgmma) {
            (PrefillKernel::Wgmma, Some(hopper)) => {
                self.prefill_wgmma(hopper, batch, (work_index, dim_index), args, out)
            }
            _ => {
                let cfg = LaunchConfig {
                    grid_dim: ((n as u32).div_ceil(MMA_ROWS), q_heads as u32, 1),
                    block_dim: (MMA_ROWS * 2, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.builder(&self.prefill.mma[work_index][dim_index]);
                b.arg(batch.q).arg(batch.k).arg(batch.v).arg(out).arg(&args);
                // SAFETY: matches prefill_*'s signature; q, out and the workspace were checked.
                unsafe { b.launch(cfg) }?;
                Ok(())
            }
        }
    }

    /// The wgmma launch, split over the keys where its blocks alone leave the device less than
    /// full (see [`wgmma_splits`]), and then the merge of the splits.
    fn prefill_wgmma(
        &self,
        hopper: &Hopper,
        batch: &PrefillBatch<'_>,
        (work_index, dim_index): (usize, usize),
        mut args: PrefillArgs,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (n, q_heads, d) = (batch.n, batch.q_heads, batch.head_dim);
        let tuning = self.prefill.tuning;
        let splits = tuning
            .splits
            .unwrap_or_else(|| wgmma_splits(n, batch.start, q_heads, self.sms));
        args.pingpong = u32::from(tuning.pingpong.unwrap_or(true));
        let tma = batch.work == KvDtype::Bf16 && tuning.tma.unwrap_or(WGMMA_TMA);
        args.tma = u32::from(tma);
        let (tk, tv) = if tma {
            let (width, keys) = (batch.kv_heads * d, batch.start + n);
            let (k, _k) = batch.k.device_ptr(&self.stream);
            let (v, _v) = batch.v.device_ptr(&self.stream);
            (
                TensorMap::bf16_workspace(k, width, keys)?,
                TensorMap::bf16_workspace(v, width, keys)?,
            )
        } else {
            (TensorMap::unused(), TensorMap::unused())
        };
        // [split][row][head][D] partial outputs, then [split][row][head] (max, sum); a launch of
        // one split writes `out` and takes `hopper.unused` in their place
        let part = if splits > 1 {
            let len = splits as usize * n * q_heads * (d + 2);
            // SAFETY: every element prefill_combine reads is written first: each split writes
            // every row's partial output and (max, sum), also a split that saw no key.
            Some(unsafe { self.stream.alloc::<f32>(len) }?)
        } else {
            None
        };
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(WGMMA_ROWS), q_heads as u32, splits),
            block_dim: (WGMMA_THREADS, 1, 1),
            shared_mem_bytes: wgmma_smem(work_index, d as u32),
        };
        let mut b = self.builder(&hopper.attention[work_index][dim_index]);
        b.arg(batch.q)
            .arg(batch.k)
            .arg(batch.v)
            .arg(&mut *out)
            .arg(part.as_ref().unwrap_or(&hopper.unused))
            .arg(&args)
            .arg(&tk)
            .arg(&tv);
        // SAFETY: matches prefill_hopper_*'s signature; q, out and the workspace were checked,
        // `part` holds `splits` splits' outputs when there are several.
        unsafe { b.launch(cfg) }?;
        if let Some(part) = part {
            let (n32, qh32, d32) = (n as u32, q_heads as u32, d as u32);
            let cfg = LaunchConfig {
                grid_dim: (n32, qh32.div_ceil(4), 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.builder(&hopper.combine);
            b.arg(&part).arg(out).arg(&n32).arg(&qh32).arg(&d32);
            b.arg(&splits).arg(&args.v_scale);
            // SAFETY: matches prefill_combine's signature; `part` and `out` are sized above.
            unsafe { b.launch(cfg) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_names_parse_and_print_back() {
        for k in [PrefillKernel::Mma, PrefillKernel::Wgmma] {
            assert_eq!(k.to_string().parse::<PrefillKernel>().unwrap(), k);
        }
        let err = "tensor".parse::<PrefillKernel>().unwrap_err().to_string();
        assert!(
            err.contains("\"tensor\"") && err.contains("mma or wgmma"),
            "{err}"
        );
    }

    #[test]
    fn a_wgmma_block_fits_hoppers_shared_memory() {
        // 227 KB per block on compute capability 9.0
        for work_index in 0..2 {
            for d in [64, 128] {
                assert!(wgmma_smem(work_index, d) <= 232_448, "{work_index} {d}");
            }
        }
        assert_eq!(wgmma_smem(0, 128), 131_072 + 65_536 + 1_088);
        assert_eq!(wgmma_smem(1, 128), 196_608 + 1_120);
    }

    #[test]
    fn only_launches_that_leave_the_device_less_than_full_split_their_keys() {
        // a 4K prompt: 32 x 32 blocks on 132 multiprocessors
        assert_eq!(wgmma_splits(4096, 0, 32, 132), 1);
        // a long prompt's 256-query extend blocks: 64 blocks, two splits make one wave (five made
        // 320 blocks: three waves, the last under half full)
        assert_eq!(wgmma_splits(256, 4096, 32, 132), 2);
        assert_eq!(wgmma_splits(256, 16_128, 32, 132), 2);
        assert_eq!(wgmma_splits(256, 32_512, 32, 132), 2);
        // its first block has two tiles of keys: one split
        assert_eq!(wgmma_splits(256, 0, 32, 132), 1);
        assert_eq!(wgmma_splits(256, 256, 32, 132), 2);
        assert_eq!(wgmma_splits(1, 0, 1, 132), 1);
        // few heads: as many splits as one wave holds, while each keeps two tiles
        assert_eq!(wgmma_splits(256, 4096, 9, 132), 7);
        assert_eq!(wgmma_splits(100, 700, 2, 132), 3);
    }
}
