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

    /// 500: a fault of the server, not of the request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The HTTP error of a gRPC status from the generate path. `param` names the request's
    /// prompt parameter (`prompt` or `messages`), which the router's `prompt` field maps to.
    pub fn from_status(status: &tonic::Status, prompt_param: &str) -> Self {
        use tonic::Code;
        let message = status.message().to_string();
        match status.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                // The router's messages start with the field at fault: `field: reason`.
                let param = message
                    .split_once(':')
                    .map(|(field, _)| openai_param(field, prompt_param));
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

/// The OpenAI parameter behind a field of the router's `GenerateRequest`.
fn openai_param(field: &str, prompt_param: &str) -> String {
    let field = field.trim();
    let last = field.rsplit('.').next().unwrap_or(field);
    match field.split('.').next() {
        Some("prompt") => prompt_param.to_string(),
        Some("sampling" | "stopping") => last.to_string(),
        _ => field.to_string(),
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
                ApiError::from_status(&status, "prompt").status.as_u16(),
                http,
                "{status:?}"
            );
        }
    }

    #[test]
    fn router_fields_map_to_openai_params() {
        let e = ApiError::from_status(&Status::invalid_argument("prompt: too long"), "messages");
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = ApiError::from_status(&Status::invalid_argument("prompt.chat: bad"), "messages");
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = ApiError::from_status(&Status::invalid_argument("sampling.top_p: 2"), "prompt");
        assert_eq!(e.param.as_deref(), Some("top_p"));
        let e = ApiError::from_status(&Status::invalid_argument("no field here"), "prompt");
        assert_eq!(e.param, None);
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
