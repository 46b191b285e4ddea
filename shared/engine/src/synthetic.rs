//! Synthetic models for benchmarks and tests: random weights for any [`ModelConfig`] (so a shape
//! can be measured without its checkpoint), a tokenizer in which every id decodes, and the shapes
//! the benchmarks use.
//!
//! Random weights measure speed, not quality: the model computes exactly what a real one of the
//! same shape computes, but its outputs mean nothing, and whatever reports numbers from it must
//! say the weights are random. Values are a pure function of (seed, tensor, index): the same seed
//! gives the same model on every backend and thread count.

use std::sync::Arc;

use rayon::prelude::*;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use crate::backend::Backend;
use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::tokenizer::{Tokenizer, TokenizerParts};
use crate::weights::{LayerWeights, LoadProgress, Weights};

/// Llama-3-8B's shape: 32 layers, hidden 4096, 32 query heads over 8 KV heads of 128 dims, FFN
/// 14336, vocabulary 128256, RoPE theta 500000 (half-split pairing, as its Hugging Face weights),
/// RMSNorm eps 1e-5, an untied LM head. `max_context` sizes the RoPE tables.
pub fn llama3_8b(max_context: usize) -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 128_256,
        hidden_size: 4096,
        intermediate_size: 14_336,
        num_layers: 32,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        rope_theta: 500_000.0,
        rope_style: RopeStyle::HalfSplit,
        rms_norm_eps: 1e-5,
        max_context,
        tie_word_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
    }
}

/// A tiny Llama for tests: 2 layers, hidden 128, 2 query heads over 1 KV head of 64 dims (a head
/// dim the CUDA kernels take, so it runs on both backends), FFN 256, vocabulary 512.
pub fn tiny_llama(max_context: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: 512,
        hidden_size: 128,
        intermediate_size: 256,
        num_layers: 2,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 64,
        ..llama3_8b(max_context)
    }
}

/// A model of `config` with [`random_weights`] on `backend`.
pub fn random_model<B: Backend>(
    backend: Arc<B>,
    config: ModelConfig,
    seed: u64,
) -> Result<Model<B>> {
    random_model_observed(backend, config, seed, &|_, _| {})
}

/// [`random_model`], telling `progress(done, total)` as the blocks are drawn (a progress bar's
/// feed, as for a checkpoint's [`LoadProgress`]).
pub fn random_model_observed<B: Backend>(
    backend: Arc<B>,
    config: ModelConfig,
    seed: u64,
    progress: LoadProgress<'_>,
) -> Result<Model<B>> {
    config.validate()?;
    let weights = draw_weights(&*backend, &config, seed, progress)?;
    Model::new(backend, config, weights)
}

/// Random weights of `config`'s shapes: matrices through `Backend::upload_matrix` (kept as the
/// backend keeps a loaded model's matrices), vectors as f32 (`Backend::upload_vec`). Matrices are
/// uniform in ±sqrt(3 / cols) (unit variance out for unit variance in, so activations stay in
/// range through any depth), norm weights are 1, Q/K/V biases uniform in ±0.1.
pub fn random_weights<B: Backend>(
    backend: &B,
    config: &ModelConfig,
    seed: u64,
) -> Result<Weights<B>> {
    draw_weights(backend, config, seed, &|_, _| {})
}

/// [`random_weights`] with progress: one step per block, one for the embedding and LM head.
fn draw_weights<B: Backend>(
    backend: &B,
    config: &ModelConfig,
    seed: u64,
    progress: LoadProgress<'_>,
) -> Result<Weights<B>> {
    config.validate()?;
    let total = config.num_layers + 1;
    let (h, q, kv, f) = (
        config.hidden_size,
        config.q_dim(),
        config.kv_dim(),
        config.intermediate_size,
    );
    // Each tensor draws from its own stream: its index in this order.
    let mut tensor = 0u64;
    let mut draw = |rows: usize, cols: usize, scale: f32| -> Result<B::Tensor> {
        tensor += 1;
        let data = uniform(seed, tensor, rows * cols, scale);
        if rows == 1 {
            backend.upload_vec(rows, cols, data) // a bias
        } else {
            backend.upload_matrix(rows, cols, data)
        }
    };
    // Unit variance out for unit variance in.
    let fan_in = |cols: usize| (3.0 / cols as f32).sqrt();
    let ones = |len: usize| backend.upload_vec(1, len, vec![1.0; len]);
    let mut layers = Vec::with_capacity(config.num_layers);
    for _ in 0..config.num_layers {
        let wq = draw(q, h, fan_in(h))?;
        let wk = draw(kv, h, fan_in(h))?;
        let wv = draw(kv, h, fan_in(h))?;
        let wo = draw(h, q, fan_in(q))?;
        let w_gate = draw(f, h, fan_in(h))?;
        let w_up = draw(f, h, fan_in(h))?;
        let w_down = draw(h, f, fan_in(f))?;
        let qkv_bias = if config.qkv_bias {
            Some([draw(1, q, 0.1)?, draw(1, kv, 0.1)?, draw(1, kv, 0.1)?])
        } else {
            None
        };
        let qk_norm = if config.qk_norm {
            Some([ones(config.head_dim)?, ones(config.head_dim)?])
        } else {
            None
        };
        layers.push(LayerWeights {
            attn_norm: ones(h)?,
            wq,
            wk,
            wv,
            wo,
            qkv_bias,
            qk_norm,
            ffn_norm: ones(h)?,
            w_gate,
            w_up,
            w_down,
        });
        progress(layers.len(), total);
    }
    let embed = draw(config.vocab_size, h, fan_in(h))?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(draw(config.vocab_size, h, fan_in(h))?)
    };
    let weights = Weights {
        embed,
        layers,
        final_norm: ones(h)?,
        lm_head,
    };
    progress(total, total);
    Ok(weights)
}

/// Values per independently seeded chunk (parallel generation, same values on any thread count).
const CHUNK: usize = 1 << 16;

/// `n` values uniform in [-scale, scale), a pure function of (seed, tensor, index).
fn uniform(seed: u64, tensor: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(chunk, values)| {
            let mut state = splitmix(seed ^ splitmix(tensor ^ splitmix(chunk as u64)));
            for v in values {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let bits = splitmix(state) >> 40; // 24 random bits
                *v = (bits as f32 / (1u64 << 23) as f32 - 1.0) * scale;
            }
        });
    out
}

/// SplitMix64's output function.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A byte-level BPE tokenizer with `vocab_size` ids, every one of which decodes: the 256
/// byte-level symbols first (fewer when the vocabulary is smaller), then `t256`, `t257`, ...
/// There are no merges and no special tokens (no end of sequence): it exists so that a random
/// model's tokens stream through the engine's detokenizer as a real model's do.
pub fn tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    if vocab_size == 0 || vocab_size > u32::MAX as usize {
        return Err(Error::InvalidConfig(format!(
            "a tokenizer of {vocab_size} ids"
        )));
    }
    let mut symbols: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    symbols.sort_unstable();
    let mut vocab = Vocab::with_capacity(vocab_size);
    for id in 0..vocab_size {
        let token = match symbols.get(id) {
            Some(c) => c.to_string(),
            None => format!("t{id}"),
        };
        vocab.insert(token, id as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(|e| Error::Tokenizer(format!("building the synthetic BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_decoder(Some(ByteLevelDecoder::default()));
    Ok(Tokenizer::from_parts(TokenizerParts {
        inner,
        bos: None,
        eos: None,
        extra_eos: Vec::new(),
        add_bos: false,
        chat_template: None,
    }))
}

#[cfg(test)]
mod tests;
