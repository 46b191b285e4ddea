//! `nibble up --metrics-listen`: the router and both workers run in one process and share its
//! one /metrics, their series told apart by `role`. Runs the built binary on the real model
//! (`$NIBBLE_MODEL` or `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`; fails without it).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_router::metrics as router;
use nibble_telemetry::Samples;
use nibble_testkit::model_path as model;
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
async fn nibble_up_serves_one_metrics_endpoint_for_all_three_services() {
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
        .env_remove("NIBBLE_METRICS_LISTEN")
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
    let (mut metrics, mut address) = (None, None);
    while address.is_none() {
        let line = lines
            .recv_timeout(Duration::from_secs(120))
            .expect("nibble up got ready");
        if let Some((_, url)) = line.split_once("metrics on http://") {
            let at: SocketAddr = url.trim_end_matches("/metrics").parse().unwrap();
            metrics = Some(at);
        }
        if let Some((_, rest)) = line.split_once("ready on ") {
            address = rest.split_whitespace().next().map(str::to_string);
        }
    }
    let metrics = metrics.expect("nibble up printed its metrics address");
    let address = address.unwrap();

    let mut client = InferenceClient::connect(format!("http://{address}"))
        .await
        .unwrap();
    let request = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Text(
            "It is a truth universally acknowledged, that a single man".into(),
        )),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: Some(4),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = client.generate(request).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}

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
    assert_eq!(
        s.value(router::REQUESTS_TOTAL, &[("outcome", "finished")]),
        1.0
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
    }
}
