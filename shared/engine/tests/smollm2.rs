//! End-to-end checks on SmolLM2-135M-Instruct (GGUF Q4_1): config, tokenizer, and perplexity
//! on Pride and Prejudice. They need the model file (see `nibble_testkit::model_path`) and
//! fail, with instructions, when it is absent.

mod common;

use nibble_engine::{eval, Architecture, CpuBackend, Model, ModelConfig, RopeStyle, Tokenizer};
use std::sync::Arc;

#[test]
fn config_matches_smollm2() {
    let c = ModelConfig::from_gguf(&common::open_model()).unwrap();
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size),
        (30, 576, 1536)
    );
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.rope_theta, 1e5);
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9);
    assert!(c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
}

#[test]
fn tokenizer_round_trips_and_splits_digits() {
    let tok = Tokenizer::from_gguf(&common::open_model()).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.eos_token_id(), Some(2));
    let text = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.\n  Café — 3.14159 ×2";
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);

    let ids = tok.encode("year 1813", false).unwrap();
    let pieces: Vec<String> = ids
        .iter()
        .map(|&i| tok.decode(&[i], false).unwrap())
        .collect();
    assert_eq!(pieces, ["year", " ", "1", "8", "1", "3"]);

    // Special tokens are matched whole.
    let ids = tok.encode("<|im_start|>user", false).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user");
}

#[test]
fn chat_template_renders() {
    let tok = Tokenizer::from_gguf(&common::open_model()).unwrap();
    let text = tok
        .render_chat(&[nibble_engine::ChatMessage::new("user", "Hello")], true)
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// Perplexity of the first 512 tokens of characters 8000..20000 of Pride and Prejudice (no
/// BOS). An independent numpy forward pass gives 21.08 and llama.cpp on an F32 copy 21.078.
#[test]
fn perplexity_on_austen_matches_reference() {
    let file = common::open_model();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let backend = Arc::new(CpuBackend::new(2).unwrap());
    let model = Model::from_gguf(backend, &file).unwrap();
    let text = std::fs::read_to_string(nibble_testkit::fixture(
        "austen_pride_and_prejudice_8000_20000.txt",
    ))
    .unwrap();
    let ids = tok.encode(&text, false).unwrap();
    assert!(ids.len() >= 512, "text has only {} tokens", ids.len());
    let score = eval::score_window(&model, &ids[..512]).unwrap();
    let ppl = score.perplexity();
    eprintln!("perplexity over 512 tokens: {ppl:.4}");
    assert!(
        (ppl - 21.08).abs() < 0.05,
        "perplexity {ppl:.4}, reference 21.08"
    );
}
