//! The worker end to end on loopback with the real model: the engine actor, and prefill and
//! decode workers as in-process gRPC servers handing pages off through `KvTransfer`.

mod support;

use std::sync::Arc;
use std::time::Duration;

use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::SeqId;
use nibble_engine::Event;
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use nibble_testkit::{greedy, handoff, handoff_with, model, Handoff, WorkerApi};
use support::{engine, Server, PAGES};
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife. However little known the feelings";
const NEW_TOKENS: u32 = 8;

fn prompt() -> Vec<u32> {
    model().1.encode(PROMPT, false).unwrap()
}

/// A worker of `role` over a new engine of `dtype`, served on loopback.
async fn server(role: v1::WorkerRole, dtype: KvDtype) -> Server {
    let id = format!("{}-{dtype}", role.as_str_name());
    Server::start(engine(dtype), role, id).await
}

/// At most [`NEW_TOKENS`] tokens.
fn stopping() -> v1::StoppingCriteria {
    v1::StoppingCriteria {
        max_tokens: Some(NEW_TOKENS),
        ..Default::default()
    }
}

/// The engine's own tokens for the prompt, through the actor: with a cold cache, then again
/// with the prompt's pages cached (the extend path reads them back, so the tokens may differ).
async fn reference(dtype: KvDtype) -> (Vec<u32>, Vec<u32>) {
    let e = engine(dtype);
    let mut runs = Vec::new();
    for id in [1, 2] {
        let mut events = e
            .submit(SeqId(id), prompt(), SamplingParams::greedy(NEW_TOKENS))
            .await
            .unwrap();
        let mut tokens = Vec::new();
        while let Some(event) = events.recv().await {
            if let Event::Token { token, .. } = event {
                tokens.push(token);
            }
        }
        runs.push(tokens);
    }
    let warm = runs.pop().unwrap();
    (runs.pop().unwrap(), warm)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_through_grpc_gives_the_tokens_of_one_engine() {
    let mut moved = Vec::new();
    for dtype in [KvDtype::Nvfp4, KvDtype::Fp8, KvDtype::Bf16] {
        let (expected, expected_warm) = reference(dtype).await;
        assert_eq!(expected.len(), NEW_TOKENS as usize);
        let p = server(v1::WorkerRole::Prefill, dtype).await;
        let d = server(v1::WorkerRole::Decode, dtype).await;

        let Handoff {
            tokens,
            reservation,
            transfer,
            ..
        } = handoff(&p, &d, "cold", &prompt(), stopping()).await;
        assert_eq!(tokens, expected, "{dtype}, cold decode cache");
        assert_eq!(reservation.cached_tokens, 0);
        let page_bytes = p.state.engine().info().page_bytes as u64;
        assert_eq!(transfer.pages, reservation.page_count);
        assert_eq!(transfer.bytes, u64::from(transfer.pages) * page_bytes);
        let sent = p.state.counters().totals();
        let received = d.state.counters().totals();
        assert_eq!(
            (sent.pages_sent, sent.bytes_sent),
            (received.pages_received, received.bytes_received)
        );
        assert_eq!(sent.bytes_sent, transfer.bytes);
        moved.push((dtype, transfer.pages, transfer.bytes));

        // Both caches now hold the prompt's full pages: D reserves only the partial last page.
        let Handoff {
            tokens,
            reservation,
            transfer: warm,
            ..
        } = handoff(&p, &d, "warm", &prompt(), stopping()).await;
        assert_eq!(tokens, expected_warm, "{dtype}, warm caches");
        assert!(
            reservation.cached_tokens > 0,
            "{dtype}: D reuses its prefix"
        );
        assert!(warm.pages < transfer.pages);

        for w in [&p, &d] {
            let load = w.pages_back().await;
            assert_eq!(load.total_pages, PAGES as u64);
        }
    }
    let (_, nvfp4_pages, nvfp4) = moved[0];
    let (_, fp8_pages, fp8) = moved[1];
    let (_, _, bf16) = moved[2];
    // nvfp4 moves its recent window too: 48 tokens of SmolLM2 in 11 pages.
    assert_eq!(
        nvfp4_pages,
        fp8_pages + 11,
        "the prompt's pages and the window's"
    );
    assert_eq!(
        nvfp4 / u64::from(nvfp4_pages) * 10_000,
        fp8 / u64::from(fp8_pages) * 5_625,
        "an nvfp4 page is 0.5625x an fp8 page"
    );
    assert_eq!(bf16, 2 * fp8);
}

/// The first token is sampled on the prefill worker: its log-probability and alternatives come
/// back in PrefillResponse and, through the hand-off, lead the decode stream's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_logprobs_survive_the_handoff() {
    let dtype = KvDtype::Nvfp4;
    let (expected, _) = reference(dtype).await;
    let p = server(v1::WorkerRole::Prefill, dtype).await;
    let d = server(v1::WorkerRole::Decode, dtype).await;
    let options = v1::LogprobsOptions {
        enabled: true,
        top_logprobs: 3,
        prompt_logprobs: None,
    };
    let Handoff {
        tokens,
        first_logprob,
        logprobs,
        ..
    } = handoff_with(
        &p,
        &d,
        "top",
        &prompt(),
        stopping(),
        Some(options),
        v1::TransferBackend::Grpc,
    )
    .await;
    assert_eq!(tokens, expected, "logprobs change no token");
    let first = first_logprob.expect("the prefill worker computed them");
    assert_eq!(first.top.len(), 3);
    assert_eq!(logprobs.len(), tokens.len(), "one entry per token");
    assert_eq!(logprobs[0], first, "the hand-off's entry leads the stream");
    for (token, lp) in tokens.iter().zip(&logprobs) {
        assert_eq!(lp.token_id, *token);
        assert_eq!(lp.top.len(), 3, "{lp:?}");
        assert_eq!(lp.top[0].token_id, *token, "greedy takes the most likely");
        assert_eq!(lp.top[0].logprob, lp.logprob);
        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert!(lp.top.iter().all(|t| t.logprob <= 0.0));
    }

    // Out of range, or alternatives without logprobs: refused, naming the field.
    for (enabled, top_logprobs) in [(true, 21), (false, 2)] {
        let status = p
            .client()
            .await
            .prefill(v1::PrefillRequest {
                request_id: format!("bad-{top_logprobs}"),
                token_ids: prompt(),
                sampling: Some(greedy()),
                logprobs: Some(v1::LogprobsOptions {
                    enabled,
                    top_logprobs,
                    prompt_logprobs: None,
                }),
                target: None,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert_eq!(
            nibble_proto::request::refused_field(&status),
            Some("logprobs.top_logprobs"),
            "{status:?}"
        );
    }
    for w in [&p, &d] {
        w.pages_back().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_decode_and_expired_reservations_free_pages() {
    let d = server(v1::WorkerRole::Decode, KvDtype::Nvfp4).await;
    // Local prefill (no hand-off), cancelled after the first chunk.
    let mut stream = d
        .client()
        .await
        .decode(v1::DecodeRequest {
            request_id: "cancelled".into(),
            token_ids: prompt(),
            sampling: Some(greedy()),
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(500),
                ignore_eos: false,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.token_ids.len(), 1);
    drop(stream);
    let load = d.pages_back().await;
    assert_eq!(load.free_pages, load.total_pages - load.evictable_pages);

    // Abort ends a running stream with ABORTED.
    let mut stream = d
        .client()
        .await
        .decode(v1::DecodeRequest {
            request_id: "stopped".into(),
            token_ids: prompt(),
            sampling: Some(greedy()),
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(500),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap();
    let aborted = d
        .client()
        .await
        .abort(v1::AbortRequest {
            request_id: "stopped".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(aborted.found);
    let err = loop {
        match stream.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("an aborted stream ends with an error"),
            Err(status) => break status,
        }
    };
    assert_eq!(err.code(), Code::Aborted, "{err}");
    d.pages_back().await;

    // An unfilled reservation is freed when its TTL passes, and Abort frees another at once.
    let reserve = |id: &str, ttl_ms| v1::ReserveRequest {
        request_id: id.into(),
        token_ids: prompt(),
        kv_format_fingerprint: d.state.engine().info().fingerprint,
        ttl_ms,
        max_tokens: None,
    };
    let mut client = d.client().await;
    let expires = client
        .reserve(reserve("expires", Some(50)))
        .await
        .unwrap()
        .into_inner();
    let kept = client
        .reserve(reserve("aborted", Some(60_000)))
        .await
        .unwrap()
        .into_inner();
    assert!(kept.page_count > 0);
    // A caller cannot hold pages longer than the worker allows.
    let greedy_ttl = client
        .reserve(reserve("greedy-ttl", Some(u32::MAX)))
        .await
        .unwrap()
        .into_inner();
    let cap = d.state.identity().reservation_ttl.as_millis() as u32;
    assert_eq!(greedy_ttl.ttl_ms, cap);
    client
        .abort(v1::AbortRequest {
            request_id: "greedy-ttl".into(),
        })
        .await
        .unwrap();
    let aborted = client
        .abort(v1::AbortRequest {
            request_id: "aborted".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(aborted.found);
    assert!(aborted.freed_pages > 0);
    d.pages_back().await;
    // Decoding an expired reservation is NOT_FOUND.
    let err = client
        .decode(v1::DecodeRequest {
            request_id: "expires".into(),
            token_ids: prompt(),
            handoff: Some(v1::Handoff {
                reservation_id: expires.reservation_id,
                first_token: 1,
                first_logprob: None,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_formats_and_unknown_reservations_are_refused() {
    let d = server(v1::WorkerRole::Decode, KvDtype::Nvfp4).await;
    let p = server(v1::WorkerRole::Prefill, KvDtype::Fp8).await;
    let ours = d.state.engine().info().fingerprint;
    let theirs = p.state.engine().info().fingerprint;
    assert_ne!(ours, theirs);
    // Health: both serve Worker and KvTransfer (a prefill worker may become a decode worker in
    // place; until then no reservation of its can be filled).
    for (server, service, serving) in [
        (&d, "nibble.v1.Worker", true),
        (&d, "nibble.v1.KvTransfer", true),
        (&p, "nibble.v1.Worker", true),
        (&p, "nibble.v1.KvTransfer", true),
    ] {
        let channel = Channel::from_shared(format!("http://{}", server.address))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = HealthClient::new(channel);
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await;
        match status {
            Ok(r) => {
                assert!(serving, "{service}");
                assert_eq!(r.into_inner().status, ServingStatus::Serving as i32);
            }
            Err(e) => {
                assert!(!serving, "{service}: {e}");
                assert_eq!(e.code(), Code::NotFound);
            }
        }
    }
    let info = d
        .client()
        .await
        .info(v1::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.kv_format_fingerprint, ours);
    assert_eq!(info.kv_format.unwrap().fingerprint(), ours);

    let mut client = d.client().await;
    let err = client
        .reserve(v1::ReserveRequest {
            request_id: "r".into(),
            token_ids: prompt(),
            kv_format_fingerprint: theirs,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    // The refusal says what this worker runs and which flags a peer must match.
    assert!(
        err.message().contains("nvfp4, 16-token pages")
            && err.message().contains("recent window 48")
            && err.message().contains("--kv-window"),
        "{err}"
    );
    let reservation = client
        .reserve(v1::ReserveRequest {
            request_id: "r".into(),
            token_ids: prompt(),
            kv_format_fingerprint: ours,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();

    // The prefill worker refuses to push to a worker of another format.
    let err = p
        .client()
        .await
        .prefill(v1::PrefillRequest {
            request_id: "r".into(),
            token_ids: prompt(),
            sampling: Some(greedy()),
            target: Some(v1::TransferTarget {
                address: d.address.clone(),
                reservation_id: reservation.reservation_id,
                first_page_index: reservation.first_page_index,
                page_count: reservation.page_count,
                kv_format_fingerprint: ours,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");

    // The decode worker refuses pages of another format, and pages for unknown reservations.
    let page_bytes = d.state.engine().info().page_bytes;
    let mut transfer = KvTransferClient::connect(format!("http://{}", d.address))
        .await
        .unwrap();
    let push = |reservation_id, fingerprint| {
        tokio_stream::iter(vec![v1::PushPagesRequest {
            reservation_id,
            page_indices: vec![0],
            data: vec![0u8; page_bytes].into(),
            kv_format_fingerprint: Some(fingerprint),
            request_id: "r".into(),
        }])
    };
    let err = transfer
        .push_pages(push(reservation.reservation_id, theirs))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    let err = transfer
        .push_pages(push(reservation.reservation_id + 1000, ours))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert_eq!(d.state.counters().totals().pages_received, 0);
    // A prefill worker has no reservation to fill.
    let mut to_prefill = KvTransferClient::connect(format!("http://{}", p.address))
        .await
        .unwrap();
    let err = to_prefill.push_pages(push(1, theirs)).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert_eq!(p.state.counters().totals().pages_received, 0);

    client
        .abort(v1::AbortRequest {
            request_id: "r".into(),
        })
        .await
        .unwrap();
    d.pages_back().await;
    p.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_actor_publishes_kv_events_and_aborts_dropped_requests() {
    let e = engine(KvDtype::Nvfp4);
    let mut kv = e.subscribe_kv_events();
    let mut events = e
        .submit(SeqId(1), prompt(), SamplingParams::greedy(2))
        .await
        .unwrap();
    while events.recv().await.is_some() {}
    // The snapshot publishes pending changes first, so every batch is queued once it returns.
    let cache = e.kv_snapshot().await.unwrap();
    let snapshot = &cache.snapshot;
    let mut ids = Vec::new();
    let mut stored = 0;
    while let Ok(batch) = kv.try_recv() {
        assert_eq!(batch.instance_id, cache.instance_id);
        for event in batch.events {
            ids.push(event.id);
            if let nibble_kvcache::KvEventData::Stored { blocks, .. } = event.data {
                stored += blocks.len();
            }
        }
    }
    assert_eq!(
        ids,
        (1..=ids.len() as u64).collect::<Vec<_>>(),
        "ids without gaps"
    );
    assert_eq!(snapshot.blocks.len(), stored);
    assert!(snapshot.blocks.len() >= prompt().len() / 16);
    assert_eq!(
        snapshot.last_event_id,
        *ids.last().unwrap(),
        "the snapshot reflects every published event"
    );

    // A dropped receiver aborts its request.
    let events = e
        .submit(SeqId(2), prompt(), SamplingParams::greedy(500))
        .await
        .unwrap();
    drop(events);
    for _ in 0..200 {
        let load = e.load().await.unwrap();
        if load.running + load.waiting == 0 {
            assert_eq!(load.free_pages + load.cached_pages, load.total_pages);
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the dropped request still runs: {:?}", e.load().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_load_follows_the_engine_and_is_exact_when_idle() {
    let e = engine(KvDtype::Nvfp4);
    // Published before the engine took any command.
    let idle = e.published_load().unwrap();
    assert_eq!(idle.total_pages, PAGES);
    assert_eq!(idle.free_pages, PAGES);
    let mut events = e
        .submit(SeqId(1), prompt(), SamplingParams::greedy(40))
        .await
        .unwrap();
    // While it runs, polls see it without waiting for a step.
    let mut seen_running = false;
    loop {
        tokio::select! {
            event = events.recv() => if event.is_none() { break },
            () = tokio::time::sleep(Duration::from_millis(5)) => {
                let load = e.published_load().unwrap();
                seen_running |= load.running == 1;
            }
        }
    }
    assert!(
        seen_running,
        "a running request shows in the published load"
    );
    // Idle again: the published load is the exact one.
    let exact = e.load().await.unwrap();
    assert_eq!(exact.running, 0);
    assert_eq!(e.published_load().unwrap(), exact);
    assert_eq!(exact.free_pages + exact.cached_pages, exact.total_pages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_and_refresh_their_capacity() {
    use nibble_discovery::{Discovery, Role, StaticRegistry};

    let d = server(v1::WorkerRole::Decode, KvDtype::Nvfp4).await;
    let registry = StaticRegistry::new();
    let discovery: Arc<dyn Discovery> = Arc::new(registry.session());
    let (_membership, task) = nibble_worker::membership::register(
        Arc::clone(&discovery),
        Arc::clone(&d.state),
        &d.address,
        Duration::from_millis(20),
    )
    .await
    .unwrap();
    let listed = registry.session().list(Some(Role::Decode)).await.unwrap();
    assert_eq!(listed.len(), 1);
    let info = &listed[0];
    assert_eq!(info.addresses.grpc, d.address);
    assert_eq!(info.addresses.transfer.as_deref(), Some(d.address.as_str()));
    assert_eq!(info.kv_fingerprint, d.state.engine().info().fingerprint);
    assert_eq!(info.page_size, 16);
    assert_eq!(info.capacity.total_pages, PAGES as u64);
    assert_eq!(info.capacity.free_pages, PAGES as u64);

    // A reservation lowers the registered free capacity.
    d.client()
        .await
        .reserve(v1::ReserveRequest {
            request_id: "held".into(),
            token_ids: prompt(),
            kv_format_fingerprint: info.kv_fingerprint,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut free = PAGES as u64;
    for _ in 0..200 {
        free = registry.session().list(Some(Role::Decode)).await.unwrap()[0]
            .capacity
            .free_pages;
        if free < PAGES as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(free < PAGES as u64, "capacity refreshed");
    task.abort();
}

/// A failed engine (as a device error fails it) ends every open stream with UNAVAILABLE, turns
/// health NOT_SERVING and leaves the membership at once, without waiting for a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_engine_stops_serving_and_leaves_the_membership() {
    use nibble_discovery::{Discovery, Role, StaticRegistry};

    let d = server(v1::WorkerRole::Decode, KvDtype::Nvfp4).await;
    let registry = StaticRegistry::new();
    let discovery: Arc<dyn Discovery> = Arc::new(registry.session());
    let _registration = nibble_worker::membership::register(
        Arc::clone(&discovery),
        Arc::clone(&d.state),
        &d.address,
        Duration::from_millis(20),
    )
    .await
    .unwrap();
    let mut stream = d
        .client()
        .await
        .decode(v1::DecodeRequest {
            request_id: "running".into(),
            token_ids: prompt(),
            sampling: Some(greedy()),
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(500),
                ignore_eos: true,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().expect("a first token");

    d.state.engine().inject_failure();
    let reason = tokio::time::timeout(Duration::from_secs(10), d.state.engine().stopped())
        .await
        .expect("the engine reports its failure");
    assert!(reason.contains("injected engine failure"), "{reason}");
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended as if its answer were complete"),
                Err(status) => break status,
            }
        }
    })
    .await
    .expect("the open stream ends");
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");

    let channel = Channel::from_shared(format!("http://{}", d.address))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut statuses = Vec::new();
    let mut members = usize::MAX;
    for _ in 0..200 {
        statuses.clear();
        for service in ["", "nibble.v1.Worker", "nibble.v1.KvTransfer"] {
            let r = health
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap();
            statuses.push(r.into_inner().status);
        }
        members = registry
            .session()
            .list(Some(Role::Decode))
            .await
            .unwrap()
            .len();
        if members == 0
            && statuses
                .iter()
                .all(|&s| s == ServingStatus::NotServing as i32)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(members, 0, "the registration ends at once");
    assert!(
        statuses
            .iter()
            .all(|&s| s == ServingStatus::NotServing as i32),
        "{statuses:?}"
    );
    let load = d.client().await.load(v1::LoadRequest {}).await.unwrap_err();
    assert_eq!(load.code(), Code::Unavailable, "{load:?}");
}

/// A decode worker told to become a prefill worker refuses new decode work at once, finishes
/// the decode it runs, then registers as a prefill worker, keeps its engine and prefills; every
/// page comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_changes_role_once_the_work_it_began_has_ended() {
    use nibble_discovery::{Discovery, Role, StaticRegistry};

    let d = server(v1::WorkerRole::Decode, KvDtype::Nvfp4).await;
    let registry = StaticRegistry::new();
    let discovery: Arc<dyn Discovery> = Arc::new(registry.session());
    let (membership, _refresh) = nibble_worker::membership::register(
        Arc::clone(&discovery),
        Arc::clone(&d.state),
        &d.address,
        Duration::from_millis(20),
    )
    .await
    .unwrap();
    let prefill = |id: &str| v1::PrefillRequest {
        request_id: id.into(),
        token_ids: prompt(),
        sampling: Some(greedy()),
        ..Default::default()
    };
    // Prefill work is not a decode worker's.
    let err = d
        .client()
        .await
        .prefill(prefill("early"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.message().contains("is a decode worker"), "{err}");

    let mut stream = d
        .client()
        .await
        .decode(v1::DecodeRequest {
            request_id: "running".into(),
            token_ids: prompt(),
            sampling: Some(greedy()),
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(40),
                ignore_eos: true,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut tokens = stream.message().await.unwrap().unwrap().token_ids.len();
    let changing = {
        let membership = Arc::clone(&membership);
        tokio::spawn(async move { membership.change_role(Role::Prefill).await })
    };
    // Draining: registered as such, no new decode work, the running decode goes on.
    for _ in 0..200 {
        let listed = registry.session().list(None).await.unwrap();
        if listed.iter().any(|w| w.role == Role::Decode && w.draining) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let listed = registry.session().list(None).await.unwrap();
    assert!(
        listed[0].draining && listed[0].role == Role::Decode,
        "{listed:?}"
    );
    let err = d
        .client()
        .await
        .reserve(v1::ReserveRequest {
            request_id: "late".into(),
            token_ids: prompt(),
            kv_format_fingerprint: d.state.engine().info().fingerprint,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.message().contains("leaving the decode role"), "{err}");
    assert!(
        !changing.is_finished(),
        "the change waits for the running decode"
    );
    while let Some(chunk) = stream.message().await.unwrap() {
        tokens += chunk.token_ids.len();
    }
    assert_eq!(tokens, 40, "the running decode finished whole");
    let change = changing.await.unwrap().unwrap();
    assert_eq!((change.from, change.to), (Role::Decode, Role::Prefill));

    // One registration, as a prefill worker, taking prefill work now.
    let listed = registry.session().list(None).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!((listed[0].role, listed[0].draining), (Role::Prefill, false));
    assert_eq!(d.state.role(), v1::WorkerRole::Prefill);
    let cached = d.state.engine().load().await.unwrap().cached_pages;
    assert!(
        cached > 0,
        "the decode's prompt pages stay in its prefix cache"
    );
    d.client().await.prefill(prefill("after")).await.unwrap();
    let info = d.client().await.info(v1::InfoRequest {}).await.unwrap();
    assert_eq!(info.into_inner().role(), v1::WorkerRole::Prefill);
    for _ in 0..200 {
        let load = d.state.engine().load().await.unwrap();
        if load.running + load.waiting + load.held == 0 {
            assert_eq!(load.free_pages + load.evictable_pages, load.total_pages);
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("pages still held: {:?}", d.state.engine().load().await);
}
