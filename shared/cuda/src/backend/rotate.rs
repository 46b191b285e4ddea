//! Elementwise launchers over head vectors and columns: the Hadamard rotation of head vectors
//! (`hadamard_f32`, which a `--hadamard` pool wraps its attention kernels in) and the per-column
//! ops of a row vector (`add_bias_f32`, `mul_cols_f32`).

use cudarc::driver::{CudaFunction, CudaSlice};
use nibble_engine::Backend;

use super::{grid, launched, CudaBackend, CudaTensor};
use nibble_engine::Result as EngineResult;

impl CudaBackend {
    /// Launches `kernel(x, v, n, cols)`, an elementwise op of every row of `x` with the
    /// `[1, cols]` vector `v` (`add_bias_f32`, `mul_cols_f32`).
    pub(super) fn per_column(
        &self,
        kernel: &CudaFunction,
        x: &mut CudaTensor,
        v: &CudaTensor,
        what: &str,
    ) -> EngineResult<()> {
        assert_eq!(v.len(), x.cols, "{what}: vector width");
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        self.bind();
        let cols = x.cols as u32;
        let mut b = self.kernels.builder(kernel);
        b.arg(x.f32_mut()).arg(v.f32()).arg(&n).arg(&cols);
        // SAFETY: matches add_bias_f32 and mul_cols_f32 (x, v, n, cols): x holds n values, v
        // holds cols.
        launched(unsafe { b.launch(grid(n)) }.map(|_| ()), what)?;
        Ok(())
    }
}

/// One tensor of a `hadamard_f32` launch: read from `src` (`None`: in place) into `dst`.
struct Segment<'a> {
    src: Option<&'a CudaSlice<f32>>,
    dst: &'a mut CudaSlice<f32>,
    vectors: u64,
}

/// The Hadamard rotation of head vectors (`hadamard_f32`), bit-identical to
/// `nibble_engine::hadamard::rotate`.
impl CudaBackend {
    /// `y = H x / sqrt(head_dim)` for each `head_dim`-value vector of `x` (64 or 128); `y` takes
    /// `x`'s shape.
    pub fn rotate_heads(
        &self,
        x: &CudaTensor,
        y: &mut CudaTensor,
        head_dim: usize,
    ) -> EngineResult<()> {
        self.rotate_many([x], [y], head_dim)?;
        Ok(())
    }

    /// [`Self::rotate_heads`] of Q, K and V into `out`, in one launch.
    pub fn rotate_qkv(
        &self,
        qkv: [&CudaTensor; 3],
        out: &mut [CudaTensor; 3],
        d: usize,
    ) -> EngineResult<()> {
        let [q, k, v] = out;
        self.rotate_many(qkv, [q, k, v], d)?;
        Ok(())
    }

    fn rotate_many<const N: usize>(
        &self,
        src: [&CudaTensor; N],
        dst: [&mut CudaTensor; N],
        head_dim: usize,
    ) -> EngineResult<()> {
        const { assert!(N <= 3, "hadamard_f32 takes up to three tensors") };
        let mut segments: [Option<Segment<'_>>; 3] = [None, None, None];
        for ((x, y), segment) in src.into_iter().zip(dst).zip(&mut segments) {
            check_heads(x, head_dim);
            self.resize(y, x.rows, x.cols);
            *segment = Some(Segment {
                src: Some(x.f32()),
                dst: y.f32_mut(),
                vectors: (x.len() / head_dim) as u64,
            });
        }
        self.launch_hadamard(segments, head_dim)?;
        Ok(())
    }

    /// [`Self::rotate_heads`] in place.
    pub fn rotate_heads_in_place(&self, x: &mut CudaTensor, head_dim: usize) -> EngineResult<()> {
        check_heads(x, head_dim);
        let vectors = (x.len() / head_dim) as u64;
        let segment = Segment {
            src: None,
            dst: x.f32_mut(),
            vectors,
        };
        self.launch_hadamard([Some(segment), None, None], head_dim)?;
        Ok(())
    }

    /// One `hadamard_f32` launch over up to three segments (it allocates nothing: it runs in
    /// every layer of a Hadamard cache's steps).
    fn launch_hadamard(
        &self,
        mut segments: [Option<Segment<'_>>; 3],
        head_dim: usize,
    ) -> EngineResult<()> {
        let total: u64 = segments.iter().flatten().map(|s| s.vectors).sum();
        if total == 0 {
            return Ok(());
        }
        self.bind();
        let dim = head_dim as u32;
        let norm = 1.0 / (head_dim as f32).sqrt();
        let (null, none) = (0u64, 0u64);
        let mut b = self.kernels.builder(&self.ops.hadamard);
        for segment in segments.iter_mut() {
            match segment {
                Some(s) => {
                    match s.src {
                        Some(src) => b.arg(src),
                        None => b.arg(&null),
                    };
                    b.arg(&mut *s.dst).arg(&s.vectors);
                }
                None => {
                    b.arg(&null).arg(&null).arg(&none);
                }
            }
        }
        b.arg(&dim).arg(&norm);
        // SAFETY: matches hadamard_f32; each segment's src (or dst, in place) and dst hold its
        // `vectors` whole vectors of `head_dim` (64 or 128) values; absent segments have none.
        launched(
            unsafe { b.launch(grid(total * 32)) }.map(|_| ()),
            "hadamard",
        )?;
        Ok(())
    }
}

fn check_heads(x: &CudaTensor, head_dim: usize) {
    assert!(
        matches!(head_dim, 64 | 128),
        "rotate_heads: head dim {head_dim}"
    );
    assert_eq!(x.len() % head_dim, 0, "rotate_heads: whole head vectors");
}
