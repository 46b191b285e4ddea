//! The row-wise kernels of `cu/ops.cu` the layers run between their GEMMs: the embedding
//! lookup, residual adds, RMSNorm (alone or fused with the residual add before it), RoPE (of Q,
//! or of Q and K in one launch) and SwiGLU. RMSNorm and SwiGLU also write their output's BF16
//! cast for the BF16-weight GEMMs that read it. (The per-column ops and the Hadamard rotation
//! are in `rotate.rs`.)

use std::sync::PoisonError;

use cudarc::driver::LaunchConfig;
use nibble_engine::backend::RopeArgs;
use nibble_engine::RopeStyle;

use super::tensor::Data;
use super::{device_err, grid, launched, CudaBackend, CudaTensor};
use nibble_engine::Result as EngineResult;

/// The input of [`CudaBackend::launch_norm`].
enum NormInput<'a> {
    /// `rms_norm(x)`.
    Plain(&'a CudaTensor),
    /// `x += y`, then `rms_norm(x)` (whole rows).
    Residual(&'a mut CudaTensor, &'a CudaTensor),
}

/// Threads per RMSNorm block: `NORM_THREADS` in `cu/ops.cu`, whose block sum is written for
/// exactly this many.
const NORM_THREADS: u32 = 256;

impl CudaBackend {
    /// Rows `tokens` of `table` (f32 or BF16 codes, widened exactly) into `out`.
    pub(super) fn embed_tokens(
        &self,
        table: &CudaTensor,
        tokens: &[u32],
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
        assert_eq!(
            (out.rows, out.cols),
            (tokens.len(), table.cols),
            "embed: output shape"
        );
        if tokens.is_empty() {
            return Ok(());
        }
        assert!(
            tokens.iter().all(|&t| (t as usize) < table.rows),
            "embed: token out of range"
        );
        self.bind();
        let mut uploaded = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        let dev = uploaded
            .upload(self.stream(), tokens.to_vec())
            .map_err(|e| device_err("host-to-device copy of the tokens", e))?;
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
        )?;
        Ok(())
    }

    /// `x += y`.
    pub(super) fn add_in_place(&self, x: &mut CudaTensor, y: &CudaTensor) -> EngineResult<()> {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add: shapes differ");
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        self.bind();
        let mut b = self.kernels.builder(&self.ops.add);
        b.arg(x.f32_mut()).arg(y.f32()).arg(&n);
        // SAFETY: matches add_f32; both hold n values.
        launched(unsafe { b.launch(grid(n)) }.map(|_| ()), "add")?;
        Ok(())
    }

    pub(super) fn norm(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
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
            return Ok(());
        }
        self.launch_norm(NormInput::Plain(x), weight, eps, out)?;
        Ok(())
    }

    /// `x += y`, then RMSNorm of `x` into `out`: one launch when the norm covers whole rows.
    pub(super) fn add_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> EngineResult<()> {
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
            self.add_in_place(x, y)?;
            self.norm(x, weight, eps, out)?;
            return Ok(());
        }
        self.launch_norm(NormInput::Residual(x, y), weight, eps, out)?;
        Ok(())
    }

    /// `gate = silu(gate) * up`.
    pub(super) fn silu(&self, gate: &mut CudaTensor, up: &CudaTensor) -> EngineResult<()> {
        assert_eq!(
            (gate.rows, gate.cols),
            (up.rows, up.cols),
            "silu_mul: shapes differ"
        );
        let n = gate.len() as u64;
        if n == 0 {
            return Ok(());
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
        launched(unsafe { b.launch(grid(n)) }.map(|_| ()), "silu_mul")?;
        if let Some(c) = &mut cast {
            c.of = Some(gate.stamp());
        }
        Ok(())
    }

    /// RoPE of `x`, and of `y` (the keys of the same rows) in the same launch when given.
    pub(super) fn launch_rope(
        &self,
        x: &mut CudaTensor,
        mut y: Option<&mut CudaTensor>,
        positions: &[u32],
        rope: &RopeArgs<'_, CudaTensor>,
    ) -> EngineResult<()> {
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
            return Ok(());
        }
        self.bind();
        let mut uploaded = self
            .positions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let pos = uploaded
            .upload(self.stream(), positions.to_vec())
            .map_err(|e| device_err("host-to-device copy of positions", e))?;
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
        launched(unsafe { b.launch(grid(pairs)) }.map(|_| ()), "rope")?;
        Ok(())
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
    ) -> EngineResult<()> {
        self.bind();
        let width = weight.len() as u32;
        let cfg = LaunchConfig {
            grid_dim: ((out.len() / weight.len()) as u32, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
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
        launched(unsafe { b.launch(cfg) }.map(|_| ()), what)?;
        if let Some(c) = &mut cast {
            c.of = Some(out.stamp());
        }
        Ok(())
    }
}
