//! A whole cluster in this process for the serving benchmarks: one prefill and one decode
//! worker and a router, each a real gRPC server on a loopback port (as `nibble up` runs them),
//! joined by the in-process registry. Requests and pages go over TCP exactly as between
//! processes; only process boundaries are missing.

use std::sync::Arc;
use std::time::Duration;

use nibble_discovery::{Discovery, Role, StaticRegistry};
use nibble_engine::ModelSource;
use nibble_kvfmt::KvDtype;
use nibble_router::{RouterConfig, ServiceConfig, Shared};
use nibble_worker::WorkerConfig;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The model the benchmarks run.
pub use nibble_testkit::model_path;

/// `n` tokens of English text (Pride and Prejudice, from its start, repeated as needed).
pub fn text_tokens(n: usize) -> Vec<u32> {
    const TEXT: &str = include_str!(
        "../../shared/engine/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt"
    );
    let tokenizer = ModelSource::open(model_path())
        .and_then(|s| s.load_tokenizer())
        .expect("tokenizer");
    let ids = tokenizer.encode(TEXT, true).expect("tokenize");
    ids.iter().copied().cycle().take(n).collect()
}

/// What to start.
#[derive(Debug, Clone)]
pub struct Setup {
    pub kv_dtype: KvDtype,
    /// MiB of KV pages per worker.
    pub kv_budget_mib: usize,
    /// Engine threads per worker.
    pub threads: usize,
    /// The router's local-prefill threshold (tokens).
    pub local_prefill_threshold: usize,
}

/// The running cluster; stops when dropped.
pub struct LocalCluster {
    pub prefill: String,
    pub decode: String,
    pub router: String,
    pub shared: Arc<Shared>,
    stop: watch::Sender<bool>,
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl LocalCluster {
    /// Starts the workers and the router and waits until the router tracks both workers.
    pub async fn start(setup: &Setup) -> Self {
        let model = model_path();
        let name = ModelSource::default_name(&model);
        let registry = StaticRegistry::new();
        let (stop, stopped) = watch::channel(false);
        let signal = move || {
            let mut rx = stopped.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let mut addresses = Vec::new();
        for role in [Role::Prefill, Role::Decode] {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let listen = listener.local_addr().expect("address");
            addresses.push(listen.to_string());
            let args = WorkerConfig {
                model_name: Some(name.clone()),
                kv_dtype: setup.kv_dtype,
                kv_budget_mib: Some(setup.kv_budget_mib),
                threads: setup.threads,
                // A cold prefill of a long prompt on a busy machine can take a while.
                reservation_ttl_ms: 600_000,
                no_metrics: true,
                ..WorkerConfig::new(model.clone())
            };
            let discovery: Arc<dyn Discovery> = Arc::new(registry.session());
            tokio::spawn(nibble_worker::run_on(
                role,
                args,
                listener,
                Some(discovery),
                signal(),
            ));
        }
        let source = ModelSource::open(&model).expect("model");
        let mut router = RouterConfig::new(name, 16);
        router.policy.local_prefill_threshold_tokens = setup.local_prefill_threshold;
        let config = ServiceConfig::new(
            router,
            Arc::new(source.load_tokenizer().expect("tokenizer")),
            source.config().expect("config").max_context as u32,
        );
        let shared = Shared::new(config).expect("router");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let router_address = listener.local_addr().expect("address").to_string();
        let discovery: Arc<dyn Discovery> = Arc::new(registry.session());
        tokio::spawn(nibble_router::serve_shared(
            listener,
            Arc::clone(&shared),
            discovery,
            signal(),
        ));
        loop {
            let stats = shared.router().stats();
            if stats.prefill_workers == 1 && stats.decode_workers == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self {
            prefill: addresses[0].clone(),
            decode: addresses[1].clone(),
            router: router_address,
            shared,
            stop,
        }
    }
}

/// The `q`-quantile (0..=1) of `samples`, sorted in place.
pub fn quantile(samples: &mut [f64], q: f64) -> f64 {
    samples.sort_by(f64::total_cmp);
    let i = ((samples.len() - 1) as f64 * q).round() as usize;
    samples[i]
}
