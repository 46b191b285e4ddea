//! nibble's transport security, shared by the router, the workers and the `nibble` client.
//!
//! * [`tls`]: [`TlsArgs`] (`--tls-cert`, `--tls-key`, `--tls-ca`) loaded into [`Tls`], checked
//!   before anything serves (every error names the flag and the file), and the rustls
//!   configurations of gRPC servers and clients (tonic) and of the HTTP API.
//! * [`token`]: bearer secrets ([`Secret`]) checked in constant time by a server interceptor
//!   ([`RequireBearer`], UNAUTHENTICATED otherwise) and sent by a client interceptor
//!   ([`SendBearer`]).
//! * [`client`]: [`Peers`], how a process dials the cluster's gRPC services: `https://` and the
//!   CA when TLS is on, the internal token on every call.
//!
//! [`SecurityArgs`] puts the TLS flags and `--internal-token` together; [`Security`] is what they
//! load into, handed to every server and client of a process.

pub mod client;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod token;

use std::sync::Arc;

pub use client::{AuthChannel, Peers};
pub use tls::{ClientCerts, Tls, TlsArgs};
pub use token::{bearer_matches, RequireBearer, Secret, SendBearer};

/// Why security settings could not be loaded or applied.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A PEM file could not be read.
    #[error("{flag} {}: cannot read: {source}", path.display())]
    Read {
        flag: &'static str,
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// A PEM file holds no usable certificate or key, or the key does not fit the certificate.
    #[error("{flag} {}: {reason}", path.display())]
    Invalid {
        flag: &'static str,
        path: std::path::PathBuf,
        reason: String,
    },
    /// Flags that do not go together (the message names them).
    #[error("{0}")]
    Flags(String),
    /// A peer address that cannot be dialed with these settings.
    #[error("address {address:?}: {reason}")]
    Address { address: String, reason: String },
    /// tonic refused a TLS configuration.
    #[error("TLS: {0}")]
    Transport(#[from] tonic::transport::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The TLS flags and the internal token, to flatten into a service's arguments.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SecurityArgs {
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Shared token the cluster's services present to each other (`authorization: Bearer`):
    /// when set, a worker refuses Worker and KvTransfer calls without it (UNAUTHENTICATED),
    /// and the router and prefill workers send it.
    #[arg(long, env = "NIBBLE_INTERNAL_TOKEN", hide_env_values = true)]
    pub internal_token: Option<String>,
}

impl SecurityArgs {
    /// Reads and checks the files; call before serving anything.
    pub fn load(&self) -> Result<Security> {
        Ok(Security {
            tls: self.tls.load()?.map(Arc::new),
            internal_token: self.internal_token.as_deref().and_then(Secret::new),
        })
    }
}

/// A process's loaded security settings. The default is none: plaintext, no token.
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// The certificates, when TLS is on.
    pub tls: Option<Arc<Tls>>,
    /// The internal token, when required.
    pub internal_token: Option<Secret>,
}

impl Security {
    /// How this process dials the cluster's services: TLS when a CA is given (presenting this
    /// process's certificate when it has one), the internal token on every call.
    pub fn peers(&self) -> Result<Peers> {
        Peers::new(
            self.tls
                .as_ref()
                .map(|t| t.grpc_client())
                .transpose()?
                .flatten(),
            self.internal_token.clone(),
        )
    }

    /// The TLS of an internal gRPC server (a worker): client certificates required when a CA
    /// is given (mTLS); `None` when TLS is off.
    pub fn internal_server_tls(&self) -> Option<tonic::transport::ServerTlsConfig> {
        self.tls
            .as_ref()
            .and_then(|t| t.grpc_server(ClientCerts::RequiredWithCa))
    }

    /// The check internal services put in front of every call.
    pub fn require_internal_token(&self) -> RequireBearer {
        RequireBearer::new(self.internal_token.clone(), "internal token")
    }
}
