//! The official `openai` Python client against the real `nibble up` (router, prefill and decode
//! workers in one process, every prompt disaggregated): the router's two client scripts, the
//! common parameters (`openai_client.py`) and structured outputs with tool calls
//! (`openai_structured.py`, JSON validated by `jsonschema`). Runs the built binary on the real
//! model (`$NIBBLE_MODEL` or `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`; fails without
//! it); Python and both packages are required (scripts/deps.sh installs them).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nibble_testkit::model_path as model;

const KEY: &str = "up-openai-key";
const MODEL: &str = "smollm2";

/// Kills the process when the test ends, however it ends.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs one of the router's client scripts.
fn script(name: &str, args: &[&str]) {
    let path = format!("{}/../router/tests/{name}", env!("CARGO_MANIFEST_DIR"));
    nibble_testkit::python::run_checks(path.as_ref(), args);
}

#[test]
fn the_openai_client_scripts_pass_against_nibble_up() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .arg("up")
        .arg("--model")
        .arg(model())
        .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
        .args(["--local-prefill-threshold", "0"])
        .args(["--served-model-name", MODEL, "--api-key", KEY])
        .env_remove("NIBBLE_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nibble up");
    let stdout = child.stdout.take().unwrap();
    let _up = Up(child);
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut http, mut ready) = (None, false);
    while !ready {
        let line = lines
            .recv_timeout(Duration::from_secs(120))
            .expect("nibble up got ready");
        if let Some((_, url)) = line.split_once("HTTP API on ") {
            http = Some(url.trim().to_string());
        }
        ready = line.contains("ready on ");
    }
    let base_url = http.expect("nibble up printed its HTTP address");
    assert!(base_url.ends_with("/v1"), "{base_url}");
    script("openai_client.py", &[&base_url, MODEL, KEY]);
    script("openai_structured.py", &[&base_url, MODEL, KEY]);
}
