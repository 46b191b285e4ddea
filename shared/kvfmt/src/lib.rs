//! nibble's KV-cache formats: the contract every other crate rests on.
//!
//! * [`e4m3`] and [`e2m1`]: the two element codecs (OCP FP8 E4M3FN and FP4 E2M1), round to
//!   nearest with ties to even, saturating.
//! * [`bf16`]: BF16 from f32, round to nearest even.
//! * [`nvfp4`]: 16-value blocks of E2M1 with one E4M3 block scale and an FP32 global scale that is
//!   a *dequantization multiplier*; [`fp8`]: E4M3 with one per-tensor scale.
//! * [`KvDtype`] names the three cache dtypes; [`interchange`] is the flat file layout of
//!   `nibble kv encode/decode`; [`layout`] is the page layout and the one byte-accounting function
//!   the pool planner and the allocator share; [`window`] is the BF16 ring of a sequence's
//!   most recent tokens; [`check`] refuses received pages holding bytes no writer produces
//!   (NaN or negative block scales, NaN FP8 codes, non-finite BF16).
//!
//! Nothing here does I/O or allocates per value on the hot path. Checked entry points reject
//! non-finite input with the position of the first bad value; `*_unchecked` fast paths assume
//! finite input and document what they do otherwise.

pub mod bf16;
pub mod check;
pub mod dtype;
pub mod e2m1;
pub mod e4m3;
mod error;
pub mod fp8;
pub mod interchange;
pub mod layout;
pub mod nvfp4;
pub mod window;

pub use check::{PageFault, SequencePages};
pub use dtype::KvDtype;
pub use error::{Error, Result};
pub use layout::{KvPart, PageLayout};
pub use nvfp4::ScaleRule;
pub use window::WindowLayout;

/// Returns the index of the first value that is NaN or infinite.
pub fn first_non_finite(values: &[f32]) -> Option<usize> {
    values.iter().position(|v| !v.is_finite())
}

/// Fails with [`Error::NonFinite`] naming the first non-finite value, if any.
pub fn check_finite(values: &[f32]) -> Result<()> {
    match first_non_finite(values) {
        Some(index) => Err(Error::NonFinite {
            index,
            value: values[index],
        }),
        None => Ok(()),
    }
}

/// Checks that a global scale is a usable dequantization multiplier: finite and > 0.
pub fn check_global_scale(g: f32) -> Result<()> {
    if g.is_finite() && g > 0.0 {
        Ok(())
    } else {
        Err(Error::BadGlobalScale(g))
    }
}
