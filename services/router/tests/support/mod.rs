//! What the router's end-to-end tests share: in-process prefill and decode workers over the
//! testkit's model, served on loopback and registered in a [`StaticRegistry`], and a router (gRPC
//! and HTTP) following that registry. Every test binary uses all of it; what only some use lies
//! in `nibble-testkit` (the model, the reference tokens, `generate`, the HTTP client, the waits)
//! or in the binary.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use nibble_discovery::{Discovery, Role, StaticRegistry};
use nibble_engine::scheduler::SchedulerConfig;
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_router::{HttpConfig, HttpListener, RouterConfig, ServiceConfig, Shared};
use nibble_security::{Peers, Security};
use nibble_testkit::{engine_config, model, wait, RouterApi, WorkerApi};
use nibble_worker::{EngineHandle, WorkerIdentity, WorkerState};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife. However little known the feelings";
/// Pages per worker: enough that the few pages a request caches weigh less in the router's
/// page-pressure cost than the prefix they save.
pub const PAGES: usize = 512;
pub const NEW_TOKENS: u32 = 8;
pub const MODEL: &str = "smollm2";

pub fn prompt() -> Vec<u32> {
    model().1.encode(PROMPT, false).unwrap()
}

pub fn engine(dtype: KvDtype) -> EngineHandle {
    engine_with(dtype, SchedulerConfig::default())
}

/// An engine over the shared model with its own scheduler settings.
pub fn engine_with(dtype: KvDtype, scheduler: SchedulerConfig) -> EngineHandle {
    let (model, tokenizer) = model();
    let config = engine_config(dtype, PAGES, scheduler);
    EngineHandle::spawn(model.clone(), Arc::clone(tokenizer), config).unwrap()
}

/// A worker served on 127.0.0.1:0 and registered in a registry until dropped.
pub struct Worker {
    pub address: String,
    pub state: Arc<WorkerState>,
    /// How the test dials it (its own TLS and token).
    pub peers: Peers,
    /// Its registration's session, alive as long as this is.
    pub _session: Arc<dyn Discovery>,
    /// Stops its server when sent to (or dropped).
    pub _stop: oneshot::Sender<()>,
}

impl Worker {
    pub async fn start(registry: &StaticRegistry, role: Role, name: &str, dtype: KvDtype) -> Self {
        Self::start_with(registry, role, name, engine(dtype)).await
    }

    /// A worker over the given engine.
    pub async fn start_with(
        registry: &StaticRegistry,
        role: Role,
        name: &str,
        engine: EngineHandle,
    ) -> Self {
        Self::start_secured(registry, role, name, engine, Security::default()).await
    }

    /// A worker that serves (and dials decode workers) with `security`.
    pub async fn start_secured(
        registry: &StaticRegistry,
        role: Role,
        name: &str,
        engine: EngineHandle,
        security: Security,
    ) -> Self {
        Self::start_advertising(registry, role, name, engine, security, None).await
    }

    /// A worker serving with `security`; a decode worker registers `transfer` as the address
    /// prefill workers push its pages to, when given (a stand-in's: how a refused push reaches
    /// a client), else its own.
    pub async fn start_advertising(
        registry: &StaticRegistry,
        role: Role,
        name: &str,
        engine: EngineHandle,
        security: Security,
        transfer: Option<String>,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let wire_role = match role {
            Role::Prefill => v1::WorkerRole::Prefill,
            _ => v1::WorkerRole::Decode,
        };
        let peers = security.peers().unwrap();
        let state = WorkerState::with_security(
            engine,
            WorkerIdentity {
                worker_id: name.into(),
                role: wire_role,
                model: MODEL.into(),
                transfer_address: match (role, transfer) {
                    (Role::Decode, Some(transfer)) => transfer,
                    (Role::Decode, None) => address.clone(),
                    _ => String::new(),
                },
                reservation_ttl: Duration::from_secs(30),
            },
            security,
        )
        .unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(nibble_worker::serve(
            Arc::clone(&state),
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        let session: Arc<dyn Discovery> = Arc::new(registry.session());
        // The capacity refresh runs detached; it ends with the session.
        let _ = nibble_worker::membership::register(
            Arc::clone(&session),
            Arc::clone(&state),
            &address,
            Duration::from_millis(200),
        )
        .await
        .unwrap();
        Self {
            address,
            state,
            peers,
            _session: session,
            _stop: stop,
        }
    }
}

impl WorkerApi for Worker {
    fn address(&self) -> &str {
        &self.address
    }

    fn worker_id(&self) -> String {
        self.state.identity().worker_id.clone()
    }

    fn fingerprint(&self) -> u64 {
        self.state.engine().info().fingerprint
    }

    /// Through its own TLS and token.
    fn load(&self) -> impl Future<Output = v1::LoadResponse> + Send {
        let mut client = WorkerClient::new(self.peers.connect_lazy(&self.address).unwrap());
        async move { client.load(v1::LoadRequest {}).await.unwrap().into_inner() }
    }
}

/// The router's configuration for the test model: pages of `page_size`, a context of 2048.
pub fn service_config(page_size: u32) -> ServiceConfig {
    ServiceConfig::new(
        RouterConfig::new(MODEL, page_size),
        Arc::clone(&model().1),
        2048,
    )
}

/// A router served on 127.0.0.1:0 until dropped.
pub struct RouterServer {
    /// The gRPC `Inference` API's address.
    pub address: String,
    /// The HTTP API's address.
    pub http_address: String,
    pub shared: Arc<Shared>,
    _stop: oneshot::Sender<()>,
}

impl RouterServer {
    /// A router with its HTTP API configured by `http` (`HttpConfig::default()`: open, no key,
    /// the default body limit) and its service configuration changed by `configure` (security,
    /// limits).
    pub async fn start(
        registry: &StaticRegistry,
        page_size: u32,
        http: HttpConfig,
        configure: impl FnOnce(&mut ServiceConfig),
    ) -> Self {
        let mut config = service_config(page_size);
        // Every uncached token goes to a prefill worker, so the hand-off path is exercised.
        config.router.policy.local_prefill_threshold_tokens = 1;
        configure(&mut config);
        let shared = Shared::new(config).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let http_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http_address = http_listener.local_addr().unwrap().to_string();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(nibble_router::serve_shared_with_http(
            listener,
            Some(HttpListener {
                listener: http_listener,
                config: http,
            }),
            Arc::clone(&shared),
            Arc::new(registry.session()),
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            address,
            http_address,
            shared,
            _stop: stop,
        }
    }

    /// Waits until the router tracks `prefill` and `decode` workers.
    pub async fn wait_for_workers(&self, prefill: usize, decode: usize) {
        wait::until(
            Duration::from_secs(5),
            Duration::from_millis(25),
            || async {
                let stats = self.shared.router().stats();
                if stats.prefill_workers == prefill && stats.decode_workers == decode {
                    Ok(())
                } else {
                    Err(stats)
                }
            },
        )
        .await
        .unwrap_or_else(|stats| panic!("workers not tracked: {stats:?}"));
    }
}

impl RouterApi for RouterServer {
    fn address(&self) -> &str {
        &self.address
    }

    fn http_address(&self) -> &str {
        &self.http_address
    }
}

/// A greedy request for [`prompt`], [`NEW_TOKENS`] long.
pub fn greedy_request(request_id: &str) -> v1::GenerateRequest {
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
