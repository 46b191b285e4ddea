//! Sampling: turning one position's logits into the next token.
//!
//! [`SamplingParams`] are validated once ([`SamplingParams::validate`] names the field that is out
//! of range); a [`Sampler`] then holds one sequence's random state. The order of operations is the
//! usual one (vLLM's): `logit_bias` added, the repetition penalty over every token seen so far
//! (prompt and output), the presence and frequency penalties over the output tokens only
//! (OpenAI's `logit -= presence * [count > 0] + frequency * count`; [`penalty`]), then greedy when
//! temperature is 0, else temperature, top-k, top-p and min-p filtering, renormalization and a
//! draw.
//!
//! A scoring request (`prompt_logprobs`) also gets the log-probability of every prompt token
//! after the first under the same raw distribution ([`prompt_logprobs`]); only such a request may
//! ask for `max_tokens` 0.
//!
//! Log-probabilities ([`TokenLogprobs`]) are under the model's own distribution: the log-softmax
//! of the raw logits, before the logit bias, every penalty, temperature and any truncation, as OpenAI
//! reports them. So they do not depend on the sampling settings, and the chosen token and its
//! `top_logprobs` alternatives share one distribution: the chosen token's value is exactly its
//! entry among the alternatives when it is one of them. With greedy decoding and no penalty the
//! chosen token is the first alternative (both break ties towards the lower token id); a penalty
//! or sampling can choose a token that is ranked lower, or not among the alternatives at all.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::grammar::{Constraint, Grammar, MAX_CONSTRAINT_BYTES};
mod penalty;
pub use penalty::prompt_logprobs;

/// Largest `max_tokens` a request may ask for.
pub const MAX_TOKENS_LIMIT: u32 = 32_768;

/// Most alternatives per token a request may ask for (OpenAI's chat limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Most `logit_bias` entries one request may give (OpenAI documents 300).
pub const MAX_LOGIT_BIAS: usize = 300;

/// The largest presence or frequency penalty, either sign (OpenAI's range).
pub const MAX_PENALTY: f32 = 2.0;

/// The largest logit bias, either sign (OpenAI's range).
pub const MAX_BIAS: f32 = 100.0;

/// How to pick tokens and when to stop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 is greedy; otherwise logits are divided by it. 0 to 2.
    pub temperature: f32,
    /// Keep only the k most likely tokens; `None` keeps all.
    pub top_k: Option<u32>,
    /// Keep the smallest set of tokens whose probability reaches top_p; in (0, 1].
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one; in [0, 1).
    pub min_p: f32,
    /// > 1 discourages tokens already seen, < 1 encourages them; 1 is off. In (0, 10].
    pub repetition_penalty: f32,
    /// Seed of the sequence's random state; `None` draws one.
    pub seed: Option<u64>,
    /// Tokens to generate at most; 1 to 32768.
    pub max_tokens: u32,
    /// Token ids that end generation (the model's end-of-sequence ids are added by the engine).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the text stops before them.
    pub stop: Vec<String>,
    /// Report the log-probability of each chosen token.
    pub logprobs: bool,
    /// With `logprobs`, also report this many most likely tokens per position; 0 to 20.
    pub top_logprobs: u32,
    /// Keep generating past the model's end-of-sequence token (benchmarks).
    pub ignore_eos: bool,
    /// What the output must match (structured outputs); `None` leaves it free.
    pub constraint: Option<Constraint>,
    /// Leave special tokens out of the text (the token ids keep them). With `false` they are
    /// spelled out, except the stop token that ends the output.
    pub skip_special_tokens: bool,
    /// Subtracted once from the logit of every token the output already holds; -2 to 2.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the output holds it; -2 to 2.
    pub frequency_penalty: f32,
    /// (token, bias) added to those logits before sampling, each token once; at most
    /// [`MAX_LOGIT_BIAS`] entries, biases -100 to 100.
    pub logit_bias: Vec<(u32, f32)>,
    /// A scoring request: report the log-probability of every prompt token after the first,
    /// with this many alternatives (0 to 20). The prompt is then computed whole (no prefix
    /// cache), and `max_tokens` may be 0.
    pub prompt_logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            logprobs: false,
            top_logprobs: 0,
            ignore_eos: false,
            constraint: None,
            skip_special_tokens: true,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            prompt_logprobs: None,
        }
    }
}

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// Most bytes in one stop string.
pub const MAX_STOP_BYTES: usize = 256;

