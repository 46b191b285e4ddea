//! Chat templates: the model's Jinja template rendered with minijinja, the way Hugging Face
//! `apply_chat_template` does (variables `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`; `raise_exception` available to templates).

use crate::error::{Error, Result};
use serde::Serialize;

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text of the turn.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

impl ChatMessage {
    /// The message as a template value: a map with `role` and `content`.
    fn to_value(&self) -> minijinja::Value {
        let map: std::collections::BTreeMap<&str, minijinja::Value> = [
            ("role", minijinja::Value::from(self.role.as_str())),
            ("content", minijinja::Value::from(self.content.as_str())),
        ]
        .into_iter()
        .collect();
        minijinja::Value::from(map)
    }
}

/// Renders `template` for `messages`.
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
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
    tmpl.render(minijinja::context! {
        messages => messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>(),
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
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
}
