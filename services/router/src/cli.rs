//! The command line of `nibble-router` (and `nibble router`): [`RouterArgs`], every flag also an
//! environment variable, and [`run`], which serves the router from them until Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nibble_discovery::{Discovery, EtcdConfig, EtcdDiscovery};
use nibble_engine::sampling::MAX_TOKENS_LIMIT;
use nibble_engine::ModelSource;
use nibble_security::{Secret, SecurityArgs};

use crate::http::HttpArgs;
use crate::{AdmissionConfig, RouterConfig, Routing, ServiceConfig};

/// The router's configuration.
#[derive(Debug, Clone, clap::Args)]
pub struct RouterArgs {
    /// Address the Inference API listens on.
    #[arg(long, env = "NIBBLE_ROUTER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// The model (GGUF file or Hugging Face directory) whose tokenizer and chat template the
    /// router uses.
    #[arg(long, env = "NIBBLE_MODEL")]
    pub model: PathBuf,
    /// The model's name as workers register it (default: the model's file name without
    /// `.gguf`, as workers default to); also the name clients use unless
    /// --served-model-name gives another.
    #[arg(long, env = "NIBBLE_MODEL_NAME")]
    pub model_name: Option<String>,
    /// Tokens per KV page (the workers' page size).
    #[arg(long, env = "NIBBLE_PAGE_SIZE", default_value_t = 16)]
    pub page_size: u32,
    /// etcd client URLs (comma-separated).
    #[arg(
        long,
        env = "NIBBLE_ETCD_ENDPOINTS",
        value_delimiter = ',',
        required = true
    )]
    pub etcd_endpoints: Vec<String>,
    /// Address of the Prometheus endpoint, GET /metrics (port 0: any free port, printed); the
    /// HTTP API's port serves /metrics as well.
    #[arg(long, env = "NIBBLE_METRICS_LISTEN", default_value = "127.0.0.1:9090")]
    pub metrics_listen: SocketAddr,
    /// Serve no /metrics (neither on --metrics-listen nor on the HTTP API's port).
    #[arg(long, env = "NIBBLE_NO_METRICS")]
    pub no_metrics: bool,
    #[command(flatten)]
    pub serving: ServingArgs,
    /// TLS and the internal token (sent to workers).
    #[command(flatten)]
    pub security: SecurityArgs,
}

/// How the router places and admits requests (shared by `nibble router` and `nibble up`).
#[derive(Debug, Clone, clap::Args)]
pub struct ServingArgs {
    /// The model's name as clients see it: what /v1/models and ListModels list and what a
    /// request's `model` must be (default: the workers' model name). Workers keep their own.
    #[arg(long, env = "NIBBLE_SERVED_MODEL_NAME", value_name = "NAME",
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub served_model_name: Option<String>,
    /// The decode worker prefills a prompt itself (no prefill worker, no page transfer) when it
    /// lacks fewer than this many of its tokens.
    #[arg(long, env = "NIBBLE_LOCAL_PREFILL_THRESHOLD", default_value_t = 512)]
    pub local_prefill_threshold: usize,
    /// How a worker is chosen: `prefix` (where the prompt's prefix is cached, weighed against
    /// load) or `round-robin` (each in turn; a baseline for benchmarks).
    #[arg(long, env = "NIBBLE_ROUTING", value_enum, default_value_t = Routing::PrefixAware)]
    pub routing: Routing,
    /// Requests dispatched to workers at once; more wait in the queue.
    #[arg(long, env = "NIBBLE_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,
    /// Requests waiting for a running place; more are refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "NIBBLE_MAX_QUEUED", default_value_t = 256)]
    pub max_queued: usize,
    /// How long a request waits in the queue before RESOURCE_EXHAUSTED, in milliseconds.
    #[arg(long, env = "NIBBLE_QUEUE_TIMEOUT_MS", default_value_t = 30_000)]
    pub queue_timeout_ms: u64,
    /// How often each worker's load is polled, in milliseconds.
    #[arg(long, env = "NIBBLE_LOAD_INTERVAL_MS", default_value_t = 250)]
    pub load_interval_ms: u64,
    /// Largest max_tokens a request may ask for (INVALID_ARGUMENT, or HTTP 400, above).
    #[arg(long, env = "NIBBLE_MAX_TOKENS_LIMIT", default_value_t = MAX_TOKENS_LIMIT,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_TOKENS_LIMIT)))]
    pub max_tokens_limit: u32,
    /// Most bytes of prompt text (or chat messages) a request may send, refused before it is
    /// tokenized (default: 64 bytes per token of the model's context).
    #[arg(long, env = "NIBBLE_MAX_PROMPT_BYTES")]
    pub max_prompt_bytes: Option<usize>,
    /// gRPC connections the router keeps open at once; more are closed as they arrive.
    #[arg(long, env = "NIBBLE_GRPC_MAX_CONNECTIONS",
          default_value_t = nibble_proto::serving::DEFAULT_MAX_CONNECTIONS)]
    pub grpc_max_connections: usize,
    /// How many times a request whose decode worker fails mid-stream is resumed on another
    /// decode worker (its prompt and the tokens it streamed computed again there, the stream
    /// continuing); beyond it the stream ends with an error. 0: never resumed.
    #[arg(long, env = "NIBBLE_MAX_RESUMES", default_value_t = crate::service::DEFAULT_MAX_RESUMES)]
    pub max_resumes: u32,
    #[command(flatten)]
    pub http: HttpArgs,
}

