//! Loading TLS files: every failure names the flag and the file, before anything serves.

use nibble_security::testing::TestPki;
use nibble_security::{ClientCerts, SecurityArgs, TlsArgs};

fn error(args: &TlsArgs) -> String {
    args.load().expect_err("loading should fail").to_string()
}

#[test]
fn good_files_load() {
    let pki = TestPki::new("test CA");
    let server = pki.issue("server", &["localhost", "127.0.0.1"]);
    let tls = pki.args(&server).load().unwrap().unwrap();
    assert!(tls.serves() && tls.has_ca());
    assert!(tls.grpc_server(ClientCerts::RequiredWithCa).is_some());
    assert!(tls.grpc_client().unwrap().is_some());
    assert!(tls.http_server(ClientCerts::None).unwrap().is_some());
    // No flag, no TLS; a CA alone is a client's configuration.
    assert!(TlsArgs::default().load().unwrap().is_none());
    let client = TlsArgs {
        tls_ca: Some(pki.ca.clone()),
        ..Default::default()
    };
    let client = client.load().unwrap().unwrap();
    assert!(!client.serves() && client.grpc_server(ClientCerts::None).is_none());
    // The token is never printed.
    let security = SecurityArgs {
        internal_token: Some("hunter2".into()),
        ..Default::default()
    }
    .load()
    .unwrap();
    assert!(!format!("{security:?}").contains("hunter2"));
}

#[test]
fn missing_and_unreadable_files_name_the_flag() {
    let pki = TestPki::new("test CA");
    let server = pki.issue("server", &["localhost"]);
    let missing = pki.path("nope.pem");
    for (flag, args) in [
        (
            "--tls-cert",
            TlsArgs {
                tls_cert: Some(missing.clone()),
                ..pki.args(&server)
            },
        ),
        (
            "--tls-key",
            TlsArgs {
                tls_key: Some(missing.clone()),
                ..pki.args(&server)
            },
        ),
        (
            "--tls-ca",
            TlsArgs {
                tls_ca: Some(missing.clone()),
                ..pki.args(&server)
            },
        ),
    ] {
        let e = error(&args);
        assert!(e.starts_with(flag), "{flag}: {e}");
        assert!(e.contains(&missing.display().to_string()), "{e}");
        assert!(e.contains("cannot read"), "{e}");
    }
}

#[test]
fn invalid_files_name_the_flag() {
    let pki = TestPki::new("test CA");
    let server = pki.issue("server", &["localhost"]);
    let other = pki.issue("other", &["localhost"]);
    let junk = pki.path("junk.pem");
    std::fs::write(&junk, "not a PEM file\n").unwrap();

    let e = error(&TlsArgs {
        tls_cert: Some(junk.clone()),
        ..pki.args(&server)
    });
    assert!(
        e.starts_with("--tls-cert") && e.contains("no PEM certificate"),
        "{e}"
    );

    let e = error(&TlsArgs {
        tls_key: Some(junk.clone()),
        ..pki.args(&server)
    });
    assert!(
        e.starts_with("--tls-key") && e.contains("no PEM private key"),
        "{e}"
    );

    // A certificate given as the key.
    let e = error(&TlsArgs {
        tls_key: Some(server.cert.clone()),
        ..pki.args(&server)
    });
    assert!(e.starts_with("--tls-key"), "{e}");

    // Another certificate's key.
    let e = error(&TlsArgs {
        tls_key: Some(other.key.clone()),
        ..pki.args(&server)
    });
    assert!(
        e.starts_with("--tls-key") && e.contains("does not fit --tls-cert"),
        "{e}"
    );

    let e = error(&TlsArgs {
        tls_ca: Some(junk.clone()),
        ..pki.args(&server)
    });
    assert!(
        e.starts_with("--tls-ca") && e.contains("no PEM certificate"),
        "{e}"
    );

    // Half an identity.
    let e = error(&TlsArgs {
        tls_key: None,
        ..pki.args(&server)
    });
    assert!(e.contains("--tls-cert needs --tls-key"), "{e}");
    let e = error(&TlsArgs {
        tls_cert: None,
        ..pki.args(&server)
    });
    assert!(e.contains("--tls-key needs --tls-cert"), "{e}");
}
