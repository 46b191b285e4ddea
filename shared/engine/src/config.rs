//! Model hyper-parameters ([`ModelConfig`]) read from GGUF metadata, and the architecture
//! variants the forward pass understands.
//!
//! A config that crosses this module's edge is valid: heads divide the hidden size, KV heads
//! divide the query heads, the head dim is even (RoPE rotates pairs).

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Longest context this engine accepts (RoPE tables are precomputed up to the context length).
pub const MAX_CONTEXT: usize = 1 << 20;

/// Model families. They share the Llama block (pre-norm, GQA attention with RoPE, SwiGLU FFN);
/// the differences are flags on [`ModelConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama (and Llama-compatible GGUF files such as SmolLM2).
    Llama,
    /// Mistral: the Llama block (sliding-window attention is not modelled).
    Mistral,
    /// Qwen2: bias on the Q, K and V projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm of Q and K before RoPE (no QKV bias).
    Qwen3,
}

impl Architecture {
    /// Parses the `general.architecture` / `model_type` name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Self::Llama),
            "mistral" => Ok(Self::Mistral),
            "qwen2" => Ok(Self::Qwen2),
            "qwen3" => Ok(Self::Qwen3),
            other => Err(Error::UnsupportedArchitecture(other.to_string())),
        }
    }

    /// The name used as the GGUF metadata key prefix.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }
}

/// How RoPE pairs up the dims of a head vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (x0, x1), (x2, x3), ...: llama.cpp's converter permutes Llama q/k rows into this
    /// order, so GGUF Llama files need it.
    Interleaved,
    /// Pairs (x_i, x_{i + d/2}): Hugging Face Llama/Mistral/Qwen weights, and GGUF Qwen files.
    HalfSplit,
}

/// Hyper-parameters of a decoder-only transformer in the Llama family.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family.
    pub architecture: Architecture,
    /// Vocabulary size (rows of the embedding table).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// FFN inner width.
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA groups).
    pub num_kv_heads: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// RoPE pairing.
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Longest context the model was trained for.
    pub max_context: usize,
    /// The LM head is the embedding table (no separate output matrix).
    pub tie_word_embeddings: bool,
    /// Q, K and V projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Q and K are RMS-normalized per head before RoPE (Qwen3).
    pub qk_norm: bool,
}

impl ModelConfig {
    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Parameters of the model: embedding, LM head unless tied, every block's projections,
    /// norms and biases, the final norm. Llama-3-8B has 8,030,261,248.
    pub fn parameter_count(&self) -> usize {
        let (h, q, kv, f) = (
            self.hidden_size,
            self.q_dim(),
            self.kv_dim(),
            self.intermediate_size,
        );
        let mut block = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h;
        if self.qkv_bias {
            block += q + 2 * kv;
        }
        if self.qk_norm {
            block += 2 * self.head_dim;
        }
        let heads = if self.tie_word_embeddings { 1 } else { 2 };
        heads * self.vocab_size * h + self.num_layers * block + h
    }

    /// Reads the config of a GGUF model. `tie_word_embeddings` is true when the file has no
    /// `output.weight` tensor.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = Architecture::from_name(file.require_str("general.architecture")?)?;
        let p = arch.name();
        let key = |k: &str| format!("{p}.{k}");
        let usize_of = |k: &str| -> Result<usize> {
            let v = file.require_u64(&key(k))?;
            usize::try_from(v)
                .map_err(|_| Error::InvalidConfig(format!("{p}.{k} = {v} is too large")))
        };
        let hidden_size = usize_of("embedding_length")?;
        let num_heads = usize_of("attention.head_count")?;
        let num_kv_heads = match file.get(&key("attention.head_count_kv")) {
            Some(_) => usize_of("attention.head_count_kv")?,
            None => num_heads,
        };
        let head_dim = match file.get(&key("attention.key_length")) {
            Some(_) => usize_of("attention.key_length")?,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        let vocab_size = match file.get(&key("vocab_size")) {
            Some(_) => usize_of("vocab_size")?,
            None => file.require_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let rope_theta = match file.get(&key("rope.freq_base")) {
            Some(_) => file.require_f64(&key("rope.freq_base"))? as f32,
            None => 10_000.0,
        };
        let config = Self {
            architecture: arch,
            vocab_size,
            hidden_size,
            intermediate_size: usize_of("feed_forward_length")?,
            num_layers: usize_of("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta,
            rope_style: match arch {
                Architecture::Llama | Architecture::Mistral => RopeStyle::Interleaved,
                Architecture::Qwen2 | Architecture::Qwen3 => RopeStyle::HalfSplit,
            },
            rms_norm_eps: file.require_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            max_context: usize_of("context_length")?,
            tie_word_embeddings: file.tensor("output.weight").is_err(),
            qkv_bias: arch == Architecture::Qwen2,
            qk_norm: arch == Architecture::Qwen3,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the invariants the forward pass relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.vocab_size == 0 || self.hidden_size == 0 || self.intermediate_size == 0 {
            return bad(format!(
                "vocab {}, hidden {}, FFN {}: all must be positive",
                self.vocab_size, self.hidden_size, self.intermediate_size
            ));
        }
        if self.num_layers == 0 || self.num_heads == 0 || self.num_kv_heads == 0 {
            return bad(format!(
                "layers {}, heads {}, KV heads {}: all must be positive",
                self.num_layers, self.num_heads, self.num_kv_heads
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head dim {} must be even and positive",
                self.head_dim
            ));
        }
        if !(self.rope_theta > 0.0 && self.rms_norm_eps >= 0.0) {
            return bad(format!(
                "rope theta {} must be positive and RMS eps {} non-negative",
                self.rope_theta, self.rms_norm_eps
            ));
        }
        if self.max_context == 0 || self.max_context > MAX_CONTEXT {
            return bad(format!(
                "context length {} must be between 1 and {MAX_CONTEXT}",
                self.max_context
            ));
        }
        Ok(())
    }
}
