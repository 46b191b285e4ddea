//! The router's /metrics after real requests through in-process prefill and decode workers (its
//! own test binary: the metrics recorder is the process's, so no other test may record into
//! it meanwhile). The workers share the process, as in `nibble up`, so their series are on the
//! same endpoint, told apart by `role`.

mod support;

use std::time::Duration;

use nibble_discovery::{Role, StaticRegistry};
use nibble_kvfmt::KvDtype;
use nibble_router::metrics as m;
use nibble_router::HttpConfig;
use nibble_telemetry::Samples;
use nibble_testkit::http_client::post_json;
use nibble_testkit::{generate, RouterApi};
use support::{greedy_request, prompt, RouterServer, Worker, NEW_TOKENS, PROMPT};
use tokio::net::TcpListener;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_exports_outcomes_latencies_decisions_queue_and_workers() {
    let metrics = nibble_telemetry::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let registry = StaticRegistry::new();
    let _p = Worker::start(&registry, Role::Prefill, "p0", KvDtype::Nvfp4).await;
    let _d = Worker::start(&registry, Role::Decode, "d0", KvDtype::Nvfp4).await;
    let router = RouterServer::start(&registry, 16, HttpConfig::default(), |_| {}).await;
    router.wait_for_workers(1, 1).await;
    let mut client = router.client().await;

    for id in ["metrics-1", "metrics-2"] {
        let got = generate(&mut client, greedy_request(id)).await.unwrap();
        got.usage.expect("the last chunk carries usage");
        assert_eq!(got.tokens.len(), NEW_TOKENS as usize);
    }
    // Refused before dispatch: counted by code, never routed.
    let mut invalid = greedy_request("metrics-invalid");
    invalid.stopping.as_mut().unwrap().max_tokens = Some(0);
    let status = client.generate(invalid).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    // Cancelled by the client after its first token.
    let mut long = greedy_request("metrics-cancelled");
    long.stopping.as_mut().unwrap().max_tokens = Some(200);
    let mut stream = client.generate(long).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("a first chunk");
    drop(stream);

    // Through the HTTP API: one completion (the same generate path), and one refused by the
    // same validation as gRPC's, counted by both the request and the HTTP counters.
    let body = serde_json::json!({ "prompt": PROMPT, "max_tokens": NEW_TOKENS });
    let ok = post_json(router.http_address(), "/v1/completions", &body).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let body = serde_json::json!({ "prompt": "x", "max_tokens": 0 });
    let bad = post_json(router.http_address(), "/v1/completions", &body).await;
    assert_eq!(bad.status, 400, "{}", bad.text());

    let mut s = Samples::default();
    for _ in 0..200 {
        s = Samples::parse(&nibble_telemetry::scrape(metrics.address()).await.unwrap());
        let cancelled = s.get(m::REQUESTS_TOTAL, &[("outcome", "cancelled")]);
        if cancelled == Some(1.0) && s.get(m::RUNNING_REQUESTS, &[]) == Some(0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let requests =
        |outcome, code| s.value(m::REQUESTS_TOTAL, &[("outcome", outcome), ("code", code)]);
    assert_eq!(requests("finished", "ok"), 3.0);
    assert_eq!(requests("refused", "invalid_argument"), 2.0);
    assert_eq!(requests("cancelled", "cancelled"), 1.0);
    assert_eq!(s.get(m::REQUESTS_TOTAL, &[("outcome", "failed")]), None);

    // Latencies: a first token for each dispatched request, an end for each finished one.
    let count = |name: &str| s.value(&format!("{name}_count"), &[]);
    assert_eq!(count(m::TIME_TO_FIRST_TOKEN_SECONDS), 4.0);
    assert_eq!(count(m::REQUEST_DURATION_SECONDS), 3.0);
    assert!(count(m::INTER_TOKEN_LATENCY_SECONDS) >= f64::from(3 * (NEW_TOKENS - 1)));
    assert!(s.value(m::GENERATION_TOKENS_TOTAL, &[]) >= f64::from(3 * NEW_TOKENS + 1));
    let ttft = s.value(&format!("{}_sum", m::TIME_TO_FIRST_TOKEN_SECONDS), &[]);
    let e2e = s.value(&format!("{}_sum", m::REQUEST_DURATION_SECONDS), &[]);
    assert!(ttft > 0.0 && e2e > 0.0, "ttft {ttft} s, e2e {e2e} s");

    let http = |status| {
        s.value(
            m::HTTP_RESPONSES_TOTAL,
            &[("route", "/v1/completions"), ("status", status)],
        )
    };
    assert_eq!((http("200"), http("400")), (1.0, 1.0));

    // Admission and routing: four requests got a place and a decision, all disaggregated
    // (every uncached token goes to the prefill worker in these tests).
    assert_eq!(count(m::QUEUE_WAIT_SECONDS), 4.0);
    assert_eq!(count(m::PREPROCESS_DURATION_SECONDS), 4.0);
    assert_eq!(count(m::DECISION_DURATION_SECONDS), 4.0);
    assert_eq!(s.value(m::DECISIONS_TOTAL, &[]), 4.0);
    assert_eq!(
        s.value(m::DECISIONS_TOTAL, &[("reason", "disaggregated")]),
        4.0
    );
    assert_eq!(
        s.value(m::DECISIONS_TOTAL, &[("reason", "local_prefill")]),
        0.0
    );
    assert!(s.value(m::PROMPT_TOKENS_TOTAL, &[]) >= 3.0 * prompt().len() as f64);
    assert!(s.value(m::CACHED_PROMPT_TOKENS_TOTAL, &[]) > 0.0);
    assert_eq!(s.value(m::QUEUED_REQUESTS, &[]), 0.0);
    assert_eq!(s.value(m::RUNNING_REQUESTS, &[]), 0.0);

    // Membership and the prefix index, fed by the workers' KV events.
    assert_eq!(s.value(m::WORKERS, &[("role", "prefill")]), 1.0);
    assert_eq!(s.value(m::WORKERS, &[("role", "decode")]), 1.0);
    assert!(s.value(m::INDEX_BLOCKS, &[]) > 0.0);
    assert!(s.value(m::KV_EVENTS_APPLIED_TOTAL, &[("role", "decode")]) > 0.0);

    // The workers' series, on the same endpoint.
    let w = nibble_worker::metrics::KV_TRANSFER_BYTES_TOTAL;
    let sent = s.value(w, &[("role", "prefill"), ("direction", "sent")]);
    let received = s.value(w, &[("role", "decode"), ("direction", "received")]);
    assert!(
        sent > 0.0 && sent == received,
        "{sent} sent, {received} received"
    );
}
