//! Structured outputs as the HTTP API takes them: OpenAI's `response_format` (`text`,
//! `json_object`, `json_schema`), and the extensions vLLM's clients send: `structured_outputs`
//! (`json`, `regex`, `choice`, `grammar`, `json_object`) and the older `guided_json`,
//! `guided_regex`, `guided_choice` and `guided_grammar`. Each becomes one `sampling.constraint`
//! of the request; grammars are Lark (llguidance's dialect). At most one may be given.
//!
//! Only the shape is checked here. The constraint itself is compiled once, by the router's
//! validation, before anything is scheduled; its refusal comes back naming the parameter it
//! came from ([`Structured::param`]).

use nibble_proto::v1;
use serde::Deserialize;

use super::error::ApiError;

/// `response_format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    /// Absent: any JSON object.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    /// Accepted either way: the schema is always enforced (see docs/HTTP.md).
    #[serde(default)]
    pub strict: Option<bool>,
}

/// vLLM's `structured_outputs`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    pub json: Option<serde_json::Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

/// The structured-output parameters of both generating endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Structured {
    pub response_format: Option<ResponseFormat>,
    pub structured_outputs: Option<StructuredOutputs>,
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

/// Most alternatives `choice` may list.
pub const MAX_CHOICES: usize = 256;

/// The constraint a parameter asks for.
fn from_kind(kind: v1::constraint::Kind) -> Option<v1::Constraint> {
    Some(v1::Constraint { kind: Some(kind) })
}

/// A JSON Schema given as a JSON value (or, as vLLM also takes it, as a string of JSON).
fn schema_kind(param: &str, schema: &serde_json::Value) -> Result<v1::constraint::Kind, ApiError> {
    use v1::constraint::Kind;
    match schema {
        serde_json::Value::String(text) => Ok(Kind::JsonSchema(text.clone())),
        serde_json::Value::Object(_) | serde_json::Value::Bool(_) => {
            Ok(Kind::JsonSchema(schema.to_string()))
        }
        other => Err(ApiError::invalid(
            param,
            format!("must be a JSON Schema object, got {other}"),
        )),
    }
}

/// A Lark grammar accepting exactly one of `choices`.
fn choice_kind(param: &str, choices: &[String]) -> Result<v1::constraint::Kind, ApiError> {
    if choices.is_empty() || choices.len() > MAX_CHOICES {
        return Err(ApiError::invalid(
            param,
            format!(
                "must list 1 to {MAX_CHOICES} strings, got {}",
                choices.len()
            ),
        ));
    }
    if choices.iter().any(String::is_empty) {
        return Err(ApiError::invalid(param, "must not contain an empty string"));
    }
    // Lark string literals take JSON's escapes.
    let alternatives: Vec<String> = choices
        .iter()
        .map(|c| serde_json::Value::String(c.clone()).to_string())
        .collect();
    Ok(v1::constraint::Kind::Lark(format!(
        "start: {}",
        alternatives.join(" | ")
    )))
}

impl Structured {
    /// The one constraint the request asks for and the parameter that asked, if any.
    pub fn constraint(&self) -> Result<Option<(v1::Constraint, &'static str)>, ApiError> {
        use v1::constraint::Kind;
        let mut found: Vec<(Option<v1::Constraint>, &'static str)> = Vec::new();
        if let Some(format) = &self.response_format {
            let c = match format {
                ResponseFormat::Text => None,
                ResponseFormat::JsonObject => from_kind(Kind::JsonObject(true)),
                ResponseFormat::JsonSchema { json_schema } => {
                    check_schema_name(&json_schema.name)?;
                    match &json_schema.schema {
                        None => from_kind(Kind::JsonObject(true)),
                        Some(schema) => {
                            from_kind(schema_kind("response_format.json_schema.schema", schema)?)
                        }
                    }
                }
            };
            found.push((c, "response_format"));
        }
        if let Some(s) = &self.structured_outputs {
            let param = "structured_outputs";
            let mut kinds = Vec::new();
            if let Some(schema) = &s.json {
                kinds.push(schema_kind("structured_outputs.json", schema)?);
            }
            if let Some(rx) = &s.regex {
                kinds.push(Kind::Regex(rx.clone()));
            }
            if let Some(choices) = &s.choice {
                kinds.push(choice_kind("structured_outputs.choice", choices)?);
            }
            if let Some(lark) = &s.grammar {
                kinds.push(Kind::Lark(lark.clone()));
            }
            if s.json_object == Some(true) {
                kinds.push(Kind::JsonObject(true));
            }
            if kinds.len() > 1 {
                return Err(ApiError::invalid(
                    param,
                    "takes one of json, regex, choice, grammar and json_object",
                ));
            }
            found.push((kinds.pop().and_then(from_kind), param));
        }
        if let Some(schema) = &self.guided_json {
            let kind = schema_kind("guided_json", schema)?;
            found.push((from_kind(kind), "guided_json"));
        }
        if let Some(rx) = &self.guided_regex {
            found.push((from_kind(Kind::Regex(rx.clone())), "guided_regex"));
        }
        if let Some(choices) = &self.guided_choice {
            let kind = choice_kind("guided_choice", choices)?;
            found.push((from_kind(kind), "guided_choice"));
        }
        if let Some(lark) = &self.guided_grammar {
            found.push((from_kind(Kind::Lark(lark.clone())), "guided_grammar"));
        }
        let mut asked = found.into_iter().filter_map(|(c, p)| c.map(|c| (c, p)));
        let first = asked.next();
        if let Some((_, second)) = asked.next() {
            return Err(ApiError::invalid(
                second,
                format!(
                    "cannot be combined with {}: give one structured-output constraint",
                    first.as_ref().map_or("", |(_, p)| p)
                ),
            ));
        }
        Ok(first)
    }

    /// The parameter a constraint refusal names.
    /// Read off which fields are set, without building the constraint again.
    pub fn param(&self) -> &'static str {
        let so = self.structured_outputs.as_ref();
        let asked = [
            (
                matches!(
                    self.response_format,
                    Some(ResponseFormat::JsonObject | ResponseFormat::JsonSchema { .. })
                ),
                "response_format",
            ),
            (
                so.is_some_and(|s| {
                    s.json.is_some()
                        || s.regex.is_some()
                        || s.choice.is_some()
                        || s.grammar.is_some()
                        || s.json_object == Some(true)
                }),
                "structured_outputs",
            ),
            (self.guided_json.is_some(), "guided_json"),
            (self.guided_regex.is_some(), "guided_regex"),
            (self.guided_choice.is_some(), "guided_choice"),
            (self.guided_grammar.is_some(), "guided_grammar"),
        ];
        asked
            .into_iter()
            .find_map(|(set, p)| set.then_some(p))
            .unwrap_or("response_format")
    }
}