/// Most stop token ids one request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// A field of a request that the engine checks. Each API names it its own way (the gRPC field
/// path, OpenAI's parameter); [`Param::name`] is the engine's (and the command line's) name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Param {
    Prompt,
    Temperature,
    TopK,
    TopP,
    MinP,
    RepetitionPenalty,
    MaxTokens,
    Stop,
    StopTokenIds,
    TopLogprobs,
    Constraint,
    PresencePenalty,
    FrequencyPenalty,
    LogitBias,
    PromptLogprobs,
}

impl Param {
    /// The engine's name of the field.
    pub fn name(self) -> &'static str {
        match self {
            Param::Prompt => "prompt",
            Param::Temperature => "temperature",
            Param::TopK => "top_k",
            Param::TopP => "top_p",
            Param::MinP => "min_p",
            Param::RepetitionPenalty => "repetition_penalty",
            Param::MaxTokens => "max_tokens",
            Param::Stop => "stop",
            Param::StopTokenIds => "stop_token_ids",
            Param::TopLogprobs => "top_logprobs",
            Param::Constraint => "constraint",
            Param::PresencePenalty => "presence_penalty",
            Param::FrequencyPenalty => "frequency_penalty",
            Param::LogitBias => "logit_bias",
            Param::PromptLogprobs => "prompt_logprobs",
        }
    }
}

impl std::fmt::Display for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A request field out of range: which one (as data, for each API to name), what it must be,
/// and what it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} must be {expected}, got {got}")]
pub struct InvalidParam {
    pub field: Param,
    pub expected: String,
    pub got: String,
}

fn invalid(field: Param, expected: impl ToString, got: impl ToString) -> InvalidParam {
    InvalidParam {
        field,
        expected: expected.to_string(),
        got: got.to_string(),
    }
}

