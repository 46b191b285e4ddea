//! A decode worker trusts no pushed page (issue 18): pages of bytes no writer produces, pages
//! outside the reservation and pages named twice are refused with INVALID_ARGUMENT naming the
//! page and the check, the reservation is released at once, and nothing of the push is decoded
//! or cached. Over the gRPC stream here; `nccl.rs` does the NCCL path.

mod support;

use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::SeqId;
use nibble_engine::Event;
use nibble_kvfmt::{KvDtype, KvPart, WindowLayout};
use nibble_proto::v1;
use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use nibble_testkit::{handoff_with, model, Handoff, WorkerApi};
use support::{engine, Server};
use tonic::Code;

const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife. However little known the feelings";
const NEW_TOKENS: u32 = 8;

fn prompt() -> Vec<u32> {
    model().1.encode(PROMPT, false).unwrap()
}

async fn server(role: v1::WorkerRole, dtype: KvDtype) -> Server {
    let id = format!("{}-{dtype}", role.as_str_name());
    Server::start(engine(dtype), role, id).await
}

/// The engine's own greedy tokens for the prompt, cold.
async fn reference(dtype: KvDtype) -> Vec<u32> {
    let mut events = engine(dtype)
        .submit(SeqId(1), prompt(), SamplingParams::greedy(NEW_TOKENS))
        .await
        .unwrap();
    let mut tokens = Vec::new();
    while let Some(event) = events.recv().await {
        if let Event::Token { token, .. } = event {
            tokens.push(token);
        }
    }
    tokens
}

/// Pushes `messages` (page indices and their bytes) into `reservation` on `d`, as any client
/// that can reach the decode worker's KvTransfer service can.
async fn push(
    d: &Server,
    reservation: &v1::ReserveResponse,
    messages: Vec<(Vec<u32>, Vec<u8>)>,
) -> Result<v1::PushPagesResponse, tonic::Status> {
    let fingerprint = d.fingerprint();
    let messages: Vec<_> = messages
        .into_iter()
        .enumerate()
        .map(|(n, (page_indices, data))| v1::PushPagesRequest {
            reservation_id: reservation.reservation_id,
            page_indices,
            data: data.into(),
            kv_format_fingerprint: (n == 0).then_some(fingerprint),
            request_id: String::new(),
        })
        .collect();
    KvTransferClient::connect(format!("http://{}", d.address))
        .await
        .unwrap()
        .max_encoding_message_size(64 << 20)
        .push_pages(tokio_stream::iter(messages))
        .await
        .map(tonic::Response::into_inner)
}

/// Every page the reservation awaits, `fill` bytes each, in one message.
fn all_pages(d: &Server, reservation: &v1::ReserveResponse, fill: u8) -> (Vec<u32>, Vec<u8>) {
    let page_bytes = d.state.engine().info().page_bytes;
    let first = reservation.first_page_index;
    let indices: Vec<u32> = (first..first + reservation.page_count).collect();
    let data = vec![fill; indices.len() * page_bytes];
    (indices, data)
}

