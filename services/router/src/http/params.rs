//! The request parameters both generating endpoints share, parsed into the router's
//! `GenerateRequest` pieces. This module checks what only the HTTP API has (its types, `n`
//! against the configured limit, `logit_bias`'s keys, `stream_options`); the ranges are checked
//! once, for both
//! APIs, by the router's validation (`service::validate`), whose refusals name the field and
//! come back here as the OpenAI parameter ([`ApiError::from_status`]).

use nibble_proto::v1;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::error::ApiError;
use super::structured::Structured;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopStrings {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM's extension: every chunk carries the usage so far.
    pub continuous_usage_stats: Option<bool>,
}

/// Parameters of both `/v1/completions` and `/v1/chat/completions`. Every field is optional
/// here so that a wrong one is found by name ([`parse_body`]); what is required is checked
/// after parsing. Fields this server does not know are ignored, as OpenAI's servers do.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<StopStrings>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<serde_json::Number>,
    pub n: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    pub user: Option<String>,
    // Extensions vLLM and SGLang clients send; the engine has them.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub skip_special_tokens: Option<bool>,
    /// `response_format` and the structured-output extensions.
    #[serde(flatten)]
    pub structured: Structured,
}

/// How the response is delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// Server-sent events instead of one JSON body.
    pub stream: bool,
    /// A last streamed chunk with the usage (and `usage: null` on the others).
    pub include_usage: bool,
    /// Every streamed chunk carries the usage so far (`stream_options.continuous_usage_stats`).
    pub continuous_usage: bool,
}

/// Parses a JSON body into `T`. A body that does not parse is a 400 naming the first
/// top-level key whose value does not fit (every field of `T` must be optional for that).
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(ApiError::bad_body)?;
    let serde_json::Value::Object(map) = &value else {
        return Err(ApiError::bad_body("expected a JSON object"));
    };
    serde_json::from_value(value.clone()).map_err(|err| {
        for (key, field) in map {
            let alone =
                serde_json::Value::Object([(key.clone(), field.clone())].into_iter().collect());
            if let Err(e) = serde_json::from_value::<T>(alone) {
                return ApiError::invalid(key.as_str(), described(&e));
            }
        }
        ApiError::bad_body(err)
    })
}

/// serde's account of a field, without the Rust type names it speaks in: a value that fits
/// none of a field's forms (an untagged enum) says so in the API's terms.
fn described(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.contains("did not match any variant of untagged enum") {
        true => "is not one of the forms this field takes (docs/HTTP.md lists them)".into(),
        false => text,
    }
}

/// The model a request names: absent, empty or `served` is fine; another is a 404.
pub fn check_model(model: Option<&str>, served: &str) -> Result<(), ApiError> {
    match model {
        None | Some("") => Ok(()),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(ApiError::unknown_model(m, served)),
    }
}

impl Common {
    /// Checks the model: absent, empty or `served` is fine; another is a 404.
    pub fn check_model(&self, served: &str) -> Result<(), ApiError> {
        check_model(self.model.as_deref(), served)
    }

