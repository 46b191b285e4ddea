//! Forward-pass consistency on tiny synthetic models built in memory: one prefill, chunked
//! prefill, token-by-token decode and batching must all give the same logits; bad inputs and
//! bad files give errors that name the problem.

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::gguf::{GgufBuilder, Value};

const VOCAB: usize = 64;
const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const FFN: usize = 48;
const LAYERS: usize = 2;
const CONTEXT: usize = 320;

/// Deterministic values in [-scale, scale).
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn tiny(arch: &str, skip: Option<&str>) -> GgufBuilder {
    let key = |k: &str| format!("{arch}.{k}");
    let mut b = GgufBuilder::new()
        .meta("general.architecture", Value::String(arch.into()))
        .meta(&key("embedding_length"), Value::U32(HIDDEN as u32))
        .meta(&key("feed_forward_length"), Value::U32(FFN as u32))
        .meta(&key("block_count"), Value::U32(LAYERS as u32))
        .meta(&key("attention.head_count"), Value::U32(HEADS as u32))
        .meta(&key("attention.head_count_kv"), Value::U32(KV_HEADS as u32))
        .meta(&key("context_length"), Value::U32(CONTEXT as u32))
        .meta(&key("vocab_size"), Value::U32(VOCAB as u32))
        .meta(&key("rope.freq_base"), Value::F32(10_000.0))
        .meta(&key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    let mut seed = 0;
    let mut add = |b: GgufBuilder, name: &str, dims: &[u64], scale: f32, offset: f32| {
        seed += 1;
        if skip == Some(name) {
            return b;
        }
        let n = dims.iter().product::<u64>() as usize;
        let v: Vec<f32> = values(seed, n, scale).iter().map(|x| x + offset).collect();
        b.tensor_f32(name, dims, &v)
    };
    let (h, q, kv, f) = (
        HIDDEN as u64,
        (HEADS * HEAD_DIM) as u64,
        (KV_HEADS * HEAD_DIM) as u64,
        FFN as u64,
    );
    b = add(b, "token_embd.weight", &[h, VOCAB as u64], 1.0, 0.0);
    b = add(b, "output_norm.weight", &[h], 0.1, 1.0);
    for l in 0..LAYERS {
        let n = |t: &str| format!("blk.{l}.{t}");
        b = add(b, &n("attn_norm.weight"), &[h], 0.1, 1.0);
        b = add(b, &n("attn_q.weight"), &[h, q], 0.3, 0.0);
        b = add(b, &n("attn_k.weight"), &[h, kv], 0.3, 0.0);
        b = add(b, &n("attn_v.weight"), &[h, kv], 0.3, 0.0);
        b = add(b, &n("attn_output.weight"), &[q, h], 0.3, 0.0);
        b = add(b, &n("ffn_norm.weight"), &[h], 0.1, 1.0);
        b = add(b, &n("ffn_gate.weight"), &[h, f], 0.3, 0.0);
        b = add(b, &n("ffn_up.weight"), &[h, f], 0.3, 0.0);
        b = add(b, &n("ffn_down.weight"), &[f, h], 0.3, 0.0);
        if arch == "qwen2" {
            b = add(b, &n("attn_q.bias"), &[q], 0.2, 0.0);
            b = add(b, &n("attn_k.bias"), &[kv], 0.2, 0.0);
            b = add(b, &n("attn_v.bias"), &[kv], 0.2, 0.0);
        }
        if arch == "qwen3" {
            b = add(b, &n("attn_q_norm.weight"), &[HEAD_DIM as u64], 0.1, 1.0);
            b = add(b, &n("attn_k_norm.weight"), &[HEAD_DIM as u64], 0.1, 1.0);
        }
    }
    b
}

fn load(arch: &str) -> Model<CpuBackend> {
    let file = GgufFile::from_bytes(tiny(arch, None).build()).unwrap();
    Model::from_gguf(Arc::new(CpuBackend::new(2).unwrap()), &file).unwrap()
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % VOCAB) as u32).collect()
}

