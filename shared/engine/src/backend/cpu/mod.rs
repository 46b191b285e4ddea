//! The CPU reference backend: f32 activations, GEMMs through the `gemm` crate, elementwise
//! kernels in [`simd`], all parallel work on one rayon pool of a fixed number of threads.
//!
//! Quantized weight matrices (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) stay in their GGUF blocks
//! ([`blocks`]) and are decoded inside the matmul ([`qmatmul`]) with exactly the values f32
//! dequantization gives: a decode step reads 0.625 bytes per Q4_1 weight (1.06 per Q8_0)
//! instead of 4, and prefill dequantizes a tile at a time for the GEMM. Plain matrices (F32,
//! F16, BF16) are f32.

mod attention;
mod blocks;
mod gemv;
mod paged;
mod qmatmul;
pub mod simd;

use super::{AttentionArgs, Backend, PageEncoding, PagedSeq, RopeArgs};
use crate::config::RopeStyle;
use crate::error::{Error, Result};
use crate::gguf::{dequant, GgmlType};
use crate::kv::StepTokens;
pub(crate) use attention::causal_gqa;
use blocks::{BlockMatrix, Isa};
use nibble_kvcache::{PageId, PagePool, PoolPlan};
pub use paged::CpuPages;
use rayon::prelude::*;
use std::ops::Range;

/// A host tensor: `rows × cols` f32, row-major; or a weight matrix kept as quantized blocks
/// (from [`Backend::upload_weight`]), which only `matmul_t` and `embed` read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CpuTensor {
    /// The values; empty when `blocks` holds them.
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    blocks: Option<BlockMatrix>,
}

impl CpuTensor {
    /// Wraps `data` (`rows * cols` values).
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(Error::InvalidInput(format!(
                "{} values do not make a {rows}x{cols} tensor",
                data.len()
            )));
        }
        Ok(Self {
            data,
            rows,
            cols,
            blocks: None,
        })
    }

    /// Changes the shape, reusing the storage; new values are zero, kept ones unspecified.
    pub fn resize(&mut self, rows: usize, cols: usize) {
        self.data.resize(rows * cols, 0.0);
        self.rows = rows;
        self.cols = cols;
    }

    /// The values, row-major (empty for a weight kept as blocks: see [`Self::block_type`]).
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    /// The values, row-major, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// One row.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The GGML block type of a weight kept quantized; `None` for f32 values.
    pub fn block_type(&self) -> Option<GgmlType> {
        self.blocks.as_ref().map(BlockMatrix::ty)
    }
}

/// CPU backend with its own thread pool.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    isa: Isa,
    /// Runs each decode step's layers twice ([`CpuBackend::repeat_decode_layers`]).
    repeat_decode: std::sync::atomic::AtomicBool,
}

