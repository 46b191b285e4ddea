//! `config.json` of a Hugging Face checkpoint, read into a [`ModelConfig`].
//!
//! Fields follow `transformers`' `LlamaConfig`, `MistralConfig`, `Qwen2Config` and
//! `Qwen3Config`, with their defaults where a field is absent or null. What the forward pass
//! does not implement is refused by name rather than ignored: RoPE scaling other than
//! `default`, partial rotary embeddings, activations other than SiLU, and the output-projection
//! and MLP biases that `attention_bias` / `mlp_bias` switch on. Sliding-window attention is not
//! modelled either; when a config enables it, the context is capped at the window, where
//! windowed and full attention agree.

use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::error::{Error, Result};
use serde_json::{Map, Value};

/// `architectures` class names of the supported families.
const CLASSES: [(&str, Architecture); 4] = [
    ("LlamaForCausalLM", Architecture::Llama),
    ("MistralForCausalLM", Architecture::Mistral),
    ("Qwen2ForCausalLM", Architecture::Qwen2),
    ("Qwen3ForCausalLM", Architecture::Qwen3),
];

impl ModelConfig {
    /// Reads the parsed `config.json` of a Hugging Face checkpoint. RoPE is
    /// [`RopeStyle::HalfSplit`] (Hugging Face q/k rows are not permuted);
    /// `tie_word_embeddings` is the config's (default false).
    pub fn from_hf_json(json: &Value) -> Result<Self> {
        let f = Fields::new(json)?;
        let architecture = architecture(&f)?;
        let hidden_size = f.require_usize("hidden_size")?;
        let num_heads = f.require_usize("num_attention_heads")?;
        let head_dim = match f.usize("head_dim")? {
            Some(d) => d,
            None if num_heads > 0 && hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(Error::InvalidConfig(format!(
                    "config.json: hidden_size {hidden_size} is not a multiple of \
                     num_attention_heads {num_heads} and no head_dim is given"
                )))
            }
        };
        refuse_unsupported(&f, architecture)?;
        let config = Self {
            architecture,
            vocab_size: f.require_usize("vocab_size")?,
            hidden_size,
            intermediate_size: f.require_usize("intermediate_size")?,
            num_layers: f.require_usize("num_hidden_layers")?,
            num_heads,
            num_kv_heads: f.usize("num_key_value_heads")?.unwrap_or(num_heads),
            head_dim,
            rope_theta: rope_theta(&f)? as f32,
            rope_style: RopeStyle::HalfSplit,
            rms_norm_eps: f.f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            max_context: max_context(&f, architecture)?,
            tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias: architecture == Architecture::Qwen2,
            qk_norm: architecture == Architecture::Qwen3,
        };
        config.validate()?;
        Ok(config)
    }
}

/// The family, from `architectures[0]` and `model_type`, which must agree when both are given.
fn architecture(f: &Fields<'_>) -> Result<Architecture> {
    let from_class = match f.get("architectures") {
        None => None,
        Some(Value::Array(list)) if !list.is_empty() => {
            let class = list[0]
                .as_str()
                .ok_or_else(|| f.type_error("architectures", "a list of strings"))?;
            let arch = CLASSES
                .iter()
                .find(|(name, _)| *name == class)
                .map(|&(_, arch)| arch)
                .ok_or_else(|| Error::UnsupportedArchitecture(class.to_string()))?;
            Some(arch)
        }
        Some(Value::Array(_)) => None,
        Some(_) => return Err(f.type_error("architectures", "a list of strings")),
    };
    let from_type = f
        .str("model_type")?
        .map(Architecture::from_name)
        .transpose()?;
    match (from_class, from_type) {
        (Some(a), Some(b)) if a != b => Err(Error::InvalidConfig(format!(
            "config.json: architectures names {} but model_type is {}",
            a.name(),
            b.name()
        ))),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Err(Error::InvalidConfig(
            "config.json names no architecture (`architectures` or `model_type`)".into(),
        )),
    }
}