impl ServingArgs {
    /// The service configuration for `model` (served as `model_name`) with pages of `page_size`.
    pub fn service_config(
        &self,
        source: &ModelSource,
        model_name: String,
        page_size: u32,
    ) -> anyhow::Result<ServiceConfig> {
        let tokenizer = Arc::new(source.load_tokenizer()?);
        let max_context = source.config()?.max_context as u32;
        let mut router = RouterConfig::new(model_name, page_size);
        router.policy.local_prefill_threshold_tokens = self.local_prefill_threshold;
        router.policy.routing = self.routing;
        let mut config = ServiceConfig::new(router, tokenizer, max_context);
        config.served_model_name = self.served_model_name.clone();
        config.admission = AdmissionConfig {
            max_running: self.max_running,
            max_queued: self.max_queued,
            queue_timeout: Duration::from_millis(self.queue_timeout_ms),
        };
        config.load_interval = Duration::from_millis(self.load_interval_ms.max(1));
        config.max_tokens_limit = self.max_tokens_limit;
        config.max_prompt_bytes = self.max_prompt_bytes;
        config.grpc_max_connections = self.grpc_max_connections;
        config.max_resumes = self.max_resumes;
        config.api_key = self.http.api_key.as_deref().and_then(Secret::new);
        Ok(config)
    }
}

/// Serves the router described by `args` until Ctrl-C, following membership in etcd.
pub async fn run(args: RouterArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    // Bad TLS files fail first, before anything is loaded or bound.
    let security = args.security.load()?;
    if security.tls.as_ref().is_some_and(|t| !t.serves()) {
        anyhow::bail!(
            "--tls-ca needs --tls-cert and --tls-key on the router (it serves TLS with them and \
             presents them to the workers)"
        );
    }
    // Every listener is bound before the model is opened or etcd is asked: a port in use fails
    // at once, naming its flag.
    let listener = nibble_telemetry::listen::bind("--listen", args.listen).await?;
    let mut http = args.serving.http.bind().await?;
    let metrics_listener = match args.no_metrics {
        true => None,
        false => Some(nibble_telemetry::bind(args.metrics_listen).await?),
    };
    if let Some(http) = http.as_mut().filter(|_| !args.no_metrics) {
        // `/metrics` on the API's port too, where aiperf and Prometheus look first.
        http.config.metrics = Some(nibble_telemetry::install());
    }
    let source = ModelSource::open(&args.model)
        .with_context(|| format!("opening {}", args.model.display()))?;
    let model_name = args
        .model_name
        .clone()
        .unwrap_or_else(|| ModelSource::default_name(&args.model));
    let mut config = args
        .serving
        .service_config(&source, model_name, args.page_size)?;
    config.security = security;
    let endpoints: Vec<&String> = args
        .etcd_endpoints
        .iter()
        .filter(|e| !e.trim().is_empty())
        .collect();
    anyhow::ensure!(
        !endpoints.is_empty(),
        "--etcd-endpoints: the router needs etcd to find its workers (`nibble up` runs a \
         cluster without etcd)"
    );
    // Started before etcd (or while it is down), the router waits for it.
    let connecting = EtcdDiscovery::connect_retrying(EtcdConfig::new(endpoints));
    let discovery: Arc<dyn Discovery> = tokio::select! {
        discovery = connecting => Arc::new(discovery),
        () = nibble_proto::serving::interrupted() => return Ok(()),
    };
    let _metrics = nibble_telemetry::start_bound(metrics_listener, "nibble-router")?;
    // The HTTP line comes first: `listening on` is the last line a starting router prints.
    let tls = config.security.tls.as_ref().is_some_and(|t| t.serves());
    if let Some(http) = &http {
        let scheme = if tls { "https" } else { "http" };
        println!(
            "nibble-router OpenAI HTTP API on {scheme}://{}/v1",
            http.listener.local_addr()?
        );
    }
    println!("nibble-router listening on {}", listener.local_addr()?);
    let served = crate::serve_with_http(
        listener,
        http,
        config,
        Arc::clone(&discovery),
        nibble_proto::serving::interrupted(),
    )
    .await;
    let _ = discovery.close().await;
    served?;
    Ok(())
}