/// Checks that a prompt of `prompt` tokens plus `max_tokens` fits a context of `context` tokens
/// (0: unknown, not checked): the one context rule of the router, the workers and the engine.
pub fn check_context(prompt: usize, max_tokens: usize, context: usize) -> Result<(), InvalidParam> {
    if context > 0 && prompt + max_tokens > context {
        return Err(invalid(
            Param::Prompt,
            format!("at most {context} tokens with max_tokens ({max_tokens})"),
            format!("{prompt} tokens"),
        ));
    }
    Ok(())
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self {
            temperature: 0.0,
            max_tokens,
            ..Self::default()
        }
    }

    /// Checks every field's range: the one set of request rules, shared by the router (both
    /// APIs), the workers and the command line.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        let t = self.temperature;
        if !(0.0..=2.0).contains(&t) {
            return Err(invalid(Param::Temperature, "between 0 and 2", t));
        }
        if self.top_k == Some(0) {
            return Err(invalid(Param::TopK, "at least 1 (or unset)", 0));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(Param::TopP, "in (0, 1]", self.top_p));
        }
        if !(0.0..1.0).contains(&self.min_p) {
            return Err(invalid(Param::MinP, "in [0, 1)", self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r > 0.0 && r <= 10.0) {
            return Err(invalid(Param::RepetitionPenalty, "in (0, 10]", r));
        }
        // 0 only scores the prompt, so only a scoring request may ask for it.
        let least = u32::from(self.prompt_logprobs.is_none());
        if !(least..=MAX_TOKENS_LIMIT).contains(&self.max_tokens) {
            return Err(invalid(
                Param::MaxTokens,
                format!("between 1 and {MAX_TOKENS_LIMIT} (0 only to score the prompt)"),
                self.max_tokens,
            ));
        }
        if let Some(k) = self.prompt_logprobs.filter(|k| *k > MAX_TOP_LOGPROBS) {
            return Err(invalid(
                Param::PromptLogprobs,
                format!("at most {MAX_TOP_LOGPROBS}"),
                k,
            ));
        }
        for (field, value) in [
            (Param::PresencePenalty, self.presence_penalty),
            (Param::FrequencyPenalty, self.frequency_penalty),
        ] {
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&value) {
                return Err(invalid(field, "between -2 and 2", value));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(invalid(
                Param::LogitBias,
                format!("at most {MAX_LOGIT_BIAS} entries"),
                format!("{} entries", self.logit_bias.len()),
            ));
        }
        if let Some((token, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-MAX_BIAS..=MAX_BIAS).contains(b))
        {
            return Err(invalid(
                Param::LogitBias,
                "biases between -100 and 100",
                format!("{bias} for token {token}"),
            ));
        }
        let mut tokens: Vec<u32> = self.logit_bias.iter().map(|(t, _)| *t).collect();
        tokens.sort_unstable();
        if let Some(w) = tokens.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(
                Param::LogitBias,
                "each token once",
                format!("token {} twice", w[0]),
            ));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(invalid(
                Param::TopLogprobs,
                format!("at most {MAX_TOP_LOGPROBS}"),
                self.top_logprobs,
            ));
        }
        if self.top_logprobs > 0 && !self.logprobs {
            return Err(invalid(
                Param::TopLogprobs,
                "0 unless logprobs is set",
                self.top_logprobs,
            ));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(invalid(
                Param::Stop,
                format!("at most {MAX_STOP_STRINGS} strings"),
                format!("{} strings", self.stop.len()),
            ));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(invalid(Param::Stop, "non-empty strings", "an empty one"));
        }
        if let Some(s) = self.stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(invalid(
                Param::Stop,
                format!("strings of at most {MAX_STOP_BYTES} bytes"),
                format!("one of {} bytes", s.len()),
            ));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(invalid(
                Param::StopTokenIds,
                format!("at most {MAX_STOP_TOKEN_IDS} ids"),
                format!("{} ids", self.stop_token_ids.len()),
            ));
        }
        if let Some(c) = &self.constraint {
            if c.source().len() > MAX_CONSTRAINT_BYTES {
                return Err(invalid(
                    Param::Constraint,
                    format!("a {} of at most {MAX_CONSTRAINT_BYTES} bytes", c.kind()),
                    format!("{} bytes", c.source().len()),
                ));
            }
            if self.ignore_eos {
                // The grammar ends the output with end-of-sequence; ignoring it cannot end.
                return Err(invalid(
                    Param::Constraint,
                    "unset when ignore_eos is set",
                    c.kind(),
                ));
            }
        }
        Ok(())
    }

    /// Checks that every token id this request names (its stop tokens, its logit biases) is
    /// in a vocabulary of `vocab` tokens.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), InvalidParam> {
        let outside =
            |field, mut ids: std::slice::Iter<'_, u32>| match ids.find(|&&t| t as usize >= vocab) {
                Some(&bad) => Err(invalid(
                    field,
                    format!("token ids below the vocabulary size {vocab}"),
                    bad,
                )),
                None => Ok(()),
            };
        outside(Param::StopTokenIds, self.stop_token_ids.iter())?;
        let biased: Vec<u32> = self.logit_bias.iter().map(|(t, _)| *t).collect();
        outside(Param::LogitBias, biased.iter())
    }

    /// Refuses prompt log-probabilities, for a request whose prompt this engine does not both
    /// compute and decode (prefill-only, a handed-off decode): the logits of every prompt
    /// position exist only where the prompt is computed, and a hand-off moves pages.
    pub fn check_not_scoring(&self) -> Result<(), InvalidParam> {
        match self.prompt_logprobs {
            Some(k) => Err(invalid(
                Param::PromptLogprobs,
                "absent where the prompt is handed off (run it on one worker)",
                k,
            )),
            None => Ok(()),
        }
    }

    /// Whether anything changes the logits before the choice (a bias or a penalty).
    fn changes_logits(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }
}

