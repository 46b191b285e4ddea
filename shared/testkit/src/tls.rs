//! A TLS client for tests of nibble's TLS listeners.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::TlsConnector;

/// A TLS client that trusts the CA certificates of the PEM file `ca` (ring, safe defaults).
pub fn connector(ca: &Path) -> std::io::Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca)?;
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| std::io::Error::other(format!("{}: {e:?}", ca.display())))?;
        roots.add(cert).map_err(std::io::Error::other)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(std::io::Error::other)?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}
