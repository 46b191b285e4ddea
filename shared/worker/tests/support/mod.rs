//! What the worker's test binaries share: the model (its path, and the model loaded once per
//! binary), a worker served on loopback, and one prefill → transfer → decode hand-off through the
//! gRPC APIs.

#![allow(dead_code)] // each test binary uses its own part

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nibble_engine::{CpuBackend, Model, ModelSource, Tokenizer};
use nibble_proto::v1;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_worker::{EngineHandle, WorkerIdentity, WorkerState};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;

pub use nibble_testkit::model_path;

/// The model and tokenizer, loaded once per test binary.
pub fn model() -> &'static (Model<CpuBackend>, Arc<Tokenizer>) {
    static MODEL: OnceLock<(Model<CpuBackend>, Arc<Tokenizer>)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let source = ModelSource::open(model_path()).unwrap();
        let model = source
            .load_model(Arc::new(CpuBackend::new(2).unwrap()))
            .unwrap();
        (model, Arc::new(source.load_tokenizer().unwrap()))
    })
}

/// A worker served on 127.0.0.1:0 until dropped.
pub struct Server {
    pub address: String,
    pub state: Arc<WorkerState>,
    _stop: oneshot::Sender<()>,
}

impl Server {
    /// Serves `engine` as a worker of `role` named `worker_id`.
    pub async fn start(engine: EngineHandle, role: v1::WorkerRole, worker_id: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let state = WorkerState::new(
            engine,
            WorkerIdentity {
                worker_id,
                role,
                model: "smollm2".into(),
                transfer_address: if role == v1::WorkerRole::Decode {
                    address.clone()
                } else {
                    String::new()
                },
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

    pub async fn client(&self) -> WorkerClient<Channel> {
        WorkerClient::connect(format!("http://{}", self.address))
            .await
            .unwrap()
    }

    pub async fn load(&self) -> v1::LoadResponse {
        self.client()
            .await
            .load(v1::LoadRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    /// Waits until no request holds a page: every page is free or cached.
    pub async fn pages_back(&self) -> v1::LoadResponse {
        for _ in 0..200 {
            let load = self.load().await;
            if load.free_pages + load.evictable_pages == load.total_pages
                && load.running_requests == 0
                && load.pending_reservations == 0
            {
                return load;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("pages not returned: {:?}", self.load().await);
    }
}

pub fn greedy() -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// What one hand-off gave.
pub struct Handoff {
    /// The decode worker's tokens (after the prefill worker's first one).
    pub tokens: Vec<u32>,
    pub reservation: v1::ReserveResponse,
    pub transfer: v1::TransferSummary,
    /// The prefill worker's log-probabilities of the first token, when asked for.
    pub first_logprob: Option<v1::TokenLogprob>,
    /// The decode stream's log-probabilities, one per token, when asked for.
    pub logprobs: Vec<v1::TokenLogprob>,
}

/// Reserve on D, Prefill on P (pushing to D), Decode on D, greedy, stopping as `stopping` says.
pub async fn handoff(
    p: &Server,
    d: &Server,
    request_id: &str,
    prompt: &[u32],
    stopping: v1::StoppingCriteria,
) -> Handoff {
    handoff_with(
        p,
        d,
        request_id,
        prompt,
        stopping,
        None,
        v1::TransferBackend::Grpc,
    )
    .await
}

/// [`handoff`] with the target's backend set to `backend` (NCCL also names D's worker id).
pub async fn handoff_over(
    p: &Server,
    d: &Server,
    request_id: &str,
    prompt: &[u32],
    stopping: v1::StoppingCriteria,
    backend: v1::TransferBackend,
) -> Handoff {
    handoff_with(p, d, request_id, prompt, stopping, None, backend).await
}

/// [`handoff`] asking both workers for `logprobs` (the prefill worker's first-token entry
/// travels in the hand-off, as the router sends it), over `backend`.
pub async fn handoff_with(
    p: &Server,
    d: &Server,
    request_id: &str,
    prompt: &[u32],
    stopping: v1::StoppingCriteria,
    logprobs: Option<v1::LogprobsOptions>,
    backend: v1::TransferBackend,
) -> Handoff {
    let fingerprint = p.state.engine().info().fingerprint;
    let reservation = d
        .client()
        .await
        .reserve(v1::ReserveRequest {
            request_id: request_id.into(),
            token_ids: prompt.to_vec(),
            kv_format_fingerprint: fingerprint,
            ttl_ms: None,
            max_tokens: stopping.max_tokens,
        })
        .await
        .unwrap()
        .into_inner();
    let prefilled = p
        .client()
        .await
        .prefill(v1::PrefillRequest {
            request_id: request_id.into(),
            token_ids: prompt.to_vec(),
            sampling: Some(greedy()),
            logprobs,
            target: Some(v1::TransferTarget {
                address: d.address.clone(),
                reservation_id: reservation.reservation_id,
                first_page_index: reservation.first_page_index,
                page_count: reservation.page_count,
                page_ids: reservation.page_ids.clone(),
                kv_format_fingerprint: reservation.kv_format_fingerprint,
                backend: backend as i32,
                decode_worker_id: d.state.identity().worker_id.clone(),
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let mut stream = d
        .client()
        .await
        .decode(v1::DecodeRequest {
            request_id: request_id.into(),
            token_ids: prompt.to_vec(),
            handoff: Some(v1::Handoff {
                reservation_id: reservation.reservation_id,
                first_token: prefilled.first_token,
                first_logprob: prefilled.logprob.clone(),
            }),
            sampling: Some(greedy()),
            stopping: Some(stopping),
            logprobs,
            skip_special_tokens: None,
        })
        .await
        .unwrap()
        .into_inner();
    let mut tokens = Vec::new();
    let mut logprobs = Vec::new();
    let mut finished = false;
    while let Some(chunk) = stream.message().await.unwrap() {
        tokens.extend(chunk.token_ids);
        logprobs.extend(chunk.logprobs);
        finished |= chunk.usage.is_some();
    }
    assert!(finished, "the last chunk carries usage");
    Handoff {
        tokens,
        reservation,
        transfer: prefilled.transfer.expect("pages were pushed"),
        first_logprob: prefilled.logprob,
        logprobs,
    }
}
