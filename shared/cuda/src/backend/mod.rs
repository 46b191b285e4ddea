//! [`CudaBackend`]: nibble-engine's [`Backend`] on one CUDA device.
//!
//! * Tensors are f32 device buffers ([`CudaTensor`], `tensor.rs`), row-major, grown on demand
//!   and never shrunk. Weight matrices are dequantized on the host with the engine's exact GGML
//!   decoders and stored in the backend's [`WeightPrecision`] (`weights.rs`): BF16 codes by
//!   default (rounded on the host, so no f32 copy reaches the device), or f32
//!   (`NIBBLE_CUDA_WEIGHTS=f32`), whose values equal the CPU backend's. Vectors (norms, biases)
//!   are always f32.
//! * GEMMs (`matmul_t`, `gemm.rs`) go to cuBLAS, loaded at run time like NVRTC: `cublasGemmEx`
//!   over BF16 weights and BF16-cast activations with f32 accumulation and output, or SGEMM over
//!   f32 weights (FP32, default math mode: no TF32). Without cuBLAS a tiled f32 kernel of
//!   `cu/ops.cu` runs instead (also chosen by `NIBBLE_CUDA_GEMM=tiled`), and weights stay f32 for
//!   it. The elementwise kernels (embedding, RMSNorm, RoPE in both pairings, SwiGLU, residual
//!   adds: `elementwise.rs`; bias adds, column scales and the Hadamard rotation: `rotate.rs`)
//!   and the contiguous-cache f32 attention are in `cu/ops.cu`, compiled with `--fmad=false`.
//! * Paged KV ([`CudaPages`], `pages.rs`) lives in device memory with exactly the bytes of
//!   `nibble_kvfmt::PageLayout`: new tokens are written by [`Kernels::quantize`], decode reads
//!   pages through [`Kernels::decode`] (`decode.rs`), initial prefill and extend run
//!   [`Kernels::prefill`] over the work-dtype workspace (the cached prefix gathered by
//!   [`Kernels::gather_work`], the new tokens encoded by `encode_work`; `attention.rs`), as the
//!   CPU paths of `nibble_engine::paged` do, with its work dtype and work scales.
//! * Logits are copied to the host (`download_rows`); sampling stays on the host.
//!
//! The trait's kernels return `()`: a CUDA failure inside one of them (a lost device, out of
//! memory) panics with the driver's message. Everything that can fail for a reason the caller
//! controls (geometry, head dim, Hadamard) is rejected up front with an error.

use std::fmt::Display;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use nibble_engine::backend::{AttentionArgs, Backend, PageEncoding, PagedSeq, RopeArgs};
use nibble_engine::kv::StepTokens;
use nibble_engine::{Error as EngineError, Result as EngineResult};
use nibble_kvcache::{PageId, PagePool, PoolPlan};

use crate::{nvrtc, DeviceStaging, Error, Kernels, Result};

mod attention;
mod decode;
mod elementwise;
mod gemm;
mod pages;
mod rotate;
mod step_graphs;
mod tensor;
mod weights;

use gemm::{load_cublas, Bf16Cast, GemmImpl};
pub use pages::CudaPages;
use step_graphs::Graphs;
pub use step_graphs::{GraphCounts, GRAPHS_ENV};
pub use tensor::CudaTensor;
use tensor::Uploaded;
pub use weights::{WeightPrecision, WEIGHTS_ENV};

/// The dense kernels' source (compiled separately: `--fmad=false`).
pub(crate) const OPS_SOURCE: &str = include_str!("../cu/ops.cu");

