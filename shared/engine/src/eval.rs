//! Scoring helpers: per-token negative log-likelihoods from logits, and perplexity of a token
//! window under a model (no BOS added; tokens 1..n are predicted from their prefixes).

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::{Logits, Model, SeqInput};
use crate::session::{KvConfig, PagedSession};

/// `-log p(target)` under `softmax(logits)`, computed in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln() - logits[target as usize] as f64
}

/// Index of the largest logit (the first, on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The result of scoring one window.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowScore {
    /// `nll[i]` is the NLL of token `i + 1` given tokens `0..=i`.
    pub nll: Vec<f64>,
    /// The model's argmax prediction for each of those positions.
    pub predicted: Vec<u32>,
}

impl WindowScore {
    /// Mean NLL over the window.
    pub fn mean_nll(&self) -> f64 {
        self.nll.iter().sum::<f64>() / self.nll.len() as f64
    }

    /// `exp(mean NLL)`.
    pub fn perplexity(&self) -> f64 {
        self.mean_nll().exp()
    }
}

/// Runs `tokens` as one prefill in a fresh f32 cache and scores every next-token prediction.
pub fn score_window<B: Backend>(model: &Model<B>, tokens: &[u32]) -> Result<WindowScore> {
    if tokens.len() < 2 {
        return Err(Error::InvalidInput(format!(
            "a window needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    let mut kv = model.new_kv(tokens.len());
    let mut ws = model.workspace();
    let mut logits = Vec::new();
    model.forward(
        &mut ws,
        &mut [SeqInput {
            tokens,
            kv: &mut kv,
        }],
        Logits::All,
        &mut logits,
    )?;
    let vocab = model.config().vocab_size;
    let rows = logits.chunks_exact(vocab);
    let (mut nlls, mut predicted) = (Vec::new(), Vec::new());
    for (row, &target) in rows.zip(&tokens[1..]) {
        nlls.push(nll(row, target));
        predicted.push(argmax(row));
    }
    Ok(WindowScore {
        nll: nlls,
        predicted,
    })
}

/// How a window's tokens go through the paged cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalPath {
    /// The whole window as one initial prefill.
    Prefill,
    /// Chunks of [`EXTEND_CHUNK`] tokens: the first an initial prefill, the rest through extend.
    Extend,
    /// The serving engine's prompt blocks (`SchedulerConfig::default().prefill_block`, 256
    /// tokens): the first an initial prefill, the rest through extend. What a prompt longer than
    /// one block gets from `nibble up`.
    Blocks,
    /// The first token prefilled, every later one teacher-forced through decode, so attention
    /// reads the quantized pages.
    Decode,
}

/// Tokens per chunk of [`EvalPath::Extend`].
pub const EXTEND_CHUNK: usize = 64;

impl std::str::FromStr for EvalPath {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prefill" => Ok(EvalPath::Prefill),
            "extend" => Ok(EvalPath::Extend),
            "decode" => Ok(EvalPath::Decode),
            "blocks" => Ok(EvalPath::Blocks),
            _ => Err(Error::InvalidInput(format!(
                "unknown path {s:?}: expected prefill, extend, blocks or decode"
            ))),
        }
    }
}

/// Scores `tokens` through the paged cache of `kv` along `path`.
pub fn score_window_paged<B: Backend>(
    model: &Model<B>,
    kv: &KvConfig,
    path: EvalPath,
    tokens: &[u32],
) -> Result<WindowScore> {
    if tokens.len() < 2 {
        return Err(Error::InvalidInput(format!(
            "a window needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    // The cache holds K as the config smooths it: the model must smooth alike (as in
    // `Engine::new`).
    let model = &model.with_k_smoothing(kv.k_smoothing.as_ref())?;
    let mut session = PagedSession::new(model, kv, tokens.len())?;
    let mut ws = model.workspace();
    let (mut all, mut chunk) = (Vec::new(), Vec::new());
    let step = match path {
        EvalPath::Prefill => tokens.len(),
        EvalPath::Extend => EXTEND_CHUNK,
        EvalPath::Blocks => crate::scheduler::SchedulerConfig::default().prefill_block,
        EvalPath::Decode => 1,
    };
    for part in tokens.chunks(step) {
        session.forward(model, &mut ws, part, Logits::All, &mut chunk)?;
        all.extend_from_slice(&chunk);
    }
    let vocab = model.config().vocab_size;
    let (mut nlls, mut predicted) = (Vec::new(), Vec::new());
    for (row, &target) in all.chunks_exact(vocab).zip(&tokens[1..]) {
        nlls.push(nll(row, target));
        predicted.push(argmax(row));
    }
    Ok(WindowScore {
        nll: nlls,
        predicted,
    })
}
