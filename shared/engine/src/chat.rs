//! Chat templates: the model's Jinja template rendered with minijinja, the way Hugging Face
//! `apply_chat_template` does (variables `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`; `raise_exception` available to templates). As in `transformers`' Jinja
//! environment, `trim_blocks` and `lstrip_blocks` are on, `{% break %}` / `{% continue %}` and
//! the `tojson` filter are available, and Python's string, dict and list methods
//! (`content.strip()`, `.startswith(...)`, `.items()`, ...) work through minijinja-contrib's
//! `pycompat`.

use crate::error::{Error, Result};
use serde::Serialize;

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Default)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text of the turn.
    pub content: String,
    /// The functions an assistant turn called.
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` turn answers.
    pub tool_call_id: Option<String>,
    /// The name of the function a `tool` turn answers for (or of the speaker).
    pub name: Option<String>,
}

/// One function call of an assistant turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

impl ChatMessage {
    /// The message as a template value: a map with `role` and `content`, and as
    /// `transformers` passes them, `tool_calls` (each `{id, type, function: {name, arguments}}`
    /// with the arguments parsed, as templates `tojson` them), `tool_call_id` and `name`.
    fn to_value(&self) -> minijinja::Value {
        use minijinja::Value;
        let mut map: std::collections::BTreeMap<&str, Value> = [
            ("role", Value::from(self.role.as_str())),
            ("content", Value::from(self.content.as_str())),
        ]
        .into_iter()
        .collect();
        if !self.tool_calls.is_empty() {
            let calls: Vec<serde_json::Value> = self
                .tool_calls
                .iter()
                .map(|c| {
                    let arguments = serde_json::from_str(&c.arguments)
                        .unwrap_or_else(|_| serde_json::Value::String(c.arguments.clone()));
                    serde_json::json!({
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": arguments},
                    })
                })
                .collect();
            map.insert("tool_calls", Value::from(minijinja::value::Serde(&calls)));
        }
        if let Some(id) = &self.tool_call_id {
            map.insert("tool_call_id", Value::from(id.as_str()));
        }
        if let Some(name) = &self.name {
            map.insert("name", Value::from(name.as_str()));
        }
        Value::from(map)
    }
}

/// What a conversation is rendered with besides its messages.
#[derive(Clone, Copy, Debug, Default)]
pub struct RenderOptions<'a> {
    /// End with the opening of the assistant's turn.
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
    /// The functions the model may call, in OpenAI's shape (`[{type, function: {name,
    /// description, parameters}}]`), passed to the template as `tools`.
    pub tools: Option<&'a serde_json::Value>,
}

/// Renders `template` for `messages`.
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    render_with(
        template,
        messages,
        RenderOptions {
            add_generation_prompt,
            bos_token,
            eos_token,
            tools: None,
        },
    )
}

/// Renders `template` for `messages` with `options`.
pub fn render_with(
    template: &str,
    messages: &[ChatMessage],
    options: RenderOptions<'_>,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid"),
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| Error::ChatTemplate(format!("parsing: {e}")))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| Error::ChatTemplate(e.to_string()))?;
    let tools = options
        .tools
        .map(|t| minijinja::Value::from(minijinja::value::Serde(t)));
    tmpl.render(minijinja::context! {
        messages => messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>(),
        add_generation_prompt => options.add_generation_prompt,
        bos_token => options.bos_token,
        eos_token => options.eos_token,
        tools => tools,
    })
    .map_err(|e| Error::ChatTemplate(format!("rendering: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_chatml() {
        let msgs = [ChatMessage::new("user", "Hi")];
        let out = render(CHATML, &msgs, true, "", "").unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// Python string methods, and block whitespace handled as `transformers` does. The expected
    /// text is what jinja2 3.1.6 renders in `transformers`' environment
    /// (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`).
    #[test]
    fn renders_python_methods_and_trims_blocks_like_transformers() {
        let template = "{%- for message in messages %}\n    {%- if message['role'] == 'system' %}\n<|system|>\n{{ message['content'].strip() }}\n    {%- elif message.content.startswith('/') %}\n<|command|>{{ message['content'][1:].upper() }}\n    {%- else %}\n<|{{ message.role }}|>\n{{ message['content'].strip() | replace('there', 'you') }}\n    {%- endif %}\n{% endfor %}\n{%- if add_generation_prompt %}\n<|assistant|>\n{% endif %}\n";
        let msgs = [
            ChatMessage::new("system", "  Be brief.  "),
            ChatMessage::new("user", " Hi there\n"),
            ChatMessage::new("user", "/help"),
        ];
        let out = render(template, &msgs, true, "", "").unwrap();
        assert_eq!(
            out,
            "<|system|>\nBe brief.<|user|>\nHi you<|command|>HELP<|assistant|>\n"
        );
        // Without a newline-eating `-`, trim_blocks drops the newline after a block tag and
        // lstrip_blocks the indentation before it.
        let out = render(
            "{% for m in messages %}\n  {% if true %}\n[{{ m.content.lstrip() }}]\n  {% endif %}\n{% endfor %}",
            &msgs[1..2],
            false,
            "",
            "",
        )
        .unwrap();
        assert_eq!(out, "[Hi there\n]\n");
        // Loop controls and tojson.
        let out = render(
            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}",
            &msgs,
            false,
            "",
            "",
        )
        .unwrap();
        // Python's `json.dumps` separators, as transformers' `tojson` (keys sorted here).
        assert_eq!(out, r#"{"content": "  Be brief.  ", "role": "system"}"#);
    }

    #[test]
    fn template_errors_are_reported() {
        let e = render(
            "{{ raise_exception('no system role') }}",
            &[],
            false,
            "",
            "",
        )
        .unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
        let e = render("{% for %}", &[], false, "", "").unwrap_err();
        assert!(e.to_string().contains("parsing"), "{e}");
    }

    /// Tools and a call round trip reach the template as `transformers` passes them (what
    /// Qwen2.5's template reads: `tools`, `message.tool_calls[].function`, tool turns).
    #[test]
    fn tools_and_calls_reach_the_template() {
        let template = concat!(
            "{% if tools %}[tools]{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};{% endfor %}\n{% endif %}",
            "{% for m in messages %}{{ m.role }}:",
            "{% if m.tool_calls %}{% for c in m.tool_calls %}<call id={{ c.id }}>{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}",
            "{% elif m.role == 'tool' %}<result for={{ m.tool_call_id }}>{{ m.content }}",
            "{% else %}{{ m.content }}{% endif %}\n{% endfor %}",
        );
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object"}}}]);
        let messages = [
            ChatMessage::new("user", "Hi"),
            ChatMessage {
                tool_calls: vec![ToolCall {
                    id: "call_1".into(),
                    name: "f".into(),
                    arguments: r#"{"x": 1}"#.into(),
                }],
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                ..ChatMessage::new("tool", "42")
            },
        ];
        let options = RenderOptions {
            tools: Some(&tools),
            ..RenderOptions::default()
        };
        let out = render_with(template, &messages, options).unwrap();
        assert_eq!(
            out,
            // trim_blocks drops each newline that follows a block tag.
            "[tools]f:{\"type\": \"object\"};user:Hiassistant:<call id=call_1>f{\"x\": 1}tool:<result for=call_1>42"
        );
    }
}
