//! A prefill and a decode worker's /metrics after real hand-offs (their own test binary: the
//! metrics recorder is the process's, so no other test may record into it meanwhile): calls by
//! code, pages and bytes moved on both sides, prefill time, generated tokens, the page pool
//! and the prefix cache.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nibble_engine::scheduler::SchedulerConfig;
use nibble_engine::{CpuBackend, EngineConfig, KvConfig, ModelSource};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_telemetry::Samples;
use nibble_testkit::{handoff, model_path, WorkerApi};
use nibble_worker::metrics as m;
use nibble_worker::EngineHandle;
use support::Server;
use tokio::net::TcpListener;

const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife. However little known the feelings";
const PAGES: usize = 64;
const NEW_TOKENS: u32 = 4;

/// A worker of `role` over a new nvfp4 engine on one thread, served on loopback.
async fn server(source: &ModelSource, role: v1::WorkerRole) -> Server {
    let model = source
        .load_model(Arc::new(CpuBackend::new(1).unwrap()))
        .unwrap();
    let kv = KvConfig::new(KvDtype::Nvfp4);
    let page_bytes = kv.layout(&model).unwrap().page_bytes();
    let engine = EngineHandle::spawn(
        model,
        Arc::new(source.load_tokenizer().unwrap()),
        EngineConfig {
            kv,
            kv_budget_bytes: PAGES * page_bytes,
            scheduler: SchedulerConfig::default(),
        },
    )
    .unwrap();
    Server::start(engine, role, role.as_str_name().into()).await
}

/// A hand-off of exactly [`NEW_TOKENS`] tokens; returns the transfer.
async fn transfer(p: &Server, d: &Server, prompt: &[u32], id: &str) -> v1::TransferSummary {
    let stopping = v1::StoppingCriteria {
        max_tokens: Some(NEW_TOKENS),
        ignore_eos: true,
        ..Default::default()
    };
    handoff(p, d, id, prompt, stopping).await.transfer
}

