//! The wire API's request fields as the engine's [`SamplingParams`], and refusals as gRPC
//! statuses that carry the field at fault as data.
//!
//! The ranges are the engine's ([`SamplingParams::validate`]), checked once by the router for
//! both public APIs and again by the worker that runs the request; this module only moves
//! fields. A refused field travels in the status's `nibble-field` metadata as its path in the
//! request message (`sampling.min_p`), so the HTTP API names the OpenAI parameter without
//! reading the message.

use nibble_engine::grammar::Constraint;
use nibble_engine::sampling::{InvalidParam, Param, SamplingParams, MAX_TOKENS_LIMIT};
use tonic::metadata::MetadataValue;
use tonic::Status;

use crate::v1;

/// The metadata key of a refusal's field path.
pub const FIELD_METADATA: &str = "nibble-field";

/// The engine's parameters for a request. `room` is the most tokens the context leaves after
/// the prompt: an absent `max_tokens` generates until the context is full. Absent fields take
/// the engine's defaults; nothing is checked here.
pub fn sampling_params(
    sampling: Option<&v1::SamplingParams>,
    stopping: Option<&v1::StoppingCriteria>,
    logprobs: Option<&v1::LogprobsOptions>,
    room: usize,
) -> SamplingParams {
    let mut p = SamplingParams::default();
    if let Some(s) = sampling {
        p.temperature = s.temperature.unwrap_or(p.temperature);
        p.top_k = s.top_k;
        p.top_p = s.top_p.unwrap_or(p.top_p);
        p.min_p = s.min_p.unwrap_or(p.min_p);
        p.repetition_penalty = s.repetition_penalty.unwrap_or(p.repetition_penalty);
        p.seed = s.seed;
        p.constraint = s.constraint.as_ref().and_then(constraint);
        p.presence_penalty = s.presence_penalty.unwrap_or(p.presence_penalty);
        p.frequency_penalty = s.frequency_penalty.unwrap_or(p.frequency_penalty);
        p.logit_bias = s.logit_bias.iter().map(|(t, b)| (*t, *b)).collect();
        // In token order: the same request gives the same parameters.
        p.logit_bias.sort_unstable_by_key(|(t, _)| *t);
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
        p.prompt_logprobs = l.prompt_logprobs;
    }
    p
}

/// Where the engine's field lives in a `GenerateRequest` (and in the worker's requests).
pub fn field_path(param: Param) -> &'static str {
    match param {
        Param::Prompt => "prompt",
        Param::Temperature => "sampling.temperature",
        Param::TopK => "sampling.top_k",
        Param::TopP => "sampling.top_p",
        Param::MinP => "sampling.min_p",
        Param::RepetitionPenalty => "sampling.repetition_penalty",
        Param::MaxTokens => "stopping.max_tokens",
        Param::Stop => "stopping.stop",
        Param::StopTokenIds => "stopping.stop_token_ids",
        Param::TopLogprobs => "logprobs.top_logprobs",
        Param::Constraint => "sampling.constraint",
        Param::PresencePenalty => "sampling.presence_penalty",
        Param::FrequencyPenalty => "sampling.frequency_penalty",
        Param::LogitBias => "sampling.logit_bias",
        Param::PromptLogprobs => "logprobs.prompt_logprobs",
    }
}

/// The engine's form of a wire constraint; one without a kind is none.
pub fn constraint(c: &v1::Constraint) -> Option<Constraint> {
    use v1::constraint::Kind;
    Some(match c.kind.as_ref()? {
        Kind::JsonObject(_) => Constraint::JsonObject,
        Kind::JsonSchema(s) => Constraint::JsonSchema(s.clone()),
        Kind::Regex(s) => Constraint::Regex(s.clone()),
        Kind::Lark(s) => Constraint::Lark(s.clone()),
    })
}

/// The wire form of an engine constraint.
pub fn wire_constraint(c: &Constraint) -> v1::Constraint {
    use v1::constraint::Kind;
    let kind = match c {
        Constraint::JsonObject => Kind::JsonObject(true),
        Constraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Constraint::Regex(s) => Kind::Regex(s.clone()),
        Constraint::Lark(s) => Kind::Lark(s.clone()),
    };
    v1::Constraint { kind: Some(kind) }
}

/// INVALID_ARGUMENT for the field at `path`: the message is `path: reason`, and the path is
/// also in the [`FIELD_METADATA`] metadata.
pub fn invalid_field(path: &'static str, reason: impl std::fmt::Display) -> Status {
    let mut status = Status::invalid_argument(format!("{path}: {reason}"));
    status
        .metadata_mut()
        .insert(FIELD_METADATA, MetadataValue::from_static(path));
    status
}

/// INVALID_ARGUMENT for an engine refusal, naming its field.
pub fn invalid_param(e: &InvalidParam) -> Status {
    invalid_field(field_path(e.field), e)
}

/// The field path a refusal names, if it names one.
pub fn refused_field(status: &Status) -> Option<&str> {
    status.metadata().get(FIELD_METADATA)?.to_str().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_fields_take_defaults_and_max_tokens_fills_the_context() {
        let p = sampling_params(None, None, None, 100);
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
        let p = sampling_params(Some(&s), Some(&stop), None, 100);
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.validate().unwrap_err().field, Param::MaxTokens);
    }

    #[test]
    fn logprobs_options_reach_the_engine() {
        let options = |enabled, top_logprobs| v1::LogprobsOptions {
            enabled,
            top_logprobs,
            prompt_logprobs: None,
        };
        let p = sampling_params(None, None, Some(&options(true, 3)), 10);
        assert!(p.logprobs);
        assert_eq!(p.top_logprobs, 3);
        assert!(p.validate().is_ok());
        for bad in [options(true, 21), options(false, 2)] {
            let p = sampling_params(None, None, Some(&bad), 10);
            assert_eq!(p.validate().unwrap_err().field, Param::TopLogprobs);
        }
    }

    #[test]
    fn penalties_biases_and_prompt_logprobs_reach_the_engine() {
        let s = v1::SamplingParams {
            presence_penalty: Some(0.5),
            frequency_penalty: Some(-1.0),
            logit_bias: [(7, 100.0), (3, -100.0)].into_iter().collect(),
            ..Default::default()
        };
        let l = v1::LogprobsOptions {
            prompt_logprobs: Some(2),
            ..Default::default()
        };
        let stop = v1::StoppingCriteria {
            max_tokens: Some(0),
            ..Default::default()
        };
        let p = sampling_params(Some(&s), Some(&stop), Some(&l), 10);
        assert_eq!((p.presence_penalty, p.frequency_penalty), (0.5, -1.0));
        assert_eq!(p.logit_bias, vec![(3, -100.0), (7, 100.0)]);
        assert_eq!(p.prompt_logprobs, Some(2));
        assert!(p.validate().is_ok(), "max_tokens 0 scores the prompt");
        let err = p.check_vocab(7).unwrap_err();
        assert_eq!(
            refused_field(&invalid_param(&err)),
            Some("sampling.logit_bias")
        );
    }

    #[test]
    fn a_refusal_carries_its_field() {
        let s = v1::SamplingParams {
            min_p: Some(1.0),
            ..Default::default()
        };
        let err = sampling_params(Some(&s), None, None, 10)
            .validate()
            .unwrap_err();
        let status = invalid_param(&err);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(refused_field(&status), Some("sampling.min_p"));
        assert!(status
            .message()
            .starts_with("sampling.min_p: min_p must be"));
        assert_eq!(refused_field(&Status::internal("x")), None);
    }
}
