//! [`CudaBackend`]: nibble-engine's [`Backend`] on one CUDA device.
//!
//! * Tensors are f32 device buffers ([`CudaTensor`]), row-major, grown on demand and never
//!   shrunk. Weight matrices are dequantized on the host with the engine's exact GGML decoders
//!   and stored in the backend's [`WeightPrecision`] (`weights`): BF16 codes by default (rounded
//!   on the host, so no f32 copy reaches the device), or f32 (`NIBBLE_CUDA_WEIGHTS=f32`), whose
//!   values equal the CPU backend's. Vectors (norms, biases) are always f32.
//! * GEMMs (`matmul_t`) go to cuBLAS, loaded at run time like NVRTC: `cublasGemmEx` over BF16
//!   weights and BF16-cast activations with f32 accumulation and output, or SGEMM over f32
//!   weights (FP32, default math mode: no TF32). Without cuBLAS a tiled f32 kernel of `cu/ops.cu`
//!   runs instead (also chosen by `NIBBLE_CUDA_GEMM=tiled`), and weights stay f32 for it. The
//!   elementwise kernels (embedding, RMSNorm, RoPE in both pairings,
//!   SwiGLU, residual/bias adds) and the contiguous-cache f32 attention are in `cu/ops.cu`,
//!   compiled with `--fmad=false`.
//! * Paged KV ([`CudaPages`]) lives in device memory with exactly the bytes of
//!   `nibble_kvfmt::PageLayout`: new tokens are written by [`Kernels::quantize`], decode reads
//!   pages through [`Kernels::decode`], initial prefill and extend run [`Kernels::prefill`] over
//!   the work-dtype workspace (the cached prefix gathered by [`Kernels::gather_work`], the new
//!   tokens encoded by `encode_work`), as the CPU paths of `nibble_engine::paged` do.
//! * Logits are copied to the host (`download_rows`); sampling stays on the host.
//!
//! The trait's kernels return `()`: a CUDA failure inside one of them (a lost device, out of
//! memory) panics with the driver's message. Everything that can fail for a reason the caller
//! controls (geometry, head dim, Hadamard) is rejected up front with an error.

use std::fmt::Display;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, LaunchConfig};
use nibble_engine::backend::{AttentionArgs, Backend, PageEncoding, PagedSeq, RopeArgs};
use nibble_engine::kv::StepTokens;
use nibble_engine::{Error as EngineError, Result as EngineResult, RopeStyle};
use nibble_kvcache::{GlobalScales, PageId, PagePool, PoolPlan, SlotId};
use nibble_kvfmt::{e2m1, KvDtype, KvPart, PageLayout, ScaleRule, WindowLayout};

use crate::libs::Search;
use crate::{
    nvrtc, DecodeBatch, DecodeWorkspace, Error, Kernels, PageGeom, PrefillBatch, Result, WindowGeom,
};

mod rotate;
mod weights;

use weights::{to_bf16, Bf16Gemm};
pub use weights::{WeightPrecision, WEIGHTS_ENV};

/// The dense kernels' source (compiled separately: `--fmad=false`).
pub(crate) const OPS_SOURCE: &str = include_str!("cu/ops.cu");

/// Entry points of `cu/ops.cu`.
pub const OPS_ENTRY_POINTS: [&str; 26] = [
    "embed_rows",
    "embed_rows_bf16",
    "f32_to_bf16",
    "gemv_bf16_n1",
    "gemv_bf16_n2",
    "gemv_bf16_n1_x2",
    "gemv_bf16_n2_x2",
    "gemv_bf16_n1_x3",
    "gemv_bf16_n2_x3",
    "gemm_bf16_skinny8",
    "gemm_bf16_skinny8_x2",
    "gemm_bf16_skinny8_x3",
    "gemm_bf16_skinny16",
    "gemm_bf16_skinny16_x2",
    "gemm_bf16_skinny16_x3",
    "add_f32",
    "add_bias_f32",
    "mul_cols_f32",
    "hadamard_f32",
    "silu_mul_f32",
    "rms_norm_f32",
    "add_rms_norm_f32",
    "rope_f32",
    "attention_f32",
    "encode_work",
    "gemm_nt_f32",
];

/// Compiles `cu/ops.cu` for `arch` (the compile test calls this with no GPU).
pub fn compile_ops(arch: &'static str) -> Result<nvrtc::Compiled> {
    nvrtc::compile("ops", OPS_SOURCE, arch, &["--fmad=false"])
}

/// Largest context of the contiguous-cache attention kernel (its scores sit in 48 KiB of shared
/// memory, next to 1 KiB of reductions).
const MAX_CONTIGUOUS_CONTEXT: usize = 11 * 1024;

/// A device tensor: `rows × cols`, row-major, in the first `rows * cols` values of `data`.
pub struct CudaTensor {
    data: Data,
    rows: usize,
    cols: usize,
    /// Which tensor this is (unique in the process) and how many times its values may have
    /// changed (every mutable access counts): together they say whether a copy made from it
    /// (the BF16 cast of `matmul_t`) is still current.
    id: u64,
    version: u64,
}

/// The values of a [`CudaTensor`].
enum Data {
    /// Activations, vectors, and weight matrices under [`WeightPrecision::F32`].
    F32(CudaSlice<f32>),
    /// BF16 codes of a weight matrix ([`WeightPrecision::Bf16`]): read only as the `w` of
    /// `matmul_t` and the table of `embed`.
    Bf16(CudaSlice<u16>),
}

impl CudaTensor {
    fn new(data: Data, rows: usize, cols: usize) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Self {
            data,
            rows,
            cols,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            version: 0,
        }
    }

    /// The state of the values a copy is made from: (tensor, version, values).
    fn stamp(&self) -> (u64, u64, usize) {
        (self.id, self.version, self.len())
    }

    fn len(&self) -> usize {
        self.rows * self.cols
    }

    fn f32(&self) -> &CudaSlice<f32> {
        match &self.data {
            Data::F32(b) => b,
            Data::Bf16(_) => panic!("{BF16_MISUSE}"),
        }
    }

    fn f32_mut(&mut self) -> &mut CudaSlice<f32> {
        self.version += 1;
        match &mut self.data {
            Data::F32(b) => b,
            Data::Bf16(_) => panic!("{BF16_MISUSE}"),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }
}

enum GemmImpl {
    Cublas(CudaBlas),
    Tiled,
}

const BF16_MISUSE: &str =
    "a BF16 weight matrix was passed where f32 values are needed (only matmul_t's w and embed's \
     table may be BF16)";

struct Ops {
    embed: CudaFunction,
    embed_bf16: CudaFunction,
    to_bf16: CudaFunction,
    /// nibble's BF16-weight GEMMs by [`RowsKernel::index`] (the weight-streaming kernel for 1
    /// and 2 rows, the skinny tensor-core one for 3 to 8 and 9 to 16), each over 1, 2 and 3
    /// matrices of one input.
    rows: [[CudaFunction; 3]; 4],
    add: CudaFunction,
    add_bias: CudaFunction,
    mul_cols: CudaFunction,
    hadamard: CudaFunction,
    silu_mul: CudaFunction,
    rms_norm: CudaFunction,
    add_rms_norm: CudaFunction,
    rope: CudaFunction,
    attention: CudaFunction,
    encode_work: CudaFunction,
    gemm: CudaFunction,
    argmax: CudaFunction,
}