/// The refusal released the reservation: nothing pending, every page free (nothing entered
/// the prefix cache), and Decode of it is NOT_FOUND.
async fn released(d: &Server, reservation: &v1::ReserveResponse, request_id: &str) {
    let load = d.state.engine().load().await.unwrap();
    assert_eq!(d.state.pending_reservations(), 0);
    assert_eq!(load.held, 0, "the engine holds nothing for it");
    assert_eq!(load.cached_pages, 0, "nothing entered the prefix cache");
    assert_eq!(load.free_pages, load.total_pages, "no page leaked");
    let err = d
        .client()
        .await
        .decode(v1::DecodeRequest {
            request_id: request_id.into(),
            token_ids: prompt(),
            handoff: Some(v1::Handoff {
                reservation_id: reservation.reservation_id,
                first_token: 1,
                first_logprob: None,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
}

/// The attack of issue 18: reserve, push pages of 0xFF (NaN block scales), then a request with
/// that prefix. The push is refused, and the request decodes what the engine decodes alone,
/// with finite log-probabilities.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_of_nan_scales_are_refused_and_later_requests_decode_normally() {
    let dtype = KvDtype::Nvfp4;
    let expected = reference(dtype).await;
    let d = server(v1::WorkerRole::Decode, dtype).await;
    let p = server(v1::WorkerRole::Prefill, dtype).await;

    let reservation = d.reserve("attack", prompt()).await;
    assert_eq!(reservation.first_page_index, 0);
    let err = push(&d, &reservation, vec![all_pages(&d, &reservation, 0xFF)])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(
        err.message()
            .starts_with("page 0 of the reservation: NVFP4 block scale 0xff at byte ")
            && err
                .message()
                .contains("(layer 0 K, head 0, token 0) is NaN"),
        "the refusal names the page and the check: {err}"
    );
    released(&d, &reservation, "attack").await;
    assert_eq!(d.state.counters().totals().pages_received, 0);

    // A request with that prefix: nothing of the attack is reused, and it decodes normally.
    let options = v1::LogprobsOptions {
        enabled: true,
        top_logprobs: 0,
        prompt_logprobs: None,
    };
    let stopping = v1::StoppingCriteria {
        max_tokens: Some(NEW_TOKENS),
        ..Default::default()
    };
    let Handoff {
        tokens,
        reservation,
        logprobs,
        ..
    } = handoff_with(
        &p,
        &d,
        "after",
        &prompt(),
        stopping,
        Some(options),
        v1::TransferBackend::Grpc,
    )
    .await;
    assert_eq!(
        reservation.cached_tokens, 0,
        "no page of the attack is cached"
    );
    assert_eq!(tokens, expected);
    assert_eq!(logprobs.len(), tokens.len());
    assert!(
        logprobs
            .iter()
            .all(|l| l.logprob.is_finite() && l.logprob <= 0.0),
        "{logprobs:?}"
    );
    for w in [&p, &d] {
        w.pages_back().await;
    }
}

/// A page named twice (in one message or two) or outside the reservation is refused, and its
/// reservation released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_named_twice_or_outside_the_reservation_are_refused() {
    let d = server(v1::WorkerRole::Decode, KvDtype::Nvfp4).await;
    let page_bytes = d.state.engine().info().page_bytes;
    // Zero bytes are valid pages of every dtype (scales 0, elements 0).
    let zeros = |pages: usize| vec![0u8; pages * page_bytes];
    let named_twice = "page_indices: page 1 of the reservation was already named";
    for (n, what) in [
        "twice in one message",
        "again in a later message",
        "outside the reservation",
    ]
    .into_iter()
    .enumerate()
    {
        let request_id = format!("r{n}");
        let reservation = d.reserve(&request_id, prompt()).await;
        let count = reservation.page_count;
        let (messages, expected) = match n {
            0 => (vec![vec![1, 1]], named_twice.to_string()),
            1 => (vec![vec![0, 1], vec![2], vec![1]], named_twice.to_string()),
            _ => (
                vec![vec![0], vec![count]],
                format!("page_indices: page {count} is outside the reservation's pages 0..{count}"),
            ),
        };
        let messages = messages
            .into_iter()
            .map(|indices| {
                let data = zeros(indices.len());
                (indices, data)
            })
            .collect();
        let err = push(&d, &reservation, messages).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err}");
        assert_eq!(err.message(), expected, "{what}");
        released(&d, &reservation, &request_id).await;
    }
    // The same pages, once each: accepted.
    let reservation = d.reserve("good", prompt()).await;
    let response = push(&d, &reservation, vec![all_pages(&d, &reservation, 0)])
        .await
        .unwrap();
    assert!(response.complete);
    assert_eq!(response.pages, reservation.page_count);
    d.client()
        .await
        .abort(v1::AbortRequest {
            request_id: "good".into(),
        })
        .await
        .unwrap();
    d.pages_back().await;
}

/// Each dtype's check, and the recent window's, names the page and the byte's place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_and_the_window_are_checked() {
    for dtype in KvDtype::ALL {
        let d = server(v1::WorkerRole::Decode, dtype).await;
        let info = d.state.engine().info().clone();
        let layout = info.kv_format.layout;
        let tokens = prompt().len();
        let last = (tokens - 1) / layout.page_size();
        let token = (tokens - 1) % layout.page_size();
        // The sequence's last token, layer 3's V, head 2: a NaN (or, in nvfp4, a NaN scale).
        let (at, bad, check): (usize, &[u8], &str) = match dtype {
            KvDtype::Nvfp4 => (
                layout.scale_offset(3, KvPart::V, 2, token),
                &[0x7F],
                "NVFP4 block scale 0x7f",
            ),
            KvDtype::Fp8 => (
                layout.data_offset(3, KvPart::V, 2, token) + 5,
                &[0xFF],
                "FP8 element 0xff",
            ),
            KvDtype::Bf16 => (
                layout.data_offset(3, KvPart::V, 2, token) + 10,
                &[0x80, 0x7F],
                "BF16 element 0x7f80",
            ),
        };
        let mut cases = vec![(last, at, bad, check.to_string(), format!("token {token}"))];
        if info.kv_format.window > 0 {
            // The window holds the last token in BF16 too, after the prompt's pages.
            let window = WindowLayout::new(&layout, info.kv_format.window).unwrap();
            let (page, offset) = window.locate(3, KvPart::V, 2, tokens - 1);
            cases.push((
                last + 1 + page,
                offset,
                &[0xC1, 0xFF],
                "recent-window BF16 value 0xffc1".into(),
                format!("position {}", tokens - 1),
            ));
        }
        for (n, (page, at, bad, check, place)) in cases.into_iter().enumerate() {
            let request_id = format!("{dtype}-{n}");
            let reservation = d.reserve(&request_id, prompt()).await;
            let (indices, mut data) = all_pages(&d, &reservation, 0);
            let start = page * info.page_bytes + at;
            data[start..start + bad.len()].copy_from_slice(bad);
            let err = push(&d, &reservation, vec![(indices, data)])
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{dtype}: {err}");
            let message = err.message();
            assert!(
                message.starts_with(&format!("page {page} of the reservation: {check} at byte {at} (layer 3 V, head 2, {place})")),
                "{dtype}: {message}"
            );
            released(&d, &reservation, &request_id).await;
        }
    }
}
