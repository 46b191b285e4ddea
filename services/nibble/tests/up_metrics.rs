//! `nibble up --metrics-listen`: the router and both workers run in one process and share its
//! one /metrics, their series told apart by `role`, served on the metrics port and on the HTTP
//! API's port (without the API key); the API serves the model as `--served-model-name`, and
//! `nibble generate --url` pointed at the API's port says which port it wants. Runs the built
//! binary on the real model (`$NIBBLE_MODEL` or
//! `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`; fails without it).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nibble_router::metrics as router;
use nibble_telemetry::Samples;
use nibble_testkit::{http_client, model_path as model};
use nibble_worker::metrics as worker;

/// Kills the process when the test ends, however it ends.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn nibble_up_serves_one_metrics_endpoint_for_all_three_services_also_on_its_api_port() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .arg("up")
        .arg("--model")
        .arg(model())
        .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
        .args([
            "--metrics-listen",
            "127.0.0.1:0",
            "--local-prefill-threshold",
            "0",
        ])
        .args(["--threads", "1", "--kv-budget-mib", "32"])
        .args(["--served-model-name", "smol", "--api-key", KEY])
        .env_remove("NIBBLE_METRICS_LISTEN")
        .env_remove("NIBBLE_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nibble up");
    let stdout = child.stdout.take().unwrap();
    let _up = Up(child);
    // Read stdout to its end on a thread: a closed pipe would fail nibble up's next line.
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut metrics, mut http, mut address) = (None, None, None);
    while address.is_none() {
        let line = lines
            .recv_timeout(Duration::from_secs(120))
            .expect("nibble up got ready");
        if let Some((_, url)) = line.split_once("metrics on http://") {
            let at: SocketAddr = url.trim_end_matches("/metrics").parse().unwrap();
            metrics = Some(at);
        }
        if let Some((_, url)) = line.split_once("HTTP API on http://") {
            http = Some(url.trim_end_matches("/v1").to_string());
        }
        if let Some((_, rest)) = line.split_once("ready on ") {
            address = rest.split_whitespace().next().map(str::to_string);
            assert!(rest.contains("(smol, "), "{line}");
        }
    }
    let metrics = metrics.expect("nibble up printed its metrics address");
    let http = http.expect("nibble up printed its HTTP address");

    // The API lists and takes the served name only; the workers' name is unknown there.
    let bearer = format!("Bearer {KEY}");
    let auth = [("Authorization", bearer.as_str())];
    let models = http_client::request(&http, "GET", "/v1/models", &auth, None).await;
    assert_eq!(models.status, 200, "{}", models.text());
    assert_eq!(models.json()["data"][0]["id"], "smol");
    let complete = |model: &str| {
        serde_json::json!({
            "model": model,
            "prompt": "It is a truth universally acknowledged, that a single man",
            "max_tokens": 4,
            "ignore_eos": true,
        })
        .to_string()
    };
    let file_name = complete("SmolLM2-135M-Instruct.Q4_1");
    let refused = http_client::request(
        &http,
        "POST",
        "/v1/completions",
        &auth,
        Some(file_name.as_bytes()),
    )
    .await;
    assert_eq!(refused.status, 404, "{}", refused.text());
    let served = complete("smol");
    let answer = http_client::request(
        &http,
        "POST",
        "/v1/completions",
        &auth,
        Some(served.as_bytes()),
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.json()["model"], "smol");
    assert_eq!(answer.json()["usage"]["completion_tokens"], 4);

    let mut s = Samples::default();
    for _ in 0..100 {
        s = Samples::parse(&nibble_telemetry::scrape(metrics).await.unwrap());
        if s.get(
            worker::REQUESTS_TOTAL,
            &[("call", "decode"), ("code", "ok")],
        ) == Some(1.0)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let finished = [("model_name", "smol"), ("outcome", "finished")];
    assert_eq!(s.value(router::REQUESTS_TOTAL, &finished), 1.0);
    let ttft = format!("{}_count", router::TIME_TO_FIRST_TOKEN_SECONDS);
    assert_eq!(s.value(&ttft, &[("model_name", "smol")]), 1.0);
    assert_eq!(
        s.value(router::GENERATION_TOKENS_TOTAL, &[("model_name", "smol")]),
        4.0
    );
    assert_eq!(s.value(router::WORKERS, &[("role", "prefill")]), 1.0);
    assert_eq!(
        s.value(
            worker::REQUESTS_TOTAL,
            &[("role", "decode"), ("call", "decode")]
        ),
        1.0
    );
    let sent = s.value(worker::KV_TRANSFER_BYTES_TOTAL, &[("role", "prefill")]);
    let received = s.value(worker::KV_TRANSFER_BYTES_TOTAL, &[("role", "decode")]);
    assert!(
        sent > 0.0 && sent == received,
        "{sent} sent, {received} received"
    );
    for role in ["prefill", "decode"] {
        assert!(
            s.value(worker::KV_PAGES_TOTAL, &[("role", role)]) > 0.0,
            "{role}"
        );
        let usage = [
            s.value(worker::KV_CACHE_USAGE, &[("role", role)]),
            s.value(
                router::KV_CACHE_USAGE,
                &[("role", role), ("model_name", "smol")],
            ),
        ];
        assert!(usage.iter().all(|u| (0.0..=1.0).contains(u)), "{usage:?}");
    }

    // The same metrics on the API's port, without the API key (as vLLM serves them), while
    // the API itself wants it.
    let unauthorized = http_client::get(&http, "/v1/models").await;
    assert_eq!(unauthorized.status, 401);
    let on_api = http_client::get(&http, "/metrics").await;
    assert_eq!(on_api.status, 200);
    assert_eq!(
        on_api.header("content-type"),
        Some(nibble_telemetry::CONTENT_TYPE)
    );
    let mut a = Samples::parse(&on_api.text());
    assert_eq!(a.value(router::REQUESTS_TOTAL, &finished), 1.0);
    // The router's usage gauge follows the workers' load reports, which keep coming after the
    // request: the two ports agree when scraped with no report in between.
    let decode_usage = |x: &Samples| x.value(router::KV_CACHE_USAGE, &[("role", "decode")]);
    let mut agreed = false;
    for _ in 0..20 {
        let now = Samples::parse(&nibble_telemetry::scrape(metrics).await.unwrap());
        if decode_usage(&a) == decode_usage(&now) {
            agreed = true;
            break;
        }
        a = Samples::parse(&http_client::get(&http, "/metrics").await.text());
    }
    assert!(
        agreed,
        "the API port's decode usage never matched the metrics port's"
    );
    assert!(a
        .get(worker::KV_PAGES_TOTAL, &[("role", "decode")])
        .is_some());

    // `nibble generate --url` at the API's port: told it is an HTTP server, and which to use.
    let wrong = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["generate", "--url", &http, "--max-tokens", "2", "hi"])
        .env("NIBBLE_API_KEY", KEY)
        .output()
        .unwrap();
    assert_eq!(wrong.status.code(), Some(2), "{wrong:?}");
    let said = String::from_utf8_lossy(&wrong.stderr);
    assert_eq!(
        said.trim(),
        format!(
            "error: {http} is an HTTP server (the OpenAI API?); --url wants the router's gRPC \
             address, e.g. 127.0.0.1:50051 (`nibble up` and `nibble router` print it: \
             `listening on ADDR`)"
        )
    );
}

const KEY: &str = "sesame";
