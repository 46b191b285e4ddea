//! Random weights are deterministic, seeded, in range and shaped for the model; the synthetic
//! tokenizer decodes every id; the shapes are the ones they claim.

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::model::{Logits, SeqInput};

fn cpu() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new(1).unwrap())
}

#[test]
fn llama3_8b_has_llama3_8bs_parameter_count() {
    let c = llama3_8b(32_768);
    c.validate().unwrap();
    assert_eq!(c.parameter_count(), 8_030_261_248);
    assert_eq!((c.q_dim(), c.kv_dim()), (4096, 1024));
    let tiny = tiny_llama(256);
    tiny.validate().unwrap();
    // 2 × 512 × 128 embedding/head; per block 128·(128 + 2·64) + 128·128 + 3·128·256 + 2·128.
    assert_eq!(tiny.parameter_count(), 2 * 512 * 128 + 2 * 147_712 + 128);
}

#[test]
fn random_weights_are_a_function_of_the_seed() {
    let be = cpu();
    let c = tiny_llama(64);
    let a = random_weights(&*be, &c, 1).unwrap();
    let b = random_weights(&*be, &c, 1).unwrap();
    let other = random_weights(&*be, &c, 2).unwrap();
    let wq = |w: &Weights<CpuBackend>| w.layers[1].wq.as_slice().to_vec();
    assert_eq!(wq(&a), wq(&b));
    assert_ne!(wq(&a), wq(&other));
    // Distinct tensors draw distinct values.
    assert_ne!(
        a.layers[0].w_gate.as_slice(),
        a.layers[0].w_up.as_slice(),
        "gate and up share a stream"
    );
    assert_eq!(a.layers.len(), c.num_layers);
    assert!(a.lm_head.is_some(), "Llama-3's head is untied");
    assert_eq!(a.final_norm.as_slice(), vec![1.0; c.hidden_size]);
}

#[test]
fn random_values_are_uniform_in_the_fan_in_range() {
    let c = tiny_llama(64);
    let w = random_weights(&*cpu(), &c, 7).unwrap();
    let down = w.layers[0].w_down.as_slice();
    assert_eq!(down.len(), c.hidden_size * c.intermediate_size);
    let bound = (3.0 / c.intermediate_size as f32).sqrt();
    assert!(down.iter().all(|x| x.abs() <= bound));
    let mean = down.iter().map(|&x| x as f64).sum::<f64>() / down.len() as f64;
    let var = down.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / down.len() as f64;
    assert!(mean.abs() < 0.01 * bound as f64, "mean {mean}");
    // Uniform in ±b has variance b²/3 = 1/cols.
    let expected = 1.0 / c.intermediate_size as f64;
    assert!(
        (var / expected - 1.0).abs() < 0.05,
        "variance {var} vs {expected}"
    );
}

#[test]
fn values_do_not_depend_on_the_length_drawn() {
    // Chunks are seeded by their index, so a prefix is the same however many values follow.
    let long = uniform(3, 9, 2 * CHUNK + 5, 1.0);
    let short = uniform(3, 9, CHUNK + 3, 1.0);
    assert_eq!(&long[..short.len()], &short[..]);
    assert_ne!(long[..CHUNK], long[CHUNK..2 * CHUNK]);
}

#[test]
fn a_random_model_gives_finite_varied_logits() {
    let model = random_model(cpu(), tiny_llama(64), 0).unwrap();
    let mut kv = model.new_kv(8);
    let mut ws = model.workspace();
    let mut logits = Vec::new();
    model
        .forward(
            &mut ws,
            &mut [SeqInput {
                tokens: &[1, 200, 511, 7],
                kv: &mut kv,
            }],
            Logits::All,
            &mut logits,
        )
        .unwrap();
    assert_eq!(logits.len(), 4 * 512);
    assert!(logits.iter().all(|x| x.is_finite()));
    let (lo, hi) = logits
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    assert!(hi - lo > 0.1, "logits barely vary: {lo}..{hi}");
}

#[test]
fn the_synthetic_tokenizer_decodes_every_id() {
    let tok = tokenizer(512).unwrap();
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.eos_token_id(), None);
    let all: Vec<u32> = (0..512).collect();
    let text = tok.decode(&all, true).unwrap();
    assert!(text.ends_with("t510t511"), "{}", &text[text.len() - 20..]);
    assert_eq!(tok.decode(&[300], true).unwrap(), "t300");
    let ids = tok.encode("hi there", false).unwrap();
    assert!(ids.iter().all(|&i| i < 256));
    assert_eq!(tok.decode(&ids, true).unwrap(), "hi there");
    let llama = tokenizer(128_256).unwrap();
    assert_eq!(llama.decode(&[128_255], true).unwrap(), "t128255");
    assert!(tokenizer(0).is_err());
}
