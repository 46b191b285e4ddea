//! Bearer secrets: the internal token and the API key. A server checks `authorization: Bearer
//! <secret>` in constant time ([`RequireBearer`], a tonic interceptor, and [`bearer_matches`]
//! for HTTP); a client adds it to every call ([`SendBearer`]). A secret is never printed.

use std::sync::Arc;

use subtle::ConstantTimeEq;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// A bearer secret (never shown by `Debug`).
#[derive(Clone)]
pub struct Secret(Arc<str>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<hidden>)")
    }
}

impl Secret {
    /// `value` as a secret; `None` when empty (an empty variable means no secret).
    pub fn new(value: &str) -> Option<Self> {
        (!value.is_empty()).then(|| Self(value.into()))
    }

    /// The secret's text.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// Whether an `Authorization` header value is `Bearer <secret>` (the scheme in any case),
/// compared in constant time in the secret's bytes.
pub fn bearer_matches(header: Option<&str>, secret: &str) -> bool {
    let given = header
        .map(str::trim)
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map_or("", |(_, value)| value.trim());
    // A length mismatch fails at once: the length of a random secret is not worth hiding.
    bool::from(given.as_bytes().ct_eq(secret.as_bytes()))
}

/// A server interceptor: with a secret, every call must carry it, or fails UNAUTHENTICATED;
/// without one, every call passes.
#[derive(Debug, Clone)]
pub struct RequireBearer {
    secret: Option<Secret>,
    what: &'static str,
}

impl RequireBearer {
    /// Requires `secret` when given; `what` names it in the refusal ("internal token").
    pub fn new(secret: Option<Secret>, what: &'static str) -> Self {
        Self { secret, what }
    }

    /// Whether calls are checked.
    pub fn enabled(&self) -> bool {
        self.secret.is_some()
    }
}

impl Interceptor for RequireBearer {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(secret) = &self.secret else {
            return Ok(request);
        };
        let header = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        if bearer_matches(header, secret.expose()) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(format!(
                "missing or wrong {} (authorization: Bearer ...)",
                self.what
            )))
        }
    }
}

/// A client interceptor adding `authorization: Bearer <secret>` to every call (nothing without
/// a secret).
#[derive(Debug, Clone, Default)]
pub struct SendBearer(Option<AsciiMetadataValue>);

impl SendBearer {
    /// Sends `secret` when given. Fails when the secret cannot be a header value.
    pub fn new(secret: Option<&Secret>) -> Result<Self, crate::Error> {
        secret
            .map(|s| {
                MetadataValue::try_from(format!("Bearer {}", s.expose())).map_err(|_| {
                    crate::Error::Flags(
                        "the token must be visible ASCII (it travels in a header)".into(),
                    )
                })
            })
            .transpose()
            .map(Self)
    }
}

impl Interceptor for SendBearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_is_checked() {
        let secret = Secret::new("s3cret").unwrap();
        for (header, ok) in [
            (Some("Bearer s3cret"), true),
            (Some("bearer  s3cret "), true),
            (Some("Bearer s3cre"), false),
            (Some("Bearer s3crett"), false),
            (Some("Basic s3cret"), false),
            (Some("s3cret"), false),
            (None, false),
        ] {
            assert_eq!(bearer_matches(header, secret.expose()), ok, "{header:?}");
        }
        assert!(Secret::new("").is_none());
        assert_eq!(format!("{secret:?}"), "Secret(<hidden>)");
    }

    #[test]
    fn interceptors_pair() {
        let secret = Secret::new("t").unwrap();
        let mut send = SendBearer::new(Some(&secret)).unwrap();
        let mut require = RequireBearer::new(Some(secret), "internal token");
        let sent = send.call(Request::new(())).unwrap();
        assert!(require.call(sent).is_ok());
        let refused = require.call(Request::new(())).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        assert!(refused.message().contains("internal token"));
        assert!(RequireBearer::new(None, "x").call(Request::new(())).is_ok());
    }
}
