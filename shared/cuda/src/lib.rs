//! nibble's CUDA kernels, compiled at start-up by NVRTC (cudarc, dynamic loading: building needs
//! no CUDA toolkit, and a machine without a GPU builds and tests everything but the launches).
//!
//! * [`nvrtc`]: finding NVRTC (PyPI wheel, `NIBBLE_NVRTC_LIB`, the loader path) and compiling
//!   every source; CI compiles them all for sm_90 and sm_80 with no GPU.
//! * [`Kernels`] (`launch/`: the decode launch in `launch/decode.rs`, the argument structs in
//!   `launch/args.rs`): a device context with the compiled module and typed launches:
//!   quantize-on-write into pages ([`Kernels::quantize`], which checks every slot against the
//!   pages; [`Kernels::quantize_unchecked`] takes device slots under a safety contract), the
//!   extend gather into the work-dtype workspace ([`Kernels::gather_work`]), causal
//!   prefill/extend attention over that workspace ([`Kernels::prefill`]: `mma.sync`, or on Hopper
//!   warpgroup MMA from `cu/prefill_hopper.cu`, see [`PrefillKernel`]) and paged split-KV decode
//!   attention over NVFP4, FP8 or BF16 pages ([`Kernels::decode`]); whole-page gather into and
//!   scatter out of a contiguous staging buffer ([`Kernels::gather_pages`],
//!   [`Kernels::scatter_pages`]) for page transfers. K/V scales travel as [`KvScales`], the
//!   longer argument lists as named structs ([`NewKv`], [`KvWorkspace`], [`CachedPrefix`],
//!   [`WindowRows`], [`DecodeOut`]).
//! * [`backend`]: [`CudaBackend`], nibble-engine's `Backend` on these kernels and cuBLAS, a
//!   module per responsibility as the engine's `backend/cpu/`: `mod.rs` (construction and the
//!   trait impl), `tensor.rs`, `gemm.rs`, `elementwise.rs`, `rotate.rs`, `weights.rs`,
//!   `pages.rs`, `attention.rs` (contiguous, prefill and extend) and `decode.rs`.
//! * [`nccl`]: NCCL opened at run time (unique ids, non-blocking communicators with deadlines,
//!   send/receive of device buffers), the GPU-to-GPU page transfer of disaggregated serving.
//!
//! Pages on the GPU have exactly the bytes of `nibble_kvfmt::PageLayout` (docs/FORMAT.md), so
//! pages written by the CPU are read by the GPU and the other way round; [`PageGeom`] carries
//! that geometry to the kernels.

pub mod backend;
mod device;
mod error;
mod geom;
mod graph;
mod launch;
mod launcher;
pub mod libs;
pub mod nvrtc;
mod staging;

pub use backend::{
    cuda_available, CudaBackend, CudaPages, CudaTensor, GraphCounts, WeightPrecision, GRAPHS_ENV,
};
/// The device context a backend runs on (NCCL communicators and staging buffers of the same
/// worker use it too).
pub use cudarc::driver::CudaContext;
pub use device::{Device, DeviceMemory, KvNeeds};
pub use error::{Error, Result};
pub use geom::{PageGeom, WindowGeom};
pub use launch::{
    CachedPrefix, DecodeBatch, DecodeOut, DecodeWorkspace, Kernels, KvScales, KvWorkspace, NewKv,
    PrefillBatch, PrefillKernel, WgmmaTuning, WindowRows,
};
pub use staging::DeviceStaging;

/// The element codecs and page addressing every kernel shares, prepended to each source.
pub(crate) const PRELUDE: &str = include_str!("cu/common.cuh");

/// Every kernel source: (name, body). Each is compiled into its own module.
pub(crate) const SOURCES: [(&str, &str); 4] = [
    ("quantize", include_str!("cu/quantize.cu")),
    ("decode", include_str!("cu/decode.cu")),
    ("prefill", include_str!("cu/prefill.cu")),
    ("pages", include_str!("cu/pages.cu")),
];

/// The source compiled for sm_90a alone (warpgroup MMA, `setmaxnreg`), loaded on compute
/// capability 9.0: Hopper's prefill and extend attention.
pub(crate) const HOPPER_SOURCE: (&str, &str) =
    ("prefill_hopper", include_str!("cu/prefill_hopper.cu"));

/// The entry points of [`HOPPER_SOURCE`] (checked by the compile test).
pub const HOPPER_ENTRY_POINTS: [&str; 5] = [
    "prefill_combine",
    "prefill_hopper_fp8_d64",
    "prefill_hopper_fp8_d128",
    "prefill_hopper_bf16_d64",
    "prefill_hopper_bf16_d128",
];

/// The kernel entry points each source must define (checked by the compile test).
pub const ENTRY_POINTS: [(&str, &[&str]); 4] = [
    (
        "quantize",
        &[
            "kv_quantize",
            "kv_quantize_nvfp4_mse",
            "kv_k_codes",
            "kv_gather_work",
            "fill_random_pages",
        ],
    ),
    (
        "decode",
        &[
            "decode_nvfp4_d64",
            "decode_nvfp4_d128",
            "decode_fp8_d64",
            "decode_fp8_d128",
            "decode_bf16_d64",
            "decode_bf16_d128",
            "decode_combine",
            "decode_combine_groups",
        ],
    ),
    (
        "prefill",
        &[
            "prefill_fp8_d64",
            "prefill_fp8_d128",
            "prefill_bf16_d64",
            "prefill_bf16_d128",
        ],
    ),
    ("pages", &["pages_gather", "pages_scatter"]),
];
