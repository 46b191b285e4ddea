//! A prefill and a decode worker's /metrics after real hand-offs (their own test binary: the
//! metrics recorder is the process's, so no other test may record into it meanwhile): calls by
//! code, pages and bytes moved on both sides, prefill time, generated tokens, the page pool
//! and the prefix cache.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nibble_engine::scheduler::SchedulerConfig;
use nibble_engine::{CpuBackend, EngineConfig, KvConfig, ModelSource};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_telemetry::Samples;
use nibble_worker::metrics as m;
use nibble_worker::{EngineHandle, WorkerIdentity, WorkerState};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;

const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife. However little known the feelings";
const PAGES: usize = 64;
const NEW_TOKENS: u32 = 4;

fn model_path() -> PathBuf {
    let path = std::env::var_os("NIBBLE_MODEL").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    );
    assert!(path.is_file(), "model file {} not found", path.display());
    path
}

/// A worker served on 127.0.0.1:0 until dropped.
struct Server {
    address: String,
    state: Arc<WorkerState>,
    _stop: oneshot::Sender<()>,
}

impl Server {
    async fn start(source: &ModelSource, role: v1::WorkerRole) -> Self {
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
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let state = WorkerState::new(
            engine,
            WorkerIdentity {
                worker_id: role.as_str_name().into(),
                role,
                model: "smollm2".into(),
                transfer_address: address.clone(),
                reservation_ttl: Duration::from_secs(30),
            },
        );
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(nibble_worker::serve(
            Arc::clone(&state),
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            address,
            state,
            _stop: stop,
        }
    }

    async fn client(&self) -> WorkerClient<Channel> {
        WorkerClient::connect(format!("http://{}", self.address))
            .await
            .unwrap()
    }
}

/// Reserve on D, Prefill on P (pushing to D), Decode on D; returns the transfer.
async fn handoff(p: &Server, d: &Server, prompt: &[u32], id: &str) -> v1::TransferSummary {
    let reservation = d
        .client()
        .await
        .reserve(v1::ReserveRequest {
            request_id: id.into(),
            token_ids: prompt.to_vec(),
            kv_format_fingerprint: d.state.engine().info().fingerprint,
            ttl_ms: None,
            max_tokens: Some(NEW_TOKENS),
        })
        .await
        .unwrap()
        .into_inner();
    let prefilled = p
        .client()
        .await
        .prefill(v1::PrefillRequest {
            request_id: id.into(),
            token_ids: prompt.to_vec(),
            sampling: None,
            logprobs: None,
            target: Some(v1::TransferTarget {
                address: d.address.clone(),
                reservation_id: reservation.reservation_id,
                first_page_index: reservation.first_page_index,
                page_count: reservation.page_count,
                page_ids: reservation.page_ids.clone(),
                kv_format_fingerprint: reservation.kv_format_fingerprint,
                backend: v1::TransferBackend::Grpc as i32,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let mut stream = d
        .client()
        .await
        .decode(v1::DecodeRequest {
            request_id: id.into(),
            token_ids: prompt.to_vec(),
            handoff: Some(v1::Handoff {
                reservation_id: reservation.reservation_id,
                first_token: prefilled.first_token,
                first_logprob: None,
            }),
            sampling: None,
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(NEW_TOKENS),
                ignore_eos: true,
                ..Default::default()
            }),
            logprobs: None,
            skip_special_tokens: None,
        })
        .await
        .unwrap()
        .into_inner();
    while stream.message().await.unwrap().is_some() {}
    prefilled.transfer.expect("pages were pushed")
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
    let p = Server::start(&source, v1::WorkerRole::Prefill).await;
    let d = Server::start(&source, v1::WorkerRole::Decode).await;

    let cold = handoff(&p, &d, &prompt, "metrics-cold").await;
    let warm = handoff(&p, &d, &prompt, "metrics-warm").await;
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
