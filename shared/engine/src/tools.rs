//! Tool calling: how a model family writes a function call, read back out of its text, and the
//! grammar that makes it write one whose arguments always parse.
//!
//! Three formats, chosen by what the chat template writes ([`ToolFormat::of_template`]):
//!
//! * [`ToolFormat::Hermes`]: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
//!   block per call (Hermes, Qwen2.5, and nibble's default);
//! * [`ToolFormat::Llama3`]: a bare JSON object `{"name": ..., "parameters": {...}}`, optionally
//!   after `<|python_tag|>`, calls separated by `;` (Llama 3.1's JSON tool calling);
//! * [`ToolFormat::Mistral`]: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`.
//!
//! A template that never mentions `tools` cannot show them to the model: for those, nibble writes
//! the functions and the Hermes format into the system message ([`ToolFormat::preamble`]).

use serde_json::{json, Value};

use crate::grammar::Constraint;
use crate::tokenizer::Tokenizer;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON Schema.
    pub parameters: Value,
}

/// A call read out of the model's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// The model's text split into what it said and what it called.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedOutput {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// How a model family writes calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Mistral,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// The format a chat template writes: Mistral's or Llama 3.1's by their markers, else Hermes.
    pub fn of_template(template: Option<&str>) -> Self {
        let t = template.unwrap_or_default();
        if t.contains(MISTRAL_OPEN) {
            ToolFormat::Mistral
        } else if t.contains(PYTHON_TAG) || t.contains("ipython") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Hermes
        }
    }

    /// Whether the template renders `tools` itself.
    pub fn template_shows_tools(template: Option<&str>) -> bool {
        template.is_some_and(|t| t.contains("tools"))
    }

    /// Where a call starts in the text; text before it is content.
    pub fn marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes => HERMES_OPEN,
            ToolFormat::Llama3 => "{",
            ToolFormat::Mistral => MISTRAL_OPEN,
        }
    }

    /// A system-message text showing `tools` and the Hermes format, for templates that do not.
    pub fn preamble(tools: &[Tool]) -> String {
        let mut text = String::from(
            "You may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        for tool in tools {
            text.push('\n');
            text.push_str(&tool_json(tool).to_string());
        }
        text.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        text
    }

    /// Splits `text` into content and calls. Text that holds no well-formed call is all content.
    pub fn parse(self, text: &str) -> ParsedOutput {
        let calls = match self {
            ToolFormat::Hermes => parse_hermes(text),
            ToolFormat::Llama3 => parse_llama3(text),
            ToolFormat::Mistral => parse_mistral(text),
        };
        match calls {
            Some((content, calls)) if !calls.is_empty() => ParsedOutput {
                content: content.trim().to_string(),
                calls,
            },
            _ => ParsedOutput {
                content: text.to_string(),
                calls: Vec::new(),
            },
        }
    }

    /// A grammar whose every output is one call (or with `parallel`, one or more) of one of
    /// `tools`, with arguments valid under its schema: what `tool_choice: required` and a named
    /// function enforce. Markers that are special tokens of `tokenizer` are written as those
    /// tokens.
    pub fn grammar(self, tools: &[Tool], parallel: bool, tokenizer: &Tokenizer) -> Constraint {
        let key = match self {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        };
        let one_of: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, key: t.parameters},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let call = json!({"oneOf": one_of, "x-guidance": compact()});
        let lark = match self {
            ToolFormat::Hermes => {
                let open = marker(tokenizer, HERMES_OPEN);
                let close = marker(tokenizer, HERMES_CLOSE);
                let more = if parallel { r#" ("\n" call)*"# } else { "" };
                format!("start: call{more}\ncall: {open} \"\\n\" body \"\\n\" {close}\nbody: %json {call}\n")
            }
            ToolFormat::Llama3 => {
                let more = if parallel { r#" ("; " call)*"# } else { "" };
                format!("start: call{more}\ncall: %json {call}\n")
            }
            ToolFormat::Mistral => {
                let open = marker(tokenizer, MISTRAL_OPEN);
                let mut list = json!({"type": "array", "items": call, "minItems": 1,
                    "x-guidance": compact()});
                if !parallel {
                    list["maxItems"] = json!(1);
                }
                format!("start: {open} \" \"? calls\ncalls: %json {list}\n")
            }
        };
        Constraint::Lark(lark)
    }
}

/// A tool in OpenAI's shape, as templates and the preamble show it.
pub fn tool_json(tool: &Tool) -> Value {
    let mut function = json!({"name": tool.name, "parameters": tool.parameters});
    if let Some(d) = &tool.description {
        function["description"] = json!(d);
    }
    json!({"type": "function", "function": function})
}

fn compact() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// A marker as a grammar writes it: the special token where the vocabulary has one (written
/// `<...>` in llguidance's Lark), else its text.
fn marker(tokenizer: &Tokenizer, text: &str) -> String {
    let special = tokenizer
        .inner()
        .get_added_tokens_decoder()
        .values()
        .any(|t| t.special && t.content == text);
    if special && text.starts_with('<') && text.ends_with('>') {
        text.to_string()
    } else if special {
        let id = tokenizer
            .token_to_id(text)
            .expect("an added token has an id");
        format!("<[{id}]>")
    } else {
        Value::String(text.to_string()).to_string()
    }
}

/// A call object `{"name": ..., key: {...}}`.
fn call_of(value: &Value) -> Option<ParsedCall> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = value
        .get("arguments")
        .or_else(|| value.get("parameters"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let arguments = match arguments {
        // Some models write the arguments as a string of JSON, as OpenAI returns them.
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ParsedCall { name, arguments })
}

fn parse_hermes(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    let first = text.find(HERMES_OPEN)?;
    let blocks: Vec<&str> = text[first..].split(HERMES_OPEN).skip(1).collect();
    let mut calls = Vec::new();
    for (i, block) in blocks.iter().enumerate() {
        let body = block.split(HERMES_CLOSE).next().unwrap_or(block).trim();
        match serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|v| call_of(&v))
        {
            Some(call) => calls.push(call),
            // A last call cut off by max_tokens is dropped; the finish reason says so.
            None if i + 1 == blocks.len() && !calls.is_empty() => {}
            None => return None,
        }
    }
    Some((text[..first].to_string(), calls))
}

fn parse_llama3(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    let body = text.trim_start();
    let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim();
    if !body.starts_with('{') {
        return None;
    }
    // One JSON object per call, separated by `;`.
    let mut calls = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = stream.next()?.ok()?;
        calls.push(call_of(&value)?);
        rest = rest[stream.byte_offset()..].trim_start_matches([';', ' ', '\n']);
    }
    Some((String::new(), calls))
}

fn parse_mistral(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    let at = text.find(MISTRAL_OPEN)?;
    let list: Value = serde_json::from_str(text[at + MISTRAL_OPEN.len()..].trim()).ok()?;
    let calls = list
        .as_array()?
        .iter()
        .map(call_of)
        .collect::<Option<Vec<_>>>()?;
    Some((text[..at].to_string(), calls))
}

#[cfg(test)]
mod tests;
