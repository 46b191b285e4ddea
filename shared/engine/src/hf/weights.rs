//! [`Weights`] from a Hugging Face checkpoint: tensors by their `transformers` names,
//! converted to f32 one at a time and uploaded to the backend.
//!
//! Hugging Face linear weights are `[out_features, in_features]`, which is already the
//! row-per-output-feature layout [`Backend::matmul_t`] takes, and their q/k rows are in the
//! order half-split RoPE expects, so tensors are used as stored. Every tensor of the checkpoint
//! must be used: one the forward pass has no place for (an `o_proj.bias`, say) is an error
//! naming it, not silently dropped.

use super::checkpoint::Checkpoint;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::weights::{LayerWeights, LoadProgress, Weights};
use std::cell::RefCell;
use std::collections::HashSet;

impl<B: Backend> Weights<B> {
    /// Loads every tensor of a Hugging Face checkpoint, checking each shape against `config`.
    /// When the embeddings are tied, a stored `lm_head.weight` is ignored (as `transformers`
    /// does).
    pub fn from_hf(backend: &B, checkpoint: &Checkpoint, config: &ModelConfig) -> Result<Self> {
        Self::from_hf_observed(backend, checkpoint, config, &|_, _| {})
    }

    /// [`Self::from_hf`], calling `progress(done, total)` as each block (and, last, the
    /// embedding, final norm and head) is on the backend: `total` is the layer count plus one.
    pub fn from_hf_observed(
        backend: &B,
        checkpoint: &Checkpoint,
        config: &ModelConfig,
        progress: LoadProgress<'_>,
    ) -> Result<Self> {
        let (h, q, kv, f) = (
            config.hidden_size,
            config.q_dim(),
            config.kv_dim(),
            config.intermediate_size,
        );
        let used = RefCell::new(HashSet::new());
        let load = |name: &str, shape: &[usize]| -> Result<B::Tensor> {
            let data = checkpoint.load_f32(name, shape)?;
            used.borrow_mut().insert(name.to_string());
            match *shape {
                [len] => backend.upload_vec(1, len, data),
                [rows, cols] => backend.upload_matrix(rows, cols, data),
                _ => unreachable!("weights are vectors or matrices"),
            }
        };

        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let n = |t: &str| format!("model.layers.{i}.{t}");
            let qkv_bias = if config.qkv_bias {
                Some([
                    load(&n("self_attn.q_proj.bias"), &[q])?,
                    load(&n("self_attn.k_proj.bias"), &[kv])?,
                    load(&n("self_attn.v_proj.bias"), &[kv])?,
                ])
            } else {
                None
            };
            let qk_norm = if config.qk_norm {
                Some([
                    load(&n("self_attn.q_norm.weight"), &[config.head_dim])?,
                    load(&n("self_attn.k_norm.weight"), &[config.head_dim])?,
                ])
            } else {
                None
            };
            layers.push(LayerWeights {
                attn_norm: load(&n("input_layernorm.weight"), &[h])?,
                wq: load(&n("self_attn.q_proj.weight"), &[q, h])?,
                wk: load(&n("self_attn.k_proj.weight"), &[kv, h])?,
                wv: load(&n("self_attn.v_proj.weight"), &[kv, h])?,
                wo: load(&n("self_attn.o_proj.weight"), &[h, q])?,
                qkv_bias,
                qk_norm,
                ffn_norm: load(&n("post_attention_layernorm.weight"), &[h])?,
                w_gate: load(&n("mlp.gate_proj.weight"), &[f, h])?,
                w_up: load(&n("mlp.up_proj.weight"), &[f, h])?,
                w_down: load(&n("mlp.down_proj.weight"), &[h, f])?,
            });
            progress(i + 1, config.num_layers + 1);
        }
        let weights = Self {
            embed: load("model.embed_tokens.weight", &[config.vocab_size, h])?,
            layers,
            final_norm: load("model.norm.weight", &[h])?,
            lm_head: if config.tie_word_embeddings {
                None
            } else {
                Some(load("lm_head.weight", &[config.vocab_size, h])?)
            },
        };
        progress(config.num_layers + 1, config.num_layers + 1);
        let used = used.into_inner();
        let mut unused: Vec<&str> = checkpoint
            .names()
            .filter(|name| !used.contains(*name) && !ignorable(name, config))
            .collect();
        unused.sort_unstable();
        match unused.first() {
            None => Ok(weights),
            Some(name) => Err(Error::Unsupported(format!(
                "tensor `{name}` has no place in the {} forward pass{}",
                config.architecture.name(),
                match unused.len() {
                    1 => String::new(),
                    n => format!(" ({} more unused tensors)", n - 1),
                }
            ))),
        }
    }
}

/// Tensors a checkpoint may carry that the model does not need: RoPE frequencies some older
/// exports saved, and the LM head of a tied model.
fn ignorable(name: &str, config: &ModelConfig) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
        || (config.tie_word_embeddings && name == "lm_head.weight")
}
