//! The Llama-family forward pass, written against [`Backend`] and [`KvStore`] only.
//!
//! One call of [`Model::forward`] runs a batch of sequences, each contributing any number of
//! new tokens (a prompt chunk or one decode token): their rows are concatenated so every
//! projection is one GEMM over the whole batch, and only attention runs per sequence, through
//! that sequence's [`KvStore`]. Scratch buffers live in a [`Workspace`] the caller keeps
//! between steps, so a decode step allocates nothing once warm.

use crate::backend::{AttnGeometry, Backend, RopeArgs};
use crate::calibrate::KSmoothing;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv::{ContiguousKv, KvBatch, KvStore, PerSequence, StepTokens};
use crate::weights::{LoadProgress, Weights};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// One sequence's part of a batch.
pub struct SeqInput<'a, B: Backend> {
    /// New tokens, at positions `kv.len()..kv.len() + tokens.len()`.
    pub tokens: &'a [u32],
    /// The sequence's cache.
    pub kv: &'a mut dyn KvStore<B>,
}

/// Which rows of the batch get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits<'a> {
    /// None (a prompt chunk that is not the last).
    None,
    /// The last new token of each sequence: one row per sequence.
    Last,
    /// Every new token, in batch order (perplexity, teacher forcing).
    All,
    /// Per sequence, every new token's row where `true` (a prompt being scored), else its
    /// last one; in batch order.
    Select(&'a [bool]),
}

/// Where a forward pass's result goes.
enum Output<'a> {
    Logits(&'a mut Vec<f32>),
    Greedy(&'a mut Vec<u32>),
}

/// Scratch buffers for [`Model::forward`], reused across calls.
pub struct Workspace<B: Backend> {
    x: B::Tensor,
    normed: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    proj: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    selected: B::Tensor,
    logits: B::Tensor,
    tokens: Vec<u32>,
    positions: Vec<u32>,
    spans: Vec<Range<usize>>,
    counts: Vec<usize>,
}

impl<B: Backend> Workspace<B> {
    /// Whether the prepared step is one token of each sequence, row `i` sequence `i` (a decode
    /// step): its rows are then each sequence's last.
    fn one_row_each(&self) -> bool {
        self.spans.iter().enumerate().all(|(i, s)| *s == (i..i + 1))
    }
}

/// RoPE cos/sin tables for every position up to the context length.
struct RopeTables<B: Backend> {
    cos: B::Tensor,
    sin: B::Tensor,
}

/// A loaded model: config, shared weights and the backend that runs them. Cloning is cheap
/// and clones share the weights.
pub struct Model<B: Backend> {
    config: ModelConfig,
    backend: Arc<B>,
    weights: Arc<Weights<B>>,
    rope: Arc<RopeTables<B>>,
    /// Per layer, the Q and K channel multipliers of K smoothing (`[1, q_dim]`, `[1, kv_dim]`).
    smoothing: Option<Arc<Vec<[B::Tensor; 2]>>>,
}

impl<B: Backend> Clone for Model<B> {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            backend: Arc::clone(&self.backend),
            weights: Arc::clone(&self.weights),
            rope: Arc::clone(&self.rope),
            smoothing: self.smoothing.clone(),
        }
    }
}

impl<B: Backend> Model<B> {
    /// Opens a GGUF file and loads its model.
    pub fn load_gguf(backend: Arc<B>, path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf(backend, &GgufFile::open(path)?)
    }

    /// Loads the model of an opened GGUF file.
    pub fn from_gguf(backend: Arc<B>, file: &GgufFile) -> Result<Self> {
        Self::from_gguf_observed(backend, file, &|_, _| {})
    }

    /// [`Self::from_gguf`], telling `progress` as the blocks load.
    pub fn from_gguf_observed(
        backend: Arc<B>,
        file: &GgufFile,
        progress: LoadProgress<'_>,
    ) -> Result<Self> {
        let config = ModelConfig::from_gguf(file)?;
        let weights = Weights::from_gguf_observed(&*backend, file, &config, progress)?;
        Self::new(backend, config, weights)
    }

    /// Assembles a model from a config and weights (any loader).
    pub fn new(backend: Arc<B>, config: ModelConfig, weights: Weights<B>) -> Result<Self> {
        config.validate()?;
        if weights.layers.len() != config.num_layers {
            return Err(Error::InvalidConfig(format!(
                "{} layers of weights for a {}-layer config",
                weights.layers.len(),
                config.num_layers
            )));
        }
        let rope = Arc::new(rope_tables(&*backend, &config)?);
        Ok(Self {
            config,
            backend,
            weights: Arc::new(weights),
            rope,
            smoothing: None,
        })
    }

