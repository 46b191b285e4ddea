//! One validation of a `GenerateRequest`, for the gRPC API and the HTTP API alike (the HTTP
//! API builds the same message): the model, the prompt (by bytes before it is tokenized, by
//! tokens after), and every sampling and stopping field by the engine's own rules
//! ([`SamplingParams::validate`]), the ones the worker applies again. A refusal names its field
//! as data ([`nibble_proto::request::refused_field`]).
//!
//! Tokenization and chat rendering are CPU work: [`validate`] is blocking, and the service runs
//! it off the async threads.

use nibble_engine::chat::ToolCall;
use nibble_engine::grammar::{Constraint, GrammarError};
use nibble_engine::sampling::{check_context, SamplingParams};
use nibble_engine::tools::Tool;
use nibble_engine::ChatMessage;
use nibble_proto::request::{invalid_field, invalid_param, sampling_params};
use nibble_proto::v1;
use tonic::Status;

use super::ServiceConfig;

/// A request that passed every check: its prompt's token ids and the engine's parameters.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub req: v1::GenerateRequest,
    pub tokens: Vec<u32>,
    pub params: SamplingParams,
}

/// Checks `req` against what `config` serves and tokenizes its prompt (blocking).
pub fn validate(req: v1::GenerateRequest, config: &ServiceConfig) -> Result<ValidRequest, Status> {
    check_model(&req.model, config.served_model())?;
    let max_tokens = req.stopping.as_ref().and_then(|s| s.max_tokens);
    let limit = config.max_tokens_limit;
    if let Some(max) = max_tokens.filter(|&m| m > limit) {
        return Err(invalid_field(
            "stopping.max_tokens",
            format!("this router allows at most {limit}, got {max}"),
        ));
    }
    let tokens = prompt_tokens(&req, config)?;
    let context = config.max_context as usize;
    let room = match context {
        0 => usize::MAX,
        context => context.saturating_sub(tokens.len()),
    };
    let params = sampling_params(
        req.sampling.as_ref(),
        req.stopping.as_ref(),
        req.logprobs.as_ref(),
        room,
    );
    params.validate().map_err(|e| invalid_param(&e))?;
    if let Some(constraint) = &params.constraint {
        check_constraint(constraint, config)?;
    }
    params
        .check_vocab(config.tokenizer.vocab_size())
        .map_err(|e| invalid_param(&e))?;
    check_context(tokens.len(), max_tokens.unwrap_or(1) as usize, context)
        .map_err(|e| invalid_param(&e))?;
    Ok(ValidRequest {
        req,
        tokens,
        params,
    })
}

/// Compiles a request's constraint (a schema, regex or grammar), so that one that cannot be
/// followed is refused before anything is scheduled. The worker that samples compiles it again.
fn check_constraint(constraint: &Constraint, config: &ServiceConfig) -> Result<(), Status> {
    let refuse = |e: GrammarError| invalid_field("sampling.constraint", e);
    let took = config
        .tokenizer
        .grammars()
        .map_err(refuse)?
        .check(constraint);
    let took = took.map_err(refuse)?;
    metrics::histogram!("nibble_router_constraint_compile_seconds", "kind" => constraint.kind())
        .record(took.as_secs_f64());
    Ok(())
}

/// The engine's form of a wire chat message.
fn chat_message(m: &v1::ChatMessage) -> ChatMessage {
    ChatMessage {
        role: m.role.clone(),
        content: m.content.clone(),
        tool_calls: m
            .tool_calls
            .iter()
            .map(|c| ToolCall {
                id: c.id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            })
            .collect(),
        tool_call_id: m.tool_call_id.clone(),
        name: m.name.clone(),
    }
}

