//! The router's gRPC service end to end on loopback with the real model: in-process prefill and
//! decode workers registered in a [`StaticRegistry`], a router following it, and clients of its
//! `Inference` API.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nibble_discovery::{Discovery, Role, StaticRegistry};
use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::{SchedulerConfig, SeqId};
use nibble_engine::{CpuBackend, EngineConfig, Event, KvConfig, Model, ModelSource, Tokenizer};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_router::{RouterConfig, ServiceConfig, Shared};
use nibble_worker::{EngineHandle, WorkerIdentity, WorkerState};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::Code;

const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife. However little known the feelings";
/// Pages per worker: enough that the few pages a request caches weigh less in the router's
/// page-pressure cost than the prefix they save.
const PAGES: usize = 512;
const NEW_TOKENS: u32 = 8;
const MODEL: &str = "smollm2";

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

fn model() -> &'static (Model<CpuBackend>, Arc<Tokenizer>) {
    static MODEL: OnceLock<(Model<CpuBackend>, Arc<Tokenizer>)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let source = ModelSource::open(model_path()).unwrap();
        let model = source
            .load_model(Arc::new(CpuBackend::new(2).unwrap()))
            .unwrap();
        (model, Arc::new(source.load_tokenizer().unwrap()))
    })
}

fn prompt() -> Vec<u32> {
    model().1.encode(PROMPT, false).unwrap()
}

fn engine(dtype: KvDtype) -> EngineHandle {
    let (model, tokenizer) = model();
    let kv = KvConfig::new(dtype);
    let page_bytes = kv.layout(model).unwrap().page_bytes();
    let config = EngineConfig {
        kv,
        kv_budget_bytes: PAGES * page_bytes,
        scheduler: SchedulerConfig::default(),
    };
    EngineHandle::spawn(model.clone(), Arc::clone(tokenizer), config).unwrap()
}

/// The engine's own greedy tokens for the prompt: cold, then with its pages cached.
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

/// A worker served on 127.0.0.1:0 and registered in a registry until dropped.
struct Worker {
    address: String,
    state: Arc<WorkerState>,
    _session: Arc<dyn Discovery>,
    _stop: oneshot::Sender<()>,
}

