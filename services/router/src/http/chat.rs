//! `POST /v1/chat/completions`: a conversation rendered by the model's chat template (the
//! router's chat prompt), answered as the assistant's message.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use nibble_engine::sampling::MAX_TOP_LOGPROBS;
use nibble_engine::tools::ToolFormat;
use nibble_engine::Tokenizer;
use nibble_proto::v1;
use serde::Deserialize;

use std::collections::{HashMap, HashSet};

use super::choices;
use super::error::{ApiError, ParamNames};
use super::generate::{self, finish_reason, usage_json, ChunkFormat};
use super::params::{self, Common, Delivery};
use super::tools::{
    self, message_calls, MessageToolCall, ToolChoice, ToolPlan, ToolSpec, ToolStream,
};
use super::{read_body, with_request_id, HttpState};
use crate::service::state::MintedId;

/// A message's `content`: text, or a list of parts of which only text parts are supported.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// One message of the conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant turn's calls.
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// The call a `tool` turn answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub common: Common,
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Vec<ToolSpec>>,
    pub tool_choice: Option<ToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    /// OpenAI's deprecated forms of `tools` and `tool_choice`: refused by name.
    pub functions: Option<serde_json::Value>,
    pub function_call: Option<serde_json::Value>,
    /// Append the opening of the assistant's turn (vLLM's extension). Default true.
    pub add_generation_prompt: Option<bool>,
}

struct Parsed {
    request: v1::GenerateRequest,
    /// Choices (`n`).
    n: u32,
    delivery: Delivery,
    logprobs: bool,
    /// The parameters refusals name.
    names: ParamNames,
    /// The call format to read, when tools are offered.
    tools: Option<ToolFormat>,
}

fn parse(
    body: ChatRequest,
    served: &str,
    max_n: u32,
    request_id: String,
    tokenizer: &Tokenizer,
) -> Result<Parsed, ApiError> {
    let c = &body.common;
    c.check_model(served)?;
    let delivery = c.delivery()?;
    let n = c.n(max_n)?;
    for (name, given) in [
        ("functions", body.functions.is_some()),
        ("function_call", body.function_call.is_some()),
    ] {
        if given {
            return Err(ApiError::invalid(
                name,
                "is deprecated and not supported; use tools and tool_choice",
            ));
        }
    }
    let plan = ToolPlan::new(
        body.tools.as_deref(),
        body.tool_choice.as_ref(),
        body.parallel_tool_calls,
        tokenizer,
    )?;
    let logprobs = body.logprobs.unwrap_or(false);
    let top_logprobs = body.top_logprobs.unwrap_or(0);
    if top_logprobs > MAX_TOP_LOGPROBS {
        return Err(ApiError::invalid(
            "top_logprobs",
            format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}"),
        ));
    }
    if top_logprobs > 0 && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "requires logprobs to be true",
        ));
    }
    let messages = body
        .messages
        .ok_or_else(|| ApiError::invalid("messages", "is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "needs at least one message"));
    }
    let messages = messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(text)) => text,
                Some(Content::Parts(parts)) => {
                    let mut texts = Vec::new();
                    for part in parts {
                        match (part.kind.as_str(), part.text) {
                            ("text", Some(text)) => texts.push(text),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content"),
                                    format!(
                                    "content parts of type {kind:?} are not supported (only text)"
                                ),
                                ))
                            }
                        }
                    }
                    texts.join("\n")
                }
            };
            Ok(v1::ChatMessage {
                role: m.role,
                content,
                tool_calls: m
                    .tool_calls
                    .as_deref()
                    .map(message_calls)
                    .unwrap_or_default(),
                tool_call_id: m.tool_call_id,
                name: m.name,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // max_completion_tokens supersedes the deprecated max_tokens.
    let (max_tokens, param) = match (body.max_completion_tokens, body.max_tokens) {
        (Some(n), _) => (Some(n), "max_completion_tokens"),
        (None, n) => (n, "max_tokens"),
    };
    let mut sampling = c.sampling()?;
    let mut constraint_param = c.structured.param();
    let mut skip_special_tokens = c.skip_special_tokens;
    if let Some(plan) = &plan {
        if let Some(grammar) = &plan.constraint {
            if sampling.constraint.is_some() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("cannot be combined with {constraint_param}"),
                ));
            }
            sampling.constraint = Some(grammar.clone());
            constraint_param = "tool_choice";
        }
        // Markers that are special tokens must reach the text to be read.
        if plan.keep_special {
            skip_special_tokens = Some(false);
        }
    }
    let request = v1::GenerateRequest {
        request_id,
        model: served.to_string(),
        prompt: Some(v1::generate_request::Prompt::Chat(v1::ChatPrompt {
            messages,
            add_generation_prompt: body.add_generation_prompt,
            tools: plan.as_ref().map(|p| p.tools.clone()).unwrap_or_default(),
        })),
        add_special_tokens: None,
        sampling: Some(sampling),
        stopping: Some(c.stopping(max_tokens)),
        logprobs: logprobs.then_some(v1::LogprobsOptions {
            enabled: true,
            top_logprobs,
            prompt_logprobs: None,
        }),
        skip_special_tokens,
    };
    Ok(Parsed {
        request,
        n,
        delivery,
        logprobs,
        names: ParamNames {
            prompt: "messages",
            max_tokens: param,
            constraint: constraint_param,
        },
        tools: plan.map(|p| p.format),
    })
}

/// The handler.
pub async fn chat_completions(
    State(state): State<HttpState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = state.next_id("chatcmpl");
    let response = run(state, body, id.clone())
        .await
        .unwrap_or_else(IntoResponse::into_response);
    with_request_id(response, id.as_str())
}

