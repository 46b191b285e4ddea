//! [`CudaTensor`] (f32 device buffers, or the BF16 codes of a weight matrix) and the backend's
//! tensor plumbing: upload, download, resize, row copies and the greedy argmax; [`Uploaded`], a
//! small host array kept on the device.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, LaunchConfig};
use nibble_engine::{Backend, Error as EngineError, Result as EngineResult};

use super::weights::{to_bf16, WeightPrecision};
use super::{device_err, engine_err, launched, CudaBackend};
use crate::graph::{self, Pass};
use crate::Result;

/// A device tensor: `rows × cols`, row-major, in the first `rows * cols` values of `data`.
pub struct CudaTensor {
    pub(super) data: Data,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Which tensor this is (unique in the process) and how many times its values may have
    /// changed (every mutable access counts): together they say whether a copy made from it
    /// (the BF16 cast of `matmul_t`) is still current.
    id: u64,
    pub(super) version: u64,
}

/// The values of a [`CudaTensor`].
pub(super) enum Data {
    /// Activations, vectors, and weight matrices under [`WeightPrecision::F32`].
    F32(CudaSlice<f32>),
    /// BF16 codes of a weight matrix ([`WeightPrecision::Bf16`]): read only as the `w` of
    /// `matmul_t` and the table of `embed`.
    Bf16(CudaSlice<u16>),
}

const BF16_MISUSE: &str =
    "a BF16 weight matrix was passed where f32 values are needed (only matmul_t's w and embed's \
     table may be BF16)";

impl CudaTensor {
    pub(super) fn new(data: Data, rows: usize, cols: usize) -> Self {
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
    pub(super) fn stamp(&self) -> (u64, u64, usize) {
        (self.id, self.version, self.len())
    }

    pub(super) fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub(super) fn f32(&self) -> &CudaSlice<f32> {
        match &self.data {
            Data::F32(b) => b,
            Data::Bf16(_) => panic!("{BF16_MISUSE}"),
        }
    }

    pub(super) fn f32_mut(&mut self) -> &mut CudaSlice<f32> {
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

/// A small host array kept on the device, copied again only when it changes (RoPE's positions
/// are the same for every layer of a step).
///
/// These arrays are a decode-step graph's inputs (`crate::graph`): a dry pass copies them as
/// usual, and the graph launched after it reads them. So a step may write each array once: a
/// second copy in the same dry pass would leave only the last values for the whole graph, and
/// blocks the graph; a capture pass, which follows a dry pass with the same host state, never
/// copies.
#[derive(Default)]
pub(super) struct Uploaded {
    pub(super) host: Vec<u32>,
    dev: Option<CudaSlice<u32>>,
    /// The dry pass (`graph::pass_id`) that last copied the array, if any.
    copied_in: Option<u64>,
}

impl Uploaded {
    /// Makes the device copy hold `data`: unchanged when it already does, else `data` copied
    /// into the buffer (stream-ordered after the launches that read it), grown when too small.
    pub(super) fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        data: Vec<u32>,
    ) -> Result<CudaView<'_, u32>> {
        let fits = self.dev.as_ref().is_some_and(|d| d.len() >= data.len());
        if !fits || self.host != data {
            match graph::pass_id() {
                (Pass::Eager, _) => {}
                (Pass::Dry, id) => {
                    if self.copied_in == Some(id) {
                        graph::block("an input array written twice in one step")?;
                    }
                    self.copied_in = Some(id);
                }
                (Pass::Capture, _) => {
                    return Err(crate::Error::Unsupported(
                        "a decode step's inputs changed between its dry pass and its capture"
                            .into(),
                    ))
                }
            }
        }
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
    pub(super) fn view(&self) -> CudaView<'_, u32> {
        let dev = self.dev.as_ref().expect("uploaded before it is viewed");
        dev.slice(0..self.host.len())
    }
}

/// Tensors in and out of device memory (the `Backend` methods of the same names).
impl CudaBackend {
    pub(super) fn alloc(&self, n: usize) -> CudaSlice<f32> {
        self.stream()
            .alloc_zeros(n.max(1))
            .unwrap_or_else(|e| panic!("CUDA: cannot allocate {n} f32: {e}"))
    }