/// Refuses the config switches whose effect the forward pass does not implement.
fn refuse_unsupported(f: &Fields<'_>, arch: Architecture) -> Result<()> {
    let unsupported = |m: String| Err(Error::Unsupported(m));
    if let Some(act) = f.str("hidden_act")? {
        if act != "silu" {
            return unsupported(format!("hidden_act `{act}` (only `silu`, the SwiGLU FFN)"));
        }
    }
    // Llama and Qwen3 put `attention_bias` on all four projections (o_proj too); Qwen2 has
    // q/k/v biases always and no o_proj bias; Mistral has none.
    if arch != Architecture::Qwen2 && f.bool("attention_bias")? == Some(true) {
        return unsupported(
            "attention_bias = true (it adds an o_proj bias, which the forward pass lacks)".into(),
        );
    }
    if f.bool("mlp_bias")? == Some(true) {
        return unsupported("mlp_bias = true (the FFN has no biases)".into());
    }
    if let Some(factor) = f.f64("partial_rotary_factor")? {
        if factor != 1.0 {
            return unsupported(format!(
                "partial_rotary_factor {factor} (RoPE rotates whole heads)"
            ));
        }
    }
    for key in ["rope_scaling", "rope_parameters"] {
        match f.get(key) {
            None => {}
            Some(Value::Object(m)) => {
                let kind = m
                    .get("rope_type")
                    .or_else(|| m.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                if kind != "default" {
                    return unsupported(format!(
                        "{key} type `{kind}` (only unscaled RoPE, `default`)"
                    ));
                }
            }
            Some(_) => return Err(f.type_error(key, "an object")),
        }
    }
    Ok(())
}

/// `rope_theta`, or `rope_parameters.rope_theta` (newer `transformers`), default 10000.
fn rope_theta(f: &Fields<'_>) -> Result<f64> {
    if let Some(theta) = f.f64("rope_theta")? {
        return Ok(theta);
    }
    match f.get("rope_parameters").and_then(|p| p.get("rope_theta")) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| f.type_error("rope_parameters.rope_theta", "a number")),
        None => Ok(10_000.0),
    }
}

/// `max_position_embeddings` (the family's default when absent), capped at the attention
/// window when sliding-window attention is on.
fn max_context(f: &Fields<'_>, arch: Architecture) -> Result<usize> {
    let default = match arch {
        Architecture::Llama => 2048,
        Architecture::Mistral => 4096 * 32,
        Architecture::Qwen2 | Architecture::Qwen3 => 32768,
    };
    let max = f.usize("max_position_embeddings")?.unwrap_or(default);
    let sliding = match arch {
        Architecture::Llama => false,
        // Mistral applies its window whenever `sliding_window` is set.
        Architecture::Mistral => true,
        Architecture::Qwen2 | Architecture::Qwen3 => {
            let by_layer = match f.get("layer_types") {
                Some(Value::Array(types)) => types
                    .iter()
                    .any(|t| t.as_str() == Some("sliding_attention")),
                _ => false,
            };
            f.bool("use_sliding_window")?.unwrap_or(false) || by_layer
        }
    };
    let window = match (sliding, f.map.get("sliding_window")) {
        (false, _) => None,
        // `MistralConfig` defaults to a 4096-token window; an explicit null turns it off.
        (true, None) if arch == Architecture::Mistral => Some(4096),
        (true, _) => f.usize("sliding_window")?,
    };
    Ok(window.map_or(max, |w| max.min(w)))
}

/// Typed access to the top-level fields of config.json; a null field counts as absent.
struct Fields<'a> {
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn new(json: &'a Value) -> Result<Self> {
        match json {
            Value::Object(map) => Ok(Self { map }),
            _ => Err(Error::InvalidConfig(
                "config.json is not a JSON object".into(),
            )),
        }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn type_error(&self, key: &str, expected: &str) -> Error {
        let found = self
            .map
            .get(key)
            .map_or("nothing".into(), |v| v.to_string());
        Error::InvalidConfig(format!(
            "config.json: `{key}` should be {expected}, found {found}"
        ))
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.type_error(key, "a non-negative integer"))
            })
            .transpose()
    }

    fn require_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?
            .ok_or_else(|| Error::InvalidConfig(format!("config.json: missing `{key}`")))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.type_error(key, "a number")))
            .transpose()
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.type_error(key, "a boolean")))
            .transpose()
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.type_error(key, "a string")))
            .transpose()
    }
}