/// The engine's form of a request's tools; parameters must be JSON objects.
pub fn chat_tools(tools: &[v1::Tool]) -> Result<Vec<Tool>, Status> {
    let mut names = std::collections::HashSet::new();
    for t in tools {
        let ok = !t.name.is_empty()
            && t.name.len() <= 64
            && t.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !ok {
            return Err(invalid_field(
                "prompt.chat.tools",
                format!(
                    "function names are 1 to 64 of [A-Za-z0-9_-], got {:?}",
                    t.name
                ),
            ));
        }
        if !names.insert(t.name.as_str()) {
            return Err(invalid_field(
                "prompt.chat.tools",
                format!("function {:?} is listed twice", t.name),
            ));
        }
    }
    tools
        .iter()
        .map(|t| {
            let parameters = match &t.parameters {
                None => serde_json::json!({"type": "object", "properties": {}}),
                Some(text) => match serde_json::from_str::<serde_json::Value>(text) {
                    Ok(v) if v.is_object() => v,
                    _ => {
                        return Err(invalid_field(
                            "prompt.chat.tools",
                            format!("the parameters of {:?} are not a JSON object", t.name),
                        ))
                    }
                },
            };
            Ok(Tool {
                name: t.name.clone(),
                description: t.description.clone(),
                parameters,
            })
        })
        .collect()
}

/// Absent or empty is the served model; another name is refused.
pub fn check_model(model: &str, served: &str) -> Result<(), Status> {
    if !model.is_empty() && model != served {
        return Err(invalid_field(
            "model",
            format!("unknown model {model:?} (this router serves {served:?})"),
        ));
    }
    Ok(())
}

/// Refuses text of more than the configured bytes before anything tokenizes it.
pub fn check_prompt_bytes(bytes: usize, config: &ServiceConfig) -> Result<(), Status> {
    let limit = config.prompt_bytes_limit();
    if bytes > limit {
        return Err(invalid_field(
            "prompt",
            format!("is {bytes} bytes, more than this router's limit of {limit}"),
        ));
    }
    Ok(())
}