    /// The delivery the request asks for.
    pub fn delivery(&self) -> Result<Delivery, ApiError> {
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "is only allowed when stream is true",
            ));
        }
        let options = self.stream_options.clone().unwrap_or_default();
        Ok(Delivery {
            stream,
            include_usage: options.include_usage.unwrap_or(false),
            continuous_usage: options.continuous_usage_stats.unwrap_or(false),
        })
    }

    /// `n`: choices per prompt, 1 to `max_n` (the router's `--max-n`). Default 1.
    pub fn n(&self, max_n: u32) -> Result<u32, ApiError> {
        match self.n.unwrap_or(1) {
            n if (1..=max_n).contains(&n) => Ok(n),
            n => Err(ApiError::invalid(
                "n",
                format!("must be between 1 and {max_n}, got {n}"),
            )),
        }
    }

    /// `logit_bias`: token ids (as JSON object keys) to numbers. The ranges, the number of
    /// entries and the vocabulary are the engine's checks.
    fn logit_bias(&self) -> Result<std::collections::HashMap<u32, f32>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Default::default());
        };
        map.iter()
            .map(|(key, value)| {
                let token = key.trim().parse::<u32>().map_err(|_| {
                    ApiError::invalid("logit_bias", format!("keys must be token ids, got {key:?}"))
                })?;
                let bias = value.as_f64().ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!("values must be numbers, got {value} for {key:?}"),
                    )
                })?;
                Ok((token, bias as f32))
            })
            .collect()
    }

    /// The sampling parameters; refuses what the engine cannot do instead of ignoring it.
    pub fn sampling(&self) -> Result<v1::SamplingParams, ApiError> {
        let logit_bias = self.logit_bias()?;
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => None,
            Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("must be positive, or -1 or 0 for all tokens, got {k}"),
                ))
            }
        };
        // Any integer seeds; a negative one is used by its bits.
        let seed = match &self.seed {
            None => None,
            Some(n) => Some(
                n.as_u64()
                    .or_else(|| n.as_i64().map(|i| i as u64))
                    .ok_or_else(|| {
                        ApiError::invalid("seed", format!("must be an integer, got {n}"))
                    })?,
            ),
        };
        Ok(v1::SamplingParams {
            temperature: self.temperature,
            top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed,
            constraint: self.structured.constraint()?.map(|(c, _)| c),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias,
        })
    }

    /// The stopping criteria with `max_tokens`.
    pub fn stopping(&self, max_tokens: Option<u32>) -> v1::StoppingCriteria {
        let stop = match self.stop.clone() {
            None => Vec::new(),
            Some(StopStrings::One(s)) => vec![s],
            Some(StopStrings::Many(list)) => list,
        };
        v1::StoppingCriteria {
            max_tokens,
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(json: &str) -> Result<Common, ApiError> {
        parse_body(json.as_bytes())
    }

    #[test]
    fn a_wrong_field_is_named() {
        let e = common(r#"{"temperature": "hot", "top_p": 0.5}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e:?}");
        let e = common(r#"{"stop": 3}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        let e = common("[1]").unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let e = common("{").unwrap_err();
        assert!(e.message.starts_with("invalid request body"), "{e:?}");
    }

    #[test]
    fn ranges_are_checked_by_name() {
        let cases = [
            (r#"{"top_k": -3}"#, "top_k"),
            (r#"{"logit_bias": {"one": 5}}"#, "logit_bias"),
            (r#"{"logit_bias": {"1": "x"}}"#, "logit_bias"),
            (r#"{"logit_bias": {"-1": 5}}"#, "logit_bias"),
            (r#"{"seed": 1.5}"#, "seed"),
        ];
        for (json, param) in cases {
            let e = common(json).and_then(|c| c.sampling()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{json}: {e:?}");
            assert!(e.message.starts_with(param), "{e:?}");
        }
        for n in [0, 17] {
            let e = common(&format!(r#"{{"n": {n}}}"#))
                .unwrap()
                .n(16)
                .unwrap_err();
            assert_eq!(e.param.as_deref(), Some("n"), "{e:?}");
        }
        assert_eq!(common(r#"{"n": 16}"#).unwrap().n(16).unwrap(), 16);
        assert_eq!(common("{}").unwrap().n(16).unwrap(), 1);
        let e = common(r#"{"stream_options": {"include_usage": true}}"#)
            .unwrap()
            .delivery()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options"));
    }

    #[test]
    fn valid_parameters_reach_the_request() {
        let c = common(
            r#"{"temperature": 0, "top_p": 0.9, "seed": -1, "top_k": -1, "stop": "\n",
                "n": 1, "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .unwrap();
        let s = c.sampling().unwrap();
        assert_eq!(s.temperature, Some(0.0));
        assert_eq!(s.top_p, Some(0.9));
        assert_eq!(s.seed, Some(u64::MAX));
        assert_eq!(s.top_k, None);
        let penalized = common(
            r#"{"presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"42": -100, " 7": 3.5}}"#,
        )
        .unwrap();
        let s = penalized.sampling().unwrap();
        assert_eq!(s.presence_penalty, Some(0.5));
        assert_eq!(s.frequency_penalty, Some(-1.0));
        assert_eq!(s.logit_bias.get(&42), Some(&-100.0));
        assert_eq!(s.logit_bias.get(&7), Some(&3.5));
        let stop = c.stopping(Some(5));
        assert_eq!(stop.stop, vec!["\n".to_string()]);
        assert_eq!(stop.max_tokens, Some(5));
        assert_eq!(
            c.delivery().unwrap(),
            Delivery {
                stream: true,
                include_usage: true,
                continuous_usage: false,
            }
        );
        assert!(c.check_model("m").is_ok());
        let c = common(r#"{"model": "other"}"#).unwrap();
        assert_eq!(c.check_model("m").unwrap_err().status.as_u16(), 404);
    }
}
