//! Tool calling on `/v1/chat/completions`: `tools`, `tool_choice` and `parallel_tool_calls` as
//! OpenAI takes them, turned into the chat prompt's tools and (for `required` or a named
//! function) a grammar; and the model's text turned back into `tool_calls`, whole or streamed.
//!
//! The call format is the model family's ([`ToolFormat`], chosen by the chat template). With
//! `auto` the model decides, and its text is read for calls; `required` and a named function
//! constrain the output to calls of those functions, so the arguments always parse; `none`
//! neither shows the tools to the model nor reads calls.

use nibble_engine::tools::{ParsedCall, Tool, ToolFormat};
use nibble_engine::Tokenizer;
use nibble_proto::request::wire_constraint;
use nibble_proto::v1;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolSpec {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: Option<FunctionSpec>,
}

/// `tools[].function`.
#[derive(Debug, Clone, Deserialize)]
pub struct FunctionSpec {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub parameters: Option<Value>,
    /// Accepted either way; a call's arguments follow the schema when the grammar applies.
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named { function: NamedFunction },
}

#[derive(Debug, Clone, Deserialize)]
pub struct NamedFunction {
    pub name: String,
}

/// One entry of an assistant message's `tool_calls`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessageToolCall {
    pub id: Option<String>,
    pub function: MessageFunction,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MessageFunction {
    pub name: String,
    /// JSON text (OpenAI's shape); an object is taken as well.
    pub arguments: Value,
}

/// What a request's tools make of it.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    /// The tools shown to the model.
    pub tools: Vec<v1::Tool>,
    /// The grammar of `required` or a named function.
    pub constraint: Option<v1::Constraint>,
    pub format: ToolFormat,
    /// Whether the call markers are special tokens, which the text must then spell out.
    pub keep_special: bool,
}

/// Most tools one request may list.
pub const MAX_TOOLS: usize = 128;

impl ToolPlan {
    /// The plan for `tools` and `tool_choice` (absent: `auto` with tools, as OpenAI's). `None`
    /// when no tool is shown (no tools, or `tool_choice: "none"`).
    pub fn new(
        tools: Option<&[ToolSpec]>,
        choice: Option<&ToolChoice>,
        parallel: Option<bool>,
        tokenizer: &Tokenizer,
    ) -> Result<Option<Self>, ApiError> {
        let specs = tools.unwrap_or_default();
        if specs.len() > MAX_TOOLS {
            return Err(ApiError::invalid(
                "tools",
                format!("at most {MAX_TOOLS} tools, got {}", specs.len()),
            ));
        }
        let mut engine_tools = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            let function = match (&spec.kind[..], &spec.function) {
                ("function", Some(f)) => f,
                ("function", None) => {
                    return Err(ApiError::invalid(
                        format!("tools[{i}].function"),
                        "is required",
                    ))
                }
                (kind, _) => {
                    return Err(ApiError::invalid(
                        format!("tools[{i}].type"),
                        format!("only \"function\" tools are supported, got {kind:?}"),
                    ))
                }
            };
            let parameters = match &function.parameters {
                None => json!({"type": "object", "properties": {}}),
                Some(p) if p.is_object() => p.clone(),
                Some(other) => {
                    return Err(ApiError::invalid(
                        format!("tools[{i}].function.parameters"),
                        format!("must be a JSON Schema object, got {other}"),
                    ))
                }
            };
            engine_tools.push(Tool {
                name: function.name.clone(),
                description: function.description.clone(),
                parameters,
            });
        }
        let mode = match choice {
            None if specs.is_empty() => return Ok(None),
            None => "auto",
            Some(ToolChoice::Mode(m)) => match m.as_str() {
                "none" | "auto" | "required" => m.as_str(),
                other => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("must be none, auto, required or a function, got {other:?}"),
                    ))
                }
            },
            Some(ToolChoice::Named { .. }) => "named",
        };
        if mode == "none" {
            return Ok(None);
        }
        if specs.is_empty() {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("{mode} needs tools"),
            ));
        }
        let format = ToolFormat::of_template(tokenizer.chat_template());
        let chosen: Vec<Tool> = match choice {
            Some(ToolChoice::Named { function }) => {
                let named: Vec<Tool> = engine_tools
                    .iter()
                    .filter(|t| t.name == function.name)
                    .cloned()
                    .collect();
                if named.is_empty() {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("names {:?}, which is not among the tools", function.name),
                    ));
                }
                named
            }
            _ => engine_tools.clone(),
        };
        let constraint = match mode {
            "required" => Some(format.grammar(&chosen, parallel.unwrap_or(true), tokenizer)),
            "named" => Some(format.grammar(&chosen, false, tokenizer)),
            _ => None,
        };
        let keep_special = tokenizer
            .inner()
            .get_added_tokens_decoder()
            .values()
            .any(|t| {
                t.special && format.marker().len() > 1 && t.content.starts_with(format.marker())
            });
        let tools = engine_tools
            .iter()
            .map(|t| v1::Tool {
                name: t.name.clone(),
                description: t.description.clone(),
                parameters: Some(t.parameters.to_string()),
            })
            .collect();
        Ok(Some(Self {
            tools,
            constraint: constraint.as_ref().map(wire_constraint),
            format,
            keep_special,
        }))
    }
}

