//! `matmul_t`: cuBLAS (SGEMM over f32 weights, `cublasGemmEx` over BF16 ones), nibble's
//! weight-streaming and skinny tensor-core kernels for the BF16 GEMMs of decode steps
//! ([`RowsKernel`]), the tiled f32 kernel without cuBLAS, and the BF16 cast of the activations
//! the BF16-weight GEMMs read ([`Bf16Cast`]).

use std::path::PathBuf;
use std::sync::{MutexGuard, PoisonError};

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::tensor::Data;
use super::weights::{Bf16Gemm, WeightPrecision};
use super::{device_err, engine_err, grid, launched, CudaBackend, CudaTensor};
use crate::graph;
use crate::libs::Search;
use nibble_engine::Result as EngineResult;

/// Which GEMM `matmul_t` runs.
pub(super) enum GemmImpl {
    Cublas(CudaBlas),
    Tiled,
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
pub(super) fn load_cublas() -> std::result::Result<PathBuf, String> {
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

/// The most output features (of all matrices of one call) the skinny GEMM takes.
const SKINNY_MAX_FEATURES: usize = 65_536;

/// Which of nibble's BF16-weight GEMM kernels serves `n` rows of `x` (decode steps): the
/// weight-streaming kernel (`gemv_bf16_n*`) for 1 and 2 rows, where it beats cuBLAS (run 60),
/// the skinny tensor-core GEMM for 3 to 8 (`gemm_bf16_skinny8*`, one tile of 8 rows) and 9 to
/// 16 (`gemm_bf16_skinny16*`, two): a layer's GEMMs take 132 us against cuBLAS's 166 at 8 rows
/// (run 67) and 144 against 174 at 16 (run 72). More rows, or rows whose length is not a
/// multiple of 32, go to cuBLAS.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum RowsKernel {
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
    pub(super) fn index(self) -> usize {
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
pub(super) struct Bf16Cast {
    pub(super) buf: CudaSlice<u16>,
    pub(super) of: Option<(u64, u64, usize)>,
}

/// The GEMMs of `matmul_t` and `matmul_t_many`.
impl CudaBackend {
    /// `outs[i] = x · ws[i]ᵀ`, 2 or 3 BF16 matrices of one input in one launch of our kernels
    /// where one serves the rows, else one [`Self::gemm`] each.
    pub(super) fn gemm_many(
        &self,
        x: &CudaTensor,
        ws: &[&CudaTensor],
        outs: &mut [&mut CudaTensor],
    ) -> EngineResult<()> {
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
                self.gemm(x, w, out)?;
            }
            return Ok(());
        };
        for (w, out) in ws.iter().zip(outs.iter()) {
            assert_eq!(
                (out.rows, out.cols),
                (n, w.rows),
                "matmul_t_many: output shape"
            );
        }
        self.bind();
        let cast = self.cast_bf16(x)?;
        self.launch_rows(kernel, &cast.buf, ws, outs, n, k)?;
        Ok(())
    }

    /// `up = x · w_upᵀ`, `gate = silu(x · w_gateᵀ) * up` and its BF16 cast in one launch of the
    /// weight-streaming kernel (`gemv_bf16_n*_swiglu`), when it serves the rows (1 or 2, BF16
    /// weights of the same shape); `false` (nothing done) otherwise. The values are those of
    /// [`Self::gemm_many`] and `silu`.
    pub(super) fn gemv_swiglu(
        &self,
        x: &CudaTensor,
        w_gate: &CudaTensor,
        w_up: &CudaTensor,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
    ) -> EngineResult<bool> {
        let (n, k, m) = (x.rows, x.cols, w_gate.rows);
        let served = matches!(self.gemm, GemmImpl::Cublas(_))
            && (w_up.rows, w_gate.cols, w_up.cols) == (m, k, k)
            && m > 0
            && matches!((&w_gate.data, &w_up.data), (Data::Bf16(_), Data::Bf16(_)))
            && matches!(RowsKernel::pick(n, k, 2 * m), Some(RowsKernel::Gemv { .. }));
        if !served {
            return Ok(false);
        }
        for out in [&*gate, &*up] {
            assert_eq!((out.rows, out.cols), (n, m), "matmul_swiglu: output shape");
        }
        // The activation's cast goes to a buffer of its own (the down projection finds it
        // there), since the input's, which every block reads throughout, is in the other.
        let mut act = self.act_bf16.lock().unwrap_or_else(PoisonError::into_inner);
        if act.of == Some(x.stamp()) {
            return Ok(false); // the input is itself a SwiGLU output: not a transformer's FFN
        }
        self.bind();
        let xs = self.cast_main(x)?;
        self.reserve_cast(&mut act, n * m);
        act.of = None;
        let (rows_per_block, threads) = RowsKernel::Gemv { rows: n }.block();
        let pairs = (m as u32).div_ceil(rows_per_block);
        let mut counters = self
            .swiglu_pairs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if counters.len() < pairs as usize {
            *counters = self
                .stream()
                .alloc_zeros(pairs as usize)
                .map_err(engine_err)?;
        }
        let (Data::Bf16(wg), Data::Bf16(wu)) = (&w_gate.data, &w_up.data) else {
            unreachable!("checked above");
        };
        let (m32, n32, k32) = (m as u32, n as u32, k as u32);
        let mut b = self.kernels.builder(&self.ops.swiglu[n - 1]);
        b.arg(wg)
            .arg(wu)
            .arg(gate.f32_mut())
            .arg(up.f32_mut())
            .arg(&m32)
            .arg(&xs.buf)
            .arg(&n32)
            .arg(&k32)
            .arg(&mut *counters)
            .arg(&mut act.buf);
        let cfg = LaunchConfig {
            grid_dim: (2 * pairs, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gemv_bf16_n*_swiglu; each weight holds m*k codes, the input's cast
        // n*k, gate and up n*m values, the counters at least ceil(m / 4) (zero between
        // launches), the activation's cast at least n*m; k is a multiple of 32
        // (RowsKernel::pick).
        launched(unsafe { b.launch(cfg) }.map(|_| ()), "SwiGLU (rows kernel)")?;
        act.of = Some(gate.stamp());
        Ok(true)
    }

    /// `out = x · wᵀ`.
    pub(super) fn gemm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
        let (n, k, m) = (x.rows, x.cols, w.rows);
        assert_eq!(w.cols, k, "matmul_t: inner dims differ");
        assert_eq!((out.rows, out.cols), (n, m), "matmul_t: output shape");
        if n == 0 || m == 0 {
            return Ok(());
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
                graph::block("cuBLAS").map_err(engine_err)?;
                if !graph::runs_now() {
                    return Ok(());
                }
                let mut o = out.f32_mut().slice_mut(0..n * m);
                // SAFETY: the views hold m*k, n*k and n*m values (shapes asserted above).
                let r = unsafe {
                    blas.gemm(cfg, &wb.slice(0..m * k), &x.f32().slice(0..n * k), &mut o)
                };
                r.map_err(|e| device_err("cuBLAS SGEMM", format!("{e:?}")))?;
            }
            (GemmImpl::Cublas(blas), Data::Bf16(wb)) => {
                let values = n * k;
                let cast = self.cast_bf16(x)?;
                let xs = &cast.buf;
                if let Some(kernel) = RowsKernel::pick(n, k, m) {
                    self.launch_rows(kernel, xs, &[w], &mut [out], n, k)?;
                    return Ok(());
                }
                graph::block("cuBLAS").map_err(engine_err)?;
                if !graph::runs_now() {
                    return Ok(());
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
                r.map_err(|e| device_err("cuBLAS GemmEx (BF16)", format!("{e:?}")))?;
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
                launched(unsafe { b.launch(cfg) }.map(|_| ()), "gemm")?;
            }
            // `with_weights` keeps weights f32 whenever the GEMM is the tiled kernel.
            (GemmImpl::Tiled, Data::Bf16(_)) => unreachable!("the tiled GEMM has f32 weights"),
        }
        Ok(())
    }

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
    ) -> EngineResult<()> {
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
        )?;
        Ok(())
    }

