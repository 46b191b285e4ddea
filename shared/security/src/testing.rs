//! A throwaway PKI for tests (feature `testing`): a CA and certificates signed by it, made with
//! rcgen when a test runs and written as PEM files to a temporary directory. No key is
//! committed anywhere.

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::{SecurityArgs, TlsArgs};

/// A CA and the certificates it signed, as PEM files in a temporary directory.
pub struct TestPki {
    dir: tempfile::TempDir,
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate's PEM file.
    pub ca: PathBuf,
}

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestPki {
    /// A new CA, named `name`.
    pub fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        let ca = dir.path().join("ca.crt");
        std::fs::write(&ca, cert.pem()).expect("write the CA");
        Self {
            dir,
            issuer: Issuer::new(params, key),
            ca,
        }
    }

    /// A certificate for `names` (DNS names or IP addresses), good for server and client
    /// authentication, written as `<file>.crt` and `<file>.key`.
    pub fn issue(&self, file: &str, names: &[&str]) -> CertFiles {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("certificate parameters");
        params.distinguished_name.push(DnType::CommonName, file);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("certificate");
        let files = CertFiles {
            cert: self.dir.path().join(format!("{file}.crt")),
            key: self.dir.path().join(format!("{file}.key")),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write the certificate");
        std::fs::write(&files.key, key.serialize_pem()).expect("write the key");
        files
    }

    /// A file in the PKI's directory (to write broken ones).
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// The TLS flags of a service with `files` that trusts this CA.
    pub fn args(&self, files: &CertFiles) -> TlsArgs {
        TlsArgs {
            tls_cert: Some(files.cert.clone()),
            tls_key: Some(files.key.clone()),
            tls_ca: Some(self.ca.clone()),
        }
    }

    /// [`args`](Self::args) with an internal token.
    pub fn security(&self, files: &CertFiles, token: Option<&str>) -> SecurityArgs {
        SecurityArgs {
            tls: self.args(files),
            internal_token: token.map(str::to_string),
        }
    }
}
