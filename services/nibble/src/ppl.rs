//! `nibble eval ppl`: perplexity of a text through the paged, quantized KV cache, and how often
//! its top-1 prediction agrees with the full-precision run.
//!
//! The text is tokenized whole without a BOS token and cut into `--windows` consecutive,
//! non-overlapping windows of `--window` tokens from its start; within a window, tokens 1..N-1
//! are predicted from their prefixes. Each window is scored twice: once by
//! [`eval::score_window`] (contiguous f32 K/V, no quantization: the reference) and once by
//! [`eval::score_window_paged`] along `--path`. Top-1 agreement is the fraction of positions
//! where the two runs' argmax tokens are equal. With `--kv-dtype f32` only the reference runs
//! (agreement is 1 by definition).
//!
//! The means are over windows; all windows have the same length, so the mean NLL is the mean
//! over every scored token and `mean.perplexity` is `exp(mean.nll)` (the geometric mean of the
//! windows' perplexities).

use std::io::Write;
use std::path::PathBuf;

use nibble_engine::eval::{self, EvalPath, WindowScore};
use nibble_kvfmt::KvDtype;
use serde::Serialize;

use crate::cli::{EvalDtype, PplArgs};
use crate::load::Opened;
use crate::{Error, Result};

/// The settings a report was made with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settings {
    pub model: PathBuf,
    pub text: PathBuf,
    /// Tokens in the whole text.
    pub text_tokens: usize,
    pub kv_dtype: &'static str,
    pub path: &'static str,
    pub window: usize,
    pub windows: usize,
    pub page_size: usize,
    /// Whether global scales came from a calibration file (else all 1.0).
    pub calibrated: bool,
    pub calibration: Option<PathBuf>,
    pub hadamard: bool,
    /// Whether K was smoothed per channel (a calibration with channels, without
    /// `--no-smooth-k`).
    pub smooth_k: bool,
    /// Whether K's NVFP4 codes were chosen for the queries (a calibration with the queries'
    /// second moment, without `--no-k-codes`).
    pub k_codes: bool,
    /// How NVFP4 block scales were chosen on write (`amax` or `mse`; null for other caches).
    pub scale_rule: Option<&'static str>,
    /// Tokens of the BF16 recent window (null for the f32 reference).
    pub kv_window: Option<usize>,
    /// The dtype prefill and extend attention held K/V in (null for the f32 reference).
    pub prefill_work: Option<&'static str>,
}

/// One window's scores.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowReport {
    /// Window number; it covers tokens `index * window .. (index + 1) * window`.
    pub index: usize,
    pub mean_nll: f64,
    pub perplexity: f64,
    /// Fraction of positions whose argmax equals the reference's.
    pub top1_agreement: f64,
    pub reference_mean_nll: f64,
    pub reference_perplexity: f64,
}

/// Means over the windows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MeanReport {
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    pub top1_agreement: f64,
    pub reference_mean_nll: f64,
    /// `exp(reference_mean_nll)`.
    pub reference_perplexity: f64,
}

/// What `nibble eval ppl` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PplReport {
    pub settings: Settings,
    pub windows: Vec<WindowReport>,
    pub mean: MeanReport,
}

impl WindowReport {
    /// Compares one window's scores with the reference's.
    pub fn new(index: usize, scored: &WindowScore, reference: &WindowScore) -> Self {
        let agree = scored
            .predicted
            .iter()
            .zip(&reference.predicted)
            .filter(|(a, b)| a == b)
            .count();
        Self {
            index,
            mean_nll: scored.mean_nll(),
            perplexity: scored.perplexity(),
            top1_agreement: agree as f64 / reference.predicted.len() as f64,
            reference_mean_nll: reference.mean_nll(),
            reference_perplexity: reference.perplexity(),
        }
    }
}

impl MeanReport {
    /// The means of `windows` (at least one).
    pub fn new(windows: &[WindowReport]) -> Self {
        let mean =
            |f: fn(&WindowReport) -> f64| windows.iter().map(f).sum::<f64>() / windows.len() as f64;
        let mean_nll = mean(|w| w.mean_nll);
        let reference_mean_nll = mean(|w| w.reference_mean_nll);
        Self {
            mean_nll,
            perplexity: mean_nll.exp(),
            top1_agreement: mean(|w| w.top1_agreement),
            reference_mean_nll,
            reference_perplexity: reference_mean_nll.exp(),
        }
    }
}

fn path_name(path: EvalPath) -> &'static str {
    match path {
        EvalPath::Prefill => "prefill",
        EvalPath::Extend => "extend",
        EvalPath::Blocks => "blocks",
        EvalPath::Decode => "decode",
    }
}

/// Runs `nibble eval ppl`, printing JSON or a table to `out`.
pub fn run(args: &PplArgs, out: &mut impl Write) -> Result<()> {
    let report = evaluate(args)?;
    let text = if args.json {
        serde_json::to_string(&report).map_err(|e| Error::Stdout(e.into()))? + "\n"
    } else {
        table(&report)
    };
    out.write_all(text.as_bytes()).map_err(Error::Stdout)
}