impl CpuBackend {
    /// A backend running on `threads` threads (at least one).
    pub fn new(threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("nibble-cpu-{i}"))
            .build()
            .map_err(|e| Error::InvalidInput(format!("cannot start {threads} CPU threads: {e}")))?;
        Ok(Self {
            pool,
            threads,
            isa: Isa::detect(),
            repeat_decode: Default::default(),
        })
    }

    /// Runs the layers of every decode step twice, as a backend that records its steps as
    /// device graphs runs their host side (a dry pass, then a capture). The second run redoes
    /// the first's work exactly, so answers must not change: this checks that the engine keeps
    /// [`Backend::decode_layers`]'s contract.
    pub fn repeat_decode_layers(&self, on: bool) {
        self.repeat_decode
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Threads in the pool.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Rows per parallel task so that each thread gets a few tasks.
    fn rows_per_task(&self, rows: usize) -> usize {
        rows.div_ceil(self.threads * 4).max(1)
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;

    fn name(&self) -> String {
        format!("cpu({} threads)", self.threads)
    }

    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    fn decode_layers(&self, layers: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if self
            .repeat_decode
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            layers()?;
        }
        layers()
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CpuTensor> {
        CpuTensor::new(rows, cols, data.to_vec())
    }

    fn upload_vec(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<CpuTensor> {
        CpuTensor::new(rows, cols, data)
    }

    fn upload_weight(
        &self,
        rows: usize,
        cols: usize,
        ty: GgmlType,
        bytes: &[u8],
    ) -> Result<CpuTensor> {
        if BlockMatrix::keeps(ty, cols) {
            return Ok(CpuTensor {
                data: Vec::new(),
                rows,
                cols,
                blocks: Some(BlockMatrix::new(ty, rows, cols, bytes)?),
            });
        }
        let mut data = vec![0.0f32; rows * cols];
        let (Some(block_len), Some(block_bytes)) = (ty.block_len(), ty.block_bytes()) else {
            return Err(Error::InvalidInput(format!("cannot dequantize {ty}")));
        };
        // Chunks of whole blocks, dequantized in parallel; lengths are checked by `dequantize`.
        const BLOCKS_PER_TASK: usize = 4096;
        let ok = bytes.len() / block_bytes == data.len() / block_len
            && self.pool.install(|| {
                bytes
                    .par_chunks(block_bytes * BLOCKS_PER_TASK)
                    .zip(data.par_chunks_mut(block_len * BLOCKS_PER_TASK))
                    .all(|(b, o)| dequant::dequantize(ty, b, o))
            });
        if !ok {
            return Err(Error::InvalidInput(format!(
                "{} bytes of {ty} do not make a {rows}x{cols} matrix",
                bytes.len()
            )));
        }
        CpuTensor::new(rows, cols, data)
    }

    fn zeros(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
            blocks: None,
        }
    }

    fn resize(&self, t: &mut CpuTensor, rows: usize, cols: usize) {
        t.resize(rows, cols);
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn download_rows(&self, t: &CpuTensor, rows: Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        out.extend_from_slice(&t.data[rows.start * t.cols..rows.end * t.cols]);
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &CpuTensor,
        src_row: usize,
        dst: &mut CpuTensor,
        dst_row: usize,
        n: usize,
    ) -> Result<()> {
        assert_eq!(src.cols, dst.cols, "copy_rows: column counts differ");
        let c = src.cols;
        dst.data[dst_row * c..(dst_row + n) * c]
            .copy_from_slice(&src.data[src_row * c..(src_row + n) * c]);
        Ok(())
    }

    fn embed(&self, table: &CpuTensor, tokens: &[u32], out: &mut CpuTensor) -> Result<()> {
        assert_eq!(
            (out.rows, out.cols),
            (tokens.len(), table.cols),
            "embed: output shape"
        );
        for (row, &t) in out.data.chunks_exact_mut(table.cols).zip(tokens) {
            let t = t as usize;
            match &table.blocks {
                Some(b) => b.decode_rows(self.isa, t..t + 1, row),
                None => row.copy_from_slice(table.row(t)),
            }
        }
        Ok(())
    }

    fn matmul_t(&self, x: &CpuTensor, w: &CpuTensor, out: &mut CpuTensor) -> Result<()> {
        let (n, k, m) = (x.rows, x.cols, w.rows);
        assert_eq!(w.cols, k, "matmul_t: inner dims differ");
        assert_eq!((out.rows, out.cols), (n, m), "matmul_t: output shape");
        if n == 0 {
            return Ok(());
        }
        if let Some(blocks) = &w.blocks {
            self.pool
                .install(|| qmatmul::matmul_t(self.isa, &x.data, blocks, &mut out.data, n));
            return Ok(());
        }
        if n <= gemv::MAX_ROWS {
            self.pool
                .install(|| gemv::matmul_t_small(&x.data, &w.data, &mut out.data, n, k, m));
            return Ok(());
        }
        let par = if self.threads > 1 {
            gemm::Parallelism::Rayon(self.threads)
        } else {
            gemm::Parallelism::None
        };
        self.pool.install(|| {
            // SAFETY: the pointers cover n×k, m×k and n×m f32 values (shapes asserted above);
            // `out` does not alias the inputs (it is borrowed mutably).
            unsafe {
                gemm::gemm(
                    n,
                    m,
                    k,
                    out.data.as_mut_ptr(),
                    1,
                    m as isize,
                    false,
                    x.data.as_ptr(),
                    1,
                    k as isize,
                    w.data.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    par,
                )
            }
        });
        Ok(())
    }

    fn add_bias(&self, x: &mut CpuTensor, bias: &CpuTensor) -> Result<()> {
        assert_eq!(bias.data.len(), x.cols, "add_bias: bias width");
        for row in x.data.chunks_exact_mut(x.cols) {
            simd::add(row, &bias.data);
        }
        Ok(())
    }

    fn mul_cols(&self, x: &mut CpuTensor, scale: &CpuTensor) -> Result<()> {
        assert_eq!(scale.data.len(), x.cols, "mul_cols: scale width");
        for row in x.data.chunks_exact_mut(x.cols) {
            for (x, s) in row.iter_mut().zip(&scale.data) {
                *x *= s;
            }
        }
        Ok(())
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add: shapes differ");
        simd::add(&mut x.data, &y.data);
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CpuTensor,
        weight: &CpuTensor,
        eps: f32,
        out: &mut CpuTensor,
    ) -> Result<()> {
        let w = weight.data.len();
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
        let chunk = self.rows_per_task(x.rows) * x.cols;
        self.pool.install(|| {
            x.data
                .par_chunks(chunk)
                .zip(out.data.par_chunks_mut(chunk))
                .for_each(|(xs, os)| simd::rms_norm(xs, &weight.data, eps, os));
        });
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        positions: &[u32],
        rope: &RopeArgs<'_, CpuTensor>,
    ) -> Result<()> {
        let d = rope.head_dim;
        let half = d / 2;
        assert_eq!(positions.len(), x.rows, "rope: one position per row");
        assert!(x.cols.is_multiple_of(d), "rope: row is not whole heads");
        assert_eq!(rope.cos.cols, half, "rope: table width");
        for (row, &pos) in x.data.chunks_exact_mut(x.cols).zip(positions) {
            let (cos, sin) = (rope.cos.row(pos as usize), rope.sin.row(pos as usize));
            for head in row.chunks_exact_mut(d) {
                match rope.style {
                    RopeStyle::Interleaved => simd::rope_interleaved(head, cos, sin),
                    RopeStyle::HalfSplit => simd::rope_half_split(head, cos, sin),
                }
            }
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &mut CpuTensor, up: &CpuTensor) -> Result<()> {
        assert_eq!(
            (gate.rows, gate.cols),
            (up.rows, up.cols),
            "silu_mul: shapes differ"
        );
        let chunk = self.rows_per_task(gate.rows) * gate.cols;
        self.pool.install(|| {
            gate.data
                .par_chunks_mut(chunk)
                .zip(up.data.par_chunks(chunk))
                .for_each(|(g, u)| simd::silu_mul(g, u));
        });
        Ok(())
    }

    fn attention(&self, args: &AttentionArgs<'_, CpuTensor>, out: &mut CpuTensor) -> Result<()> {
        self.pool.install(|| attention::causal_gqa(args, out));
        Ok(())
    }

    type Pages = CpuPages;

    fn new_pages(&self, plan: PoolPlan, encoding: PageEncoding) -> Result<CpuPages> {
        CpuPages::new(plan, encoding)
    }

    fn paged_attention(
        &self,
        pages: &mut CpuPages,
        pool: &PagePool,
        layer: usize,
        step: &StepTokens<'_, CpuTensor>,
        seqs: &[PagedSeq<'_>],
        out: &mut CpuTensor,
    ) -> Result<()> {
        self.pool
            .install(|| pages.attend(pool, layer, step, seqs, out))
    }

    fn read_page(&self, pages: &CpuPages, page: PageId, out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        out.extend_from_slice(pages.store().page(page)?);
        Ok(())
    }

    fn write_page(
        &self,
        pages: &mut CpuPages,
        pool: &PagePool,
        page: PageId,
        bytes: &[u8],
    ) -> Result<()> {
        let dst = pages.store_mut().page_mut(pool, page)?;
        if dst.len() != bytes.len() {
            return Err(Error::InvalidInput(format!(
                "page {page} is {} bytes, received {}",
                dst.len(),
                bytes.len()
            )));
        }
        dst.copy_from_slice(bytes);
        Ok(())
    }

    type Staging = Vec<u8>;

    fn stage_pages(&self, pages: &CpuPages, ids: &[PageId], into: &mut Vec<u8>) -> Result<()> {
        into.clear();
        for &id in ids {
            into.extend_from_slice(pages.store().page(id)?);
        }
        Ok(())
    }

    fn staged_host_bytes<'a>(&self, staging: &'a Vec<u8>) -> Result<std::borrow::Cow<'a, [u8]>> {
        Ok(std::borrow::Cow::Borrowed(staging))
    }

    fn unstage_pages(
        &self,
        pages: &mut CpuPages,
        pool: &PagePool,
        ids: &[PageId],
        staging: &Vec<u8>,
    ) -> Result<()> {
        let page_bytes = pages.store().layout().page_bytes();
        if staging.len() != ids.len() * page_bytes {
            return Err(Error::InvalidInput(format!(
                "staging holds {} bytes, not {} pages of {page_bytes}",
                staging.len(),
                ids.len()
            )));
        }
        for (&id, bytes) in ids.iter().zip(staging.chunks_exact(page_bytes.max(1))) {
            self.write_page(pages, pool, id, bytes)?;
        }
        Ok(())
    }

    fn staging_bytes(&self, staging: &Vec<u8>) -> usize {
        staging.len()
    }
}
