//! Hand-offs at their edges, found by the chaos test and the failover measurements.
//!
//! * The decode worker already holds every page of the prompt: a prompt of whole pages, cached
//!   on the decode worker by an earlier hand-off, in a K/V format without a recent window (fp8,
//!   bf16). The reservation awaits no page, so the prefill worker pushes none and the decode
//!   worker decodes from its cache. (The prefill worker used to open a push of no message,
//!   which the decode worker refuses, and the request failed INVALID_ARGUMENT.)
//! * The reservation expired before the prompt was prefilled (a long prefill queue): the
//!   prefill fails DEADLINE_EXCEEDED, which the router tells its client as a request that took
//!   too long, not NOT_FOUND (which it passed on as the client's mistake, internals and all).

mod support;

use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_testkit::{greedy, handoff, model, Handoff, WorkerApi};
use support::{engine, Server};
use tonic::Code;

/// Two whole pages of 16 tokens.
const PROMPT_TOKENS: usize = 32;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_holding_the_whole_prompt_is_sent_no_page() {
    let text = "It is a truth universally acknowledged, that a single man in possession of a \
                good fortune, must be in want of a wife. However little known the feelings or \
                views of such a man may be on his first entering a neighbourhood";
    let prompt = model().1.encode(text, false).unwrap()[..PROMPT_TOKENS].to_vec();
    let stopping = v1::StoppingCriteria {
        max_tokens: Some(6),
        ignore_eos: true,
        ..Default::default()
    };
    for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
        let p = Server::start(engine(dtype), v1::WorkerRole::Prefill, "p".into()).await;
        let d = Server::start(engine(dtype), v1::WorkerRole::Decode, "d".into()).await;
        let cold = handoff(&p, &d, "cold", &prompt, stopping.clone()).await;
        assert_eq!(cold.reservation.cached_tokens, 0, "{dtype}");
        let Handoff {
            tokens,
            reservation,
            transfer,
            ..
        } = handoff(&p, &d, "warm", &prompt, stopping.clone()).await;
        assert_eq!(
            reservation.cached_tokens as usize, PROMPT_TOKENS,
            "{dtype}: the decode worker cached the whole prompt"
        );
        assert_eq!(reservation.page_count, 0, "{dtype}");
        assert_eq!(transfer.pages, 0, "{dtype}");
        // The cached pages are the bytes the prefill worker sent the first time.
        assert_eq!(tokens, cold.tokens, "{dtype}");
        for w in [&p, &d] {
            let load = w.pages_back().await;
            assert_eq!(load.pending_reservations, 0, "{dtype}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_that_expired_before_its_prefill_fails_it_as_too_slow() {
    let prompt = model().1.encode("The capital of France is", false).unwrap();
    let p = Server::start(engine(KvDtype::Nvfp4), v1::WorkerRole::Prefill, "p".into()).await;
    let d = Server::start(engine(KvDtype::Nvfp4), v1::WorkerRole::Decode, "d".into()).await;
    let reservation = d
        .client()
        .await
        .reserve(v1::ReserveRequest {
            request_id: "late".into(),
            token_ids: prompt.clone(),
            kv_format_fingerprint: p.fingerprint(),
            ttl_ms: Some(1),
            max_tokens: Some(4),
        })
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let err = p
        .client()
        .await
        .prefill(v1::PrefillRequest {
            request_id: "late".into(),
            token_ids: prompt,
            sampling: Some(greedy()),
            logprobs: None,
            target: Some(v1::TransferTarget {
                address: d.address().to_string(),
                reservation_id: reservation.reservation_id,
                first_page_index: reservation.first_page_index,
                page_count: reservation.page_count,
                page_ids: reservation.page_ids,
                kv_format_fingerprint: reservation.kv_format_fingerprint,
                backend: v1::TransferBackend::Grpc as i32,
                decode_worker_id: d.worker_id(),
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    for w in [&p, &d] {
        let load = w.pages_back().await;
        assert_eq!(load.pending_reservations, 0);
    }
}