    /// Rows `rows` of `t` into a new exactly-sized buffer.
    pub(super) fn rows_of(&self, t: &CudaTensor, rows: Range<usize>) -> Result<CudaSlice<f32>> {
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

    pub(super) fn upload_f32(
        &self,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> EngineResult<CudaTensor> {
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

    /// A weight matrix in the backend's [`WeightPrecision`].
    pub(super) fn upload_weights(
        &self,
        rows: usize,
        cols: usize,
        data: Vec<f32>,
    ) -> EngineResult<CudaTensor> {
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

    pub(super) fn zeros_f32(&self, rows: usize, cols: usize) -> CudaTensor {
        self.bind();
        CudaTensor::new(Data::F32(self.alloc(rows * cols)), rows, cols)
    }

    /// Reshapes `t`, reallocating only when it has too few values.
    pub(super) fn reshape(&self, t: &mut CudaTensor, rows: usize, cols: usize) {
        if t.f32().len() < rows * cols {
            self.bind();
            t.data = Data::F32(self.alloc(rows * cols));
        }
        t.version += 1;
        t.rows = rows;
        t.cols = cols;
    }

    pub(super) fn download(
        &self,
        t: &CudaTensor,
        rows: Range<usize>,
        out: &mut Vec<f32>,
    ) -> EngineResult<()> {
        if rows.is_empty() {
            return Ok(());
        }
        self.bind();
        let host = self
            .stream()
            .clone_dtoh(&t.f32().slice(rows.start * t.cols..rows.end * t.cols))
            .map_err(|e| device_err("device-to-host copy", e))?;
        out.extend_from_slice(&host);
        Ok(())
    }

    /// Each row's first largest value (`argmax_rows_f32`), copied to the host.
    pub(super) fn argmax(&self, t: &CudaTensor, out: &mut Vec<u32>) -> EngineResult<()> {
        if t.rows == 0 {
            return Ok(());
        }
        self.bind();
        let mut dev: CudaSlice<u32> = self
            .stream()
            .alloc_zeros(t.rows)
            .map_err(|e| device_err("allocation of the argmax rows", e))?;
        let cols = t.cols as u32;
        let mut b = self.kernels.builder(&self.ops.argmax);
        b.arg(t.f32()).arg(&mut dev).arg(&cols);
        let cfg = LaunchConfig {
            grid_dim: (t.rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches argmax_rows_f32; t holds rows * cols values, dev one per row.
        launched(unsafe { b.launch(cfg) }.map(|_| ()), "argmax_rows")?;
        let host = self
            .stream()
            .clone_dtoh(&dev)
            .map_err(|e| device_err("device-to-host copy", e))?;
        out.extend_from_slice(&host);
        Ok(())
    }

    pub(super) fn copy_tensor_rows(
        &self,
        src: &CudaTensor,
        src_row: usize,
        dst: &mut CudaTensor,
        dst_row: usize,
        n: usize,
    ) -> EngineResult<()> {
        assert_eq!(src.cols, dst.cols, "copy_rows: column counts differ");
        assert!(
            src_row + n <= src.rows && dst_row + n <= dst.rows,
            "copy_rows: rows"
        );
        if n == 0 {
            return Ok(());
        }
        self.bind();
        graph::block("a device-to-device copy").map_err(engine_err)?;
        if !graph::runs_now() {
            return Ok(());
        }
        let c = src.cols;
        launched(
            self.stream().memcpy_dtod(
                &src.f32().slice(src_row * c..(src_row + n) * c),
                &mut dst.f32_mut().slice_mut(dst_row * c..(dst_row + n) * c),
            ),
            "copy_rows",
        )?;
        Ok(())
    }
}
