//! Wire messages to engine types and back. Absent fields take the documented defaults; ranges
//! are checked by the engine ([`SamplingParams::validate`]), which names the field.

use nibble_engine::sampling::{SamplingParams, MAX_TOKENS_LIMIT};
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
    p.logprobs = logprobs.is_some_and(|l| l.enabled);
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

/// A chosen token's log-probability, when it was computed.
pub fn logprob(token: u32, logprob: Option<f32>) -> Option<v1::TokenLogprob> {
    logprob.map(|logprob| v1::TokenLogprob {
        token_id: token,
        logprob,
        top: Vec::new(),
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
}