/// Logits of every position from one prefill.
fn prefill_all(model: &Model<CpuBackend>, toks: &[u32]) -> Vec<f32> {
    let mut kv = model.new_kv(1);
    let mut out = Vec::new();
    model
        .forward(
            &mut model.workspace(),
            &mut [SeqInput {
                tokens: toks,
                kv: &mut kv,
            }],
            Logits::All,
            &mut out,
        )
        .unwrap();
    out
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.is_finite() && (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn chunked_prefill_and_decode_match_one_prefill() {
    for arch in ["llama", "qwen2", "qwen3"] {
        let model = load(arch);
        let toks = tokens(300); // > 64 rows: the blocked path; > 256: split decode spans
        let full = prefill_all(&model, &toks);

        // Chunks of 37 (the extend shape), one of 3, then single tokens (the decode shape).
        let mut kv = model.new_kv(8);
        let mut ws = model.workspace();
        let mut got = Vec::new();
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < toks.len() {
            let n = match pos {
                0..111 => 37,  // the blocked GEMM path with a cached prefix
                111..114 => 3, // the few-rows path with a cached prefix
                _ => 1,        // decode
            };
            model
                .forward(
                    &mut ws,
                    &mut [SeqInput {
                        tokens: &toks[pos..pos + n],
                        kv: &mut kv,
                    }],
                    Logits::All,
                    &mut out,
                )
                .unwrap();
            got.extend_from_slice(&out);
            pos += n;
        }
        assert_eq!(kv.len(), toks.len());
        assert_close(&got, &full, arch);
    }
}

#[test]
fn batched_sequences_match_separate_runs() {
    let model = load("llama");
    let (a, b, c) = (tokens(70), tokens(5)[1..].to_vec(), vec![3u32]);
    let (fa, fb, fc) = (
        prefill_all(&model, &a),
        prefill_all(&model, &b),
        prefill_all(&model, &c),
    );
    let last = |f: &[f32]| f[f.len() - VOCAB..].to_vec();

    let (mut ka, mut kb, mut kc) = (model.new_kv(4), model.new_kv(4), model.new_kv(4));
    let mut out = Vec::new();
    model
        .forward(
            &mut model.workspace(),
            &mut [
                SeqInput {
                    tokens: &a,
                    kv: &mut ka,
                },
                SeqInput {
                    tokens: &b,
                    kv: &mut kb,
                },
                SeqInput {
                    tokens: &c,
                    kv: &mut kc,
                },
            ],
            Logits::Last,
            &mut out,
        )
        .unwrap();
    assert_eq!(out.len(), 3 * VOCAB);
    assert_close(&out[..VOCAB], &last(&fa), "a");
    assert_close(&out[VOCAB..2 * VOCAB], &last(&fb), "b");
    assert_close(&out[2 * VOCAB..], &last(&fc), "c");

    // Selected: every row of `a` (scored), the last of `b`.
    let (mut ka, mut kb) = (model.new_kv(4), model.new_kv(4));
    model
        .forward(
            &mut model.workspace(),
            &mut [
                SeqInput {
                    tokens: &a,
                    kv: &mut ka,
                },
                SeqInput {
                    tokens: &b,
                    kv: &mut kb,
                },
            ],
            Logits::Select(&[true, false]),
            &mut out,
        )
        .unwrap();
    assert_eq!(out.len(), (a.len() + 1) * VOCAB);
    assert_close(&out[..a.len() * VOCAB], &fa, "every row of a");
    assert_close(&out[a.len() * VOCAB..], &last(&fb), "b's last row");
}

#[test]
fn rope_style_changes_the_result() {
    let file = GgufFile::from_bytes(tiny("llama", None).build()).unwrap();
    let backend = Arc::new(CpuBackend::new(1).unwrap());
    let mut config = ModelConfig::from_gguf(&file).unwrap();
    assert_eq!(config.rope_style, crate::RopeStyle::Interleaved);
    let inter = Model::from_gguf(backend.clone(), &file).unwrap();
    config.rope_style = crate::RopeStyle::HalfSplit;
    let weights = Weights::from_gguf(&*backend, &file, &config).unwrap();
    let half = Model::new(backend, config, weights).unwrap();
    let toks = tokens(10);
    let (x, y) = (prefill_all(&inter, &toks), prefill_all(&half, &toks));
    // Position 0 has no rotation; later positions must differ.
    assert_close(&x[..VOCAB], &y[..VOCAB], "position 0");
    assert!(x[VOCAB..]
        .iter()
        .zip(&y[VOCAB..])
        .any(|(a, b)| (a - b).abs() > 1e-3));
}

#[test]
fn bad_inputs_are_rejected_without_touching_the_cache() {
    let model = load("llama");
    let mut kv = model.new_kv(4);
    let mut ws = model.workspace();
    let mut out = Vec::new();
    let mut run = |toks: &[u32], kv: &mut ContiguousKv<CpuBackend>| {
        model.forward(
            &mut ws,
            &mut [SeqInput { tokens: toks, kv }],
            Logits::Last,
            &mut out,
        )
    };
    let e = run(&[1, VOCAB as u32], &mut kv).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    let e = run(&[], &mut kv).unwrap_err();
    assert!(e.to_string().contains("no tokens"), "{e}");
    let e = run(&tokens(CONTEXT + 1), &mut kv).unwrap_err();
    assert!(e.to_string().contains("context length"), "{e}");
    assert_eq!(kv.len(), 0);
    run(&tokens(3), &mut kv).unwrap();
    assert_eq!(kv.len(), 3);
}

#[test]
fn loading_errors_name_the_problem() {
    let backend = Arc::new(CpuBackend::new(1).unwrap());
    let load = |b: GgufBuilder| {
        Model::from_gguf(backend.clone(), &GgufFile::from_bytes(b.build()).unwrap())
    };

    let e = load(tiny("llama", Some("blk.1.ffn_up.weight")))
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::MissingTensor(n) if n == "blk.1.ffn_up.weight"),
        "{e}"
    );

    let e = load(tiny("gpt2", None)).err().unwrap();
    assert!(
        matches!(&e, Error::UnsupportedArchitecture(a) if a == "gpt2"),
        "{e}"
    );

    let e = load(tiny("llama", Some("blk.0.attn_k.weight")).tensor_f32(
        "blk.0.attn_k.weight",
        &[HIDDEN as u64, 8],
        &[0.0; HIDDEN * 8],
    ))
    .err()
    .unwrap();
    assert!(
        e.to_string().contains("blk.0.attn_k.weight") && matches!(e, Error::ShapeMismatch { .. }),
        "{e}"
    );

    let e = load(tiny("llama", None).meta("llama.attention.head_count_kv", Value::U32(3)))
        .err()
        .unwrap();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
}