async fn run(
    state: HttpState,
    body: Result<Bytes, BytesRejection>,
    id: MintedId,
) -> Result<Response, ApiError> {
    let body: ChatRequest = params::parse_body(&read_body(&state, body)?)?;
    let served = state.model().to_string();
    let max_n = state.config().max_n;
    let parsed = parse(body, &served, max_n, id.to_string(), &state.tokenizer())?;
    let choices = choices::fan_out(vec![parsed.request], parsed.n);
    let prompts: Vec<usize> = choices.iter().map(|c| c.prompt).collect();
    let (merged, routes) = choices::start_all(&state.service, &id, choices, parsed.names).await?;
    let format = ChatChunks {
        id: id.to_string(),
        model: served,
        created: generate::unix_now(),
        tokenizer: parsed.logprobs.then(|| state.tokenizer()),
        sent_role: HashSet::new(),
        tools: parsed.tools,
        calls: HashMap::new(),
    };
    if parsed.delivery.stream {
        return Ok(routes.headers(generate::sse(
            merged,
            prompts,
            format,
            parsed.delivery,
            parsed.names,
        )));
    }
    let (collected, usage) = generate::collect(merged, &prompts, parsed.names).await?;
    let choices: Vec<_> = collected
        .into_iter()
        .map(|(index, c)| {
            let mut finish = finish_reason(c.finish_reason);
            let message = match parsed.tools {
                Some(tool_format) => {
                    let (message, called) = tools::message(tool_format, &c.text);
                    if called && finish == Some("stop") {
                        finish = Some("tool_calls");
                    }
                    message
                }
                None => serde_json::json!({ "role": "assistant", "content": c.text }),
            };
            serde_json::json!({
                "index": index,
                "message": message,
                "logprobs": format.logprobs(&c.logprobs),
                "finish_reason": finish,
            })
        })
        .collect();
    let response = Json(serde_json::json!({
        "id": format.id,
        "object": "chat.completion",
        "created": format.created,
        "model": format.model,
        "choices": choices,
        "usage": usage_json(&usage),
    }))
    .into_response();
    Ok(routes.headers(response))
}

struct ChatChunks {
    id: String,
    model: String,
    created: u64,
    /// Present when log-probabilities were asked for (to spell the tokens).
    tokenizer: Option<std::sync::Arc<nibble_engine::Tokenizer>>,
    /// Choices whose opening (role) chunk was sent.
    sent_role: HashSet<u32>,
    /// The call format to read, when tools are offered.
    tools: Option<ToolFormat>,
    /// Per choice, the calls being read out of its text.
    calls: HashMap<u32, ToolStream>,
}

impl ChatChunks {
    /// Chat's `logprobs` object for some tokens (`null` unless asked for): per token its text,
    /// log-probability and UTF-8 bytes, and the `top_logprobs` most likely tokens alike, most
    /// likely first.
    fn logprobs(&self, logprobs: &[v1::TokenLogprob]) -> serde_json::Value {
        let Some(tokenizer) = &self.tokenizer else {
            return serde_json::Value::Null;
        };
        let entry = |token_id: u32, logprob: f32| {
            let token = super::token_text(tokenizer, token_id);
            serde_json::json!({
                "token": token,
                "logprob": logprob,
                "bytes": token.as_bytes(),
            })
        };
        let content: Vec<_> = logprobs
            .iter()
            .map(|lp| {
                let mut json = entry(lp.token_id, lp.logprob);
                let top: Vec<_> = lp
                    .top
                    .iter()
                    .map(|t| entry(t.token_id, t.logprob))
                    .collect();
                json["top_logprobs"] = top.into();
                json
            })
            .collect();
        serde_json::json!({ "content": content })
    }

    fn chunk(
        &self,
        index: u32,
        delta: serde_json::Value,
        logprobs: serde_json::Value,
        finish: Option<&str>,
    ) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
            }],
        })
    }
}

impl ChunkFormat for ChatChunks {
    fn chunks(&mut self, index: u32, chunk: v1::GenerateResponse) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        if self.sent_role.insert(index) {
            out.push(self.chunk(
                index,
                serde_json::json!({ "role": "assistant", "content": "" }),
                serde_json::Value::Null,
                None,
            ));
        }
        let mut calls = self.tools.map(|f| {
            self.calls
                .remove(&index)
                .unwrap_or_else(|| ToolStream::new(f))
        });
        let text = match &mut calls {
            Some(calls) => calls.push(&chunk.text),
            None => chunk.text,
        };
        if !text.is_empty() || !chunk.logprobs.is_empty() {
            out.push(self.chunk(
                index,
                serde_json::json!({ "content": text }),
                self.logprobs(&chunk.logprobs),
                None,
            ));
        }
        match finish_reason(chunk.finish_reason) {
            Some(mut finish) => {
                if let Some(mut calls) = calls {
                    let (rest, calls) = calls.finish();
                    if !rest.is_empty() {
                        let delta = serde_json::json!({ "content": rest });
                        out.push(self.chunk(index, delta, serde_json::Value::Null, None));
                    }
                    if !calls.is_empty() {
                        let delta = serde_json::json!({ "tool_calls": calls });
                        out.push(self.chunk(index, delta, serde_json::Value::Null, None));
                        if finish == "stop" {
                            finish = "tool_calls";
                        }
                    }
                }
                let done = serde_json::json!({});
                out.push(self.chunk(index, done, serde_json::Value::Null, Some(finish)));
            }
            None => {
                if let Some(calls) = calls {
                    self.calls.insert(index, calls);
                }
            }
        }
        out
    }

    fn usage_chunk(&self, usage: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }
}