/// One alternative at a position: a token and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// The log-probabilities of one sampled position, under the model's distribution (see the
/// module header).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens (fewer when the vocabulary is smaller), most likely
    /// first; equal log-probabilities in increasing token id.
    pub top: Vec<TopLogprob>,
}

/// One draw: the token and, when asked for, its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// One sequence's sampler.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Candidate (token, weight) pairs, reused across steps.
    candidates: Vec<(u32, f32)>,
    /// Tokens already penalized in this step, reused across steps.
    marked: Vec<bool>,
    /// The request's constraint, whose mask is applied before every draw.
    grammar: Option<Grammar>,
    /// How many times each token is in the output, for the presence and frequency penalties
    /// (zeroed after each step).
    counts: Vec<u32>,
    /// How many of the tokens `sample` sees are the prompt's (the rest are output).
    prompt_len: usize,
}

/// log Σ exp(logits): `logits[t]` minus it is the log-softmax of token t.
fn log_normalizer(logits: &[f32]) -> f32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x));
    let sum: f32 = logits.iter().map(|x| (x - max).exp()).sum();
    max + sum.ln()
}

/// The `k` largest logits as (token, logit), largest first, equal logits in increasing token id
/// (the order [`argmax`] breaks ties in); NaN logits are never chosen.
///
/// One pass over the vocabulary keeping a sorted buffer of at most `k` entries (a bounded
/// insertion, as cheap as a heap for k ≤ 20): a logit enters only when it beats the smallest one
/// kept, so most tokens cost one comparison. No vocabulary-sized copy, no sort.
fn top_k(logits: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    let k = k.min(logits.len());
    if k == 0 {
        return;
    }
    for (token, &x) in logits.iter().enumerate() {
        if x.is_nan() || (out.len() == k && x <= out[k - 1].1) {
            continue;
        }
        // After every kept logit >= x: an equal one (a lower token id) stays ahead.
        let at = out.partition_point(|(_, y)| *y >= x);
        if out.len() == k {
            out.pop();
        }
        out.insert(at, (token as u32, x));
    }
}

