//! What changes a row of logits before the choice, beside the repetition penalty: OpenAI's
//! `logit_bias` and its presence and frequency penalties; and the log-probability of a given
//! token at a position, for the prompt tokens of a scoring request.

use super::{log_normalizer, top_k, TokenLogprobs, TopLogprob};

/// Adds each (token, bias) to its logit; tokens outside the row are skipped (the request's
/// validation refused them already).
pub(super) fn bias(logits: &mut [f32], biases: &[(u32, f32)]) {
    for &(token, bias) in biases {
        if let Some(x) = logits.get_mut(token as usize) {
            *x += bias;
        }
    }
}

/// OpenAI's penalties over the `output` tokens: each token's logit loses `presence` once if it
/// occurs and `frequency` once per occurrence. `counts` is scratch of at least zeros, left zeroed.
pub(super) fn presence_frequency(
    logits: &mut [f32],
    output: &[u32],
    presence: f32,
    frequency: f32,
    counts: &mut Vec<u32>,
) {
    let vocab = logits.len();
    counts.resize(vocab, 0);
    let inside = || {
        output
            .iter()
            .map(|t| *t as usize)
            .filter(move |t| *t < vocab)
    };
    for t in inside() {
        counts[t] += 1;
    }
    for t in inside() {
        let count = std::mem::take(&mut counts[t]);
        if count > 0 {
            logits[t] -= presence + frequency * count as f32;
        }
    }
}

/// The log-probability of `token` under the raw `logits` of the position before it, and the
/// `k` most likely tokens there (most likely first, ties in token order), as a sampled token's
/// are reported. `scratch` is reused between calls.
pub fn prompt_logprobs(
    logits: &[f32],
    token: u32,
    k: u32,
    scratch: &mut Vec<(u32, f32)>,
) -> TokenLogprobs {
    let normalizer = log_normalizer(logits);
    top_k(logits, k as usize, scratch);
    TokenLogprobs {
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |x| x - normalizer),
        top: scratch
            .iter()
            .map(|&(token, x)| TopLogprob {
                token,
                logprob: x - normalizer,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Sampler, SamplingParams};
    use super::*;

    #[test]
    fn presence_and_frequency_follow_openai() {
        let mut x = vec![1.0, 1.0, 1.0, 1.0];
        let mut counts = Vec::new();
        // Token 1 three times, token 2 once, token 9 outside the row.
        presence_frequency(&mut x, &[1, 2, 1, 9, 1], 0.5, 0.25, &mut counts);
        assert_eq!(x, vec![1.0, 1.0 - 0.5 - 0.75, 1.0 - 0.5 - 0.25, 1.0]);
        assert!(counts.iter().all(|c| *c == 0), "scratch left zeroed");
        // Negative values reward.
        let mut x = vec![0.0, 0.0];
        presence_frequency(&mut x, &[0, 0], -1.0, -2.0, &mut counts);
        assert_eq!(x, vec![5.0, 0.0]);
    }

    #[test]
    fn penalties_count_only_the_output() {
        // Token 1 is the argmax; it is in the prompt (not penalized) and then in the output.
        let params = SamplingParams {
            presence_penalty: 2.0,
            ..SamplingParams::greedy(4)
        };
        let logits = [1.0, 3.0, 2.0];
        let mut prompt_only = Sampler::new(params.clone()).after_prompt(2);
        assert_eq!(prompt_only.sample(&mut logits.clone(), &[1, 1]).token, 1);
        let mut with_output = Sampler::new(params).after_prompt(2);
        // 3 - 2 = 1 < 2: token 2 wins.
        assert_eq!(with_output.sample(&mut logits.clone(), &[1, 1, 1]).token, 2);
        assert!(!with_output.is_greedy());
    }

    #[test]
    fn a_bias_forces_or_bans_a_token_and_logprobs_stay_raw() {
        let params = SamplingParams {
            logit_bias: vec![(0, 100.0), (1, -100.0)],
            logprobs: true,
            ..SamplingParams::greedy(4)
        };
        let mut sampler = Sampler::new(params);
        assert!(!sampler.is_greedy());
        let raw = [1.0f32, 3.0, 2.0];
        let mut x = raw;
        let s = sampler.sample(&mut x, &[]);
        assert_eq!(s.token, 0);
        assert_eq!(x, [101.0, -97.0, 2.0]);
        let total: f32 = raw.iter().map(|v| v.exp()).sum();
        assert!((s.logprobs.unwrap().logprob - (1.0f32.exp() / total).ln()).abs() < 1e-6);
        // Banned: with the bias on token 1 alone, token 2 is the argmax.
        let mut ban = Sampler::new(SamplingParams {
            logit_bias: vec![(1, -100.0)],
            ..SamplingParams::greedy(4)
        });
        assert_eq!(ban.sample(&mut raw.clone(), &[]).token, 2);
    }

    #[test]
    fn a_prompt_tokens_logprob_is_its_log_softmax() {
        let x = [0.0f32, (2.0f32).ln(), (5.0f32).ln()];
        let mut scratch = Vec::new();
        let lp = prompt_logprobs(&x, 1, 2, &mut scratch);
        // exp: 1, 2, 5 of 8.
        assert!((lp.logprob - (2.0f32 / 8.0).ln()).abs() < 1e-6);
        assert_eq!(lp.top.len(), 2);
        assert_eq!((lp.top[0].token, lp.top[1].token), (2, 1));
        assert!((lp.top[0].logprob - (5.0f32 / 8.0).ln()).abs() < 1e-6);
        assert_eq!(prompt_logprobs(&x, 0, 0, &mut scratch).top, vec![]);
    }
}
