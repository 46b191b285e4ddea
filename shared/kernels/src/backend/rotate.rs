//! Elementwise launchers over head vectors and columns: the Hadamard rotation of head vectors
//! (`hadamard_f32`, which a `--hadamard` pool wraps its attention kernels in) and the per-column
//! ops of a row vector (`add_bias_f32`, `mul_cols_f32`).

use cudarc::driver::{CudaFunction, CudaSlice};
use nibble_engine::Backend;

use super::{grid, launched, CudaBackend, CudaTensor};

impl CudaBackend {
    /// Launches `kernel(x, v, n, cols)`, an elementwise op of every row of `x` with the
    /// `[1, cols]` vector `v` (`add_bias_f32`, `mul_cols_f32`).
    pub(super) fn per_column(
        &self,
        kernel: &CudaFunction,
        x: &mut CudaTensor,
        v: &CudaTensor,
        what: &str,
    ) {
        assert_eq!(v.len(), x.cols, "{what}: vector width");
        let n = x.len() as u64;
        if n == 0 {
            return;
        }
        self.bind();
        let cols = x.cols as u32;
        let mut b = self.kernels.builder(kernel);
        b.arg(x.f32_mut()).arg(v.f32()).arg(&n).arg(&cols);
        // SAFETY: matches add_bias_f32 and mul_cols_f32 (x, v, n, cols): x holds n values, v
        // holds cols.
        launched(unsafe { b.launch(grid(n)) }.map(|_| ()), what);
    }
}

/// The Hadamard rotation of head vectors (`hadamard_f32`), bit-identical to
/// `nibble_engine::hadamard::rotate`.
impl CudaBackend {
    /// `y = H x / sqrt(head_dim)` for each `head_dim`-value vector of `x` (64 or 128); `y` takes
    /// `x`'s shape.
    pub fn rotate_heads(&self, x: &CudaTensor, y: &mut CudaTensor, head_dim: usize) {
        assert!(
            matches!(head_dim, 64 | 128),
            "rotate_heads: head dim {head_dim}"
        );
        assert_eq!(x.len() % head_dim, 0, "rotate_heads: whole head vectors");
        self.resize(y, x.rows, x.cols);
        self.launch_hadamard(Some(x.f32()), y.f32_mut(), x.len() / head_dim, head_dim);
    }

    /// [`Self::rotate_heads`] in place.
    pub fn rotate_heads_in_place(&self, x: &mut CudaTensor, head_dim: usize) {
        assert!(
            matches!(head_dim, 64 | 128),
            "rotate_heads: head dim {head_dim}"
        );
        assert_eq!(x.len() % head_dim, 0, "rotate_heads: whole head vectors");
        let vectors = x.len() / head_dim;
        self.launch_hadamard(None, x.f32_mut(), vectors, head_dim);
    }

    /// `src` None: in place (the kernel reads `dst`).
    pub(super) fn launch_hadamard(
        &self,
        src: Option<&CudaSlice<f32>>,
        dst: &mut CudaSlice<f32>,
        vectors: usize,
        head_dim: usize,
    ) {
        if vectors == 0 {
            return;
        }
        self.bind();
        let (n, dim) = (vectors as u64, head_dim as u32);
        let norm = 1.0 / (head_dim as f32).sqrt();
        let null = 0u64;
        let mut b = self.kernels.builder(&self.ops.hadamard);
        match src {
            Some(src) => b.arg(src),
            None => b.arg(&null),
        };
        b.arg(dst).arg(&n).arg(&dim).arg(&norm);
        // SAFETY: matches hadamard_f32; src (or dst, in place) and dst hold `vectors` whole
        // vectors of `head_dim` (64 or 128) values, one warp each.
        launched(unsafe { b.launch(grid(n * 32)) }.map(|_| ()), "hadamard");
    }
}
