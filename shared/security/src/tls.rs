//! TLS from PEM files: [`TlsArgs`] (the flags), loaded and checked into [`Tls`], which makes the
//! rustls configurations of gRPC servers and clients (through tonic) and of the HTTP API.
//!
//! * `--tls-cert` and `--tls-key` (both or neither) are this process's identity: servers serve
//!   with it, and clients present it when a server asks for a client certificate.
//! * `--tls-ca` is the CA peers are verified against: a client trusts only it (no system roots),
//!   and an internal server (a worker) given it requires client certificates signed by it
//!   ([`ClientCerts::RequiredWithCa`], mutual TLS between services). Public servers (the
//!   router's Inference and HTTP APIs) never ask for a client certificate: their clients
//!   authenticate with the API key.
//!
//! A client names the server it dials by the host of the address (a DNS name or an IP address),
//! so a certificate must name every address it is dialed at (a DNS or IP subject alternative
//! name); workers are dialed at the address they advertise.
//!
//! Every file is read and checked when loaded, before anything serves: a missing or unreadable
//! file, one without a PEM certificate or key, or a key that does not match its certificate is
//! an [`Error`] naming the flag and the path.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::{Error, Result};

/// How long a server waits for a client's TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// PEM certificate (chain) this process serves with, and presents as a client certificate
    /// when it dials a peer; with --tls-key, turns TLS on. It must name the address peers dial
    /// (DNS or IP subject alternative names).
    #[arg(long, env = "NIBBLE_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "NIBBLE_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) peers are verified against: clients dial peers over TLS trusting
    /// only it, and workers require client certificates signed by it (mutual TLS).
    #[arg(long, env = "NIBBLE_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
}

/// Whether a server asks its clients for a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientCerts {
    /// Never (the public APIs: clients authenticate with the API key).
    None,
    /// Required and verified against the CA when one is given (internal services).
    RequiredWithCa,
}

/// This process's certificate and key.
#[derive(Clone)]
struct OwnKeys {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
}

/// Loaded and checked TLS files.
#[derive(Clone)]
pub struct Tls {
    identity: Option<OwnKeys>,
    ca: Option<(Vec<u8>, Arc<rustls::RootCertStore>)>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("identity", &self.identity.is_some())
            .field("ca", &self.ca.is_some())
            .finish()
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Read {
        flag,
        path: path.to_path_buf(),
        source,
    })
}

fn invalid(flag: &'static str, path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Invalid {
        flag,
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn certificates(
    flag: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(flag, path, format!("not a PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(
            flag,
            path,
            "holds no PEM certificate (BEGIN CERTIFICATE)",
        ));
    }
    Ok(certs)
}

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsArgs {
    /// TLS from the flags, or `None` when no flag is given. `--tls-cert` and `--tls-key` go
    /// together; `--tls-ca` alone makes a client-only configuration.
    pub fn load(&self) -> Result<Option<Tls>> {
        let given = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
        let (cert, key, ca) = (
            given(&self.tls_cert),
            given(&self.tls_key),
            given(&self.tls_ca),
        );
        let identity = match (cert, key) {
            (None, None) => None,
            (Some(_), None) => {
                return Err(Error::Flags(
                    "--tls-cert needs --tls-key (its private key)".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::Flags(
                    "--tls-key needs --tls-cert (its certificate)".into(),
                ))
            }
            (Some(cert), Some(key)) => Some(load_identity(&cert, &key)?),
        };
        let ca = match ca {
            None => None,
            Some(path) => {
                let pem = read("--tls-ca", &path)?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in certificates("--tls-ca", &path, &pem)? {
                    roots.add(cert).map_err(|e| {
                        invalid("--tls-ca", &path, format!("not a CA certificate: {e}"))
                    })?;
                }
                Some((pem, Arc::new(roots)))
            }
        };
        if identity.is_none() && ca.is_none() {
            return Ok(None);
        }
        Ok(Some(Tls { identity, ca }))
    }
}

fn load_identity(cert: &Path, key: &Path) -> Result<OwnKeys> {
    let cert_pem = read("--tls-cert", cert)?;
    let key_pem = read("--tls-key", key)?;
    let chain = certificates("--tls-cert", cert, &cert_pem)?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| invalid("--tls-key", key, format!("holds no PEM private key: {e}")))?;
    // Builds a server configuration once: this checks that the key is usable and belongs to
    // the certificate.
    rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Flags(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain.clone(), key_der.clone_key())
        .map_err(|e| {
            invalid(
                "--tls-key",
                key,
                format!("does not fit --tls-cert {}: {e}", cert.display()),
            )
        })?;
    Ok(OwnKeys {
        cert_pem,
        key_pem,
        chain,
        key: Arc::new(key_der),
    })
}

impl Tls {
    /// Whether this process has a certificate to serve with.
    pub fn serves(&self) -> bool {
        self.identity.is_some()
    }

    /// Whether peers are verified against a CA (clients use TLS; internal servers want client
    /// certificates).
    pub fn has_ca(&self) -> bool {
        self.ca.is_some()
    }

    fn tonic_identity(&self) -> Option<Identity> {
        self.identity
            .as_ref()
            .map(|i| Identity::from_pem(&i.cert_pem, &i.key_pem))
    }

    /// The TLS of a gRPC server, or `None` without a certificate.
    pub fn grpc_server(&self, client_certs: ClientCerts) -> Option<ServerTlsConfig> {
        let mut config = ServerTlsConfig::new()
            .identity(self.tonic_identity()?)
            .timeout(HANDSHAKE_TIMEOUT);
        if let (ClientCerts::RequiredWithCa, Some((ca, _))) = (client_certs, &self.ca) {
            config = config
                .client_ca_root(Certificate::from_pem(ca))
                .client_auth_optional(false);
        }
        Some(config)
    }

    /// The TLS of a gRPC client, or `None` without a CA (clients then dial in plaintext).
    pub fn grpc_client(&self) -> Result<Option<ClientTlsConfig>> {
        let Some((ca, _)) = &self.ca else {
            return Ok(None);
        };
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some(identity) = self.tonic_identity() {
            config = config.identity(identity);
        }
        Ok(Some(config))
    }

    /// The rustls configuration of an HTTP/1.1 server, or `None` without a certificate.
    pub fn http_server(
        &self,
        client_certs: ClientCerts,
    ) -> Result<Option<Arc<rustls::ServerConfig>>> {
        let Some(identity) = &self.identity else {
            return Ok(None);
        };
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Flags(format!("TLS: {e}")))?;
        let builder = match (client_certs, &self.ca) {
            (ClientCerts::RequiredWithCa, Some((_, roots))) => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::clone(roots),
                    provider(),
                )
                .build()
                .map_err(|e| Error::Flags(format!("--tls-ca: {e}")))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(identity.chain.clone(), identity.key.clone_key())
            .map_err(|e| Error::Flags(format!("--tls-cert/--tls-key: {e}")))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(Arc::new(config)))
    }
}
