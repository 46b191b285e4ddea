//! Errors of the HTTP API in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
//! with their status. Every failure of a request becomes an [`ApiError`] here, in one place:
//! parameter checks name the OpenAI parameter, and the gRPC statuses of the generate path map
//! to HTTP statuses in [`ApiError::from_status`].

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A failed request: its HTTP status and the body OpenAI clients parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's error `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The request parameter at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code, e.g. `model_not_found`.
    pub code: Option<&'static str>,
}

/// The JSON body of an error response.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

/// The `error` object.
#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400: `param` is invalid; the message says why (and starts with the parameter's name).
    pub fn invalid(param: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        let param = param.into();
        Self {
            message: format!("{param}: {reason}"),
            param: Some(param),
            code: Some("invalid_value"),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "")
        }
    }

    /// 400: the body is not the JSON the endpoint takes.
    pub fn bad_body(reason: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("invalid request body: {reason}"),
        )
    }

    /// 401: no or a wrong API key.
    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "a valid API key is required: send `Authorization: Bearer <key>`",
            )
        }
    }

    /// 404: a model this router does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!("the model {asked:?} does not exist (this router serves {served:?})"),
            )
        }
    }

    /// 404: no such route.
    pub fn no_route(method: &str, path: &str) -> Self {
        Self {
            code: Some("unknown_url"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!("no route {method} {path}"),
            )
        }
    }

    /// 405: the route exists, the method does not.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{path} does not take {method}"),
        )
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is larger than {limit} bytes"),
            )
        }
    }

    /// 408: the request's body did not arrive whole within `timeout` of its headers.
    pub fn body_timeout(timeout: std::time::Duration) -> Self {
        Self {
            code: Some("request_timeout"),
            ..Self::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s of its headers; the connection \
                     is closed",
                    timeout.as_secs_f64()
                ),
            )
        }
    }

    /// 500: a fault of the server, not of the request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The HTTP error of a gRPC status from the generate path. A refusal that names its field
    /// (`nibble-field` metadata) names the OpenAI parameter behind it (`names`), and its
    /// message starts with that parameter instead of the field path.
    pub fn from_status(status: &tonic::Status, names: ParamNames) -> Self {
        use tonic::Code;
        let message = status.message().to_string();
        match status.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                let field = nibble_proto::request::refused_field(status);
                let param = field.map(|f| names.openai(f));
                let message = match (field, &param) {
                    (Some(field), Some(param)) => match message.strip_prefix(field) {
                        Some(reason) => format!("{param}{reason}"),
                        None => message,
                    },
                    _ => message,
                };
                Self {
                    param,
                    code: Some("invalid_value"),
                    ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
                }
            }
            Code::NotFound => Self::new(StatusCode::NOT_FOUND, "not_found_error", message),
            Code::ResourceExhausted => Self {
                code: Some("rate_limit_exceeded"),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            },
            Code::Unavailable => Self {
                code: Some("service_unavailable"),
                ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            },
            Code::DeadlineExceeded => Self {
                code: Some("timeout"),
                ..Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message)
            },
            Code::Unauthenticated => Self::unauthorized(),
            _ => Self::internal(message),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }
}

/// The OpenAI parameters of an endpoint that the router's fields map to by more than their
/// last name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamNames {
    /// The prompt: `prompt` or `messages`.
    pub prompt: &'static str,
    /// The token limit: `max_tokens` or `max_completion_tokens`.
    pub max_tokens: &'static str,
    /// The structured-output parameter the constraint came from (`response_format`, ...).
    pub constraint: &'static str,
}

impl ParamNames {
    /// The OpenAI parameter behind the field at `path` of the router's `GenerateRequest`.
    fn openai(self, path: &str) -> String {
        let last = path.rsplit('.').next().unwrap_or(path);
        match path {
            "stopping.max_tokens" => self.max_tokens.to_string(),
            "logprobs.top_logprobs" => "top_logprobs".to_string(),
            "sampling.constraint" => self.constraint.to_string(),
            "prompt.chat.tools" => "tools".to_string(),
            // Completions ask for prompt log-probabilities with `echo` and `logprobs`.
            "logprobs.prompt_logprobs" => "logprobs".to_string(),
            _ if path.split('.').next() == Some("prompt") => self.prompt.to_string(),
            _ if path.starts_with("sampling.") || path.starts_with("stopping.") => last.to_string(),
            _ => path.to_string(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        let headers = response.headers_mut();
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Status;

    const COMPLETIONS: ParamNames = ParamNames {
        prompt: "prompt",
        max_tokens: "max_tokens",
        constraint: "response_format",
    };
    const CHAT: ParamNames = ParamNames {
        prompt: "messages",
        max_tokens: "max_completion_tokens",
        constraint: "response_format",
    };

    #[test]
    fn statuses_map_to_http() {
        let cases = [
            (Status::invalid_argument("prompt: too long"), 400),
            (Status::resource_exhausted("queue full"), 429),
            (Status::unavailable("no decode worker"), 503),
            (Status::deadline_exceeded("late"), 504),
            (Status::not_found("gone"), 404),
            (Status::internal("bug"), 500),
            (Status::unknown("?"), 500),
        ];
        for (status, http) in cases {
            assert_eq!(
                ApiError::from_status(&status, COMPLETIONS).status.as_u16(),
                http,
                "{status:?}"
            );
        }
    }

    #[test]
    fn router_fields_map_to_openai_params() {
        use nibble_proto::request::invalid_field;
        let e = ApiError::from_status(&invalid_field("prompt", "is too long"), CHAT);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(e.message, "messages: is too long");
        let e = ApiError::from_status(&invalid_field("prompt.chat", "bad"), CHAT);
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = ApiError::from_status(&invalid_field("sampling.top_p", "2"), COMPLETIONS);
        assert_eq!(e.param.as_deref(), Some("top_p"));
        assert_eq!(e.message, "top_p: 2");
        let e = ApiError::from_status(&invalid_field("stopping.max_tokens", "0"), CHAT);
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
        // A message is never read for a field.
        let e = ApiError::from_status(&Status::invalid_argument("top_p: 2"), COMPLETIONS);
        assert_eq!(e.param, None);
        assert_eq!(e.message, "top_p: 2");
    }

    #[test]
    fn body_has_openai_shape() {
        let e = ApiError::invalid("temperature", "must be between 0 and 2, got 3");
        let json = serde_json::to_value(e.body()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"error": {
                "message": "temperature: must be between 0 and 2, got 3",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": "invalid_value",
            }})
        );
    }
}
