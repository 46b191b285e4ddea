//! The router's gRPC service end to end on loopback with the real model: in-process prefill and
//! decode workers registered in a [`StaticRegistry`], a router following it, and clients of its
//! `Inference` API (the setup is in `support`).

mod support;

use std::time::Duration;

use nibble_discovery::{Role, StaticRegistry};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_router::HttpConfig;
use nibble_testkit::{generate, reference, Generated, RouterApi, WorkerApi};
use support::{greedy_request, prompt, RouterServer, Worker, MODEL, NEW_TOKENS, PROMPT};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_through_router_prefill_and_decode_gives_one_engines_tokens() {
    let dtype = KvDtype::Nvfp4;
    let [expected, expected_warm]: [Vec<u32>; 2] =
        reference(dtype, &[prompt(), prompt()], NEW_TOKENS)
            .try_into()
            .unwrap();
    assert_eq!(expected.len(), NEW_TOKENS as usize);

    let registry = StaticRegistry::new();
    let p = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
    let d0 = Worker::start(&registry, Role::Decode, "d0", dtype).await;
    let d1 = Worker::start(&registry, Role::Decode, "d1", dtype).await;
    let page_size = p.state.engine().info().page_size as u32;
    let router = RouterServer::start(&registry, page_size, HttpConfig::default(), |_| {}).await;
    router.wait_for_workers(1, 2).await;
    let mut client = router.client().await;

    let Generated {
        tokens,
        usage,
        finish_reason: finish,
        route,
        ..
    } = generate(&mut client, greedy_request("cold")).await.unwrap();
    let usage = usage.expect("the last chunk carries usage");
    assert_eq!(tokens, expected, "router → P → D gives the engine's tokens");
    let route = route.expect("the first chunk says where the request ran");
    assert_eq!(route.prefill_worker, "p0");
    assert_eq!(route.reason, "disaggregated");
    assert!(["d0", "d1"].contains(&route.decode_worker.as_str()));
    assert_eq!(finish, v1::FinishReason::Length as i32);
    assert_eq!(usage.prompt_tokens as usize, prompt().len());
    assert_eq!(usage.completion_tokens, NEW_TOKENS);
    assert_eq!(usage.cached_tokens, 0, "cold caches");
    let pushed = p.state.counters().totals().pages_sent;
    assert!(pushed > 0, "P pushed the prompt's pages");
    let holder = if d0.state.counters().totals().pages_received > 0 {
        &d0
    } else {
        &d1
    };
    let received = holder.state.counters().totals().pages_received;
    assert_eq!(received, pushed, "one decode worker got every page");

    // Wait until the holder's KV events have reached the router's index, and its load report
    // shows the finished request's pages back (its recent window's 11 pages, held until then,
    // would weigh more in the router's page-pressure cost than the cached prefix saves).
    let full_pages = prompt().len() / page_size as usize;
    for _ in 0..200 {
        let workers = router.shared.router().workers();
        let decodes = workers.iter().filter(|w| w.info.role == Role::Decode);
        let blocks = decodes.clone().map(|w| w.blocks).max().unwrap_or(0);
        let all_back = decodes
            .clone()
            .all(|w| w.load.available_pages == w.load.total_pages);
        if blocks >= full_pages && all_back {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    let Generated {
        tokens,
        usage,
        route: warm_route,
        ..
    } = generate(&mut client, greedy_request("warm")).await.unwrap();
    assert_eq!(
        warm_route.unwrap().decode_worker,
        route.decode_worker,
        "the warm request ran where the prefix lives"
    );
    let usage = usage.expect("the last chunk carries usage");
    assert_eq!(
        tokens, expected_warm,
        "warm caches give the engine's warm tokens"
    );
    assert!(
        usage.cached_tokens > 0,
        "routed to the prefix holder: {usage:?}"
    );
    assert_eq!(
        d0.state.counters().totals().pages_received + d1.state.counters().totals().pages_received,
        holder.state.counters().totals().pages_received,
        "the second request went to the decode worker holding the prefix"
    );

    for w in [&p, &d0, &d1] {
        w.pages_back().await;
    }
    assert_eq!(router.shared.router().stats().in_flight, 0);
}

/// Top alternatives come back for every token, the first one too: it is sampled on the prefill
/// worker and reaches the client through the hand-off to the decode worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_logprobs_come_through_prefill_handoff_and_decode() {
    let dtype = KvDtype::Nvfp4;
    let expected = reference(dtype, &[prompt()], NEW_TOKENS).remove(0);
    let registry = StaticRegistry::new();
    let p = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
    let d = Worker::start(&registry, Role::Decode, "d0", dtype).await;
    let page_size = p.state.engine().info().page_size as u32;
    let router = RouterServer::start(&registry, page_size, HttpConfig::default(), |_| {}).await;
    router.wait_for_workers(1, 1).await;
    let mut client = router.client().await;

    let mut request = greedy_request("top");
    request.logprobs = Some(v1::LogprobsOptions {
        enabled: true,
        top_logprobs: 4,
        prompt_logprobs: None,
    });
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    while let Some(chunk) = stream.message().await.unwrap() {
        assert_eq!(chunk.logprobs.len(), chunk.token_ids.len(), "{chunk:?}");
        tokens.extend(chunk.token_ids);
        logprobs.extend(chunk.logprobs);
    }
    assert_eq!(tokens, expected);
    assert!(
        p.state.counters().totals().pages_sent > 0,
        "the prefill worker sampled the first token and handed off"
    );
    for (token, lp) in tokens.iter().zip(&logprobs) {
        assert_eq!(lp.token_id, *token);
        assert_eq!(lp.top.len(), 4, "{lp:?}");
        assert_eq!(lp.top[0].token_id, *token, "greedy takes the most likely");
        assert_eq!(lp.top[0].logprob, lp.logprob);
        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert!(lp.top.iter().all(|t| t.logprob <= 0.0));
    }
    for w in [&p, &d] {
        w.pages_back().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_generate_frees_pages_on_both_workers() {
    let dtype = KvDtype::Nvfp4;
    let registry = StaticRegistry::new();
    let p = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
    let d = Worker::start(&registry, Role::Decode, "d0", dtype).await;
    let page_size = p.state.engine().info().page_size as u32;
    let router = RouterServer::start(&registry, page_size, HttpConfig::default(), |_| {}).await;
    router.wait_for_workers(1, 1).await;
    let mut client = router.client().await;

    let mut request = greedy_request("cancel");
    request.stopping = Some(v1::StoppingCriteria {
        max_tokens: Some(512),
        ..Default::default()
    });
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().expect("a first chunk");
    assert!(!first.token_ids.is_empty());
    drop(stream);

    for w in [&p, &d] {
        w.pages_back().await;
    }
    for _ in 0..200 {
        if router.shared.router().stats().in_flight == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the router still counts the request");
}

/// A client's request id is only a label: a second request under the same id neither is
/// refused nor, when it is cancelled, aborts the first (the workers see ids the router minted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_id_never_reaches_another_request() {
    let dtype = KvDtype::Nvfp4;
    let registry = StaticRegistry::new();
    let p = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
    let d = Worker::start(&registry, Role::Decode, "d0", dtype).await;
    let page_size = p.state.engine().info().page_size as u32;
    let router = RouterServer::start(&registry, page_size, HttpConfig::default(), |_| {}).await;
    router.wait_for_workers(1, 1).await;
    let mut client = router.client().await;

    let long = || {
        let mut request = greedy_request("victim");
        request.stopping = Some(v1::StoppingCriteria {
            max_tokens: Some(48),
            ignore_eos: true,
            ..Default::default()
        });
        request
    };
    let mut victim = client.generate(long()).await.unwrap().into_inner();
    let first = victim.message().await.unwrap().expect("a first chunk");
    assert_eq!(
        first.request_id, "victim",
        "responses carry the client's id"
    );
    // The attacker reuses the id, then hangs up: its own request is aborted, no other.
    let mut attacker = client.generate(long()).await.unwrap().into_inner();
    attacker
        .message()
        .await
        .unwrap()
        .expect("the same id is not refused");
    drop(attacker);
    let mut tokens = first.token_ids.len();
    let mut finish = 0;
    while let Some(chunk) = victim
        .message()
        .await
        .expect("the victim's stream lives on")
    {
        tokens += chunk.token_ids.len();
        finish = chunk.finish_reason;
    }
    assert_eq!(tokens, 48);
    assert_eq!(finish, v1::FinishReason::Length as i32);
    for w in [&p, &d] {
        w.pages_back().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_name_the_field() {
    let registry = StaticRegistry::new();
    let router = RouterServer::start(&registry, 16, HttpConfig::default(), |_| {}).await;
    let mut client = router.client().await;
    let text = |t: &str| Some(v1::generate_request::Prompt::Text(t.into()));

    let mut cases = Vec::new();
    let mut r = greedy_request("empty");
    r.prompt = text("");
    cases.push((r, "prompt"));
    let mut r = greedy_request("none");
    r.prompt = None;
    cases.push((r, "prompt"));
    let mut r = greedy_request("no-ids");
    r.prompt = Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
        ids: vec![],
    }));
    cases.push((r, "prompt"));
    let mut r = greedy_request("zero");
    r.stopping.as_mut().unwrap().max_tokens = Some(0);
    cases.push((r, "stopping.max_tokens"));
    for top_p in [0.0, -0.5, 1.5, f32::NAN] {
        let mut r = greedy_request("top_p");
        r.sampling.as_mut().unwrap().top_p = Some(top_p);
        cases.push((r, "sampling.top_p"));
    }
    let mut r = greedy_request("model");
    r.model = "no-such-model".into();
    cases.push((r, "model"));
    let mut r = greedy_request("long");
    r.stopping.as_mut().unwrap().max_tokens = Some(4096);
    cases.push((r, "prompt"));
    let mut r = greedy_request("min_p");
    r.sampling.as_mut().unwrap().min_p = Some(1.0);
    cases.push((r, "sampling.min_p"));
    let mut r = greedy_request("stops");
    r.stopping.as_mut().unwrap().stop = vec!["x".into(); 1000];
    cases.push((r, "stopping.stop"));
    cases.push((greedy_request(&"i".repeat(257)), "request_id"));
    for (enabled, top_logprobs) in [(true, 21), (false, 3)] {
        let mut r = greedy_request(&format!("top-{enabled}-{top_logprobs}"));
        r.logprobs = Some(v1::LogprobsOptions {
            enabled,
            top_logprobs,
            prompt_logprobs: None,
        });
        cases.push((r, "logprobs.top_logprobs"));
    }

    for (request, field) in cases {
        let id: String = request.request_id.chars().take(16).collect();
        let status = client.generate(request).await.err().unwrap_or_else(|| {
            panic!("{id}: accepted");
        });
        assert_eq!(status.code(), Code::InvalidArgument, "{id}: {status:?}");
        assert!(
            status.message().starts_with(&format!("{field}:")),
            "{id}: {:?} names {field}",
            status.message()
        );
        assert_eq!(
            nibble_proto::request::refused_field(&status),
            Some(field),
            "{id}: the field is data too"
        );
    }

    // A valid request with no workers is UNAVAILABLE, not a validation error.
    let status = client.generate(greedy_request("ok")).await.err().unwrap();
    assert_eq!(status.code(), Code::Unavailable);
}

/// A request message that does not decode is the caller's fault: INVALID_ARGUMENT on every
/// Inference call (tonic-prost's codec would say INTERNAL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_invalid_argument() {
    let registry = StaticRegistry::new();
    let router = RouterServer::start(&registry, 16, HttpConfig::default(), |_| {}).await;
    // A varint that never ends, and a string field whose length runs past the message.
    let garbage = [vec![0xFF; 11], vec![0x0A, 0x64, b'a', b'b']];
    for (path, message) in [
        ("/nibble.v1.Inference/Generate", "GenerateRequest"),
        ("/nibble.v1.Inference/Tokenize", "TokenizeRequest"),
        ("/nibble.v1.Inference/ListModels", "ListModelsRequest"),
    ] {
        for bytes in &garbage {
            let status =
                nibble_testkit::raw::call(&router.address, path, vec![bytes.clone()]).await;
            assert_eq!(status.code(), Code::InvalidArgument, "{path}: {status:?}");
            let expected = format!("is not a valid {message}");
            assert!(status.message().contains(&expected), "{path}: {status:?}");
        }
    }
    let path = "/nibble.v1.Inference/ListModels";
    let status = nibble_testkit::raw::call(&router.address, path, vec![Vec::new()]).await;
    assert_eq!(status.code(), Code::Ok, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_list_models() {
    let registry = StaticRegistry::new();
    let router = RouterServer::start(&registry, 16, HttpConfig::default(), |_| {}).await;
    let mut client = router.client().await;
    let tokenized = client
        .tokenize(v1::TokenizeRequest {
            model: String::new(),
            text: PROMPT.into(),
            add_special_tokens: Some(false),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(tokenized.token_ids, prompt());
    assert_eq!(tokenized.tokens.len(), tokenized.token_ids.len());
    let status = client
        .tokenize(v1::TokenizeRequest {
            model: "other".into(),
            text: "x".into(),
            add_special_tokens: None,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().starts_with("model:"));

    let models = client
        .list_models(v1::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner()
        .models;
    assert_eq!(models.len(), 1);
    assert_eq!(models[0].name, MODEL);
    assert!(models[0].is_default);
    assert_eq!(
        (models[0].prefill_workers, models[0].decode_workers),
        (0, 0)
    );
}

/// Stops `worker`'s server as a crash would, leaving its registration in place (a killed
/// process's lease outlives it); the returned session keeps the registration alive.
fn crash(worker: Worker) -> std::sync::Arc<dyn nibble_discovery::Discovery> {
    let _ = worker._stop.send(());
    worker._session
}

/// A worker that dies while its registration lives on costs no request: one sent to the dead
/// decode worker moves to the live one before any token, the dead one is marked unreachable,
/// and with the prefill worker dead too a prompt is prefilled on the decode worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_survive_dead_workers_that_are_still_registered() {
    let dtype = KvDtype::Nvfp4;
    let registry = StaticRegistry::new();
    let p = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
    let d0 = Worker::start(&registry, Role::Decode, "d0", dtype).await;
    let d1 = Worker::start(&registry, Role::Decode, "d1", dtype).await;
    let page_size = p.state.engine().info().page_size as u32;
    // No load polls after the first: only the requests themselves find the dead workers.
    let router = RouterServer::start(&registry, page_size, HttpConfig::default(), |c| {
        c.load_interval = Duration::from_secs(3600)
    })
    .await;
    router.wait_for_workers(1, 2).await;
    let mut client = router.client().await;

    let _d0_registration = crash(d0);
    for i in 0..6 {
        let done = generate(&mut client, greedy_request(&format!("after-{i}")))
            .await
            .unwrap_or_else(|status| panic!("request {i}: {status:?}"));
        assert_eq!(done.tokens.len(), NEW_TOKENS as usize, "request {i}");
        assert_eq!(done.finish_reason, v1::FinishReason::Length as i32);
    }
    let stats = router.shared.router().stats();
    assert_eq!(stats.decode_workers, 2, "d0 is still registered");
    assert_eq!(stats.unreachable_workers, 1, "and marked unreachable");
    assert_eq!(router.shared.router().reachable_decode_workers(), 1);

    let _p_registration = crash(p);
    let done = generate(&mut client, greedy_request("no-prefill-worker"))
        .await
        .expect("prefilled on the decode worker");
    assert_eq!(done.tokens.len(), NEW_TOKENS as usize);
    assert_eq!(done.usage.unwrap().prompt_tokens as usize, prompt().len());
    d1.pages_back().await;
}

/// A decode worker's `KvTransfer` stand-in that refuses every push as a decode worker refuses
/// pages that fail its checks.
struct RefusingPages;

#[tonic::async_trait]
impl v1::kv_transfer_server::KvTransfer for RefusingPages {
    async fn push_pages(
        &self,
        request: tonic::Request<tonic::Streaming<v1::PushPagesRequest>>,
    ) -> Result<tonic::Response<v1::PushPagesResponse>, tonic::Status> {
        let _first = request.into_inner().message().await;
        Err(tonic::Status::invalid_argument(
            "page 0 of the reservation: NVFP4 block scale 0xff at byte 1536 (layer 0 K, head 0, \
             token 0) is NaN: scales are 0x00..=0x7e",
        ))
    }

    async fn nccl_connect(
        &self,
        _: tonic::Request<v1::NcclConnectRequest>,
    ) -> Result<tonic::Response<v1::NcclConnectResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("no NCCL here"))
    }

    type NcclPagesStream = tokio_stream::Empty<Result<v1::NcclPagesProgress, tonic::Status>>;

    async fn nccl_pages(
        &self,
        _: tonic::Request<v1::NcclPagesRequest>,
    ) -> Result<tonic::Response<Self::NcclPagesStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("no NCCL here"))
    }
}

/// Pages a decode worker refused (issue 18: the client got 400 naming the decode worker's
/// address and tonic's wording) reach the client as the cluster's fault, a stable sentence with
/// its request's id, over gRPC and HTTP alike; nothing of the request is left on the workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_pages_reach_clients_as_a_stable_error_without_internal_addresses() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refusing = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::kv_transfer_server::KvTransferServer::new(RefusingPages))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let dtype = KvDtype::Nvfp4;
    let registry = StaticRegistry::new();
    let p = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
    let security = nibble_security::Security::default();
    let engine = support::engine(dtype);
    let d = Worker::start_advertising(
        &registry,
        Role::Decode,
        "d0",
        engine,
        security,
        Some(refusing.clone()),
    )
    .await;
    let page_size = p.state.engine().info().page_size as u32;
    let router = RouterServer::start(&registry, page_size, HttpConfig::default(), |_| {}).await;
    router.wait_for_workers(1, 1).await;

    let mut client = router.client().await;
    let err = generate(&mut client, greedy_request("mine"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    assert_eq!(
        err.message(),
        "the cluster failed the request (request mine)"
    );

    let body = serde_json::json!({"model": MODEL, "prompt": PROMPT, "max_tokens": NEW_TOKENS});
    let http =
        nibble_testkit::http_client::post_json(router.http_address(), "/v1/completions", &body)
            .await;
    assert_eq!(http.status, 500, "{}", http.text());
    let id = http
        .header("x-request-id")
        .expect("the request id")
        .to_string();
    assert_eq!(
        http.json()["error"]["message"],
        format!("the cluster failed the request (request {id})")
    );
    for told in [err.message().to_string(), http.text()] {
        for internal in [
            refusing.as_str(),
            "127.0.0.1",
            "status:",
            "InvalidArgument",
            "push",
        ] {
            assert!(!told.contains(internal), "{internal:?} in {told}");
        }
    }
    p.pages_back().await;
    d.pages_back().await;
}
