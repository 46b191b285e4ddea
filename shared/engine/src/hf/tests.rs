//! config.json parsing: defaults, family differences, and refusals by name.

use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::error::Error;
use serde_json::{json, Value};

fn base(arch: &str, model_type: &str) -> Value {
    json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
    })
}

fn with(mut v: Value, key: &str, value: Value) -> Value {
    v[key] = value;
    v
}

fn err(v: Value) -> String {
    ModelConfig::from_hf_json(&v).unwrap_err().to_string()
}

#[test]
fn reads_a_llama_config_with_transformers_defaults() {
    let c = ModelConfig::from_hf_json(&base("LlamaForCausalLM", "llama")).unwrap();
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 2, 16));
    assert_eq!(c.rope_style, RopeStyle::HalfSplit);
    assert_eq!((c.rope_theta, c.rms_norm_eps), (10_000.0, 1e-6));
    assert_eq!(c.max_context, 2048);
    assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
}

#[test]
fn family_flags_and_explicit_head_dim() {
    let c = ModelConfig::from_hf_json(&base("Qwen2ForCausalLM", "qwen2")).unwrap();
    assert!(c.qkv_bias && !c.qk_norm);
    let v = with(base("Qwen3ForCausalLM", "qwen3"), "head_dim", json!(32));
    let c = ModelConfig::from_hf_json(&with(v, "rope_theta", json!(1000000))).unwrap();
    assert!(c.qk_norm && !c.qkv_bias);
    assert_eq!((c.head_dim, c.q_dim(), c.kv_dim()), (32, 128, 64));
    assert_eq!(c.rope_theta, 1e6);
    // model_type alone is enough; a null field is the default.
    let mut v = base("", "mistral");
    v.as_object_mut().unwrap().remove("architectures");
    let c = ModelConfig::from_hf_json(&with(v, "num_key_value_heads", Value::Null)).unwrap();
    assert_eq!((c.architecture, c.num_kv_heads), (Architecture::Mistral, 4));
}

#[test]
fn sliding_window_caps_the_context() {
    let mistral = || base("MistralForCausalLM", "mistral");
    // MistralConfig's default window is 4096; null turns it off.
    let c = ModelConfig::from_hf_json(&mistral()).unwrap();
    assert_eq!(c.max_context, 4096);
    let c = ModelConfig::from_hf_json(&with(mistral(), "sliding_window", Value::Null)).unwrap();
    assert_eq!(c.max_context, 131072);
    // Qwen only when use_sliding_window (or a sliding layer type) says so.
    let q = with(
        base("Qwen2ForCausalLM", "qwen2"),
        "sliding_window",
        json!(1024),
    );
    assert_eq!(ModelConfig::from_hf_json(&q).unwrap().max_context, 32768);
    let on = with(q.clone(), "use_sliding_window", json!(true));
    assert_eq!(ModelConfig::from_hf_json(&on).unwrap().max_context, 1024);
    let typed = with(
        q,
        "layer_types",
        json!(["full_attention", "sliding_attention"]),
    );
    assert_eq!(ModelConfig::from_hf_json(&typed).unwrap().max_context, 1024);
}

#[test]
fn unknown_or_inconsistent_architectures_are_refused_by_name() {
    let e = ModelConfig::from_hf_json(&base("GPT2LMHeadModel", "gpt2")).unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedArchitecture(a) if a == "GPT2LMHeadModel"),
        "{e}"
    );
    let mut v = base("", "phi3");
    v.as_object_mut().unwrap().remove("architectures");
    assert!(err(v).contains("`phi3`"));
    let e = err(base("LlamaForCausalLM", "qwen2"));
    assert!(e.contains("llama") && e.contains("qwen2"), "{e}");
    let mut v = base("", "");
    v.as_object_mut().unwrap().remove("architectures");
    v.as_object_mut().unwrap().remove("model_type");
    assert!(err(v).contains("names no architecture"));
}

#[test]
fn unsupported_features_are_refused_by_name() {
    let llama = || base("LlamaForCausalLM", "llama");
    let cases = [
        (
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": 8.0}),
            "rope_scaling type `llama3`",
        ),
        (
            "rope_scaling",
            json!({"type": "linear", "factor": 2.0}),
            "rope_scaling type `linear`",
        ),
        (
            "rope_parameters",
            json!({"rope_type": "yarn"}),
            "rope_parameters type `yarn`",
        ),
        ("attention_bias", json!(true), "attention_bias = true"),
        ("mlp_bias", json!(true), "mlp_bias = true"),
        ("hidden_act", json!("gelu"), "hidden_act `gelu`"),
        (
            "partial_rotary_factor",
            json!(0.5),
            "partial_rotary_factor 0.5",
        ),
    ];
    for (key, value, want) in cases {
        let e = ModelConfig::from_hf_json(&with(llama(), key, value)).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{key}: {e}");
        assert!(e.to_string().contains(want), "{key}: {e}");
    }
    // Accepted: default RoPE spelled out, and Qwen2's attention_bias (q/k/v only).
    let ok = with(llama(), "rope_scaling", json!({"rope_type": "default"}));
    ModelConfig::from_hf_json(&ok).unwrap();
    let ok = with(
        base("Qwen2ForCausalLM", "qwen2"),
        "attention_bias",
        json!(true),
    );
    ModelConfig::from_hf_json(&ok).unwrap();
    // rope_theta inside rope_parameters (newer transformers).
    let v = with(
        llama(),
        "rope_parameters",
        json!({"rope_type": "default", "rope_theta": 500000.0}),
    );
    assert_eq!(ModelConfig::from_hf_json(&v).unwrap().rope_theta, 5e5);
}

#[test]
fn missing_and_mistyped_fields_are_named() {
    let mut v = base("LlamaForCausalLM", "llama");
    v.as_object_mut().unwrap().remove("intermediate_size");
    assert_eq!(
        err(v),
        "invalid model config: config.json: missing `intermediate_size`"
    );
    let e = err(with(
        base("LlamaForCausalLM", "llama"),
        "hidden_size",
        json!("64"),
    ));
    assert!(
        e.contains("`hidden_size` should be a non-negative integer, found \"64\""),
        "{e}"
    );
    let e = err(with(
        base("LlamaForCausalLM", "llama"),
        "num_attention_heads",
        json!(5),
    ));
    assert!(e.contains("not a multiple"), "{e}");
    let e = err(with(
        base("LlamaForCausalLM", "llama"),
        "num_key_value_heads",
        json!(3),
    ));
    assert!(e.contains("not a multiple of 3 KV heads"), "{e}");
}