    /// The cast buffer, at least `values` long, for a kernel whose output feeds BF16-weight
    /// GEMMs (RMSNorm, SwiGLU) to write that output's BF16 cast as it goes, sparing the GEMM a
    /// cast launch; `None` when the GEMMs take f32 weights. The caller records the output's
    /// stamp in it after the launch. (BF16 weights imply cuBLAS: without it they are f32.)
    pub(super) fn cast_target(&self, values: usize) -> Option<MutexGuard<'_, Bf16Cast>> {
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

    /// The BF16 cast of `x` for the BF16-weight GEMMs, made unless a buffer already holds this
    /// state of `x` (GEMMs of one input cast it once, and RMSNorm and SwiGLU write it with their
    /// output). Held until the GEMM is queued.
    fn cast_bf16(&self, x: &CudaTensor) -> EngineResult<MutexGuard<'_, Bf16Cast>> {
        {
            let act = self.act_bf16.lock().unwrap_or_else(PoisonError::into_inner);
            if act.of == Some(x.stamp()) {
                return Ok(act);
            }
        }
        self.cast_main(x)
    }

    /// [`Self::cast_bf16`] in the main cast buffer only (not the fused SwiGLU's).
    fn cast_main(&self, x: &CudaTensor) -> EngineResult<MutexGuard<'_, Bf16Cast>> {
        let values = x.len();
        let mut cast = self.x_bf16.lock().unwrap_or_else(PoisonError::into_inner);
        if cast.of != Some(x.stamp()) {
            self.reserve_cast(&mut cast, values);
            let count = values as u64;
            let mut b = self.kernels.builder(&self.ops.to_bf16);
            b.arg(&mut cast.buf).arg(x.f32()).arg(&count);
            // SAFETY: matches f32_to_bf16; both hold at least `values` values.
            launched(unsafe { b.launch(grid(count)) }.map(|_| ()), "f32_to_bf16")?;
            cast.of = Some(x.stamp());
        }
        Ok(cast)
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
