//! Wire messages to engine types and back. Absent fields take the documented defaults; ranges
//! are checked by the engine ([`SamplingParams::validate`]), which names the field.

use nibble_engine::sampling::{SamplingParams, TokenLogprobs, MAX_TOKENS_LIMIT};
use nibble_engine::scheduler::FinishReason;
use nibble_proto::v1;

use crate::error::Result;

/// The engine's parameters for a request. `room` is the most tokens the context leaves after the
/// prompt: an absent `max_tokens` generates until the context is full.
pub fn sampling_params(
    sampling: Option<&v1::SamplingParams>,
    stopping: Option<&v1::StoppingCriteria>,
    logprobs: Option<&v1::LogprobsOptions>,
    room: usize,
) -> Result<SamplingParams> {
    let mut p = SamplingParams::default();
    if let Some(s) = sampling {
        p.temperature = s.temperature.unwrap_or(p.temperature);
        p.top_k = s.top_k;
        p.top_p = s.top_p.unwrap_or(p.top_p);
        p.min_p = s.min_p.unwrap_or(p.min_p);
        p.repetition_penalty = s.repetition_penalty.unwrap_or(p.repetition_penalty);
        p.seed = s.seed;
    }
    p.max_tokens = room.clamp(1, MAX_TOKENS_LIMIT as usize) as u32;
    if let Some(s) = stopping {
        if let Some(max) = s.max_tokens {
            p.max_tokens = max;
        }
        p.stop = s.stop.clone();
        p.stop_token_ids = s.stop_token_ids.clone();
        p.ignore_eos = s.ignore_eos;
    }
    if let Some(l) = logprobs {
        p.logprobs = l.enabled;
        p.top_logprobs = l.top_logprobs;
    }
    Ok(p)
}

/// The wire finish reason. `Stop` is a stop string unless the last token is a stop token.
pub fn finish_reason(reason: FinishReason, stop_token: bool) -> v1::FinishReason {
    match reason {
        FinishReason::Length => v1::FinishReason::Length,
        FinishReason::Stop if stop_token => v1::FinishReason::StopToken,
        FinishReason::Stop => v1::FinishReason::StopString,
        FinishReason::Aborted => v1::FinishReason::Unspecified,
    }
}

/// The wire usage.
pub fn usage(u: &nibble_engine::Usage) -> v1::Usage {
    v1::Usage {
        prompt_tokens: u.prompt_tokens as u32,
        completion_tokens: u.completion_tokens as u32,
        cached_tokens: u.cached_tokens as u32,
    }
}

/// A chosen token's log-probability and its alternatives, when they were computed.
pub fn logprob(token: u32, logprobs: Option<TokenLogprobs>) -> Option<v1::TokenLogprob> {
    logprobs.map(|l| v1::TokenLogprob {
        token_id: token,
        logprob: l.logprob,
        top: l
            .top
            .into_iter()
            .map(|t| v1::TopLogprob {
                token_id: t.token,
                logprob: t.logprob,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_fields_take_defaults_and_max_tokens_fills_the_context() {
        let p = sampling_params(None, None, None, 100).unwrap();
        assert_eq!(p.temperature, 1.0);
        assert_eq!(p.max_tokens, 100);
        let s = v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        };
        let stop = v1::StoppingCriteria {
            max_tokens: Some(0),
            ..Default::default()
        };
        let p = sampling_params(Some(&s), Some(&stop), None, 100).unwrap();
        assert_eq!(p.temperature, 0.0);
        let err = p.validate().unwrap_err();
        assert_eq!(err.field, "max_tokens");
    }

    #[test]
    fn logprobs_options_reach_the_engine_and_come_back() {
        let options = |enabled, top_logprobs| v1::LogprobsOptions {
            enabled,
            top_logprobs,
        };
        let p = sampling_params(None, None, Some(&options(true, 3)), 10).unwrap();
        assert!(p.logprobs);
        assert_eq!(p.top_logprobs, 3);
        assert!(p.validate().is_ok());
        for bad in [options(true, 21), options(false, 2)] {
            let p = sampling_params(None, None, Some(&bad), 10).unwrap();
            assert_eq!(p.validate().unwrap_err().field, "top_logprobs");
        }

        let wire = logprob(
            7,
            Some(TokenLogprobs {
                logprob: -0.5,
                top: vec![nibble_engine::sampling::TopLogprob {
                    token: 7,
                    logprob: -0.5,
                }],
            }),
        )
        .unwrap();
        assert_eq!(wire.token_id, 7);
        assert_eq!(wire.logprob, -0.5);
        assert_eq!(
            wire.top,
            vec![v1::TopLogprob {
                token_id: 7,
                logprob: -0.5
            }]
        );
        assert_eq!(logprob(7, None), None);
    }
}
