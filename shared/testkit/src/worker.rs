//! A worker as tests drive it through its gRPC API: its `Load`, the wait until its pages are
//! back, and one prefill → transfer → decode hand-off between two workers.

use std::future::Future;
use std::time::Duration;

use nibble_proto::v1;
use nibble_proto::v1::worker_client::WorkerClient;
use tonic::transport::Channel;

use crate::wait;

/// How long [`WorkerApi::pages_back`] waits.
const PAGES_BACK_WAIT: Duration = Duration::from_secs(5);

/// A worker a test serves (in process): how to reach its Worker API, and what the hand-off
/// needs to know of it.
pub trait WorkerApi: Sync {
    /// Where it listens (`host:port`): its gRPC APIs, and a decode worker's page pushes.
    fn address(&self) -> &str;

    /// The worker id it serves as (a decode worker's, in an NCCL hand-off's target).
    fn worker_id(&self) -> String;

    /// Its KV-cache format's fingerprint.
    fn fingerprint(&self) -> u64;

    /// A plaintext client of its Worker API at [`address`](Self::address). A worker that needs
    /// TLS or a token overrides [`load`](Self::load), and takes no part in a [`handoff`].
    fn client(&self) -> impl Future<Output = WorkerClient<Channel>> + Send {
        async move {
            WorkerClient::connect(format!("http://{}", self.address()))
                .await
                .unwrap()
        }
    }

    /// Its `Load`.
    fn load(&self) -> impl Future<Output = v1::LoadResponse> + Send {
        async move {
            self.client()
                .await
                .load(v1::LoadRequest {})
                .await
                .unwrap()
                .into_inner()
        }
    }

    /// Reserves pages for `tokens` under `request_id`, in its own KV format (panics if refused).
    fn reserve(
        &self,
        request_id: &str,
        tokens: Vec<u32>,
    ) -> impl Future<Output = v1::ReserveResponse> + Send {
        let request = v1::ReserveRequest {
            request_id: request_id.into(),
            token_ids: tokens,
            kv_format_fingerprint: self.fingerprint(),
            ..Default::default()
        };
        async move {
            self.client()
                .await
                .reserve(request)
                .await
                .unwrap()
                .into_inner()
        }
    }

    /// Waits (5 s at most, else panics) until no request holds a page: every page is free or
    /// cached, nothing runs and no reservation is pending. The `Load` that showed it.
    fn pages_back(&self) -> impl Future<Output = v1::LoadResponse> + Send {
        async move {
            wait::until(PAGES_BACK_WAIT, Duration::from_millis(25), || async {
                let load = self.load().await;
                if load.free_pages + load.evictable_pages == load.total_pages
                    && load.running_requests == 0
                    && load.pending_reservations == 0
                {
                    Ok(load)
                } else {
                    Err(load)
                }
            })
            .await
            .unwrap_or_else(|load| panic!("pages not returned: {load:?}"))
        }
    }
}

/// Greedy sampling.
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
    p: &impl WorkerApi,
    d: &impl WorkerApi,
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
    p: &impl WorkerApi,
    d: &impl WorkerApi,
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
    p: &impl WorkerApi,
    d: &impl WorkerApi,
    request_id: &str,
    prompt: &[u32],
    stopping: v1::StoppingCriteria,
    logprobs: Option<v1::LogprobsOptions>,
    backend: v1::TransferBackend,
) -> Handoff {
    let reservation = d
        .client()
        .await
        .reserve(v1::ReserveRequest {
            request_id: request_id.into(),
            token_ids: prompt.to_vec(),
            kv_format_fingerprint: p.fingerprint(),
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
                address: d.address().to_string(),
                reservation_id: reservation.reservation_id,
                first_page_index: reservation.first_page_index,
                page_count: reservation.page_count,
                page_ids: reservation.page_ids.clone(),
                kv_format_fingerprint: reservation.kv_format_fingerprint,
                backend: backend as i32,
                decode_worker_id: d.worker_id(),
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
            generated_token_ids: Vec::new(),
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
