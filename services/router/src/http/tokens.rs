//! `POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt's token ids under
//! the served model's tokenizer, and the text of token ids. Tokenizing goes through the gRPC
//! `Tokenize` call (the same model check and prompt byte limit); both run the tokenizer off the
//! async threads.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use nibble_proto::v1;
use nibble_proto::v1::inference_server::Inference;
use serde::Deserialize;

use super::error::{ApiError, ParamNames};
use super::params::{check_model, parse_body};
use super::{read_body, HttpState};

/// The parameters refusals name.
const NAMES: ParamNames = ParamNames {
    prompt: "prompt",
    max_tokens: "max_tokens",
    constraint: "response_format",
};

#[derive(Debug, Default, Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    add_special_tokens: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

/// `POST /tokenize`: `{"count", "max_model_len", "tokens", "token_strs"}`.
pub async fn tokenize(
    State(state): State<HttpState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body: TokenizeRequest = parse_body(&read_body(&state, body)?)?;
        check_model(body.model.as_deref(), state.model())?;
        let text = body
            .prompt
            .ok_or_else(|| ApiError::invalid("prompt", "is required (a string)"))?;
        let request = v1::TokenizeRequest {
            model: String::new(),
            text,
            add_special_tokens: body.add_special_tokens,
        };
        let answer = state
            .service
            .tokenize(tonic::Request::new(request))
            .await
            .map_err(|s| ApiError::from_status(&s, NAMES))?
            .into_inner();
        Ok::<_, ApiError>(Json(serde_json::json!({
            "count": answer.token_ids.len(),
            "max_model_len": state.shared().config().max_context,
            "tokens": answer.token_ids,
            "token_strs": answer.tokens,
        })))
    };
    result
        .await
        .map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `POST /detokenize`: `{"prompt"}`, the text of `tokens` (special tokens kept).
pub async fn detokenize(
    State(state): State<HttpState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body: DetokenizeRequest = parse_body(&read_body(&state, body)?)?;
        check_model(body.model.as_deref(), state.model())?;
        let tokens = body
            .tokens
            .ok_or_else(|| ApiError::invalid("tokens", "is required (a list of token ids)"))?;
        let tokenizer = state.tokenizer();
        let vocab = tokenizer.vocab_size();
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "tokens",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let text = tokio::task::spawn_blocking(move || tokenizer.decode(&tokens, false))
            .await
            .map_err(|e| ApiError::internal(format!("detokenize task: {e}")))?
            .map_err(|e| ApiError::internal(format!("tokenizer: {e}")))?;
        Ok(Json(serde_json::json!({ "prompt": text })))
    };
    result
        .await
        .map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}
