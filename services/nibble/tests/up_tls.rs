//! `nibble up` with TLS, the internal token and an API key, as a real process, driven by
//! `nibble generate --url` as a client: with the CA and the key it is served; without the CA, or
//! without the key, it is refused. The certificates come from a CA made here (no committed key).
//!
//! The model is `$NIBBLE_MODEL` or `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`; without
//! it this test fails, it never passes silently.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nibble_security::testing::TestPki;
use nibble_testkit::model_path as model;

const KEY: &str = "up-api-key";

/// `nibble ARGS` without the caller's NIBBLE_* settings.
fn nibble(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nibble"));
    for (var, _) in std::env::vars() {
        if var.starts_with("NIBBLE_") && var != "NIBBLE_MODEL" {
            cmd.env_remove(var);
        }
    }
    cmd.args(args);
    cmd
}

/// Kills the cluster when the test ends, however it ends.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn nibble_up_with_tls_serves_nibble_generate_with_the_ca_and_the_key() {
    let pki = TestPki::new("nibble test CA");
    let node = pki.issue("node", &["127.0.0.1", "localhost"]);
    let model = model();
    let (cert, key, ca) = (
        node.cert.to_str().unwrap(),
        node.key.to_str().unwrap(),
        pki.ca.to_str().unwrap(),
    );
    let mut child = nibble(&[
        "up",
        "--model",
        model.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--kv-budget-mib",
        "32",
        "--threads",
        "1",
        "--api-key",
        KEY,
    ])
    .env("NIBBLE_TLS_CERT", cert)
    .env("NIBBLE_TLS_KEY", key)
    .env("NIBBLE_TLS_CA", ca)
    .env("NIBBLE_INTERNAL_TOKEN", "up-internal-token")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .expect("nibble up starts");
    let stdout = child.stdout.take().unwrap();
    let up = Up(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            let _ = tx.send(line);
        }
    });
    let mut printed = Vec::new();
    let address = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("nibble up is not ready: {printed:?}"));
        if let Some((_, rest)) = line.split_once("nibble up: ready on ") {
            break rest.split_whitespace().next().unwrap().to_string();
        }
        printed.push(line);
    };
    assert!(
        printed
            .iter()
            .any(|l| l.contains("OpenAI HTTP API on https://")),
        "{printed:?}"
    );
    let generate_at = |url: &str, extra: &[&str]| -> Output {
        let mut args = vec![
            "generate",
            "--url",
            url,
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        ];
        args.extend_from_slice(extra);
        args.push("Hello");
        nibble(&args).output().expect("nibble generate runs")
    };
    let generate = |extra: &[&str]| generate_at(&address, extra);

    let served = generate(&["--tls-ca", ca, "--api-key", KEY]);
    assert!(served.status.success(), "{}", text(&served));
    assert!(
        String::from_utf8_lossy(&served.stderr).contains("completion 4 tokens"),
        "{}",
        text(&served)
    );

    let no_key = generate(&["--tls-ca", ca]);
    assert!(!no_key.status.success(), "{}", text(&no_key));
    assert!(
        String::from_utf8_lossy(&no_key.stderr).contains("Unauthenticated"),
        "{}",
        text(&no_key)
    );

    let no_ca = generate(&["--api-key", KEY]);
    assert!(!no_ca.status.success(), "{}", text(&no_ca));

    let https_without_ca = generate_at(&format!("https://{address}"), &["--api-key", KEY]);
    assert!(
        String::from_utf8_lossy(&https_without_ca.stderr).contains("--tls-ca"),
        "{}",
        text(&https_without_ca)
    );
    drop(up);
}
