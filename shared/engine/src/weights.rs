//! Model weights: uploaded to the backend once (matrices in their file type, which the backend
//! may keep quantized; vectors as f32) and shared (the model holds them in an `Arc`) by every
//! request. Matrices are row-major with one row per output feature (GGUF dims `[in, out]`),
//! which is what [`Backend::matmul_t`] takes.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::gguf::GgufFile;

/// Told `(done, total)` as a loader puts the weights on the backend, one step per block plus
/// one for the embedding, final norm and head (a progress bar's feed).
pub type LoadProgress<'a> = &'a dyn Fn(usize, usize);

/// One transformer block.
pub struct LayerWeights<B: Backend> {
    /// RMSNorm before attention, `[1, hidden]`.
    pub attn_norm: B::Tensor,
    /// Query projection, `[q_dim, hidden]`.
    pub wq: B::Tensor,
    /// Key projection, `[kv_dim, hidden]`.
    pub wk: B::Tensor,
    /// Value projection, `[kv_dim, hidden]`.
    pub wv: B::Tensor,
    /// Output projection, `[hidden, q_dim]`.
    pub wo: B::Tensor,
    /// Q/K/V biases (Qwen2), `[1, q_dim]`, `[1, kv_dim]`, `[1, kv_dim]`.
    pub qkv_bias: Option<[B::Tensor; 3]>,
    /// Per-head Q and K RMSNorm weights (Qwen3), `[1, head_dim]` each.
    pub qk_norm: Option<[B::Tensor; 2]>,
    /// RMSNorm before the FFN, `[1, hidden]`.
    pub ffn_norm: B::Tensor,
    /// SwiGLU gate, `[ffn, hidden]`.
    pub w_gate: B::Tensor,
    /// SwiGLU up, `[ffn, hidden]`.
    pub w_up: B::Tensor,
    /// FFN down, `[hidden, ffn]`.
    pub w_down: B::Tensor,
}

/// All weights of a model.
pub struct Weights<B: Backend> {
    /// Token embeddings, `[vocab, hidden]`.
    pub embed: B::Tensor,
    /// Blocks, in order.
    pub layers: Vec<LayerWeights<B>>,
    /// Final RMSNorm, `[1, hidden]`.
    pub final_norm: B::Tensor,
    /// LM head `[vocab, hidden]`, or `None` when tied to `embed`.
    pub lm_head: Option<B::Tensor>,
}

impl<B: Backend> Weights<B> {
    /// The LM head matrix (the embedding table when tied).
    pub fn lm_head(&self) -> &B::Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Loads every tensor of a GGUF model, checking each shape against `config`.
    pub fn from_gguf(backend: &B, file: &GgufFile, config: &ModelConfig) -> Result<Self> {
        Self::from_gguf_observed(backend, file, config, &|_, _| {})
    }

    /// [`Self::from_gguf`], calling `progress(done, total)` as each block (and, last, the
    /// embedding, final norm and head) is on the backend: `total` is the layer count plus one.
    pub fn from_gguf_observed(
        backend: &B,
        file: &GgufFile,
        config: &ModelConfig,
        progress: LoadProgress<'_>,
    ) -> Result<Self> {
        let (h, q, kv, f) = (
            config.hidden_size,
            config.q_dim(),
            config.kv_dim(),
            config.intermediate_size,
        );
        // `rows × cols` in our terms is GGUF dims [cols, rows]; a vector is [len]. Matrices go
        // to the backend in their file type (it may keep quantized blocks; see
        // `Backend::upload_weight`).
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<B::Tensor> {
            let ty = file
                .tensor_shaped(name, &[cols as u64, rows as u64])?
                .ggml_type;
            backend.upload_weight(rows, cols, ty, file.tensor_bytes(name)?)
        };
        let vector = |name: &str, len: usize| -> Result<B::Tensor> {
            let data = file.dequantize_shaped(name, &[len as u64])?;
            backend.upload_vec(1, len, data)
        };

        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let n = |t: &str| format!("blk.{i}.{t}");
            let qkv_bias = if config.qkv_bias {
                Some([
                    vector(&n("attn_q.bias"), q)?,
                    vector(&n("attn_k.bias"), kv)?,
                    vector(&n("attn_v.bias"), kv)?,
                ])
            } else {
                None
            };
            let qk_norm = if config.qk_norm {
                Some([
                    vector(&n("attn_q_norm.weight"), config.head_dim)?,
                    vector(&n("attn_k_norm.weight"), config.head_dim)?,
                ])
            } else {
                None
            };
            layers.push(LayerWeights {
                attn_norm: vector(&n("attn_norm.weight"), h)?,
                wq: matrix(&n("attn_q.weight"), q, h)?,
                wk: matrix(&n("attn_k.weight"), kv, h)?,
                wv: matrix(&n("attn_v.weight"), kv, h)?,
                wo: matrix(&n("attn_output.weight"), h, q)?,
                qkv_bias,
                qk_norm,
                ffn_norm: vector(&n("ffn_norm.weight"), h)?,
                w_gate: matrix(&n("ffn_gate.weight"), f, h)?,
                w_up: matrix(&n("ffn_up.weight"), f, h)?,
                w_down: matrix(&n("ffn_down.weight"), h, f)?,
            });
            progress(i + 1, config.num_layers + 1);
        }
        let weights = Self {
            embed: matrix("token_embd.weight", config.vocab_size, h)?,
            layers,
            final_norm: vector("output_norm.weight", h)?,
            lm_head: if config.tie_word_embeddings {
                None
            } else {
                Some(matrix("output.weight", config.vocab_size, h)?)
            },
        };
        progress(config.num_layers + 1, config.num_layers + 1);
        Ok(weights)
    }
}