/// OpenAI's rule for `json_schema.name`: 1 to 64 letters, digits, `_` or `-`.
fn check_schema_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "response_format.json_schema.name",
            format!("must be 1 to 64 letters, digits, '_' or '-', got {name:?}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::params::parse_body;
    use v1::constraint::Kind;

    fn constraint(json: &str) -> Result<Option<(Kind, &'static str)>, ApiError> {
        let s: Structured = parse_body(json.as_bytes())?;
        Ok(s.constraint()?.map(|(c, p)| (c.kind.unwrap(), p)))
    }

    #[test]
    fn each_parameter_becomes_its_constraint() {
        assert!(constraint(r#"{"response_format": {"type": "text"}}"#)
            .unwrap()
            .is_none());
        let (k, p) = constraint(r#"{"response_format": {"type": "json_object"}}"#)
            .unwrap()
            .unwrap();
        assert_eq!((k, p), (Kind::JsonObject(true), "response_format"));
        let (k, _) = constraint(
            r#"{"response_format": {"type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "integer"}, "strict": true}}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(k, Kind::JsonSchema(r#"{"type":"integer"}"#.into()));
        let (k, p) = constraint(r#"{"guided_regex": "[0-9]+"}"#)
            .unwrap()
            .unwrap();
        assert_eq!((k, p), (Kind::Regex("[0-9]+".into()), "guided_regex"));
        let (k, p) = constraint(r#"{"structured_outputs": {"choice": ["yes", "n\"o"]}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            (k, p),
            (
                Kind::Lark(r#"start: "yes" | "n\"o""#.into()),
                "structured_outputs"
            )
        );
        let (k, _) = constraint(r#"{"guided_json": "{\"type\": \"string\"}"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(k, Kind::JsonSchema(r#"{"type": "string"}"#.into()));
        let (k, _) = constraint(r#"{"guided_grammar": "start: \"a\""}"#)
            .unwrap()
            .unwrap();
        assert_eq!(k, Kind::Lark(r#"start: "a""#.into()));
    }

    #[test]
    fn bad_shapes_are_refused_by_name() {
        let refused = |json: &str| constraint(json).unwrap_err().param.unwrap();
        assert_eq!(
            refused(r#"{"response_format": {"type": "xml"}}"#),
            "response_format"
        );
        assert_eq!(
            refused(
                r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}"#
            ),
            "response_format.json_schema.name"
        );
        assert_eq!(
            refused(
                r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}}"#
            ),
            "response_format.json_schema.schema"
        );
        assert_eq!(refused(r#"{"guided_choice": []}"#), "guided_choice");
        assert_eq!(
            refused(r#"{"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}"#),
            "structured_outputs"
        );
        assert_eq!(
            refused(r#"{"response_format": {"type": "json_object"}, "guided_regex": "a"}"#),
            "guided_regex"
        );
        assert_eq!(
            refused(r#"{"structured_outputs": {"xml": "a"}}"#),
            "structured_outputs"
        );
    }
}