/// The CUDA backend: one device, its default stream, the nibble kernels and cuBLAS.
pub struct CudaBackend {
    ordinal: usize,
    kernels: Kernels,
    ops: Ops,
    gemm: GemmImpl,
    weights: WeightPrecision,
    /// The BF16 cast of `matmul_t`'s activations (BF16 weights), grown on demand; used in stream
    /// order, so one buffer serves every GEMM.
    x_bf16: Mutex<Bf16Cast>,
    /// RoPE's positions: every layer rotates Q and K at the same ones.
    positions: Mutex<Uploaded>,
}

/// Which of nibble's BF16-weight GEMM kernels serves `n` rows of `x` (decode steps): the
/// weight-streaming kernel (`gemv_bf16_n*`) for 1 and 2 rows, where it beats cuBLAS (run 60),
/// the skinny tensor-core GEMM for 3 to 8 (`gemm_bf16_skinny8*`, one tile of 8 rows) and 9 to
/// 16 (`gemm_bf16_skinny16*`, two): a layer's GEMMs take 132 us against cuBLAS's 166 at 8 rows
/// (run 67) and 144 against 174 at 16 (run 72). More rows, or rows whose length is not a
/// multiple of 32, go to cuBLAS.
/// The input of [`CudaBackend::launch_norm`].
enum NormInput<'a> {
    /// `rms_norm(x)`.
    Plain(&'a CudaTensor),
    /// `x += y`, then `rms_norm(x)` (whole rows).
    Residual(&'a mut CudaTensor, &'a CudaTensor),
}

/// The most output features (of all matrices of one call) the skinny GEMM takes.
const SKINNY_MAX_FEATURES: usize = 65_536;

#[derive(Clone, Copy, Debug, PartialEq)]
enum RowsKernel {
    Gemv { rows: usize },
    Skinny,
    Skinny16,
}

impl RowsKernel {
    /// The kernel for `n` rows of `k` values times weight matrices of `m` output features in
    /// all, if one of ours serves it.
    fn pick(n: usize, k: usize, m: usize) -> Option<Self> {
        if !k.is_multiple_of(32) {
            return None;
        }
        match n {
            1 | 2 => Some(Self::Gemv { rows: n }),
            // The vocabulary projection stays on cuBLAS: 8,016 short-lived blocks of 16 warps
            // took 279 us against its 262 at 8 rows (run 67).
            3..=8 if m <= SKINNY_MAX_FEATURES => Some(Self::Skinny),
            9..=16 if m <= SKINNY_MAX_FEATURES => Some(Self::Skinny16),
            _ => None,
        }
    }

    /// Row of `Ops::rows`.
    fn index(self) -> usize {
        match self {
            Self::Gemv { rows } => rows - 1,
            Self::Skinny => 2,
            Self::Skinny16 => 3,
        }
    }

    /// Weight rows per block and threads per block (`GEMV_ROWS`, `SKINNY_WARPS` in `cu/ops.cu`).
    fn block(self) -> (u32, u32) {
        match self {
            Self::Gemv { .. } => (4, 128),
            Self::Skinny | Self::Skinny16 => (16, 16 * 32),
        }
    }
}

/// The BF16 cast of an activation tensor and the tensor state it was made from: GEMMs that read
/// the same input (Q, K and V; gate and up) cast it once.
struct Bf16Cast {
    buf: CudaSlice<u16>,
    of: Option<(u64, u64, usize)>,
}

/// Whether a CUDA driver with at least one device is present (for `--device auto`).
pub fn cuda_available() -> bool {
    // SAFETY: only tries to open the driver library by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    matches!(CudaContext::device_count(), Ok(n) if n > 0)
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles every kernel and loads cuBLAS (falling back to the tiled
    /// GEMM, with a note on stderr, when cuBLAS is not found). Weights are stored as
    /// `NIBBLE_CUDA_WEIGHTS` says ([`WeightPrecision::from_env`]: BF16 unless it is "f32").
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_weights(ordinal, WeightPrecision::from_env()?)
    }

    /// As [`CudaBackend::new`], with the weight precision given (the environment is not read for
    /// it). The tiled GEMM reads f32 weights: without cuBLAS the precision is f32 whatever is
    /// asked ([`CudaBackend::weights`] tells).
    pub fn with_weights(ordinal: usize, weights: WeightPrecision) -> Result<Self> {
        let kernels = Kernels::new(ordinal)?;
        let ctx = kernels.context().clone();
        let module = ctx.load_module(compile_ops(kernels.arch())?.ptx)?;
        let f = |name: &str| module.load_function(name);
        // One kernel over 1, 2 and 3 matrices: NAME, NAME_x2, NAME_x3.
        let by_parts = |name: &str| -> std::result::Result<[CudaFunction; 3], _> {
            Ok::<_, cudarc::driver::DriverError>([
                f(name)?,
                f(&format!("{name}_x2"))?,
                f(&format!("{name}_x3"))?,
            ])
        };
        let ops = Ops {
            embed: f("embed_rows")?,
            embed_bf16: f("embed_rows_bf16")?,
            to_bf16: f("f32_to_bf16")?,
            rows: [
                by_parts("gemv_bf16_n1")?,
                by_parts("gemv_bf16_n2")?,
                by_parts("gemm_bf16_skinny8")?,
                by_parts("gemm_bf16_skinny16")?,
            ],
            add: f("add_f32")?,
            add_bias: f("add_bias_f32")?,
            mul_cols: f("mul_cols_f32")?,
            hadamard: f("hadamard_f32")?,
            silu_mul: f("silu_mul_f32")?,
            rms_norm: f("rms_norm_f32")?,
            add_rms_norm: f("add_rms_norm_f32")?,
            rope: f("rope_f32")?,
            attention: f("attention_f32")?,
            encode_work: f("encode_work")?,
            gemm: f("gemm_nt_f32")?,
            argmax: f("argmax_rows_f32")?,
        };
        let forced_tiled = std::env::var("NIBBLE_CUDA_GEMM").is_ok_and(|v| v == "tiled");
        let gemm = if forced_tiled {
            GemmImpl::Tiled
        } else {
            match load_cublas() {
                Ok(_) => GemmImpl::Cublas(
                    CudaBlas::new(kernels.stream().clone())
                        .map_err(|e| Error::NoDevice(format!("cuBLAS: {e:?}")))?,
                ),
                Err(why) => {
                    eprintln!("nibble: cuBLAS not loaded ({why}); using the tiled f32 GEMM");
                    GemmImpl::Tiled
                }
            }
        };
        let weights = match gemm {
            GemmImpl::Cublas(_) => weights,
            GemmImpl::Tiled => WeightPrecision::F32,
        };
        let x_bf16 = Mutex::new(Bf16Cast {
            buf: kernels.stream().alloc_zeros(1)?,
            of: None,
        });
        Ok(Self {
            ordinal,
            kernels,
            ops,
            gemm,
            weights,
            x_bf16,
            positions: Mutex::default(),
        })
    }

    /// How weight matrices are stored (and so which GEMM `matmul_t` runs).
    pub fn weights(&self) -> WeightPrecision {
        self.weights
    }

    /// "cublas" or "tiled".
    pub fn gemm_name(&self) -> &'static str {
        match self.gemm {
            GemmImpl::Cublas(_) => "cublas",
            GemmImpl::Tiled => "tiled",
        }
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.kernels.stream()
    }

    fn bind(&self) {
        self.kernels
            .context()
            .bind_to_thread()
            .unwrap_or_else(|e| panic!("CUDA: cannot bind the context: {e}"));
    }

    fn alloc(&self, n: usize) -> CudaSlice<f32> {
        self.stream()
            .alloc_zeros(n.max(1))
            .unwrap_or_else(|e| panic!("CUDA: cannot allocate {n} f32: {e}"))
    }

    fn htod_u32(&self, data: &[u32]) -> CudaSlice<u32> {
        if data.is_empty() {
            return self.stream().alloc_zeros(1).expect("CUDA alloc");
        }
        self.stream()
            .clone_htod(data)
            .unwrap_or_else(|e| panic!("CUDA: host-to-device copy: {e}"))
    }

    /// Rows `rows` of `t` into a new exactly-sized buffer.
    fn rows_of(&self, t: &CudaTensor, rows: Range<usize>) -> Result<CudaSlice<f32>> {
        let c = t.cols;
        let mut out = self.stream().alloc_zeros((rows.len() * c).max(1))?;
        if !rows.is_empty() {
            self.stream().memcpy_dtod(
                &t.f32().slice(rows.start * c..rows.end * c),
                &mut out.slice_mut(0..rows.len() * c),
            )?;
        }
        Ok(out)
    }
}

