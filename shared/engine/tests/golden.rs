//! Golden test: this engine's logits against an independent float64 numpy forward pass of the
//! same weights (tests/fixtures/make_golden.py; README.md next to it says how it was made).
//!
//! Tolerance: |Δ| ≤ 1e-3 on every compared logit and on each position's logsumexp (logits are
//! O(10); the engine computes in f32 and the measured worst difference is about 5e-5), and the
//! reference's top-1 token must be the engine's top-1 at every position.

mod common;

use nibble_engine::{eval, CpuBackend, Logits, Model, SeqInput};
use serde_json::Value;
use std::sync::Arc;

const TOLERANCE: f64 = 1e-3;

#[test]
fn logits_match_numpy_reference() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(nibble_testkit::fixture("golden_smollm2.json")).unwrap(),
    )
    .unwrap();
    let tokens: Vec<u32> = golden["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let probe: Vec<usize> = golden["probe_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as usize)
        .collect();

    let model =
        Model::from_gguf(Arc::new(CpuBackend::new(2).unwrap()), &common::open_model()).unwrap();
    let mut kv = model.new_kv(tokens.len());
    let mut logits = Vec::new();
    model
        .forward(
            &mut model.workspace(),
            &mut [SeqInput {
                tokens: &tokens,
                kv: &mut kv,
            }],
            Logits::All,
            &mut logits,
        )
        .unwrap();
    let vocab = model.config().vocab_size;

    let mut worst = 0.0f64;
    let positions = golden["positions"].as_array().unwrap();
    assert_eq!(positions.len(), tokens.len());
    for (pos, (want, row)) in positions.iter().zip(logits.chunks_exact(vocab)).enumerate() {
        let mut check = |what: &str, got: f64, want: f64| {
            let d = (got - want).abs();
            worst = worst.max(d);
            assert!(
                d <= TOLERANCE,
                "position {pos} {what}: engine {got}, reference {want}"
            );
        };
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let lse = max
            + row
                .iter()
                .map(|&v| (v as f64 - max).exp())
                .sum::<f64>()
                .ln();
        check("logsumexp", lse, want["logsumexp"].as_f64().unwrap());
        let top = want["top"].as_array().unwrap();
        for pair in top {
            let id = pair[0].as_u64().unwrap() as usize;
            check(
                &format!("logit of {id}"),
                row[id] as f64,
                pair[1].as_f64().unwrap(),
            );
        }
        for (&id, w) in probe.iter().zip(want["probe"].as_array().unwrap()) {
            check(
                &format!("probe logit of {id}"),
                row[id] as f64,
                w.as_f64().unwrap(),
            );
        }
        let top1 = top[0][0].as_u64().unwrap() as u32;
        assert_eq!(eval::argmax(row), top1, "position {pos}: top-1 differs");
    }
    eprintln!("worst |engine - reference| over compared logits: {worst:.2e}");
}