/// Scores the windows `args` describe.
pub fn evaluate(args: &PplArgs) -> Result<PplReport> {
    let dtype: Option<KvDtype> = match args.kv_dtype {
        EvalDtype::F32 => None,
        EvalDtype::Kv(dtype) => Some(dtype),
    };
    if dtype.is_none() {
        let flag = if args.quant.calibration.is_some() {
            Some("--calibration")
        } else if args.quant.hadamard {
            Some("--hadamard")
        } else if args.quant.kv_window.is_some() {
            Some("--kv-window")
        } else if args.quant.prefill_work.is_some() {
            Some("--prefill-work")
        } else {
            None
        };
        if let Some(flag) = flag {
            return Err(Error::Flag {
                flag,
                reason: "applies to a quantized cache, not --kv-dtype f32".into(),
            });
        }
    }
    let opened = Opened::open(&args.model)?;
    let kv = dtype
        .map(|dtype| opened.kv_config(dtype, &args.quant))
        .transpose()?;
    let tokens = opened.tokenize_file(&args.text)?;
    let needed = args.window.checked_mul(args.windows).ok_or(Error::Flag {
        flag: "--windows",
        reason: "window × windows overflows".into(),
    })?;
    if tokens.len() < needed {
        return Err(Error::TextTooShort {
            path: args.text.clone(),
            tokens: tokens.len(),
            needed,
            what: format!("{} windows of {} tokens", args.windows, args.window),
        });
    }
    let model_path = opened.path().to_path_buf();
    let (model, _) = opened.load(kv.as_ref())?;
    let mut windows = Vec::with_capacity(args.windows);
    crate::with_model!(model, |model| {
        for (index, window) in tokens[..needed].chunks_exact(args.window).enumerate() {
            // The model as its file has it (`score_window_paged` smooths K for its cache).
            let reference = eval::score_window(&model, window)?;
            let report = match &kv {
                Some(kv) => {
                    let scored = eval::score_window_paged(&model, kv, args.path, window)?;
                    WindowReport::new(index, &scored, &reference)
                }
                None => WindowReport::new(index, &reference, &reference),
            };
            windows.push(report);
        }
    });
    Ok(PplReport {
        settings: Settings {
            model: model_path,
            text: args.text.clone(),
            text_tokens: tokens.len(),
            kv_dtype: args.kv_dtype.name(),
            path: path_name(args.path),
            window: args.window,
            windows: args.windows,
            page_size: args.quant.page_size,
            calibrated: args.quant.calibration.is_some(),
            calibration: args.quant.calibration.clone(),
            hadamard: args.quant.hadamard,
            smooth_k: kv.as_ref().is_some_and(|kv| kv.k_smoothing.is_some()),
            k_codes: kv.as_ref().is_some_and(|kv| kv.k_codes.is_some()),
            scale_rule: (dtype == Some(KvDtype::Nvfp4)).then(|| args.quant.scale_rule.name()),
            kv_window: kv.as_ref().map(|kv| kv.window),
            prefill_work: kv.as_ref().map(|kv| kv.work().name()),
        },
        mean: MeanReport::new(&windows),
        windows,
    })
}

/// The report as a small table: one row per window, then the means.
fn table(report: &PplReport) -> String {
    let s = &report.settings;
    let mut text =
        format!(
        "{} · kv {} · path {} · {} windows of {} tokens{}{}{}{}{}{}{}\n{:>6} {:>9} {:>11} {:>8} {:>9}\n",
        s.model.display(),
        s.kv_dtype,
        s.path,
        s.windows,
        s.window,
        if s.calibrated { " · calibrated" } else { "" },
        if s.hadamard { " · hadamard" } else { "" },
        if s.smooth_k { " · K smoothed" } else { "" },
        if s.k_codes { " · K codes for the queries" } else { "" },
        s.scale_rule.map(|r| format!(" · scales {r}")).unwrap_or_default(),
        s.kv_window
            .filter(|w| *w > 0)
            .map(|w| format!(" · bf16 window {w}"))
            .unwrap_or_default(),
        s.prefill_work
            .map(|w| format!(" · prefill in {w}"))
            .unwrap_or_default(),
        "window",
        "ppl",
        "ppl (f32)",
        "top-1",
        "mean NLL",
    );
    let row = |name: String, ppl: f64, reference: f64, top1: f64, nll: f64| {
        format!("{name:>6} {ppl:>9.4} {reference:>11.4} {top1:>8.4} {nll:>9.5}\n")
    };
    for w in &report.windows {
        text += &row(
            w.index.to_string(),
            w.perplexity,
            w.reference_perplexity,
            w.top1_agreement,
            w.mean_nll,
        );
    }
    let m = &report.mean;
    text += &row(
        "mean".into(),
        m.perplexity,
        m.reference_perplexity,
        m.top1_agreement,
        m.mean_nll,
    );
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(nll: &[f64], predicted: &[u32]) -> WindowScore {
        WindowScore {
            nll: nll.to_vec(),
            predicted: predicted.to_vec(),
        }
    }

    #[test]
    fn agreement_and_means() {
        let reference = score(&[1.0, 1.0, 1.0, 1.0], &[1, 2, 3, 4]);
        let a = WindowReport::new(0, &score(&[1.0, 2.0, 1.0, 2.0], &[1, 2, 0, 4]), &reference);
        assert_eq!(a.top1_agreement, 0.75);
        assert_eq!(a.mean_nll, 1.5);
        assert!((a.perplexity - 1.5f64.exp()).abs() < 1e-12);
        assert_eq!(a.reference_mean_nll, 1.0);
        let b = WindowReport::new(1, &score(&[0.5; 4], &[0, 0, 0, 4]), &reference);
        assert_eq!(b.top1_agreement, 0.25);
        let m = MeanReport::new(&[a, b]);
        assert_eq!(m.mean_nll, 1.0);
        assert_eq!(m.perplexity, 1.0f64.exp());
        assert_eq!(m.top1_agreement, 0.5);
        assert_eq!(m.reference_perplexity, 1.0f64.exp());
    }
}