fn grid(n: u64) -> LaunchConfig {
    const BLOCK: u64 = 256;
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK).max(1) as u32, 1, 1),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn launched(r: std::result::Result<(), cudarc::driver::DriverError>, what: &str) {
    if let Err(e) = r {
        panic!("CUDA: {what} failed: {e}");
    }
}

fn engine_err(e: impl Display) -> EngineError {
    EngineError::InvalidInput(format!("CUDA backend: {e}"))
}

/// Where cuBLAS is looked for (`crate::libs`'s order).
const CUBLAS: Search = Search {
    env: "NIBBLE_CUBLAS_LIB",
    names: &["libcublas.so.13", "libcublas.so.12"],
    wheel_dirs: &["nvidia/cu13/lib", "nvidia/cublas/lib"],
    system_dirs: &["/usr/local/cuda/lib64"],
};

/// Opens cuBLAS (and cuBLASLt beside it) by absolute path so that cudarc's by-name lookup finds
/// them, from `NIBBLE_CUBLAS_LIB` (file or directory), the loader path, the PyPI wheels under
/// python3's site-packages, or /usr/local/cuda/lib64.
fn load_cublas() -> std::result::Result<PathBuf, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading cuBLAS runs its initializers, which have no preconditions.
    let open = |p: &std::path::Path| unsafe { Library::open(Some(p), RTLD_NOW | RTLD_GLOBAL) };
    let found = CUBLAS.find(|file| {
        let name = file.file_name().unwrap_or_default().to_string_lossy();
        if let Ok(lt) = open(&file.with_file_name(name.replace("cublas", "cublasLt"))) {
            std::mem::forget(lt);
        }
        std::mem::forget(open(file).map_err(|e| e.to_string())?);
        // SAFETY: only checks that the library now opens by name.
        if unsafe { cudarc::cublas::sys::is_culib_present() } {
            Ok(())
        } else {
            Err("opened, but not by name".into())
        }
    });
    found
        .map(|(file, ())| file)
        .map_err(|tried| format!("libcublas not found; looked in {tried}"))
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;

    fn name(&self) -> String {
        format!(
            "cuda:{} ({}, {} GEMM, {} weights)",
            self.ordinal,
            self.kernels.arch(),
            self.gemm_name(),
            self.weights.as_str()
        )
    }

    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.bind();
        f()
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> EngineResult<CudaTensor> {
        if data.len() != rows * cols {
            return Err(EngineError::InvalidInput(format!(
                "{} values do not make a {rows}x{cols} tensor",
                data.len()
            )));
        }
        self.bind();
        let buf = if data.is_empty() {
            self.alloc(0)
        } else {
            self.stream().clone_htod(data).map_err(engine_err)?
        };
        Ok(CudaTensor::new(Data::F32(buf), rows, cols))
    }

    // `upload_weight` is the trait's: GGML blocks dequantized on the host, then `upload_matrix`.

    fn upload_matrix(&self, rows: usize, cols: usize, data: Vec<f32>) -> EngineResult<CudaTensor> {
        if self.weights == WeightPrecision::F32 {
            return self.upload_vec(rows, cols, data);
        }
        // Rounded on the host: only the BF16 codes reach the device.
        let codes = to_bf16(&data);
        drop(data);
        self.bind();
        let buf = if codes.is_empty() {
            self.stream().alloc_zeros(1).map_err(engine_err)?
        } else {
            self.stream().clone_htod(&codes).map_err(engine_err)?
        };
        Ok(CudaTensor::new(Data::Bf16(buf), rows, cols))
    }

    fn zeros(&self, rows: usize, cols: usize) -> CudaTensor {
        self.bind();
        CudaTensor::new(Data::F32(self.alloc(rows * cols)), rows, cols)
    }

    fn resize(&self, t: &mut CudaTensor, rows: usize, cols: usize) {
        if t.f32().len() < rows * cols {
            self.bind();
            t.data = Data::F32(self.alloc(rows * cols));
        }
        t.version += 1;
        t.rows = rows;
        t.cols = cols;
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn download_rows(&self, t: &CudaTensor, rows: Range<usize>, out: &mut Vec<f32>) {
        if rows.is_empty() {
            return;
        }
        self.bind();
        let host = self
            .stream()
            .clone_dtoh(&t.f32().slice(rows.start * t.cols..rows.end * t.cols))
            .unwrap_or_else(|e| panic!("CUDA: device-to-host copy: {e}"));
        out.extend_from_slice(&host);
    }

    fn argmax_rows(&self, t: &CudaTensor, out: &mut Vec<u32>) {
        if t.rows == 0 {
            return;
        }
        self.bind();
        let mut dev: CudaSlice<u32> = self
            .stream()
            .alloc_zeros(t.rows)
            .unwrap_or_else(|e| panic!("CUDA: cannot allocate {} u32: {e}", t.rows));
        let cols = t.cols as u32;
        let mut b = self.kernels.builder(&self.ops.argmax);
        b.arg(t.f32()).arg(&mut dev).arg(&cols);
        let cfg = LaunchConfig {
            grid_dim: (t.rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches argmax_rows_f32; t holds rows * cols values, dev one per row.
        launched(unsafe { b.launch(cfg) }.map(|_| ()), "argmax_rows");
        let host = self
            .stream()
            .clone_dtoh(&dev)
            .unwrap_or_else(|e| panic!("CUDA: device-to-host copy: {e}"));
        out.extend_from_slice(&host);
    }

    fn copy_rows(
        &self,
        src: &CudaTensor,
        src_row: usize,
        dst: &mut CudaTensor,
        dst_row: usize,
        n: usize,
    ) {
        assert_eq!(src.cols, dst.cols, "copy_rows: column counts differ");
        assert!(
            src_row + n <= src.rows && dst_row + n <= dst.rows,
            "copy_rows: rows"
        );
        if n == 0 {
            return;
        }
        self.bind();
        let c = src.cols;
        launched(
            self.stream().memcpy_dtod(
                &src.f32().slice(src_row * c..(src_row + n) * c),
                &mut dst.f32_mut().slice_mut(dst_row * c..(dst_row + n) * c),
            ),
            "copy_rows",
        );
    }

    fn embed(&self, table: &CudaTensor, tokens: &[u32], out: &mut CudaTensor) {
        assert_eq!(
            (out.rows, out.cols),
            (tokens.len(), table.cols),
            "embed: output shape"
        );
        if tokens.is_empty() {
            return;
        }
        assert!(
            tokens.iter().all(|&t| (t as usize) < table.rows),
            "embed: token out of range"
        );
        self.bind();
        let dev = self.htod_u32(tokens);
        let (n, cols) = (tokens.len() as u32, table.cols as u32);
        let mut b;
        match &table.data {
            Data::F32(t) => {
                b = self.kernels.builder(&self.ops.embed);
                b.arg(out.f32_mut()).arg(t);
            }
            Data::Bf16(t) => {
                b = self.kernels.builder(&self.ops.embed_bf16);
                b.arg(out.f32_mut()).arg(t);
            }
        }
        b.arg(&dev).arg(&n).arg(&cols);
        // SAFETY: matches embed_rows / embed_rows_bf16; out holds n*cols values, tokens are
        // < table.rows.
        launched(
            unsafe { b.launch(grid(n as u64 * cols as u64)) }.map(|_| ()),
            "embed",
        );
    }

    fn matmul_t_many(&self, x: &CudaTensor, ws: &[&CudaTensor], outs: &mut [&mut CudaTensor]) {
        assert_eq!(ws.len(), outs.len(), "matmul_t_many: one output per weight");
        let (n, k) = (x.rows, x.cols);
        let features = ws.iter().map(|w| w.rows).sum();
        let ours = RowsKernel::pick(n, k, features).filter(|_| {
            matches!(self.gemm, GemmImpl::Cublas(_))
                && (2..=3).contains(&ws.len())
                && ws
                    .iter()
                    .all(|w| w.cols == k && w.rows > 0 && matches!(w.data, Data::Bf16(_)))
        });
        let Some(kernel) = ours else {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul_t(x, w, out);
            }
            return;
        };
        for (w, out) in ws.iter().zip(outs.iter()) {
            assert_eq!(
                (out.rows, out.cols),
                (n, w.rows),
                "matmul_t_many: output shape"
            );
        }
        self.bind();
        let cast = self.cast_bf16(x);
        self.launch_rows(kernel, &cast.buf, ws, outs, n, k);
    }

    fn matmul_t(&self, x: &CudaTensor, w: &CudaTensor, out: &mut CudaTensor) {
        let (n, k, m) = (x.rows, x.cols, w.rows);
        assert_eq!(w.cols, k, "matmul_t: inner dims differ");
        assert_eq!((out.rows, out.cols), (n, m), "matmul_t: output shape");
        if n == 0 || m == 0 {
            return;
        }
        self.bind();
        match (&self.gemm, &w.data) {
            (GemmImpl::Cublas(blas), Data::F32(wb)) => {
                // Row-major out[n][m] = x[n][k] · w[m][k]ᵀ is, column-major, outᵀ (m × n) =
                // wᵀ (w read as k × m, transposed) · xᵀ (x read as k × n).
                let cfg = GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_T,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: m as i32,
                    n: n as i32,
                    k: k as i32,
                    alpha: 1.0f32,
                    lda: k as i32,
                    ldb: k as i32,
                    beta: 0.0f32,
                    ldc: m as i32,
                };
                let mut o = out.f32_mut().slice_mut(0..n * m);
                // SAFETY: the views hold m*k, n*k and n*m values (shapes asserted above).
                let r = unsafe {
                    blas.gemm(cfg, &wb.slice(0..m * k), &x.f32().slice(0..n * k), &mut o)
                };
                if let Err(e) = r {
                    panic!("cuBLAS SGEMM failed: {e:?}");
                }
            }
            (GemmImpl::Cublas(blas), Data::Bf16(wb)) => {
                let values = n * k;
                let cast = self.cast_bf16(x);
                let xs = &cast.buf;
                if let Some(kernel) = RowsKernel::pick(n, k, m) {
                    self.launch_rows(kernel, xs, &[w], &mut [out], n, k);
                    return;
                }
                let gemm = Bf16Gemm { n, m, k };
                let mut o = out.f32_mut().slice_mut(0..n * m);
                // SAFETY: the views hold m*k, n*k and n*m values (shapes asserted above).
                let r = unsafe {
                    gemm.run(
                        blas,
                        self.stream(),
                        &wb.slice(0..m * k),
                        &xs.slice(0..values),
                        &mut o,
                    )
                };
                if let Err(e) = r {
                    panic!("cuBLAS GemmEx (BF16) failed: {e:?}");
                }
            }
            (GemmImpl::Tiled, Data::F32(wb)) => {
                let (n32, m32, k32) = (n as u32, m as u32, k as u32);
                let cfg = LaunchConfig {
                    grid_dim: (m32.div_ceil(16), n32.div_ceil(16), 1),
                    block_dim: (16, 16, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.kernels.builder(&self.ops.gemm);
                b.arg(x.f32())
                    .arg(wb)
                    .arg(out.f32_mut())
                    .arg(&n32)
                    .arg(&m32)
                    .arg(&k32);
                // SAFETY: matches gemm_nt_f32; buffers hold at least n*k, m*k, n*m values.
                launched(unsafe { b.launch(cfg) }.map(|_| ()), "gemm");
            }
            // `with_weights` keeps weights f32 whenever the GEMM is the tiled kernel.
            (GemmImpl::Tiled, Data::Bf16(_)) => unreachable!("the tiled GEMM has f32 weights"),
        }
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaTensor) {
        self.per_column(&self.ops.add_bias, x, bias, "add_bias");
    }

    fn mul_cols(&self, x: &mut CudaTensor, scale: &CudaTensor) {
        self.per_column(&self.ops.mul_cols, x, scale, "mul_cols");
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add: shapes differ");
        let n = x.len() as u64;
        if n == 0 {
            return;
        }
        self.bind();
        let mut b = self.kernels.builder(&self.ops.add);
        b.arg(x.f32_mut()).arg(y.f32()).arg(&n);
        // SAFETY: matches add_f32; both hold n values.
        launched(unsafe { b.launch(grid(n)) }.map(|_| ()), "add");
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaTensor, eps: f32, out: &mut CudaTensor) {
        let w = weight.len();
        assert!(
            w > 0 && x.cols.is_multiple_of(w),
            "rms_norm: weight width {w} vs {} cols",
            x.cols
        );
        assert_eq!(
            (out.rows, out.cols),
            (x.rows, x.cols),
            "rms_norm: output shape"
        );
        if x.len() == 0 {
            return;
        }
        self.launch_norm(NormInput::Plain(x), weight, eps, out);
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) {
        assert_eq!(
            (x.rows, x.cols),
            (y.rows, y.cols),
            "add_rms_norm: shapes differ"
        );
        assert_eq!(
            (out.rows, out.cols),
            (x.rows, x.cols),
            "add_rms_norm: output shape"
        );
        if weight.len() != x.cols || x.len() == 0 {
            // Per-head norms (or nothing to do): the two kernels.
            self.add(x, y);
            self.rms_norm(x, weight, eps, out);
            return;
        }
        self.launch_norm(NormInput::Residual(x, y), weight, eps, out);
    }

    fn rope(&self, x: &mut CudaTensor, positions: &[u32], rope: &RopeArgs<'_, CudaTensor>) {
        self.launch_rope(x, None, positions, rope);
    }

    fn rope_qk(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        positions: &[u32],
        rope: &RopeArgs<'_, CudaTensor>,
    ) {
        self.launch_rope(q, Some(k), positions, rope);
    }

    fn silu_mul(&self, gate: &mut CudaTensor, up: &CudaTensor) {
        assert_eq!(
            (gate.rows, gate.cols),
            (up.rows, up.cols),
            "silu_mul: shapes differ"
        );
        let n = gate.len() as u64;
        if n == 0 {
            return;
        }
        self.bind();
        let mut cast = self.cast_target(gate.len());
        let mut b = self.kernels.builder(&self.ops.silu_mul);
        b.arg(gate.f32_mut())
            .arg(up.f32())
            .arg(&n)
            .arg(cast.as_mut().map(|c| &mut c.buf));
        // SAFETY: matches silu_mul_f32; both hold n values, the cast buffer (or null) at least
        // n.
        launched(unsafe { b.launch(grid(n)) }.map(|_| ()), "silu_mul");
        if let Some(c) = &mut cast {
            c.of = Some(gate.stamp());
        }
    }

    fn attention(&self, args: &AttentionArgs<'_, CudaTensor>, out: &mut CudaTensor) {
        let g = args.geometry;
        let n = args.q_rows.len();
        assert!(
            g.num_kv_heads > 0 && g.num_heads.is_multiple_of(g.num_kv_heads),
            "attention: heads"
        );
        assert!(args.kv_len >= n, "attention: kv_len below the new rows");
        assert!(
            args.kv_len <= MAX_CONTIGUOUS_CONTEXT,
            "CUDA contiguous-cache attention supports at most {MAX_CONTIGUOUS_CONTEXT} tokens \
             (use the paged cache)"
        );
        if n == 0 {
            return;
        }
        self.bind();
        let (row0, n32, kv_len) = (args.q_rows.start as u32, n as u32, args.kv_len as u32);
        let (qh, kvh, hd) = (g.num_heads as u32, g.num_kv_heads as u32, g.head_dim as u32);
        let cfg = LaunchConfig {
            grid_dim: (n32, qh, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: kv_len * 4,
        };
        let mut b = self.kernels.builder(&self.ops.attention);
        b.arg(args.q.f32())
            .arg(args.k.f32())
            .arg(args.v.f32())
            .arg(out.f32_mut())
            .arg(&row0)
            .arg(&n32)
            .arg(&kv_len)
            .arg(&qh)
            .arg(&kvh)
            .arg(&hd)
            .arg(&g.scale);
        // SAFETY: matches attention_f32; q/out rows and the kv_len context rows exist (the
        // caller's contract), and the scores fit the shared memory requested.
        launched(unsafe { b.launch(cfg) }.map(|_| ()), "attention");
    }

    type Pages = CudaPages;

    fn new_pages(&self, plan: PoolPlan, encoding: PageEncoding) -> EngineResult<CudaPages> {
        let PageEncoding {
            scales,
            hadamard,
            scale_rule,
            window,
        } = encoding;
        let layout = plan.layout;
        let window = WindowLayout::new(&layout, window).map_err(nibble_kvcache::Error::from)?;
        let needs = crate::KvNeeds {
            head_dim: layout.head_dim(),
            page_size: layout.page_size(),
        };
        if let Some(reason) = needs.unsupported() {
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
        Ok(CudaPages {
            bytes: stream.alloc_zeros(plan.bytes.max(1)).map_err(engine_err)?,
            layout,
            scales,
            scale_rule,
            window,
            ws_k: stream.alloc_zeros(1).map_err(engine_err)?,
            ws_v: stream.alloc_zeros(1).map_err(engine_err)?,
            decode: DecodeWorkspace::new(&self.kernels).map_err(engine_err)?,
            decode_inputs: DecodeInputs::default(),
            hadamard,
            rotated: None,
        })
    }

    fn paged_attention(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        layer: usize,
        step: &StepTokens<'_, CudaTensor>,
        seqs: &[PagedSeq<'_>],
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
        self.bind();
        let unsupported = |e| match e {
            Error::Unsupported(m) => EngineError::Unsupported(m),
            other => engine_err(other),
        };
        if !pages.hadamard {
            return self
                .attend(pages, pool, layer, step, seqs, out)
                .map_err(unsupported);
        }
        // The pages hold rotated vectors: attend with rotated Q, K, V (orthonormal, so the
        // scores are unchanged), then rotate the output back (H is its own inverse).
        let d = step.geometry.head_dim;
        let mut rotated = pages
            .rotated
            .take()
            .unwrap_or_else(|| [self.zeros(0, 0), self.zeros(0, 0), self.zeros(0, 0)]);
        self.rotate_qkv([step.q, step.k, step.v], &mut rotated, d);
        let [q, k, v] = &rotated;
        let step = StepTokens { q, k, v, ..*step };
        let result = self.attend(pages, pool, layer, &step, seqs, out);
        pages.rotated = Some(rotated);
        result.map_err(unsupported)?;
        self.rotate_heads_in_place(out, d);
        Ok(())
    }

    fn read_page(&self, pages: &CudaPages, page: PageId, out: &mut Vec<u8>) -> EngineResult<()> {
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

    fn write_page(
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

/// Page bytes in device memory plus the work-dtype workspace and the decode partials.
pub struct CudaPages {
    bytes: CudaSlice<u8>,
    layout: PageLayout,
    scales: GlobalScales,
    scale_rule: ScaleRule,
    window: WindowLayout,
    ws_k: CudaSlice<u8>,
    ws_v: CudaSlice<u8>,
    decode: DecodeWorkspace,
    decode_inputs: DecodeInputs,
    /// Head vectors are stored rotated by the normalized Hadamard matrix: Q, K and V are
    /// rotated into `rotated` before attention and the output rotated back after it.
    hadamard: bool,
    rotated: Option<[CudaTensor; 3]>,
}

/// A small host array kept on the device, copied again only when it changes (RoPE's positions
/// are the same for every layer of a step).
#[derive(Default)]
struct Uploaded {
    host: Vec<u32>,
    dev: Option<CudaSlice<u32>>,
}

impl Uploaded {
    /// Makes the device copy hold `data`: unchanged when it already does, else `data` copied
    /// into the buffer (stream-ordered after the launches that read it), grown when too small.
    fn upload(&mut self, stream: &Arc<CudaStream>, data: Vec<u32>) -> Result<CudaView<'_, u32>> {
        let fits = self.dev.as_ref().is_some_and(|d| d.len() >= data.len());
        if !fits {
            self.dev = Some(stream.clone_htod(&data)?);
        } else if self.host != data {
            let dev = self.dev.as_mut().expect("checked above");
            stream.memcpy_htod(&data, &mut dev.slice_mut(0..data.len()))?;
        }
        self.host = data;
        Ok(self.view())
    }

    /// The device copy of what was last uploaded.
    fn view(&self) -> CudaView<'_, u32> {
        let dev = self.dev.as_ref().expect("uploaded before it is viewed");
        dev.slice(0..self.host.len())
    }
}

/// A decode step's slots, context lengths and page table on the device, with the row length
/// of its page table.
#[derive(Default)]
struct DecodeInputs {
    uploaded: Uploaded,
    max_pages: usize,
}

impl CudaPages {
    /// All page bytes, copied to the host (tests compare them with the CPU backend's).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        Ok(self.bytes.stream().clone_dtoh(&self.bytes)?)
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.layout.page_bytes()
    }
}

/// Device-side page transfer (the NCCL path): pages move between the pool and a contiguous
/// staging buffer without touching the host.
impl CudaBackend {
    /// The device context (NCCL communicators of this worker live on the same device).
    pub fn context(&self) -> &Arc<CudaContext> {
        self.kernels.context()
    }

    /// Copies `ids` (in order) into a new staging buffer, on this backend's stream: ordered after
    /// every kernel that wrote those pages. Users on other streams wait for the copy through
    /// cudarc's event tracking.
    pub fn gather_pages(&self, pages: &CudaPages, ids: &[PageId]) -> Result<CudaSlice<u8>> {
        self.bind();
        let size = pages.layout.page_bytes();
        let mut staging = self.stream().alloc_zeros::<u8>((ids.len() * size).max(1))?;
        if ids.is_empty() {
            return Ok(staging);
        }
        let ids: Vec<u32> = ids.iter().map(|p| p.0).collect();
        self.kernels
            .gather_pages(&mut staging, &pages.bytes, &ids, size)?;
        Ok(staging)
    }

    /// Writes `staging` (exactly `ids.len()` pages) into the allocated pages `ids`, on this
    /// backend's stream (so later attention kernels see the bytes).
    pub fn scatter_pages(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        ids: &[PageId],
        staging: &CudaSlice<u8>,
    ) -> Result<()> {
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
        let size = pages.layout.page_bytes();
        self.kernels
            .scatter_pages(&mut pages.bytes, staging, &ids, size)
    }
}

impl CudaBackend {
    /// `outs[i] = x · ws[i]ᵀ` for 1 to 3 BF16 weight matrices on one of nibble's kernels, one
    /// launch: matrix i takes the next ceil(m_i / rows per block) blocks. `xs` is the BF16 cast
    /// of `n` rows of `k` values; shapes were checked by the caller.
    fn launch_rows(
        &self,
        kernel: RowsKernel,
        xs: &CudaSlice<u16>,
        ws: &[&CudaTensor],
        outs: &mut [&mut CudaTensor],
        n: usize,
        k: usize,
    ) {
        let (rows_per_block, threads) = kernel.block();
        let blocks: u32 = ws
            .iter()
            .map(|w| (w.rows as u32).div_ceil(rows_per_block))
            .sum();
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n32, k32) = (n as u32, k as u32);
        // The row counts live until the launch (the builder keeps references), without a heap
        // allocation per GEMM.
        let m: [u32; 3] = std::array::from_fn(|i| ws.get(i).map_or(0, |w| w.rows as u32));
        let mut b = self
            .kernels
            .builder(&self.ops.rows[kernel.index()][ws.len() - 1]);
        for w in ws {
            match &w.data {
                Data::Bf16(codes) => b.arg(codes),
                Data::F32(_) => panic!("launch_rows: f32 weights"),
            };
        }
        match outs {
            [o0] => {
                b.arg(o0.f32_mut());
            }
            [o0, o1] => {
                b.arg(o0.f32_mut()).arg(o1.f32_mut());
            }
            [o0, o1, o2] => {
                b.arg(o0.f32_mut()).arg(o1.f32_mut()).arg(o2.f32_mut());
            }
            _ => panic!("launch_rows: 1 to 3 matrices, not {}", outs.len()),
        }
        for rows in &m[..ws.len()] {
            b.arg(rows);
        }
        b.arg(xs).arg(&n32).arg(&k32);
        // SAFETY: matches gemv_bf16_n* / gemm_bf16_skinny* (weights, outputs, row counts, input,
        // n, k) for ws.len() matrices; each w holds m_i*k codes, xs n*k, each output n*m_i
        // values; k is a multiple of 32, so every lane's 16-byte loads are whole and aligned.
        launched(
            unsafe { b.launch(cfg) }.map(|_| ()),
            "BF16 GEMM (rows kernel)",
        );
    }

    /// RoPE of `x`, and of `y` (the keys of the same rows) in the same launch when given.
    fn launch_rope(
        &self,
        x: &mut CudaTensor,
        mut y: Option<&mut CudaTensor>,
        positions: &[u32],
        rope: &RopeArgs<'_, CudaTensor>,
    ) {
        let d = rope.head_dim;
        for t in std::iter::once(&*x).chain(y.as_deref()) {
            assert_eq!(positions.len(), t.rows, "rope: one position per row");
            assert!(
                d.is_multiple_of(2) && t.cols.is_multiple_of(d),
                "rope: row is not whole heads"
            );
        }
        assert_eq!(rope.cos.cols, d / 2, "rope: table width");
        assert!(
            positions.iter().all(|&p| (p as usize) < rope.cos.rows),
            "rope: position beyond the table"
        );
        let y_cols = y.as_ref().map_or(0, |t| t.cols);
        let pairs = (x.rows * (x.cols + y_cols) / 2) as u64;
        if pairs == 0 {
            return;
        }
        self.bind();
        let mut uploaded = self
            .positions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let pos = uploaded
            .upload(self.stream(), positions.to_vec())
            .unwrap_or_else(|e| panic!("CUDA: host-to-device copy: {e}"));
        let (rows, x_cols, y_cols, hd) = (x.rows as u32, x.cols as u32, y_cols as u32, d as u32);
        let half_split = u32::from(rope.style == RopeStyle::HalfSplit);
        let mut b = self.kernels.builder(&self.ops.rope);
        b.arg(x.f32_mut())
            .arg(y.as_mut().map(|t| t.f32_mut()))
            .arg(&pos)
            .arg(rope.cos.f32())
            .arg(rope.sin.f32())
            .arg(&rows)
            .arg(&x_cols)
            .arg(&y_cols)
            .arg(&hd)
            .arg(&half_split);
        // SAFETY: matches rope_f32; x holds rows * x_cols values, y (or null, with y_cols 0)
        // rows * y_cols; positions index rows of the tables (checked above).
        launched(unsafe { b.launch(grid(pairs)) }.map(|_| ()), "rope");
    }

    /// RMSNorm over groups of `weight.len()` values of the input into `out` (shapes checked by
    /// the caller, at least one group), after `x += y` for [`NormInput::Residual`]; the kernel
    /// also writes `out`'s BF16 cast when the GEMMs take BF16 weights.
    fn launch_norm(
        &self,
        input: NormInput<'_>,
        weight: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) {
        self.bind();
        let width = weight.len() as u32;
        let cfg = LaunchConfig {
            grid_dim: ((out.len() / weight.len()) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut cast = self.cast_target(out.len());
        let what = match &input {
            NormInput::Plain(_) => "rms_norm",
            NormInput::Residual(..) => "add_rms_norm",
        };
        let mut b = match input {
            NormInput::Plain(x) => {
                let mut b = self.kernels.builder(&self.ops.rms_norm);
                b.arg(x.f32());
                b
            }
            NormInput::Residual(x, y) => {
                let mut b = self.kernels.builder(&self.ops.add_rms_norm);
                b.arg(x.f32_mut()).arg(y.f32());
                b
            }
        };
        b.arg(weight.f32())
            .arg(out.f32_mut())
            .arg(&width)
            .arg(&eps)
            .arg(cast.as_mut().map(|c| &mut c.buf));
        // SAFETY: matches rms_norm_f32 (x, w, out, width, eps, out_bf16) and add_rms_norm_f32
        // (x, y, w, out, width, eps, out_bf16); x, y and out hold whole groups of width values,
        // the cast buffer (or null) at least out's.
        launched(unsafe { b.launch(cfg) }.map(|_| ()), what);
        if let Some(c) = &mut cast {
            c.of = Some(out.stamp());
        }
    }

    /// The cast buffer, at least `values` long, for a kernel whose output feeds BF16-weight
    /// GEMMs (RMSNorm, SwiGLU) to write that output's BF16 cast as it goes, sparing the GEMM a
    /// cast launch; `None` when the GEMMs take f32 weights. The caller records the output's
    /// stamp in it after the launch. (BF16 weights imply cuBLAS: without it they are f32.)
    fn cast_target(&self, values: usize) -> Option<MutexGuard<'_, Bf16Cast>> {
        if self.weights != WeightPrecision::Bf16 {
            return None;
        }
        let mut cast = self.x_bf16.lock().unwrap_or_else(PoisonError::into_inner);
        self.reserve_cast(&mut cast, values);
        cast.of = None;
        Some(cast)
    }

    fn reserve_cast(&self, cast: &mut Bf16Cast, values: usize) {
        if cast.buf.len() < values {
            cast.of = None;
            cast.buf = self
                .stream()
                .alloc_zeros(values.max(1))
                .unwrap_or_else(|e| panic!("CUDA: cannot allocate {values} bf16: {e}"));
        }
    }

    /// The BF16 cast of `x` for the BF16-weight GEMMs, made unless the buffer already holds this
    /// state of `x` (GEMMs of one input cast it once, and RMSNorm and SwiGLU write it with their
    /// output). Held until the GEMM is queued.
    fn cast_bf16(&self, x: &CudaTensor) -> MutexGuard<'_, Bf16Cast> {
        let values = x.len();
        let mut cast = self.x_bf16.lock().unwrap_or_else(PoisonError::into_inner);
        if cast.of != Some(x.stamp()) {
            self.reserve_cast(&mut cast, values);
            let count = values as u64;
            let mut b = self.kernels.builder(&self.ops.to_bf16);
            b.arg(&mut cast.buf).arg(x.f32()).arg(&count);
            // SAFETY: matches f32_to_bf16; both hold at least `values` values.
            launched(unsafe { b.launch(grid(count)) }.map(|_| ()), "f32_to_bf16");
            cast.of = Some(x.stamp());
        }
        cast
    }

    fn attend(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        layer: usize,
        step: &StepTokens<'_, CudaTensor>,
        seqs: &[PagedSeq<'_>],
        out: &mut CudaTensor,
    ) -> Result<()> {
        if seqs.len() != step.spans.len() {
            return Err(Error::Shape {
                what: "sequences (one per span)",
                expected: step.spans.len(),
                actual: seqs.len(),
            });
        }
        let stream = self.stream().clone();
        let layout = pages.layout;
        let dtype = layout.dtype();
        let geometry = step.geometry;
        if geometry.num_kv_heads != layout.kv_heads() || geometry.head_dim != layout.head_dim() {
            return Err(Error::Unsupported(format!(
                "step geometry {geometry:?} does not match the pages' layout"
            )));
        }
        let (d, q_heads, kv_heads) = (geometry.head_dim, geometry.num_heads, layout.kv_heads());
        let (q_row, kv_row) = (q_heads * d, kv_heads * d);
        let geom = PageGeom::new(&layout, layer)?;
        let g = (
            pages.scales.get(layer, KvPart::K),
            pages.scales.get(layer, KvPart::V),
        );
        // The work dtype's scales (see nibble_engine::paged): nvfp4 maps the same amax onto 448.
        let work = match dtype {
            KvDtype::Nvfp4 => (g.0 * e2m1::MAX, g.1 * e2m1::MAX),
            KvDtype::Fp8 | KvDtype::Bf16 => g,
        };
        let work_dtype = if dtype == KvDtype::Bf16 {
            KvDtype::Bf16
        } else {
            KvDtype::Fp8
        };
        let width = if dtype == KvDtype::Bf16 { 2 } else { 1 };
        // Every slot in range, allocated and unique before any kernel writes.
        let all: Vec<Option<SlotId>> = seqs
            .iter()
            .flat_map(|s| s.slots.iter().copied().map(Some))
            .collect();
        pool.check_slots(&all)
            .map_err(|e| Error::Unsupported(e.to_string()))?;
        let wgeom = WindowGeom::new(&pages.window, &layout, layer);
        for seq in seqs {
            pool.check_window(&pages.window, seq.window)
                .map_err(|e| Error::Unsupported(e.to_string()))?;
        }
        for (seq, span) in seqs.iter().zip(step.spans) {
            if seq.slots.len() != span.len() {
                return Err(Error::Shape {
                    what: "slots of a sequence (one per new token)",
                    expected: span.len(),
                    actual: seq.slots.len(),
                });
            }
            if seq.pages.len() * layout.page_size() < seq.stored + span.len() {
                return Err(Error::Shape {
                    what: "pages covering a sequence's context",
                    expected: (seq.stored + span.len()).div_ceil(layout.page_size()),
                    actual: seq.pages.len(),
                });
            }
        }
        let is_decode = |s: &PagedSeq<'_>| s.stored > 0 && s.slots.len() == 1;
        let softmax_scale = geometry.scale;

        // Prefill and extend, one sequence at a time.
        for (seq, span) in seqs.iter().zip(step.spans) {
            if is_decode(seq) {
                continue;
            }
            let n = span.len();
            let start = seq.stored;
            let q = self.rows_of(step.q, span.clone())?;
            let k = self.rows_of(step.k, span.clone())?;
            let v = self.rows_of(step.v, span.clone())?;
            let bytes = (start + n) * kv_row * width;
            if pages.ws_k.len() < bytes {
                pages.ws_k = stream.alloc_zeros(bytes)?;
                pages.ws_v = stream.alloc_zeros(bytes)?;
            }
            if start > 0 {
                let table: Vec<u32> = seq.pages[..start.div_ceil(layout.page_size())]
                    .iter()
                    .map(|p| p.0)
                    .collect();
                let table = stream.clone_htod(&table)?;
                self.kernels.gather_work(
                    (&mut pages.ws_k, &mut pages.ws_v),
                    &pages.bytes,
                    geom,
                    dtype,
                    &table,
                    start,
                    g,
                    work,
                )?;
            }
            let (values, at) = ((n * kv_row) as u64, (start * kv_row) as u64);
            let bf16 = u32::from(dtype == KvDtype::Bf16);
            let mut b = self.kernels.builder(&self.ops.encode_work);
            b.arg(&mut pages.ws_k)
                .arg(&mut pages.ws_v)
                .arg(&k)
                .arg(&v)
                .arg(&values)
                .arg(&at)
                .arg(&bf16)
                .arg(&work.0)
                .arg(&work.1);
            // SAFETY: matches encode_work; the workspace holds (start + n) tokens, k and v n.
            unsafe { b.launch(grid(2 * values)) }?;
            let mut o: CudaSlice<f32> = stream.alloc_zeros(n * q_row)?;
            let batch = PrefillBatch {
                q: &q,
                n,
                start,
                q_heads,
                kv_heads,
                head_dim: d,
                k: &pages.ws_k,
                v: &pages.ws_v,
                work: work_dtype,
                work_scales: work,
                softmax_scale,
            };
            self.kernels.prefill(&batch, &mut o)?;
            stream.memcpy_dtod(
                &o,
                &mut out
                    .f32_mut()
                    .slice_mut(span.start * q_row..span.end * q_row),
            )?;
            let slots: Vec<u32> = seq.slots.iter().map(|s| s.0).collect();
            let slots = stream.clone_htod(&slots)?;
            self.kernels.quantize(
                &mut pages.bytes,
                geom,
                dtype,
                pages.scale_rule,
                &k.as_view(),
                &v.as_view(),
                &slots.as_view(),
                g,
            )?;
            if !pages.window.is_none() {
                let table: Vec<u32> = seq.window.iter().map(|p| p.0).collect();
                let table = stream.clone_htod(&table)?;
                let lens = stream.clone_htod(&[(start + n) as u32])?;
                // SAFETY: the window's pages were checked against the pool above; the length
                // covers the n rows.
                unsafe {
                    self.kernels.store_window(
                        &mut pages.bytes,
                        wgeom,
                        &table.as_view(),
                        &k.as_view(),
                        &v.as_view(),
                        &lens.as_view(),
                        n,
                        d,
                    )
                }?;
            }
        }

        // Decode: write every decode token's K/V, then one batched split-KV launch.
        let decodes: Vec<(&PagedSeq<'_>, &Range<usize>)> = seqs
            .iter()
            .zip(step.spans)
            .filter(|(s, _)| is_decode(s))
            .collect();
        if decodes.is_empty() {
            return Ok(());
        }
        let count = decodes.len();
        let max_context = decodes.iter().map(|(s, _)| s.stored + 1).max().unwrap_or(1);
        let max_pages = max_context.div_ceil(layout.page_size());
        // [slots | context lengths | page table]: the same for every layer of a step, so built
        // and uploaded at its first layer (KvBatch's protocol: layers in order from 0) and
        // reused by the others; a step of other sequences (other slots) rebuilds it.
        let slots_now: Vec<u32> = decodes.iter().map(|(seq, _)| seq.slots[0].0).collect();
        let cached = &pages.decode_inputs;
        let wp = pages.window.pages();
        let table_end = 2 * count + count * max_pages;
        let reuse = layer > 0
            && cached.max_pages == max_pages
            && cached.uploaded.host.len() == table_end + count * wp
            && cached.uploaded.host[..count] == slots_now[..];
        if !reuse {
            // [slots | context lengths | page table | window table]
            let mut inputs = vec![0u32; table_end + count * wp];
            inputs[..count].copy_from_slice(&slots_now);
            for (i, (seq, _)) in decodes.iter().enumerate() {
                let window = table_end + i * wp;
                for (j, p) in seq.window.iter().enumerate() {
                    inputs[window + j] = p.0;
                }
                let ctx = seq.stored + 1;
                inputs[count + i] = ctx as u32;
                let row = 2 * count + i * max_pages;
                for (j, p) in seq.pages[..ctx.div_ceil(layout.page_size())]
                    .iter()
                    .enumerate()
                {
                    inputs[row + j] = p.0;
                }
            }
            pages.decode_inputs.max_pages = max_pages;
            pages.decode_inputs.uploaded.upload(&stream, inputs)?;
        }
        let inputs = pages.decode_inputs.uploaded.view();
        let slots = inputs.slice(0..count);
        let context = inputs.slice(count..2 * count);
        let table = inputs.slice(2 * count..table_end);
        let window_table = inputs.slice(table_end..);

        // A decode-only step has its rows in order: Q, K and V are read and the output written
        // in place. Otherwise the decode rows are gathered into buffers of their own.
        let first = decodes[0].1.start;
        let in_place = decodes
            .iter()
            .enumerate()
            .all(|(i, (_, span))| span.start == first + i && span.len() == 1);
        let rows = first..first + count;
        let gathered = if in_place {
            None
        } else {
            let gather = |t: &CudaTensor, row: usize| -> Result<CudaSlice<f32>> {
                let mut buf = stream.alloc_zeros(count * row)?;
                for (i, (_, span)) in decodes.iter().enumerate() {
                    let r = span.start;
                    stream.memcpy_dtod(
                        &t.f32().slice(r * row..(r + 1) * row),
                        &mut buf.slice_mut(i * row..(i + 1) * row),
                    )?;
                }
                Ok(buf)
            };
            Some((
                gather(step.q, q_row)?,
                gather(step.k, kv_row)?,
                gather(step.v, kv_row)?,
            ))
        };
        let (q, k, v) = match &gathered {
            Some((q, k, v)) => (q.as_view(), k.as_view(), v.as_view()),
            None => (
                step.q.f32().slice(rows.start * q_row..rows.end * q_row),
                step.k.f32().slice(rows.start * kv_row..rows.end * kv_row),
                step.v.f32().slice(rows.start * kv_row..rows.end * kv_row),
            ),
        };
        self.kernels.quantize(
            &mut pages.bytes,
            geom,
            dtype,
            pages.scale_rule,
            &k,
            &v,
            &slots,
            g,
        )?;
        // SAFETY: the window pages were checked against the pool above; each context length
        // is at least 1 (the new token).
        unsafe {
            self.kernels.store_window(
                &mut pages.bytes,
                wgeom,
                &window_table,
                &k,
                &v,
                &context,
                1,
                d,
            )
        }?;
        let batch = DecodeBatch {
            q,
            q_heads,
            page_table: table,
            max_pages,
            context,
            max_context,
            scales: g,
            softmax_scale,
            window: wgeom,
            window_table: Some(window_table),
        };
        if gathered.is_none() {
            // When the decode rows are the whole output (a decode-only step), the decode also
            // writes the output's BF16 cast, which the output projection then reads.
            let whole = rows.start == 0 && out.len() == count * q_row;
            let mut cast = if whole {
                self.cast_target(out.len())
            } else {
                None
            };
            let mut o = out
                .f32_mut()
                .slice_mut(rows.start * q_row..rows.end * q_row);
            self.kernels.decode(
                &pages.bytes,
                geom,
                dtype,
                &batch,
                &mut pages.decode,
                &mut o,
                cast.as_mut().map(|c| &mut c.buf),
            )?;
            if let Some(c) = &mut cast {
                c.of = Some(out.stamp());
            }
            return Ok(());
        }
        let mut o: CudaSlice<f32> = stream.alloc_zeros(count * q_row)?;
        self.kernels.decode(
            &pages.bytes,
            geom,
            dtype,
            &batch,
            &mut pages.decode,
            &mut o.as_view_mut(),
            None,
        )?;
        for (i, (_, span)) in decodes.iter().enumerate() {
            let r = span.start;
            stream.memcpy_dtod(
                &o.slice(i * q_row..(i + 1) * q_row),
                &mut out.f32_mut().slice_mut(r * q_row..(r + 1) * q_row),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_row_counts_pick_their_gemm_kernel() {
        // Llama-3-8B's Q, K and V together: 6,144 features of 4,096.
        let pick = |n| RowsKernel::pick(n, 4096, 6144);
        assert_eq!(pick(1), Some(RowsKernel::Gemv { rows: 1 }));
        assert_eq!(pick(2), Some(RowsKernel::Gemv { rows: 2 }));
        for n in 3..=8 {
            assert_eq!(pick(n), Some(RowsKernel::Skinny), "{n} rows");
        }
        for n in 9..=16 {
            assert_eq!(pick(n), Some(RowsKernel::Skinny16), "{n} rows");
        }
        assert_eq!(pick(17), None, "17 rows and more go to cuBLAS");
        assert_eq!(pick(64), None);
        // Rows whose length the 16-byte loads cannot cover whole.
        assert_eq!(RowsKernel::pick(1, 4100, 6144), None);
        assert_eq!(RowsKernel::pick(8, 4100, 6144), None);
        // The vocabulary projection at 3-8 rows stays on cuBLAS; at 1-2 the GEMV is faster.
        assert_eq!(RowsKernel::pick(8, 4096, 128_256), None);
        assert_eq!(RowsKernel::pick(16, 4096, 128_256), None);
        assert_eq!(
            RowsKernel::pick(1, 4096, 128_256),
            Some(RowsKernel::Gemv { rows: 1 })
        );
        // The rows of Ops::rows, in the order they are loaded.
        assert_eq!(RowsKernel::Gemv { rows: 1 }.index(), 0);
        assert_eq!(RowsKernel::Gemv { rows: 2 }.index(), 1);
        assert_eq!(RowsKernel::Skinny.index(), 2);
        assert_eq!(RowsKernel::Skinny16.index(), 3);
    }
}
