//! The paged cache on the real model: every KV dtype through every attention path stays close
//! to the f32 reference, and the paths agree with each other.

mod common;

use std::sync::Arc;

use nibble_engine::eval::{score_window, score_window_paged, EvalPath};
use nibble_engine::paged::WorkDtype;
use nibble_engine::{CpuBackend, KvConfig, Model, Tokenizer};
use nibble_kvfmt::KvDtype;

/// The model on the CPU backend and the Austen fixture's tokens.
fn model_and_text() -> (Model<CpuBackend>, Vec<u32>) {
    let file = common::open_model();
    let model = Model::from_gguf(Arc::new(CpuBackend::new(2).unwrap()), &file).unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let text = std::fs::read_to_string(nibble_testkit::fixture(
        "austen_pride_and_prejudice_8000_20000.txt",
    ))
    .unwrap();
    (model, tokenizer.encode(&text, false).unwrap())
}

#[test]
fn every_dtype_and_path_tracks_the_f32_reference() {
    let (model, tokens) = model_and_text();
    let window = &tokens[..160];
    let reference = score_window(&model, window).unwrap();
    let mut prefill_nll = Vec::new();
    for dtype in KvDtype::ALL {
        let kv = KvConfig::new(dtype);
        let mut nlls = Vec::new();
        for path in [EvalPath::Prefill, EvalPath::Extend, EvalPath::Decode] {
            let score = score_window_paged(&model, &kv, path, window).unwrap();
            let agree = score
                .predicted
                .iter()
                .zip(&reference.predicted)
                .filter(|(a, b)| a == b)
                .count() as f64
                / reference.predicted.len() as f64;
            let delta = score.mean_nll() - reference.mean_nll();
            eprintln!(
                "{dtype} {path:?}: nll {:.4} (f32 {:.4}), top-1 agreement {agree:.3}",
                score.mean_nll(),
                reference.mean_nll()
            );
            let (max_delta, min_agree) = match dtype {
                KvDtype::Bf16 => (0.01, 0.97),
                KvDtype::Fp8 => (0.05, 0.93),
                KvDtype::Nvfp4 => (0.1, 0.75),
            };
            assert!(
                delta.abs() < max_delta,
                "{dtype} {path:?}: NLL moved by {delta}"
            );
            assert!(agree >= min_agree, "{dtype} {path:?}: agreement {agree}");
            nlls.push(score.mean_nll());
        }
        // Extend and decode read pages of this dtype: for bf16 that equals the work dtype.
        if dtype == KvDtype::Bf16 {
            assert!(
                (nlls[0] - nlls[1]).abs() < 1e-9,
                "bf16 prefill and extend agree"
            );
        }
        // Prefill attends over the prompt's K/V in the work dtype (BF16 by default) and never
        // reads pages, so its score does not depend on the stored dtype.
        prefill_nll.push((dtype, nlls[0]));
    }
    assert!(
        prefill_nll.iter().all(|(_, nll)| *nll == prefill_nll[0].1),
        "prefill never reads the pages: {prefill_nll:?}"
    );
}

/// `KvConfig::prefill_work` sets the dtype prefill and extend attention hold K/V in: an nvfp4
/// cache whose prefill works in BF16 (the default) scores a one-shot prefill exactly as a bf16
/// cache does (neither reads its pages there), and its extend, which reads the cached prefix
/// from NVFP4 pages, differs from both; in FP8 (`--prefill-work fp8`) both paths differ again.
#[test]
fn the_prefill_work_dtype_is_what_prefill_attention_reads() {
    let (model, tokens) = model_and_text();
    let window = &tokens[..160];
    let bf16 = KvConfig::new(KvDtype::Bf16);
    let nvfp4 = KvConfig::new(KvDtype::Nvfp4);
    assert_eq!(nvfp4.work(), WorkDtype::Bf16);
    let nvfp4_fp8 = KvConfig {
        prefill_work: Some(WorkDtype::Fp8),
        ..nvfp4.clone()
    };
    let score = |kv: &KvConfig, path| score_window_paged(&model, kv, path, window).unwrap();
    assert_eq!(
        score(&nvfp4, EvalPath::Prefill),
        score(&bf16, EvalPath::Prefill)
    );
    assert_ne!(
        score(&nvfp4, EvalPath::Prefill),
        score(&nvfp4_fp8, EvalPath::Prefill)
    );
    let extend = score(&nvfp4, EvalPath::Extend);
    assert_ne!(extend, score(&bf16, EvalPath::Extend));
    assert_ne!(extend, score(&nvfp4_fp8, EvalPath::Extend));
}