/// Scrapes until `ready` holds for the samples (a decode call is counted when the server drops
/// its stream, just after the client saw the end), for at most 5 s.
async fn scrape_until(address: SocketAddr, ready: impl Fn(&Samples) -> bool) -> Samples {
    for _ in 0..100 {
        let samples = Samples::parse(&nibble_telemetry::scrape(address).await.unwrap());
        if ready(&samples) {
            return samples;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "the metrics never got there: {}",
        nibble_telemetry::scrape(address).await.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_export_calls_transfers_pages_and_the_prefix_cache() {
    let metrics = nibble_telemetry::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let source = ModelSource::open(model_path()).unwrap();
    let prompt = source
        .load_tokenizer()
        .unwrap()
        .encode(PROMPT, false)
        .unwrap();
    let p = server(&source, v1::WorkerRole::Prefill).await;
    let d = server(&source, v1::WorkerRole::Decode).await;

    let cold = transfer(&p, &d, &prompt, "metrics-cold").await;
    let warm = transfer(&p, &d, &prompt, "metrics-warm").await;
    // A refused reservation is counted by its code.
    let refused = d
        .client()
        .await
        .reserve(v1::ReserveRequest {
            request_id: "metrics-refused".into(),
            token_ids: prompt.clone(),
            kv_format_fingerprint: 1,
            ttl_ms: None,
            max_tokens: None,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);

    let s = scrape_until(metrics.address(), |s| {
        s.get(m::REQUESTS_TOTAL, &[("call", "decode"), ("code", "ok")]) == Some(2.0)
    })
    .await;
    let calls = |role, call, code| {
        s.value(
            m::REQUESTS_TOTAL,
            &[("role", role), ("call", call), ("code", code)],
        )
    };
    assert_eq!(calls("decode", "reserve", "ok"), 2.0);
    assert_eq!(calls("decode", "reserve", "failed_precondition"), 1.0);
    assert_eq!(calls("prefill", "prefill", "ok"), 2.0);
    assert_eq!(calls("decode", "push_pages", "ok"), 2.0);
    assert_eq!(calls("decode", "decode", "ok"), 2.0);

    // Pages and bytes, counted on both sides, agree with what the pushes reported.
    let pages = f64::from(cold.pages + warm.pages);
    let bytes = (cold.bytes + warm.bytes) as f64;
    assert!(bytes > 0.0);
    let sent = [("role", "prefill"), ("direction", "sent")];
    let received = [("role", "decode"), ("direction", "received")];
    assert_eq!(s.value(m::KV_TRANSFER_PAGES_TOTAL, &sent), pages);
    assert_eq!(s.value(m::KV_TRANSFER_PAGES_TOTAL, &received), pages);
    assert_eq!(s.value(m::KV_TRANSFER_BYTES_TOTAL, &sent), bytes);
    assert_eq!(s.value(m::KV_TRANSFER_BYTES_TOTAL, &received), bytes);
    let grpc = |dir: &[(&'static str, &'static str); 2]| {
        s.value(
            m::KV_TRANSFERS_TOTAL,
            &[dir[0], dir[1], ("backend", "grpc")],
        )
    };
    assert_eq!((grpc(&sent), grpc(&received)), (2.0, 2.0), "both over gRPC");
    assert_eq!(
        s.get(m::KV_TRANSFER_FALLBACKS_TOTAL, &[]),
        None,
        "no NCCL, no fall back"
    );
    assert_eq!(s.value(m::NCCL_LINKS, &[("role", "decode")]), 0.0);
    let durations = format!("{}_count", m::KV_TRANSFER_DURATION_SECONDS);
    assert_eq!(s.value(&durations, &sent), 2.0);
    assert_eq!(s.value(&durations, &received), 2.0);
    let prefills = format!("{}_count", m::PREFILL_DURATION_SECONDS);
    assert_eq!(s.value(&prefills, &[("role", "prefill")]), 2.0);
    assert_eq!(
        s.value(m::GENERATION_TOKENS_TOTAL, &[("role", "decode")]),
        f64::from(2 * NEW_TOKENS)
    );

    // The page pool, sampled at scrape time.
    let page_bytes = d.state.engine().info().page_bytes as f64;
    for role in ["prefill", "decode"] {
        let total = s.value(m::KV_PAGES_TOTAL, &[("role", role)]);
        let free = s.value(m::KV_PAGES_FREE, &[("role", role)]);
        assert_eq!(total, PAGES as f64, "{role}");
        assert!(
            free > 0.0 && free <= total,
            "{role}: {free} free of {total}"
        );
        assert_eq!(s.value(m::KV_PAGE_BYTES, &[("role", role)]), page_bytes);
        assert_eq!(s.value(m::RUNNING_REQUESTS, &[("role", role)]), 0.0);
        // With nothing running, every page is free or only cached: none is in use.
        let cached = s.value(m::KV_PAGES_CACHED, &[("role", role)]);
        let usage = s.value(m::KV_CACHE_USAGE, &[("role", role)]);
        assert!(cached > 0.0, "{role}: the prompt's pages stay cached");
        assert_eq!(usage, 1.0 - (free + cached) / total, "{role}");
        assert_eq!(usage, 0.0, "{role}");
    }
    assert_eq!(bytes, pages * page_bytes);

    // The second prompt found the first one's pages: on the prefill worker, which computed it
    // again, and on the decode worker, which reserved only what it lacked.
    for role in ["prefill", "decode"] {
        let lookups = s.value(m::PREFIX_CACHE_LOOKUPS_TOTAL, &[("role", role)]);
        let queries = s.value(m::PREFIX_CACHE_QUERIES_TOTAL, &[("role", role)]);
        let hits = s.value(m::PREFIX_CACHE_HITS_TOTAL, &[("role", role)]);
        assert!(lookups >= 2.0, "{role}: {lookups} lookups");
        assert!(hits > 0.0 && hits <= queries, "{role}: {hits} of {queries}");
    }
}
