//! [`Peers`]: how a process dials gRPC services. A bare `host:port` becomes `https://host:port`
//! when TLS is on (a CA is given) and `http://host:port` otherwise; the host names the server
//! for certificate verification. Every call carries the internal token when one is set.

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use crate::token::{Secret, SendBearer};
use crate::{Error, Result};

/// A channel whose calls carry the bearer token (when one is set).
pub type AuthChannel = InterceptedService<Channel, SendBearer>;

/// How to dial peers.
#[derive(Debug, Clone, Default)]
pub struct Peers {
    tls: Option<ClientTlsConfig>,
    token: SendBearer,
}

impl Peers {
    /// Dials with `tls` when given (else plaintext), sending `token` when given.
    pub fn new(tls: Option<ClientTlsConfig>, token: Option<Secret>) -> Result<Self> {
        Ok(Self {
            tls,
            token: SendBearer::new(token.as_ref())?,
        })
    }

    /// Whether peers are dialed over TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The URI of `address`: kept when it has a scheme, else `https://` with TLS and `http://`
    /// without.
    pub fn uri(&self, address: &str) -> String {
        if address.contains("://") {
            address.to_string()
        } else if self.tls() {
            format!("https://{address}")
        } else {
            format!("http://{address}")
        }
    }

    /// An endpoint for `address` with this TLS.
    pub fn endpoint(&self, address: &str) -> Result<Endpoint> {
        let uri = self.uri(address);
        let bad = |reason: String| Error::Address {
            address: address.to_string(),
            reason,
        };
        let endpoint = Endpoint::from_shared(uri.clone()).map_err(|e| bad(e.to_string()))?;
        match &self.tls {
            Some(tls) => Ok(endpoint.tls_config(tls.clone())?),
            None if uri.starts_with("https://") => Err(bad(
                "an https:// address needs --tls-ca (the CA its certificate is verified against)"
                    .into(),
            )),
            None => Ok(endpoint),
        }
    }

    /// A channel to `address` that connects on first use.
    pub fn connect_lazy(&self, address: &str) -> Result<AuthChannel> {
        Ok(self.with_token(self.endpoint(address)?.connect_lazy()))
    }

    /// `channel`, its calls carrying the token.
    pub fn with_token(&self, channel: Channel) -> AuthChannel {
        InterceptedService::new(channel, self.token.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes() {
        let plain = Peers::default();
        assert_eq!(plain.uri("10.0.0.1:50061"), "http://10.0.0.1:50061");
        assert_eq!(plain.uri("https://a:1"), "https://a:1");
        let err = plain.endpoint("https://a:1").unwrap_err().to_string();
        assert!(err.contains("--tls-ca"), "{err}");
        let tls = Peers::new(Some(ClientTlsConfig::new()), None).unwrap();
        assert_eq!(tls.uri("w-0.prefill:50061"), "https://w-0.prefill:50061");
        assert!(tls.endpoint("w-0.prefill:50061").is_ok());
    }
}