impl Worker {
    async fn start(registry: &StaticRegistry, role: Role, name: &str, dtype: KvDtype) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let wire_role = match role {
            Role::Prefill => v1::WorkerRole::Prefill,
            _ => v1::WorkerRole::Decode,
        };
        let state = WorkerState::new(
            engine(dtype),
            WorkerIdentity {
                worker_id: name.into(),
                role: wire_role,
                model: MODEL.into(),
                transfer_address: if role == Role::Decode {
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
        let session: Arc<dyn Discovery> = Arc::new(registry.session());
        nibble_worker::registration::register(
            Arc::clone(&session),
            Arc::clone(&state),
            role,
            &address,
            Duration::from_millis(200),
        )
        .await
        .unwrap();
        Self {
            address,
            state,
            _session: session,
            _stop: stop,
        }
    }

    async fn load(&self) -> v1::LoadResponse {
        WorkerClient::connect(format!("http://{}", self.address))
            .await
            .unwrap()
            .load(v1::LoadRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    /// Waits until no request holds a page.
    async fn pages_back(&self) {
        for _ in 0..200 {
            let load = self.load().await;
            if load.free_pages + load.evictable_pages == load.total_pages
                && load.running_requests == 0
                && load.pending_reservations == 0
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("pages not returned: {:?}", self.load().await);
    }
}

/// A router served on 127.0.0.1:0 until dropped.
struct RouterServer {
    address: String,
    shared: Arc<Shared>,
    _stop: oneshot::Sender<()>,
}

impl RouterServer {
    async fn start(registry: &StaticRegistry, page_size: u32) -> Self {
        let mut router = RouterConfig::new(MODEL, page_size);
        // Every uncached token goes to a prefill worker, so the hand-off path is exercised.
        router.policy.local_prefill_threshold_tokens = 1;
        let config = ServiceConfig::new(router, Arc::clone(&model().1), 2048);
        let shared = Shared::new(config).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(nibble_router::serve_shared(
            listener,
            Arc::clone(&shared),
            Arc::new(registry.session()),
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            address,
            shared,
            _stop: stop,
        }
    }

    async fn client(&self) -> InferenceClient<Channel> {
        InferenceClient::connect(format!("http://{}", self.address))
            .await
            .unwrap()
    }

    /// Waits until the router tracks `prefill` and `decode` workers.
    async fn wait_for_workers(&self, prefill: usize, decode: usize) {
        for _ in 0..200 {
            let stats = self.shared.router().stats();
            if stats.prefill_workers == prefill && stats.decode_workers == decode {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("workers not tracked: {:?}", self.shared.router().stats());
    }
}

fn greedy_request(request_id: &str) -> v1::GenerateRequest {
    v1::GenerateRequest {
        request_id: request_id.into(),
        model: MODEL.into(),
        prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
            ids: prompt(),
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: Some(NEW_TOKENS),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Streams a request to the end: its tokens, the last chunk's finish reason and usage.
async fn generate(
    client: &mut InferenceClient<Channel>,
    request: v1::GenerateRequest,
) -> (Vec<u32>, i32, v1::Usage) {
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    let mut last = None;
    while let Some(chunk) = stream.message().await.unwrap() {
        tokens.extend(&chunk.token_ids);
        if let Some(usage) = chunk.usage {
            last = Some((chunk.finish_reason, usage));
        }
    }
    let (finish, usage) = last.expect("the last chunk carries usage");
    (tokens, finish, usage)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_through_router_prefill_and_decode_gives_one_engines_tokens() {
    let dtype = KvDtype::Nvfp4;
    let (expected, expected_warm) = reference(dtype).await;
    assert_eq!(expected.len(), NEW_TOKENS as usize);

    let registry = StaticRegistry::new();
    let p = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
    let d0 = Worker::start(&registry, Role::Decode, "d0", dtype).await;
    let d1 = Worker::start(&registry, Role::Decode, "d1", dtype).await;
    let page_size = p.state.engine().info().page_size as u32;
    let router = RouterServer::start(&registry, page_size).await;
    router.wait_for_workers(1, 2).await;
    let mut client = router.client().await;

    let (tokens, finish, usage) = generate(&mut client, greedy_request("cold")).await;
    assert_eq!(tokens, expected, "router → P → D gives the engine's tokens");
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

    // Wait until the holder's KV events have reached the router's index.
    let full_pages = prompt().len() / page_size as usize;
    for _ in 0..200 {
        let blocks = router
            .shared
            .router()
            .workers()
            .iter()
            .filter(|w| w.info.role == Role::Decode)
            .map(|w| w.blocks)
            .max()
            .unwrap_or(0);
        if blocks >= full_pages {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    let (tokens, _, usage) = generate(&mut client, greedy_request("warm")).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_generate_frees_pages_on_both_workers() {
    let dtype = KvDtype::Nvfp4;
    let registry = StaticRegistry::new();
    let p = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
    let d = Worker::start(&registry, Role::Decode, "d0", dtype).await;
    let page_size = p.state.engine().info().page_size as u32;
    let router = RouterServer::start(&registry, page_size).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_name_the_field() {
    let registry = StaticRegistry::new();
    let router = RouterServer::start(&registry, 16).await;
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

    for (request, field) in cases {
        let id = request.request_id.clone();
        let status = client.generate(request).await.err().unwrap_or_else(|| {
            panic!("{id}: accepted");
        });
        assert_eq!(status.code(), Code::InvalidArgument, "{id}: {status:?}");
        assert!(
            status.message().starts_with(&format!("{field}:")),
            "{id}: {:?} names {field}",
            status.message()
        );
    }

    // A valid request with no workers is UNAVAILABLE, not a validation error.
    let status = client.generate(greedy_request("ok")).await.err().unwrap();
    assert_eq!(status.code(), Code::Unavailable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_list_models() {
    let registry = StaticRegistry::new();
    let router = RouterServer::start(&registry, 16).await;
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