/// An assistant message's calls in the wire form.
pub fn message_calls(calls: &[MessageToolCall]) -> Vec<v1::ToolCall> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| v1::ToolCall {
            id: c.id.clone().unwrap_or_else(|| format!("call_{i}")),
            name: c.function.name.clone(),
            arguments: match &c.function.arguments {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            },
        })
        .collect()
}

/// A fresh call id, as OpenAI's look.
fn call_id() -> String {
    use rand::Rng;
    let n: u128 = rand::thread_rng().gen();
    format!("call_{:024x}", n & ((1u128 << 96) - 1))
}

/// `tool_calls` entries for parsed calls; streamed deltas carry their `index`.
fn calls_json(calls: &[ParsedCall], indexed: bool) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut call = json!({
                "id": call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if indexed {
                call["index"] = json!(i);
            }
            call
        })
        .collect()
}

/// A whole answer as an assistant message: `content` (null when only calls were made) and
/// `tool_calls`; and whether calls were made (`finish_reason` is then `tool_calls`).
pub fn message(format: ToolFormat, text: &str) -> (Value, bool) {
    let parsed = format.parse(text);
    if parsed.calls.is_empty() {
        return (json!({"role": "assistant", "content": text}), false);
    }
    let content = (!parsed.content.is_empty()).then_some(parsed.content);
    let message = json!({
        "role": "assistant",
        "content": content,
        "tool_calls": calls_json(&parsed.calls, false),
    });
    (message, true)
}

/// A streamed answer's text, split as it comes into content deltas (sent at once) and calls
/// (held from the first possible marker until the end, then sent as `tool_calls` deltas).
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    /// Text from where a call may start, not sent yet.
    held: String,
    /// Whether a marker was seen: everything after it is held.
    calling: bool,
    /// Whether any content was sent (Llama's calls start only at the very beginning).
    sent: bool,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            held: String::new(),
            calling: false,
            sent: false,
        }
    }

    /// Takes a text delta; returns the content that can be sent now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.calling {
            return String::new();
        }
        let marker = self.format.marker();
        if self.format == ToolFormat::Llama3 {
            // A call is the whole answer, from its first non-space character.
            let start = self.held.trim_start();
            if self.sent || (!start.is_empty() && !start.starts_with(['{', '<'])) {
                self.sent = true;
                return std::mem::take(&mut self.held);
            }
            self.calling = start.starts_with('{') || start.starts_with("<|python_tag|>");
            return String::new();
        }
        if let Some(at) = self.held.find(marker) {
            self.calling = true;
            let content: String = self.held.drain(..at).collect();
            self.sent |= !content.is_empty();
            return content;
        }
        // Hold back a tail that could be the start of the marker.
        let len = self.held.len();
        let keep = (1..=(marker.len() - 1).min(len))
            .rev()
            .find(|&n| {
                self.held.is_char_boundary(len - n) && marker.starts_with(&self.held[len - n..])
            })
            .unwrap_or(0);
        let send = len - keep;
        let content: String = self.held.drain(..send).collect();
        self.sent |= !content.is_empty();
        content
    }

    /// At the end: the content still held (text that was no call after all) and the calls.
    pub fn finish(&mut self) -> (String, Vec<Value>) {
        let held = std::mem::take(&mut self.held);
        if !self.calling {
            return (held, Vec::new());
        }
        let parsed = self.format.parse(&held);
        if parsed.calls.is_empty() {
            return (held, Vec::new());
        }
        (parsed.content, calls_json(&parsed.calls, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_text_is_content_until_a_call_starts() {
        let mut s = ToolStream::new(ToolFormat::Hermes);
        let mut content = String::new();
        for piece in [
            "Sure",
            ", let me check.",
            "\n<tool",
            "_call>\n{\"name\": \"f\", ",
            "\"arguments\": {}}\n</tool_call>",
        ] {
            content.push_str(&s.push(piece));
        }
        assert_eq!(content, "Sure, let me check.\n");
        let (rest, calls) = s.finish();
        assert_eq!(rest, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "f");
        assert_eq!(calls[0]["index"], 0);
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));

        // A held tail that turns out not to be a marker is sent.
        let mut s = ToolStream::new(ToolFormat::Hermes);
        assert_eq!(s.push("a <to"), "a ");
        assert_eq!(s.push("p>"), "<top>");
        assert_eq!(s.finish(), (String::new(), Vec::new()));

        // A broken call is content at the end.
        let mut s = ToolStream::new(ToolFormat::Hermes);
        assert_eq!(s.push("<tool_call>{oops"), "");
        assert_eq!(s.finish().0, "<tool_call>{oops");
    }

    #[test]
    fn a_llama_call_is_the_whole_answer() {
        let mut s = ToolStream::new(ToolFormat::Llama3);
        assert_eq!(s.push(" {\"name\": \"f\","), "");
        assert_eq!(s.push(" \"parameters\": {\"x\": 1}}"), "");
        let (_, calls) = s.finish();
        assert_eq!(calls[0]["function"]["arguments"], r#"{"x":1}"#);
        let mut s = ToolStream::new(ToolFormat::Llama3);
        assert_eq!(s.push("Hello {"), "Hello {");
    }

    #[test]
    fn a_whole_answer_with_calls_has_null_content() {
        let (m, called) = message(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>",
        );
        assert!(called);
        assert!(m["content"].is_null());
        assert_eq!(m["tool_calls"][0]["type"], "function");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], r#"{"a":1}"#);
        let (m, called) = message(ToolFormat::Hermes, "No call.");
        assert!(!called);
        assert_eq!(m["content"], "No call.");
    }
}
