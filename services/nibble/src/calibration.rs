//! `nibble calibrate`: per-layer K/V amax on a sample text, written as the calibration JSON that
//! `--calibration` reads (amax values plus the global scales for nvfp4 and fp8).
//!
//! The text is tokenized whole without a BOS token, cut to `--max-tokens`, and run through the
//! model in independent windows of `--window` tokens ([`calibrate::calibrate`]); the output file
//! is replaced atomically, so a failed run leaves no file (and an old one untouched).

use nibble_engine::calibrate;

use crate::cli::CalibrateArgs;
use crate::load::Opened;
use crate::{files, Error, Result};

/// Runs `nibble calibrate`.
pub fn run(args: &CalibrateArgs) -> Result<()> {
    let opened = Opened::open(&args.model)?;
    let mut tokens = opened.tokenize_file(&args.text)?;
    if tokens.is_empty() {
        return Err(Error::TextTooShort {
            path: args.text.clone(),
            tokens: 0,
            needed: 1,
            what: "calibration needs at least one token".into(),
        });
    }
    if let Some(max) = args.max_tokens {
        tokens.truncate(max);
    }
    let (model, _) = opened.load(None)?;
    let source = args.text.display().to_string();
    let mut calibration = crate::with_model!(model, |model| calibrate::calibrate(
        &model,
        &tokens,
        args.window,
        &source
    )?);
    calibration.nvfp4_window = args.nvfp4_window;
    let mut json = calibration.to_json()?;
    json.push('\n');
    files::write_atomically(&args.output, json.as_bytes())
}