/// Entry points of `cu/ops.cu`.
pub const OPS_ENTRY_POINTS: [&str; 28] = [
    "embed_rows",
    "embed_rows_bf16",
    "f32_to_bf16",
    "gemv_bf16_n1",
    "gemv_bf16_n2",
    "gemv_bf16_n1_x2",
    "gemv_bf16_n2_x2",
    "gemv_bf16_n1_x3",
    "gemv_bf16_n2_x3",
    "gemv_bf16_n1_swiglu",
    "gemv_bf16_n2_swiglu",
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

struct Ops {
    embed: CudaFunction,
    embed_bf16: CudaFunction,
    to_bf16: CudaFunction,
    /// nibble's BF16-weight GEMMs by [`gemm::RowsKernel::index`] (the weight-streaming kernel for 1
    /// and 2 rows, the skinny tensor-core one for 3 to 8 and 9 to 16), each over 1, 2 and 3
    /// matrices of one input.
    rows: [[CudaFunction; 3]; 4],
    /// The weight-streaming kernel's SwiGLU (gate and up, then the activation) for 1 and 2 rows.
    swiglu: [CudaFunction; 2],
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
    /// Decode steps recorded as CUDA graphs (`step_graphs.rs`); first, so that they are
    /// destroyed while the context they belong to is alive.
    graphs: Graphs,
    ordinal: usize,
    kernels: Kernels,
    ops: Ops,
    gemm: GemmImpl,
    weights: WeightPrecision,
    /// The BF16 cast of `matmul_t`'s activations (BF16 weights), grown on demand; used in stream
    /// order, so one buffer serves every GEMM.
    x_bf16: Mutex<Bf16Cast>,
    /// The fused SwiGLU's output cast (`gemv_bf16_n*_swiglu`), which the down projection reads:
    /// a buffer of its own, since the kernel reads its input's cast from `x_bf16` as it writes.
    act_bf16: Mutex<Bf16Cast>,
    /// The fused SwiGLU's counters, one per pair of blocks (`gemv_bf16_n*_swiglu`): zero
    /// between launches, grown (zeroed) on demand.
    swiglu_pairs: Mutex<CudaSlice<u32>>,
    /// RoPE's positions: every layer rotates Q and K at the same ones.
    positions: Mutex<Uploaded>,
    /// The step's tokens, for the embedding.
    tokens: Mutex<Uploaded>,
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
            swiglu: [f("gemv_bf16_n1_swiglu")?, f("gemv_bf16_n2_swiglu")?],
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
        let act_bf16 = Mutex::new(Bf16Cast {
            buf: kernels.stream().alloc_zeros(1)?,
            of: None,
        });
        let swiglu_pairs = Mutex::new(kernels.stream().alloc_zeros(1)?);
        Ok(Self {
            ordinal,
            kernels,
            ops,
            gemm,
            weights,
            x_bf16,
            act_bf16,
            swiglu_pairs,
            positions: Mutex::default(),
            tokens: Mutex::default(),
            graphs: Graphs::from_env()?,
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
}

fn grid(n: u64) -> LaunchConfig {
    const BLOCK: u64 = 256;
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK).max(1) as u32, 1, 1),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A launch's result as the engine's [`EngineError::Device`], naming the kernel.
fn launched(
    r: std::result::Result<(), cudarc::driver::DriverError>,
    what: &str,
) -> EngineResult<()> {
    r.map_err(|e| device_err(what, e))
}

/// A CUDA crate error of `what` as the engine's: a driver error is a device failure, anything
/// else (a page not allocated, a shape) a refused input.
fn classified(what: &str, e: Error) -> EngineError {
    match e {
        Error::Driver(e) => device_err(what, e),
        other => EngineError::InvalidInput(format!("{what}: {other}")),
    }
}

/// A device failure (a launch, copy or allocation) of `what`, as the engine's error.
fn device_err(what: &str, e: impl Display) -> EngineError {
    EngineError::Device(format!("CUDA: {what} failed: {e}"))
}

/// A CUDA (driver or crate) error as the engine's, classified ([`classified`]).
fn engine_err(e: impl Into<Error>) -> EngineError {
    classified("CUDA backend", e.into())
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

    fn decode_layers(&self, layers: &mut dyn FnMut() -> EngineResult<()>) -> EngineResult<()> {
        self.graphed_decode(layers)
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> EngineResult<CudaTensor> {
        self.upload_f32(rows, cols, data)
    }

    // `upload_weight` is the trait's: GGML blocks dequantized on the host, then `upload_matrix`.

    fn upload_matrix(&self, rows: usize, cols: usize, data: Vec<f32>) -> EngineResult<CudaTensor> {
        self.upload_weights(rows, cols, data)
    }

    fn zeros(&self, rows: usize, cols: usize) -> CudaTensor {
        self.zeros_f32(rows, cols)
    }

    fn resize(&self, t: &mut CudaTensor, rows: usize, cols: usize) {
        self.reshape(t, rows, cols);
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn download_rows(
        &self,
        t: &CudaTensor,
        rows: Range<usize>,
        out: &mut Vec<f32>,
    ) -> EngineResult<()> {
        self.download(t, rows, out)?;
        Ok(())
    }

    fn argmax_rows(&self, t: &CudaTensor, out: &mut Vec<u32>) -> EngineResult<()> {
        self.argmax(t, out)?;
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &CudaTensor,
        src_row: usize,
        dst: &mut CudaTensor,
        dst_row: usize,
        n: usize,
    ) -> EngineResult<()> {
        self.copy_tensor_rows(src, src_row, dst, dst_row, n)?;
        Ok(())
    }

    fn embed(&self, table: &CudaTensor, tokens: &[u32], out: &mut CudaTensor) -> EngineResult<()> {
        self.embed_tokens(table, tokens, out)?;
        Ok(())
    }

    fn matmul_t_many(
        &self,
        x: &CudaTensor,
        ws: &[&CudaTensor],
        outs: &mut [&mut CudaTensor],
    ) -> EngineResult<()> {
        self.gemm_many(x, ws, outs)?;
        Ok(())
    }

    fn matmul_t(&self, x: &CudaTensor, w: &CudaTensor, out: &mut CudaTensor) -> EngineResult<()> {
        self.gemm(x, w, out)?;
        Ok(())
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaTensor) -> EngineResult<()> {
        self.per_column(&self.ops.add_bias, x, bias, "add_bias")?;
        Ok(())
    }

    fn mul_cols(&self, x: &mut CudaTensor, scale: &CudaTensor) -> EngineResult<()> {
        self.per_column(&self.ops.mul_cols, x, scale, "mul_cols")?;
        Ok(())
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) -> EngineResult<()> {
        self.add_in_place(x, y)?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
        self.norm(x, weight, eps, out)?;
        Ok(())
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
        self.add_norm(x, y, weight, eps, out)?;
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        positions: &[u32],
        rope: &RopeArgs<'_, CudaTensor>,
    ) -> EngineResult<()> {
        self.launch_rope(x, None, positions, rope)?;
        Ok(())
    }

    fn rope_qk(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        positions: &[u32],
        rope: &RopeArgs<'_, CudaTensor>,
    ) -> EngineResult<()> {
        self.launch_rope(q, Some(k), positions, rope)?;
        Ok(())
    }

    fn silu_mul(&self, gate: &mut CudaTensor, up: &CudaTensor) -> EngineResult<()> {
        self.silu(gate, up)?;
        Ok(())
    }

    fn matmul_swiglu(
        &self,
        x: &CudaTensor,
        w_gate: &CudaTensor,
        w_up: &CudaTensor,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
    ) -> EngineResult<()> {
        if self.gemv_swiglu(x, w_gate, w_up, gate, up)? {
            return Ok(());
        }
        self.gemm_many(x, &[w_gate, w_up], &mut [&mut *gate, &mut *up])?;
        self.silu(gate, up)
    }

    fn attention(
        &self,
        args: &AttentionArgs<'_, CudaTensor>,
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
        self.attend_contiguous(args, out)?;
        Ok(())
    }

    type Pages = CudaPages;

    fn new_pages(&self, plan: PoolPlan, encoding: PageEncoding) -> EngineResult<CudaPages> {
        self.create_pages(plan, encoding)
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
        self.attend_paged(pages, pool, layer, step, seqs, out)
    }

    fn read_page(&self, pages: &CudaPages, page: PageId, out: &mut Vec<u8>) -> EngineResult<()> {
        self.read_page_bytes(pages, page, out)
    }

    fn write_page(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        page: PageId,
        bytes: &[u8],
    ) -> EngineResult<()> {
        self.write_page_bytes(pages, pool, page, bytes)
    }

    type Staging = DeviceStaging;

    fn stage_pages(
        &self,
        pages: &CudaPages,
        ids: &[PageId],
        into: &mut DeviceStaging,
    ) -> EngineResult<()> {
        self.gather_pages(pages, ids, into)
            .map_err(|e| classified("staging pages", e))
    }

    fn unstage_pages(
        &self,
        pages: &mut CudaPages,
        pool: &PagePool,
        ids: &[PageId],
        staging: &DeviceStaging,
    ) -> EngineResult<()> {
        self.scatter_pages(pages, pool, ids, staging)
            .map_err(|e| classified("writing staged pages", e))
    }

    fn staging_bytes(&self, staging: &DeviceStaging) -> usize {
        staging.len()
    }

    fn staged_host_bytes<'a>(
        &self,
        staging: &'a DeviceStaging,
    ) -> EngineResult<std::borrow::Cow<'a, [u8]>> {
        self.bind();
        let host = self
            .stream()
            .clone_dtoh(&staging.view())
            .map_err(|e| device_err("copying staged pages to the host", e))?;
        Ok(std::borrow::Cow::Owned(host))
    }
}