#[test]
fn k_smoothing_leaves_attention_scores_unchanged() {
    // Multipliers from 1/3 to 3 on every K channel (and the reciprocals on the queries that
    // read it; not powers of two, so the products round): with an f32 cache the logits are
    // those of the unsmoothed model.
    let kv_dim = KV_HEADS * HEAD_DIM;
    let smoothing = KSmoothing {
        k: (0..LAYERS)
            .map(|l| {
                (0..kv_dim)
                    .map(|c| 3f32.powf(((c + l) % 5) as f32 / 2.0 - 1.0))
                    .collect()
            })
            .collect(),
    };
    for arch in ["llama", "qwen2", "qwen3"] {
        let model = load(arch);
        let toks = tokens(70);
        let plain = prefill_all(&model, &toks);
        let smoothed = model.with_k_smoothing(Some(&smoothing)).unwrap();
        let out = prefill_all(&smoothed, &toks);
        assert_close(&out, &plain, arch);
        assert_ne!(out, plain, "{arch}: the smoothing ran");
        // `None` takes it off again.
        let off = smoothed.with_k_smoothing(None).unwrap();
        assert_eq!(prefill_all(&off, &toks), plain, "{arch}");
    }

    let model = load("llama");
    let short = KSmoothing {
        k: vec![vec![1.0; kv_dim]; LAYERS - 1],
    };
    let err = model.with_k_smoothing(Some(&short)).err().unwrap();
    assert!(err.to_string().contains("model has 2 of 16"), "{err}");
    let mut zero = smoothing.clone();
    zero.k[1][3] = 0.0;
    let err = model.with_k_smoothing(Some(&zero)).err().unwrap();
    assert!(err.to_string().contains("multiplier 0 is not"), "{err}");
}