    /// This model with K smoothed by `smoothing` (`None`: not smoothed): every layer's K
    /// channels multiplied after RoPE, and its queries' by the reciprocals, so attention
    /// scores are unchanged and the cache holds the smoothed K. Shares the weights.
    pub fn with_k_smoothing(&self, smoothing: Option<&KSmoothing>) -> Result<Self> {
        let c = &self.config;
        let smoothing = match smoothing {
            None => None,
            Some(s) => {
                if s.k.len() != c.num_layers || s.k.iter().any(|k| k.len() != c.kv_dim()) {
                    return Err(Error::InvalidInput(format!(
                        "K smoothing has {} layers of {} channels; the model has {} of {}",
                        s.k.len(),
                        s.k.first().map_or(0, Vec::len),
                        c.num_layers,
                        c.kv_dim()
                    )));
                }
                if let Some(bad) = s.k.iter().flatten().find(|x| !(x.is_finite() && **x > 0.0)) {
                    return Err(Error::InvalidInput(format!(
                        "K smoothing multiplier {bad} is not a finite positive number"
                    )));
                }
                let be = &*self.backend;
                let layers =
                    s.k.iter()
                        .zip(s.q(c.num_heads, c.head_dim))
                        .map(|(k, q)| {
                            Ok([
                                be.upload_vec(1, c.q_dim(), q)?,
                                be.upload_vec(1, c.kv_dim(), k.clone())?,
                            ])
                        })
                        .collect::<Result<Vec<_>>>()?;
                Some(Arc::new(layers))
            }
        };
        Ok(Self {
            smoothing,
            ..self.clone()
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<Weights<B>> {
        &self.weights
    }

    /// Attention geometry of every layer.
    pub fn geometry(&self) -> AttnGeometry {
        AttnGeometry {
            num_heads: self.config.num_heads,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            scale: 1.0 / (self.config.head_dim as f32).sqrt(),
        }
    }

    /// A contiguous f32 cache with room for `initial` tokens before it grows.
    pub fn new_kv(&self, initial: usize) -> ContiguousKv<B> {
        ContiguousKv::new(&*self.backend, &self.config, initial)
    }

    /// Empty scratch buffers; they grow to the largest batch seen.
    pub fn workspace(&self) -> Workspace<B> {
        let z = || self.backend.zeros(0, 0);
        Workspace {
            x: z(),
            normed: z(),
            q: z(),
            k: z(),
            v: z(),
            attn: z(),
            proj: z(),
            gate: z(),
            up: z(),
            selected: z(),
            logits: z(),
            tokens: Vec::new(),
            positions: Vec::new(),
            spans: Vec::new(),
            counts: Vec::new(),
        }
    }

    /// Runs the new tokens of every sequence in `batch` through the model, appends them to the
    /// sequences' caches, and writes the requested logits (`rows × vocab`, row-major) to
    /// `logits` (cleared first). On error no cache's length changes.
    pub fn forward(
        &self,
        ws: &mut Workspace<B>,
        batch: &mut [SeqInput<'_, B>],
        which: Logits<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let tokens: Vec<&[u32]> = batch.iter().map(|s| s.tokens).collect();
        let mut stores: Vec<&mut dyn KvStore<B>> =
            batch.iter_mut().map(|s| &mut *s.kv as _).collect();
        let mut kv = PerSequence(&mut stores);
        self.forward_batch(ws, &tokens, &mut kv, which, logits)
    }

    /// [`forward`](Self::forward) over any [`KvBatch`]: sequence `i` contributes `tokens[i]`,
    /// at positions `kv.stored(i)..`. This is how paged caches, which attend for the whole batch
    /// at once, run the model.
    pub fn forward_batch(
        &self,
        ws: &mut Workspace<B>,
        tokens: &[&[u32]],
        kv: &mut dyn KvBatch<B>,
        which: Logits<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        self.backend
            .scope(|| self.forward_in_scope(ws, tokens, kv, which, Output::Logits(logits)))
    }

    /// [`forward_batch`](Self::forward_batch) for greedy decoding: instead of the last token's
    /// logits, each sequence's greedy token (the first largest logit, as the greedy sampler
    /// picks it) in `greedy`, found by the backend where the logits are.
    pub fn forward_batch_greedy(
        &self,
        ws: &mut Workspace<B>,
        tokens: &[&[u32]],
        kv: &mut dyn KvBatch<B>,
        greedy: &mut Vec<u32>,
    ) -> Result<()> {
        self.backend
            .scope(|| self.forward_in_scope(ws, tokens, kv, Logits::Last, Output::Greedy(greedy)))
    }

    fn forward_in_scope(
        &self,
        ws: &mut Workspace<B>,
        tokens: &[&[u32]],
        kv: &mut dyn KvBatch<B>,
        which: Logits<'_>,
        mut out: Output<'_>,
    ) -> Result<()> {
        match &mut out {
            Output::Logits(v) => v.clear(),
            Output::Greedy(v) => v.clear(),
        }
        self.prepare(ws, tokens, kv)?;
        // A decode-only step over a cache whose attention can be repeated may run as a
        // recorded device graph (Backend::decode_layers).
        if kv.repeatable() && ws.one_row_each() {
            self.backend
                .decode_layers(&mut || self.layers(ws, &mut *kv))?;
        } else {
            self.layers(ws, kv)?;
        }
        ws.counts.clear();
        ws.counts.extend(ws.spans.iter().map(|s| s.len()));
        kv.commit(&ws.counts);
        self.logits(ws, which, out)?;
        Ok(())
    }

    /// The embedding and every layer of a prepared step: `ws.x` ends as the last layer's output
    /// (before the final norm), and every sequence's K/V are in its cache.
    fn layers(&self, ws: &mut Workspace<B>, kv: &mut dyn KvBatch<B>) -> Result<()> {
        let be = &*self.backend;
        let c = &self.config;
        let rows = ws.tokens.len();
        let geometry = self.geometry();
        let rope = RopeArgs {
            cos: &self.rope.cos,
            sin: &self.rope.sin,
            style: c.rope_style,
            head_dim: c.head_dim,
        };

        be.resize(&mut ws.x, rows, c.hidden_size);
        be.embed(&self.weights.embed, &ws.tokens, &mut ws.x)?;
        // Each residual add is fused with the RMSNorm that reads its result (add_rms_norm):
        // the first attention norm stands alone, the last add (the final norm reads only the
        // selected rows, in `logits`) too.
        let layers = &self.weights.layers;
        be.resize(&mut ws.normed, rows, c.hidden_size);
        if let Some(first) = layers.first() {
            be.rms_norm(&ws.x, &first.attn_norm, c.rms_norm_eps, &mut ws.normed)?;
        }
        for (layer, w) in layers.iter().enumerate() {
            // Attention block (`normed` holds this layer's attention norm of x).
            be.resize(&mut ws.q, rows, c.q_dim());
            be.resize(&mut ws.k, rows, c.kv_dim());
            be.resize(&mut ws.v, rows, c.kv_dim());
            be.matmul_t_many(
                &ws.normed,
                &[&w.wq, &w.wk, &w.wv],
                &mut [&mut ws.q, &mut ws.k, &mut ws.v],
            )?;
            if let Some([bq, bk, bv]) = &w.qkv_bias {
                be.add_bias(&mut ws.q, bq)?;
                be.add_bias(&mut ws.k, bk)?;
                be.add_bias(&mut ws.v, bv)?;
            }
            if let Some([qn, kn]) = &w.qk_norm {
                // Per-head norm; `attn`/`proj` are free until attention runs.
                be.resize(&mut ws.attn, rows, c.q_dim());
                be.rms_norm(&ws.q, qn, c.rms_norm_eps, &mut ws.attn)?;
                std::mem::swap(&mut ws.q, &mut ws.attn);
                be.resize(&mut ws.proj, rows, c.kv_dim());
                be.rms_norm(&ws.k, kn, c.rms_norm_eps, &mut ws.proj)?;
                std::mem::swap(&mut ws.k, &mut ws.proj);
            }
            be.rope_qk(&mut ws.q, &mut ws.k, &ws.positions, &rope)?;
            if let Some(smoothing) = &self.smoothing {
                let [sq, sk] = &smoothing[layer];
                be.mul_cols(&mut ws.q, sq)?;
                be.mul_cols(&mut ws.k, sk)?;
            }
            be.resize(&mut ws.attn, rows, c.q_dim());
            let step = StepTokens {
                q: &ws.q,
                k: &ws.k,
                v: &ws.v,
                spans: &ws.spans,
                geometry,
            };
            kv.attend(be, layer, &step, &mut ws.attn)?;
            be.resize(&mut ws.proj, rows, c.hidden_size);
            be.matmul_t(&ws.attn, &w.wo, &mut ws.proj)?;

            // SwiGLU FFN block.
            be.add_rms_norm(
                &mut ws.x,
                &ws.proj,
                &w.ffn_norm,
                c.rms_norm_eps,
                &mut ws.normed,
            )?;
            be.resize(&mut ws.gate, rows, c.intermediate_size);
            be.resize(&mut ws.up, rows, c.intermediate_size);
            be.matmul_swiglu(&ws.normed, &w.w_gate, &w.w_up, &mut ws.gate, &mut ws.up)?;
            be.matmul_t(&ws.gate, &w.w_down, &mut ws.proj)?;
            match layers.get(layer + 1) {
                Some(next) => {
                    let eps = c.rms_norm_eps;
                    be.add_rms_norm(&mut ws.x, &ws.proj, &next.attn_norm, eps, &mut ws.normed)?;
                }
                None => be.add(&mut ws.x, &ws.proj)?,
            }
        }
        Ok(())
    }

    /// Validates the batch, reserves cache room, and fills the token/position/span lists.
    fn prepare(
        &self,
        ws: &mut Workspace<B>,
        batch: &[&[u32]],
        kv: &mut dyn KvBatch<B>,
    ) -> Result<()> {
        ws.tokens.clear();
        ws.positions.clear();
        ws.spans.clear();
        if kv.sequences() != batch.len() {
            return Err(Error::InvalidInput(format!(
                "{} token lists for {} caches",
                batch.len(),
                kv.sequences()
            )));
        }
        for (i, tokens) in batch.iter().enumerate() {
            if tokens.is_empty() {
                return Err(Error::InvalidInput(format!(
                    "sequence {i} of the batch has no tokens"
                )));
            }
            if let Some(&t) = tokens
                .iter()
                .find(|&&t| t as usize >= self.config.vocab_size)
            {
                return Err(Error::InvalidInput(format!(
                    "token id {t} in sequence {i} is outside the vocabulary of {}",
                    self.config.vocab_size
                )));
            }
            let start = kv.stored(i);
            let end = start + tokens.len();
            if end > self.config.max_context {
                return Err(Error::InvalidInput(format!(
                    "sequence {i} would reach {end} tokens, beyond the context length {}",
                    self.config.max_context
                )));
            }
            let row = ws.tokens.len();
            ws.spans.push(row..row + tokens.len());
            ws.tokens.extend_from_slice(tokens);
            ws.positions.extend((start..end).map(|p| p as u32));
        }
        if batch.is_empty() {
            return Err(Error::InvalidInput("empty batch".into()));
        }
        ws.counts.clear();
        ws.counts.extend(batch.iter().map(|t| t.len()));
        kv.reserve(&self.backend, &ws.counts)
    }

    /// Final norm and LM head for the rows `which` selects, then their logits or greedy tokens.
    fn logits(&self, ws: &mut Workspace<B>, which: Logits<'_>, out: Output<'_>) -> Result<()> {
        let be = &*self.backend;
        let c = &self.config;
        let source = match which {
            Logits::None => return Ok(()),
            Logits::All => &ws.x,
            Logits::Last if ws.one_row_each() => &ws.x,
            Logits::Last => {
                be.resize(&mut ws.selected, ws.spans.len(), c.hidden_size);
                for (i, span) in ws.spans.iter().enumerate() {
                    be.copy_rows(&ws.x, span.end - 1, &mut ws.selected, i, 1)?;
                }
                &ws.selected
            }
            Logits::Select(every) => {
                let rows = |(span, every): (&Range<usize>, &bool)| match every {
                    true => span.clone(),
                    false => span.end - 1..span.end,
                };
                let count = ws.spans.iter().zip(every).map(rows).map(|r| r.len()).sum();
                be.resize(&mut ws.selected, count, c.hidden_size);
                let mut at = 0;
                for r in ws.spans.iter().zip(every).map(rows) {
                    be.copy_rows(&ws.x, r.start, &mut ws.selected, at, r.len())?;
                    at += r.len();
                }
                &ws.selected
            }
        };
        let (rows, _) = be.shape(source);
        be.resize(&mut ws.normed, rows, c.hidden_size);
        be.rms_norm(
            source,
            &self.weights.final_norm,
            c.rms_norm_eps,
            &mut ws.normed,
        )?;
        be.resize(&mut ws.logits, rows, c.vocab_size);
        be.matmul_t(&ws.normed, self.weights.lm_head(), &mut ws.logits)?;
        match out {
            Output::Logits(v) => be.download_rows(&ws.logits, 0..rows, v),
            Output::Greedy(v) => be.argmax_rows(&ws.logits, v),
        }
    }
}

/// cos/sin of `pos · theta^(-2i/d)` for every position below the context length, computed in
/// f64 and rounded once.
fn rope_tables<B: Backend>(backend: &B, c: &ModelConfig) -> Result<RopeTables<B>> {
    let half = c.head_dim / 2;
    let mut cos = Vec::with_capacity(c.max_context * half);
    let mut sin = Vec::with_capacity(c.max_context * half);
    for pos in 0..c.max_context {
        for i in 0..half {
            let inv_freq = (c.rope_theta as f64).powf(-2.0 * i as f64 / c.head_dim as f64);
            let angle = pos as f64 * inv_freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    Ok(RopeTables {
        cos: backend.upload_vec(c.max_context, half, cos)?,
        sin: backend.upload_vec(c.max_context, half, sin)?,
    })
}

#[cfg(test)]
mod tests;
