//! SmolLM2 with its Q4_1 / Q8_0 matrices kept as GGUF blocks (what the CPU backend does) against
//! the same model with every matrix dequantized to f32 at load: the block kernels use the same
//! weight values, so prefill (tiled GEMM) and decode (fused few-row kernels, one and three rows)
//! give the same greedy tokens and logits that differ only by f32 summation order.

mod common;

use nibble_engine::gguf::{GgmlType, GgufFile};
use nibble_engine::{
    Backend, ContiguousKv, CpuBackend, CpuTensor, Logits, Model, ModelConfig, SeqInput, Tokenizer,
    Weights,
};
use std::sync::Arc;

/// Largest |Δ| allowed between the two models' logits (the golden test's tolerance against a
/// float64 reference; measured differences are ~1e-5).
const TOLERANCE: f32 = 1e-3;

/// The model's weights with every matrix replaced by its f32 dequantization.
fn f32_weights(backend: &CpuBackend, file: &GgufFile, config: &ModelConfig) -> Weights<CpuBackend> {
    let mut w = Weights::from_gguf(backend, file, config).unwrap();
    let plain = |name: &str, t: &mut CpuTensor| {
        let (rows, cols) = backend.shape(t);
        *t = backend
            .upload_vec(rows, cols, file.dequantize(name).unwrap())
            .unwrap();
    };
    plain("token_embd.weight", &mut w.embed);
    for (i, l) in w.layers.iter_mut().enumerate() {
        for (name, t) in [
            ("attn_q", &mut l.wq),
            ("attn_k", &mut l.wk),
            ("attn_v", &mut l.wv),
            ("attn_output", &mut l.wo),
            ("ffn_gate", &mut l.w_gate),
            ("ffn_up", &mut l.w_up),
            ("ffn_down", &mut l.w_down),
        ] {
            plain(&format!("blk.{i}.{name}.weight"), t);
        }
    }
    w
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= TOLERANCE, "{what}: logits differ by {worst}");
}

fn argmax(row: &[f32]) -> u32 {
    nibble_engine::eval::argmax(row)
}

#[test]
fn quantized_blocks_match_f32_weights() {
    let file = common::open_model();
    let backend = Arc::new(CpuBackend::new(2).unwrap());
    let config = ModelConfig::from_gguf(&file).unwrap();
    let quant = Model::from_gguf(backend.clone(), &file).unwrap();
    let plain = Model::new(
        backend.clone(),
        config.clone(),
        f32_weights(&backend, &file, &config),
    )
    .unwrap();
    let qw = quant.weights();
    assert_eq!(qw.layers[0].wq.block_type(), Some(GgmlType::Q4_1));
    assert_eq!(qw.embed.block_type(), Some(GgmlType::Q8_0));
    assert_eq!(plain.weights().layers[0].wq.block_type(), None);

    let vocab = config.vocab_size;
    let prompt = Tokenizer::from_gguf(&file)
        .unwrap()
        .encode(
            "It is a truth universally acknowledged, that a single man",
            false,
        )
        .unwrap();
    let prompts = [&prompt[..], &prompt[2..], &prompt[5..]];

    // Prefill every prompt (all positions' logits: the tiled path and the LM head GEMM).
    let mut state = Vec::new();
    for model in [&quant, &plain] {
        let mut ws = model.workspace();
        let mut kvs: Vec<ContiguousKv<CpuBackend>> =
            prompts.iter().map(|p| model.new_kv(p.len() + 16)).collect();
        let mut all = Vec::new();
        for (p, kv) in prompts.iter().zip(&mut kvs) {
            let mut logits = Vec::new();
            model
                .forward(
                    &mut ws,
                    &mut [SeqInput { tokens: p, kv }],
                    Logits::All,
                    &mut logits,
                )
                .unwrap();
            all.push(logits);
        }
        state.push((ws, kvs, all));
    }
    for (i, (q, p)) in state[0].2.iter().zip(&state[1].2).enumerate() {
        assert_close(q, p, &format!("prefill of prompt {i}"));
    }

    // Greedy decode, the three streams batched (three rows per step: kernels for two and one).
    let mut next: Vec<u32> = state[0]
        .2
        .iter()
        .map(|l| argmax(&l[l.len() - vocab..]))
        .collect();
    for step in 0..12 {
        let mut outs = Vec::new();
        for (model, (ws, kvs, _)) in [&quant, &plain].into_iter().zip(&mut state) {
            let mut batch: Vec<SeqInput<'_, CpuBackend>> = kvs
                .iter_mut()
                .zip(&next)
                .map(|(kv, t)| SeqInput {
                    tokens: std::slice::from_ref(t),
                    kv: kv as &mut dyn nibble_engine::KvStore<CpuBackend>,
                })
                .collect();
            let mut logits = Vec::new();
            model
                .forward(ws, &mut batch, Logits::Last, &mut logits)
                .unwrap();
            outs.push(logits);
        }
        assert_close(&outs[0], &outs[1], &format!("decode step {step}"));
        let tokens = |l: &[f32]| -> Vec<u32> { l.chunks_exact(vocab).map(argmax).collect() };
        assert_eq!(
            tokens(&outs[0]),
            tokens(&outs[1]),
            "greedy tokens at step {step}"
        );
        next = tokens(&outs[0]);
    }
}