/// The prompt's token ids.
fn prompt_tokens(req: &v1::GenerateRequest, config: &ServiceConfig) -> Result<Vec<u32>, Status> {
    use v1::generate_request::Prompt as P;
    let tokenizer = &config.tokenizer;
    let internal = |e: nibble_engine::Error| Status::internal(format!("tokenizer: {e}"));
    let ids = match &req.prompt {
        None => {
            return Err(invalid_field(
                "prompt",
                "is required (text, tokens or chat)",
            ))
        }
        Some(P::Text(text)) => {
            if text.is_empty() {
                return Err(invalid_field("prompt", "text must not be empty"));
            }
            check_prompt_bytes(text.len(), config)?;
            tokenizer
                .encode(text, req.add_special_tokens.unwrap_or(true))
                .map_err(internal)?
        }
        Some(P::Tokens(tokens)) => {
            let vocab = tokenizer.vocab_size();
            if let Some(bad) = tokens.ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(invalid_field(
                    "prompt.tokens",
                    format!("token id {bad} is outside the vocabulary of {vocab}"),
                ));
            }
            tokens.ids.clone()
        }
        Some(P::Chat(chat)) => {
            if chat.messages.is_empty() {
                return Err(invalid_field("prompt.chat", "needs at least one message"));
            }
            let bytes = chat
                .messages
                .iter()
                .map(|m| m.role.len() + m.content.len())
                .sum();
            check_prompt_bytes(bytes, config)?;
            let messages: Vec<ChatMessage> = chat.messages.iter().map(chat_message).collect();
            let tools = chat_tools(&chat.tools)?;
            let text = tokenizer
                .render_chat_with_tools(
                    &messages,
                    &tools,
                    chat.add_generation_prompt.unwrap_or(true),
                )
                .map_err(|e| invalid_field("prompt.chat", e))?;
            tokenizer.encode(&text, false).map_err(internal)?
        }
    };
    if ids.is_empty() {
        return Err(invalid_field("prompt", "must not be empty"));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use nibble_engine::ModelSource;
    use nibble_proto::request::refused_field;

    use super::*;
    use crate::RouterConfig;

    fn config() -> ServiceConfig {
        let source = ModelSource::open(nibble_testkit::model_path()).unwrap();
        let tokenizer = Arc::new(source.load_tokenizer().unwrap());
        let mut config = ServiceConfig::new(RouterConfig::new("m", 16), tokenizer, 2048);
        config.max_prompt_bytes = Some(4096);
        config
    }

    #[test]
    fn requests_name_the_served_model_not_the_workers() {
        let mut config = config();
        assert_eq!(config.served_model(), "m");
        config.served_model_name = Some("smol".into());
        assert_eq!(config.served_model(), "smol");
        let named = |model: &str| v1::GenerateRequest {
            model: model.into(),
            ..text("Hello")
        };
        assert!(validate(named("smol"), &config).is_ok());
        assert!(validate(named(""), &config).is_ok());
        assert_eq!(refused(named("m"), &config), "model");
    }

    fn text(prompt: &str) -> v1::GenerateRequest {
        v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text(prompt.into())),
            ..Default::default()
        }
    }

    fn refused(req: v1::GenerateRequest, config: &ServiceConfig) -> String {
        let status = validate(req, config).unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        let field = refused_field(&status).expect("a refusal names its field");
        assert!(status.message().starts_with(field), "{status:?}");
        field.to_string()
    }

    #[test]
    fn the_engine_rules_apply_at_the_router() {
        let config = config();
        let with = |sampling: v1::SamplingParams| v1::GenerateRequest {
            sampling: Some(sampling),
            ..text("Hello")
        };
        // min_p = 1 passed the router before and was refused by the worker after routing.
        let min_p = with(v1::SamplingParams {
            min_p: Some(1.0),
            ..Default::default()
        });
        assert_eq!(refused(min_p, &config), "sampling.min_p");
        let penalty = with(v1::SamplingParams {
            repetition_penalty: Some(1e30),
            ..Default::default()
        });
        assert_eq!(refused(penalty, &config), "sampling.repetition_penalty");
        let hot = with(v1::SamplingParams {
            temperature: Some(2.5),
            ..Default::default()
        });
        assert_eq!(refused(hot, &config), "sampling.temperature");
        let stops = v1::GenerateRequest {
            stopping: Some(v1::StoppingCriteria {
                stop: vec!["x".into(); 100_000],
                ..Default::default()
            }),
            ..text("Hello")
        };
        assert_eq!(refused(stops, &config), "stopping.stop");
        let stop_ids = v1::GenerateRequest {
            stopping: Some(v1::StoppingCriteria {
                stop_token_ids: vec![u32::MAX],
                ..Default::default()
            }),
            ..text("Hello")
        };
        assert_eq!(refused(stop_ids, &config), "stopping.stop_token_ids");
        let pushy = with(v1::SamplingParams {
            presence_penalty: Some(2.5),
            ..Default::default()
        });
        assert_eq!(refused(pushy, &config), "sampling.presence_penalty");
        let outside = with(v1::SamplingParams {
            logit_bias: [(49_152, 1.0)].into_iter().collect(),
            ..Default::default()
        });
        assert_eq!(refused(outside, &config), "sampling.logit_bias");
        let scoring = |max_tokens, prompt_logprobs| v1::GenerateRequest {
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(max_tokens),
                ..Default::default()
            }),
            logprobs: Some(v1::LogprobsOptions {
                prompt_logprobs,
                ..Default::default()
            }),
            ..text("Hello")
        };
        assert_eq!(refused(scoring(0, None), &config), "stopping.max_tokens");
        assert_eq!(
            refused(scoring(0, Some(21)), &config),
            "logprobs.prompt_logprobs"
        );
        assert!(validate(scoring(0, Some(5)), &config).is_ok(), "score only");
        let valid = validate(text("Hello"), &config).unwrap();
        assert!(!valid.tokens.is_empty());
        assert_eq!(valid.params.max_tokens as usize, 2048 - valid.tokens.len());
    }

    #[test]
    fn prompts_are_refused_by_bytes_before_tokens_and_by_context_after() {
        let config = config();
        assert_eq!(refused(text(&"a".repeat(4097)), &config), "prompt");
        let long = v1::GenerateRequest {
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(2048),
                ..Default::default()
            }),
            ..text("Hello there")
        };
        assert_eq!(refused(long, &config), "prompt");
        let other = v1::GenerateRequest {
            model: "other".into(),
            ..text("Hello")
        };
        assert_eq!(refused(other, &config), "model");
        let bad_token = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
                ids: vec![1, 10_000_000],
            })),
            ..Default::default()
        };
        assert_eq!(refused(bad_token, &config), "prompt.tokens");
        let mut capped = config.clone();
        capped.max_tokens_limit = 8;
        let many = v1::GenerateRequest {
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(9),
                ..Default::default()
            }),
            ..text("Hello")
        };
        assert_eq!(refused(many, &capped), "stopping.max_tokens");
    }
}