/// The first index of the largest value (a NaN never wins, unless it is first).
pub(crate) fn argmax(logits: &[f32]) -> usize {
    let Some(&first) = logits.first() else {
        return 0;
    };
    // The first maximum; the best value kept in a register (not reloaded from the row).
    let (mut best, mut best_x) = (0, first);
    for (i, &x) in logits.iter().enumerate().skip(1) {
        if x > best_x {
            (best, best_x) = (i, x);
        }
    }
    best
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_entropy(),
        };
        Self {
            params,
            rng,
            candidates: Vec::new(),
            marked: Vec::new(),
            counts: Vec::new(),
            prompt_len: 0,
            grammar: None,
        }
    }

    /// The same sampler for a sequence whose first `prompt_len` seen tokens are its prompt:
    /// the presence and frequency penalties count only the tokens after them (without this,
    /// every seen token is output).
    pub fn after_prompt(self, prompt_len: usize) -> Self {
        Self { prompt_len, ..self }
    }

    /// The same sampler with its random stream `n` draws on: where it would be had it drawn
    /// the first `n` tokens of its output itself. A decode worker's sampler continues after the
    /// tokens another engine sampled (the prefill worker's first token, a resumed request's
    /// output), so a seeded request draws the same numbers whichever engines sample it.
    pub fn skip_draws(mut self, n: usize) -> Self {
        // `draw` takes one f32 per token.
        for _ in 0..n {
            let _: f32 = self.rng.gen();
        }
        self
    }

    /// This sampler with `grammar` masking every draw (the request's constraint, started).
    pub fn with_grammar(mut self, grammar: Grammar) -> Self {
        self.grammar = Some(grammar);
        self
    }

    /// Why the request's constraint failed mid-output, if it did (the output then ends).
    pub fn grammar_error(&self) -> Option<&str> {
        self.grammar.as_ref().and_then(Grammar::error)
    }

    /// Whether [`sample`](Self::sample) is a plain argmax of the logits (temperature 0, no
    /// bias, penalty or constraint, no log-probabilities of any kind): then the token can come
    /// from `Backend::argmax_rows` without the logits.
    pub fn is_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature == 0.0
            && !p.changes_logits()
            && !p.logprobs
            && p.prompt_logprobs.is_none()
            && self.grammar.is_none()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (modified in place by the bias and penalties), given
    /// every token the sequence has seen so far (its prompt, then its output).
    pub fn sample(&mut self, logits: &mut [f32], seen: &[u32]) -> Sampled {
        let p = &self.params;
        // Log-probabilities come from the raw logits, before the bias, penalties and a mask
        // change them.
        let changes = p.changes_logits() || self.grammar.is_some();
        let raw = (p.logprobs && changes).then(|| logits.to_vec());
        let (presence, frequency) = (p.presence_penalty, p.frequency_penalty);
        penalty::bias(logits, &p.logit_bias);
        if p.repetition_penalty != 1.0 {
            self.penalize(logits, seen);
        }
        if presence != 0.0 || frequency != 0.0 {
            let output = seen.get(self.prompt_len..).unwrap_or_default();
            penalty::presence_frequency(logits, output, presence, frequency, &mut self.counts);
        }
        // The constraint last: what it allows is never biased back in.
        if let Some(grammar) = &mut self.grammar {
            grammar.mask(logits);
        }
        let token = if self.params.temperature == 0.0 {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        if let Some(grammar) = &mut self.grammar {
            grammar.advance(token as u32);
        }
        let logprobs = self
            .params
            .logprobs
            .then(|| self.logprobs(raw.as_deref().unwrap_or(logits), token));
        Sampled {
            token: token as u32,
            logprobs,
        }
    }

    /// The chosen token's log-probability and the top alternatives, from the raw `logits`.
    fn logprobs(&mut self, logits: &[f32], token: usize) -> TokenLogprobs {
        let normalizer = log_normalizer(logits);
        // `candidates` is free again once the draw is done.
        top_k(
            logits,
            self.params.top_logprobs as usize,
            &mut self.candidates,
        );
        TokenLogprobs {
            logprob: logits[token] - normalizer,
            top: self
                .candidates
                .iter()
                .map(|&(token, x)| TopLogprob {
                    token,
                    logprob: x - normalizer,
                })
                .collect(),
        }
    }

    /// Applies the repetition penalty once to each distinct token in `seen`.
    fn penalize(&mut self, logits: &mut [f32], seen: &[u32]) {
        let penalty = self.params.repetition_penalty;
        let vocab = logits.len();
        self.marked.resize(vocab, false);
        for t in seen.iter().map(|t| *t as usize).filter(|t| *t < vocab) {
            if !std::mem::replace(&mut self.marked[t], true) {
                let x = &mut logits[t];
                *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
            }
        }
        for t in seen.iter().map(|t| *t as usize).filter(|t| *t < vocab) {
            self.marked[t] = false;
        }
    }

    /// Temperature, top-k, top-p, min-p, then a draw.
    fn draw(&mut self, logits: &[f32]) -> usize {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x));
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, x)| (i as u32, ((x - max) * inv_t).exp())),
        );
        let by_weight = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if let Some(k) = p.top_k {
            let k = (k as usize).min(c.len());
            if k < c.len() {
                c.select_nth_unstable_by(k - 1, by_weight);
                c.truncate(k);
            }
        }
        if p.top_p < 1.0 || p.min_p > 0.0 {
            c.sort_unstable_by(by_weight);
            let total: f32 = c.iter().map(|x| x.1).sum();
            let floor = p.min_p * c[0].1;
            let mut cumulative = 0.0;
            let mut keep = 0;
            for (_, w) in c.iter() {
                if *w < floor || cumulative >= p.top_p * total {
                    break;
                }
                cumulative += w;
                keep += 1;
            }
            c.truncate(keep.max(1));
        }
        let total: f32 = c.iter().map(|x| x.1).sum();
        let mut r = self.rng.gen::<f32>() * total;
        for (token, w) in c.iter() {
            if r < *w {
                return *token as usize;
            }
            r -= w;
        }
        c.last().expect("at least one candidate").0 as usize
    }
}

#[cfg(test)]
mod tests;
