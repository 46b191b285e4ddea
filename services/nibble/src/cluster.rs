//! The cluster from the `nibble` binary: `nibble router|prefill|decode` run one service each
//! (the same code as `nibble-router`, `nibble-prefill` and `nibble-decode`), `nibble up` runs a
//! whole cluster in this process, and `nibble generate --url` is a client of a running router.
//!
//! `nibble up` starts a router and its workers (one prefill and one decode worker unless
//! `--prefill-workers` / `--decode-workers` say otherwise) on loopback, joined by an
//! in-process registry (the same `Discovery` trait etcd serves; no etcd is needed), prints each
//! address, and once both workers are registered prints the line
//! `nibble up: ready on ADDR` and serves until Ctrl-C.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nibble_discovery::{Discovery, Role, StaticRegistry};
use nibble_engine::paged::WorkDtype;
use nibble_engine::ModelSource;
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_router::cli::ServingArgs;
use nibble_worker::{WorkerArgs, WorkerConfig};
use tokio::sync::watch;

use crate::cli::{GenerateArgs, DEFAULT_MODEL};
use crate::{Error, Result};

/// The shares of one GPU's memory the KV pages of `nibble up`'s two workers take when no budget
/// is given: decode holds every running sequence's context, prefill only the prompts in flight
/// and its prefix cache. Together 85%, leaving room for two copies of the model's weights and
/// the activations (each worker also keeps 10% of the GPU free when it sizes its pool).
const UP_PREFILL_KV_FRACTION: f64 = 0.25;
const UP_DECODE_KV_FRACTION: f64 = 0.6;

/// Flags of `nibble up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Model: a GGUF file or a Hugging Face model directory (the default is fetched on first
    /// use).
    #[arg(long, value_name = "PATH", env = "NIBBLE_MODEL", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Address of the router's Inference API.
    #[arg(long, env = "NIBBLE_ROUTER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address of the prefill worker (port 0: any free port; with several, each its own).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub prefill_listen: SocketAddr,
    /// Address of the decode worker (port 0: any free port; with several, each its own).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub decode_listen: SocketAddr,
    /// Prefill workers; 0 runs an aggregated cluster (every prompt prefilled on its decode
    /// worker).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(0..=16))]
    pub prefill_workers: u16,
    /// Decode workers (the router spreads requests over them).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=16))]
    pub decode_workers: u16,
    /// KV cache dtype of both workers: bf16, fp8 or nvfp4.
    #[arg(long, value_name = "DTYPE", env = "NIBBLE_KV_DTYPE", default_value = "nvfp4",
          value_parser = KvDtype::parse)]
    pub kv_dtype: KvDtype,
    /// Tokens per KV page.
    #[arg(long, env = "NIBBLE_PAGE_SIZE", default_value_t = 16)]
    pub page_size: usize,
    /// How NVFP4 block scales are chosen on write: mse (of the E4M3 codes near amax/6, the one
    /// with the least squared error over the block; the default) or amax (amax/6, the bytes other
    /// NVFP4 implementations write). Readers decode both alike.
    #[arg(long, value_name = "RULE", env = "NIBBLE_KV_SCALE_RULE", default_value = "mse",
          value_parser = nibble_kvfmt::ScaleRule::parse)]
    pub scale_rule: nibble_kvfmt::ScaleRule,
    /// Calibration JSON (from `nibble calibrate`) with per-layer K/V global scales and K's
    /// channel amax for both workers; without it every scale is the dtype's uncalibrated one.
    #[arg(long, value_name = "FILE", env = "NIBBLE_CALIBRATION")]
    pub calibration: Option<PathBuf>,
    /// Rotate both workers' K/V head vectors (and Q) by the normalized Hadamard matrix before
    /// quantizing (power-of-two head dims).
    #[arg(long, env = "NIBBLE_HADAMARD")]
    pub hadamard: bool,
    /// Do not smooth the workers' K per channel (smoothed by default when --calibration
    /// measured K's channels).
    #[arg(long, env = "NIBBLE_NO_SMOOTH_K")]
    pub no_smooth_k: bool,
    /// Round the workers' K to the nearest NVFP4 codes instead of choosing the codes for the
    /// queries (chosen for them by default when --calibration holds the queries' second moment).
    #[arg(long, env = "NIBBLE_NO_K_CODES")]
    pub no_k_codes: bool,
    /// Tokens of each sequence's most recent K/V also kept in BF16 by both workers; a multiple
    /// of --page-size, 0 for none [default: 48 for an nvfp4 cache in whole pages, 0 otherwise].
    #[arg(long, value_name = "TOKENS", env = "NIBBLE_KV_WINDOW")]
    pub kv_window: Option<usize>,
    /// The dtype both workers' prefill and extend attention hold K/V in: fp8 or bf16 [default:
    /// bf16].
    #[arg(long, value_name = "DTYPE", env = "NIBBLE_PREFILL_WORK", value_parser = WorkDtype::parse)]
    pub prefill_work: Option<WorkDtype>,
    /// MiB of KV pages each worker allocates [default: 256 on the CPU; on a GPU, which the two
    /// workers share, 25% of its memory for the prefill worker's pages and 60% for the decode
    /// worker's].
    #[arg(long, env = "NIBBLE_KV_BUDGET_MIB")]
    pub kv_budget_mib: Option<usize>,
    /// Where both workers' engines run: cpu, cuda (GPU 0; an error if it cannot start) or auto
    /// (CUDA when a GPU is found, else the CPU).
    #[arg(
        long,
        value_name = "DEVICE",
        env = "NIBBLE_DEVICE",
        default_value = "auto"
    )]
    pub device: nibble_cuda::Device,
    /// CPU threads of each worker's engine [default: half the available cores, at least 1].
    #[arg(long, env = "NIBBLE_THREADS")]
    pub threads: Option<usize>,
    /// Once the cluster is ready, send this prompt through the router as one chat message
    /// (greedy, at most 128 tokens) and stream the answer, then keep serving.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Address of the Prometheus endpoint, GET /metrics, for the router and both workers
    /// (their series told apart by `role`; port 0: any free port). Unset: none.
    #[arg(long, env = "NIBBLE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Also run the planner, which moves workers between prefill and decode in place to meet
    /// --slo-ttft-ms and --slo-itl-ms (docs/OPERATIONS.md, "The planner").
    #[arg(long, env = "NIBBLE_PLANNER")]
    pub planner: bool,
    #[command(flatten)]
    pub policy: crate::planner::PolicyArgs,
    #[command(flatten)]
    pub serving: ServingArgs,
    /// TLS and the internal token, for the router and both workers (certificates must then
    /// name 127.0.0.1, or the addresses given).
    #[command(flatten)]
    pub security: nibble_security::SecurityArgs,
    /// Let workers listen beyond loopback (--prefill-listen, --decode-listen) without
    /// --internal-token or mutual TLS; without this flag that is refused. Only for a network
    /// that nothing but this process can reach.
    #[arg(long, env = "NIBBLE_ALLOW_UNAUTHENTICATED_INTERNAL")]
    pub allow_unauthenticated_internal: bool,
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Cluster(format!("cannot start the async runtime: {e}")))
}

/// The flags the printed `generate` and `curl` examples need to pass the cluster's TLS and API
/// key as they are set (the key itself is never printed: `$NIBBLE_API_KEY` stands for it).
struct Hints {
    generate: String,
    curl: String,
}

impl Hints {
    fn new(args: &UpArgs) -> Self {
        let (mut generate, mut curl) = (String::new(), String::new());
        if let Some(ca) = args
            .security
            .tls
            .tls_ca
            .as_ref()
            .or(args.security.tls.tls_cert.as_ref())
        {
            generate.push_str(&format!(" --tls-ca {}", ca.display()));
            curl.push_str(&format!(" --cacert {}", ca.display()));
        }
        if args.serving.http.api_key.is_some() {
            generate.push_str(" --api-key \"$NIBBLE_API_KEY\"");
            curl.push_str(" -H \"Authorization: Bearer $NIBBLE_API_KEY\"");
        }
        Self { generate, curl }
    }
}

/// `nibble prefill` / `nibble decode`.
pub fn run_worker(role: Role, args: &WorkerArgs) -> Result<()> {
    nibble_telemetry::logging::init();
    runtime()?
        .block_on(nibble_worker::run(role, args.clone()))
        .map_err(|e| Error::Cluster(format!("nibble {role}: {e}")))
}

/// `nibble router`.
pub fn run_router(args: &nibble_router::cli::RouterArgs) -> Result<()> {
    nibble_telemetry::logging::init();
    runtime()?
        .block_on(nibble_router::cli::run(args.clone()))
        .map_err(|e| Error::Cluster(format!("nibble router: {e:#}")))
}

/// `nibble up`: serves until Ctrl-C; `out` gets the addresses and the ready line.
pub fn up(args: &UpArgs, out: &mut (impl Write + Send)) -> Result<()> {
    nibble_telemetry::logging::init();
    runtime()?.block_on(up_until(args, out, nibble_proto::serving::interrupted()))
}

/// [`up`] until `shutdown` completes.
pub async fn up_until(
    args: &UpArgs,
    out: &mut (impl Write + Send),
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let fail = |what: &str, e: &dyn std::fmt::Display| Error::Cluster(format!("{what}: {e}"));
    // Bad TLS files fail before the model loads; workers and router share the settings, and
    // the workers' rules (certificate, key and CA together) apply.
    let security = args.security.load().map_err(|e| fail("nibble up", &e))?;
    if security
        .tls
        .as_ref()
        .is_some_and(|t| !t.serves() || !t.has_ca())
    {
        return Err(Error::Cluster(
            "nibble up: TLS needs --tls-cert, --tls-key and --tls-ca together (the services \
             serve with the certificate and verify each other with the CA)"
                .into(),
        ));
    }
    let planner = match args.planner {
        true => Some(args.policy.config()?),
        false => None,
    };
    // Every listener is bound before the model is fetched or opened: a port in use fails at
    // once, naming its flag.
    let bind = |flag: &'static str, address| async move {
        nibble_telemetry::listen::bind(flag, address)
            .await
            .map_err(|e| Error::Cluster(e.to_string()))
    };
    let metrics_listener = match args.metrics_listen {
        None => None,
        Some(listen) => Some(bind("--metrics-listen", listen).await?),
    };
    let mut worker_listeners = Vec::new();
    for (role, flag, address, count) in [
        (
            Role::Prefill,
            "--prefill-listen",
            args.prefill_listen,
            args.prefill_workers,
        ),
        (
            Role::Decode,
            "--decode-listen",
            args.decode_listen,
            args.decode_workers,
        ),
    ] {
        if count > 0 {
            nibble_worker::config::check_exposure(
                flag,
                address,
                &security,
                args.allow_unauthenticated_internal,
            )
            .map_err(|e| fail("nibble up", &e))?;
        }
        if count > 1 && address.port() != 0 {
            return Err(Error::Cluster(format!(
                "nibble up: {flag} {address} names one port, but {count} {role} workers need \
                 one each: give port 0 (any free port)"
            )));
        }
        for _ in 0..count {
            worker_listeners.push((role, count, bind(flag, address).await?));
        }
    }
    let listener = bind("--listen", args.listen).await?;
    let mut http = args
        .serving
        .http
        .bind()
        .await
        .map_err(|e| Error::Cluster(e.to_string()))?;
    // `/metrics` on the API's port, where aiperf and Prometheus look first: the recorder is
    // installed before any service starts, so that all three record into it.
    if let Some(http) = &mut http {
        http.config.metrics = Some(nibble_telemetry::install());
    }
    let model = args.model.clone();
    tokio::task::spawn_blocking(move || crate::fetch::ensure_default_model(&model))
        .await
        .map_err(|e| Error::Cluster(format!("fetching the model: {e}")))??;
    let source = ModelSource::open(&args.model).map_err(|source| Error::Model {
        path: args.model.clone(),
        source,
    })?;
    // The workers' name; clients see --served-model-name when given (the router maps).
    let model_name = ModelSource::default_name(&args.model);
    let mut config = args
        .serving
        .service_config(&source, model_name.clone(), args.page_size as u32)
        .map_err(|e| fail("router", &e))?;
    let scheme = if security.tls.is_some() {
        "https"
    } else {
        "http"
    };
    // How `--prompt` reaches the router: its CA, and the API key when one is set.
    let prompt_peers = nibble_security::Peers::new(
        security
            .tls
            .as_ref()
            .map(|t| t.grpc_client())
            .transpose()
            .map_err(|e| fail("nibble up", &e))?
            .flatten(),
        args.serving
            .http
            .api_key
            .as_deref()
            .and_then(nibble_security::Secret::new),
    )
    .map_err(|e| fail("nibble up", &e))?;
    let hints = Hints::new(args);
    // The planner calls the workers' Load with the same TLS and token as the router.
    let planner_peers = match planner {
        Some(_) => Some(security.peers().map_err(|e| fail("planner", &e))?),
        None => None,
    };
    config.security = security;
    drop(source);
    // Installed before any service starts, so that all three record into it.
    let _metrics = match metrics_listener {
        None => None,
        Some(listener) => {
            let server = nibble_telemetry::spawn(listener).map_err(|e| fail("metrics", &e))?;
            writeln!(
                out,
                "nibble up: metrics on http://{}/metrics",
                server.address()
            )
            .map_err(Error::Stdout)?;
            Some(server)
        }
    };
    let registry = StaticRegistry::new();
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
    });
    let mut workers = Vec::new();
    for (role, count, listener) in worker_listeners {
        let worker = WorkerConfig {
            model_name: Some(model_name.clone()),
            kv_dtype: args.kv_dtype,
            page_size: args.page_size,
            scale_rule: args.scale_rule,
            calibration: args.calibration.clone(),
            hadamard: args.hadamard,
            no_smooth_k: args.no_smooth_k,
            no_k_codes: args.no_k_codes,
            kv_window: args.kv_window,
            prefill_work: args.prefill_work,
            kv_budget_mib: args.kv_budget_mib,
            // Several workers of a role share its share of the GPU.
            kv_memory_fraction: match role {
                Role::Prefill => UP_PREFILL_KV_FRACTION,
                _ => UP_DECODE_KV_FRACTION,
            } / f64::from(count),
            threads,
            device: args.device,
            // One /metrics for the whole process, the router's (`--metrics-listen`).
            no_metrics: true,
            security: args.security.clone(),
            allow_unauthenticated_internal: args.allow_unauthenticated_internal,
            ..WorkerConfig::new(args.model.clone())
        };
        let discovery: Arc<dyn Discovery> = Arc::new(registry.session());
        workers.push(tokio::spawn(nibble_worker::run_on(
            role,
            worker,
            listener,
            Some(discovery),
            stopped(),
        )));
    }
    let address = listener.local_addr().map_err(|e| fail("router", &e))?;
    writeln!(out, "nibble-router listening on {address}").map_err(Error::Stdout)?;
    let http_address = match &http {
        Some(http) => {
            let address = http.listener.local_addr().map_err(|e| fail("router", &e))?;
            writeln!(
                out,
                "nibble-router OpenAI HTTP API on {scheme}://{address}/v1"
            )
            .map_err(Error::Stdout)?;
            Some(address)
        }
        None => None,
    };
    let served_model = config.served_model().to_string();
    let shared = nibble_router::Shared::new(config).map_err(|e| fail("router", &e))?;
    let router_discovery: Arc<dyn Discovery> = Arc::new(registry.session());
    let mut router = tokio::spawn(nibble_router::serve_shared_with_http(
        listener,
        http,
        Arc::clone(&shared),
        router_discovery,
        stopped(),
    ));
    let _planner = match planner.zip(planner_peers) {
        Some((config, peers)) => {
            let task = crate::planner::PlannerTask {
                id: "planner-up".into(),
                config,
                discovery: Arc::new(registry.session()),
                peers,
                latency: crate::planner::LatencySource::Local,
            };
            Some(AbortOnDrop(tokio::spawn(task.run())))
        }
        None => None,
    };
    let started = Instant::now();
    let ready = async {
        loop {
            let stats = shared.router().stats();
            if stats.prefill_workers >= usize::from(args.prefill_workers)
                && stats.decode_workers >= usize::from(args.decode_workers)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let workers = first_to_end(workers);
    tokio::pin!(workers, shutdown);
    tokio::select! {
        () = ready => {
            writeln!(
                out,
                "nibble up: ready on {address} ({served_model}, {} KV, loaded in {:.1} s); try: \
                 nibble generate --url {address}{} --chat \"Hello\"",
                args.kv_dtype,
                started.elapsed().as_secs_f64(),
                hints.generate,
            )
            .map_err(Error::Stdout)?;
            if let Some(prompt) = &args.prompt {
                let request = up_prompt(prompt);
                writeln!(out, "> {prompt}").map_err(Error::Stdout)?;
                let url = address.to_string();
                let diag = &mut std::io::stderr();
                // The services' log lines wait until the answer is printed, instead of landing
                // in the middle of it on the same terminal.
                let held = nibble_telemetry::logging::hold();
                let answered = stream_remote(&url, &prompt_peers, request, false, out, diag).await;
                drop(held);
                answered?;
            }
            if let Some(http) = http_address {
                writeln!(
                    out,
                    "nibble up: OpenAI API: curl{} {scheme}://{http}/v1/completions -H \
                     'Content-Type: application/json' -d '{{\"prompt\": \"Hello\", \
                     \"max_tokens\": 16}}'",
                    hints.curl,
                )
                .map_err(Error::Stdout)?;
            }
            out.flush().map_err(Error::Stdout)?;
        }
        failed = &mut workers => return Err(worker_failure(failed)),
        served = &mut router => return Err(router_failure(served)),
        () = &mut shutdown => {}
    }
    let outcome = tokio::select! {
        failed = &mut workers => Err(worker_failure(failed)),
        served = &mut router => Err(router_failure(served)),
        () = &mut shutdown => Ok(()),
    };
    let _ = stop_tx.send(true);
    outcome
}

/// The request `nibble up --prompt` sends: one user message, greedy, at most 128 tokens.
fn up_prompt(prompt: &str) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Chat(v1::ChatPrompt {
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: prompt.into(),
                ..Default::default()
            }],
            add_generation_prompt: Some(true),
            tools: Vec::new(),
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: Some(128),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Completes when the first of `tasks` ends, with its result.
async fn first_to_end(
    tasks: Vec<tokio::task::JoinHandle<nibble_worker::Result<()>>>,
) -> std::result::Result<nibble_worker::Result<()>, tokio::task::JoinError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(tasks.len().max(1));
    for task in tasks {
        let tx = tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(task.await).await;
        });
    }
    drop(tx);
    rx.recv().await.unwrap_or(Ok(Ok(())))
}

fn worker_failure(
    ended: std::result::Result<nibble_worker::Result<()>, tokio::task::JoinError>,
) -> Error {
    match ended {
        Ok(Ok(())) => Error::Cluster("a worker stopped".into()),
        Ok(Err(e)) => Error::Cluster(format!("worker: {e}")),
        Err(e) => Error::Cluster(format!("worker: {e}")),
    }
}

fn router_failure(
    ended: std::result::Result<
        std::result::Result<(), nibble_router::ServeError>,
        tokio::task::JoinError,
    >,
) -> Error {
    match ended {
        Ok(Ok(())) => Error::Cluster("the router stopped".into()),
        Ok(Err(e)) => Error::Cluster(format!("router: {e}")),
        Err(e) => Error::Cluster(format!("router: {e}")),
    }
}

/// The request `nibble generate` sends to a router.
pub fn generate_request(args: &GenerateArgs) -> Result<v1::GenerateRequest> {
    let params = args.sampling.params()?;
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(v1::ChatMessage {
                role: "system".into(),
                content: system.clone(),
                ..Default::default()
            });
        }
        messages.push(v1::ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
            ..Default::default()
        });
        v1::generate_request::Prompt::Chat(v1::ChatPrompt {
            messages,
            add_generation_prompt: Some(true),
            tools: Vec::new(),
        })
    } else {
        v1::generate_request::Prompt::Text(args.prompt.clone())
    };
    Ok(v1::GenerateRequest {
        request_id: String::new(),
        model: String::new(),
        prompt: Some(prompt),
        add_special_tokens: None,
        sampling: Some(v1::SamplingParams {
            temperature: Some(params.temperature),
            top_k: params.top_k,
            top_p: Some(params.top_p),
            min_p: Some(params.min_p),
            repetition_penalty: Some(params.repetition_penalty),
            seed: params.seed,
            constraint: params
                .constraint
                .as_ref()
                .map(nibble_proto::request::wire_constraint),
            presence_penalty: Some(params.presence_penalty),
            frequency_penalty: Some(params.frequency_penalty),
            logit_bias: params.logit_bias.iter().copied().collect(),
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: Some(params.max_tokens),
            stop: params.stop.clone(),
            stop_token_ids: params.stop_token_ids.clone(),
            ignore_eos: false,
        }),
        logprobs: Some(v1::LogprobsOptions {
            enabled: params.logprobs,
            top_logprobs: 0,
            prompt_logprobs: None,
        }),
        skip_special_tokens: None,
    })
}

/// `nibble generate --url ADDR`: streams the router's text to `out`, a summary line (and, with
/// `--logprobs`, a JSON line) to `diag`.
pub fn generate_remote(
    url: &str,
    args: &GenerateArgs,
    out: &mut impl Write,
    diag: &mut impl Write,
) -> Result<()> {
    let request = generate_request(args)?;
    let peers = client_peers(args.tls_ca.clone(), args.api_key.as_deref())?;
    runtime()?.block_on(stream_remote(
        url,
        &peers,
        request,
        args.sampling.logprobs,
        out,
        diag,
    ))
}

/// How a client of the router (`generate --url`, `bench`) dials it: over TLS trusting
/// `tls_ca` when given, sending `api_key` when given; a bad file or key names its flag.
pub fn client_peers(
    tls_ca: Option<PathBuf>,
    api_key: Option<&str>,
) -> Result<nibble_security::Peers> {
    let flag = |flag: &'static str| {
        move |e: nibble_security::Error| Error::Flag {
            flag,
            reason: e.to_string(),
        }
    };
    let tls = nibble_security::TlsArgs {
        tls_ca,
        ..Default::default()
    }
    .load()
    .map_err(flag("--tls-ca"))?;
    nibble_security::Peers::new(
        tls.map(|t| t.grpc_client())
            .transpose()
            .map_err(flag("--tls-ca"))?
            .flatten(),
        api_key.and_then(nibble_security::Secret::new),
    )
    .map_err(flag("--api-key"))
}

/// Sends `request` to the router at `url` (dialed as `peers` says: TLS, API key) and streams
/// its text to `out`; the summary line (and the logprobs JSON line when `logprobs_line`) goes
/// to `diag`.
pub async fn stream_remote(
    url: &str,
    peers: &nibble_security::Peers,
    request: v1::GenerateRequest,
    logprobs_line: bool,
    out: &mut impl Write,
    diag: &mut impl Write,
) -> Result<()> {
    let remote = |status: tonic::Status| Error::Remote {
        url: url.to_string(),
        code: status.code(),
        message: status.message().to_string(),
    };
    let start = Instant::now();
    let channel = peers
        .endpoint(url)
        .map_err(|e| Error::Flag {
            flag: "--url",
            reason: e.to_string(),
        })?
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| Error::Remote {
            url: url.to_string(),
            code: tonic::Code::Unavailable,
            message: format!("cannot connect: {e}"),
        })?;
    let mut client = InferenceClient::new(peers.with_token(channel));
    // A garbled first answer may be the OpenAI API's port, which speaks HTTP/1 (and answers
    // HTTP/2 with a 404 that reads as a broken gRPC message).
    let first_failure = |status: tonic::Status| async move {
        let garbled = matches!(
            status.code(),
            tonic::Code::Internal | tonic::Code::Unknown | tonic::Code::Unimplemented
        );
        if garbled && crate::http_probe::answers_http1(url).await {
            Error::NotGrpc {
                url: url.to_string(),
            }
        } else {
            remote(status)
        }
    };
    let mut stream = match client.generate(request).await {
        Ok(response) => response.into_inner(),
        Err(status) => return Err(first_failure(status).await),
    };
    let mut first_token = None;
    let mut logprobs = Vec::new();
    let mut finish = v1::FinishReason::Unspecified;
    let mut usage = None;
    let mut answered = false;
    loop {
        let chunk = match stream.message().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(status) if !answered => return Err(first_failure(status).await),
            Err(status) => return Err(remote(status)),
        };
        answered = true;
        if !chunk.token_ids.is_empty() {
            first_token.get_or_insert_with(Instant::now);
        }
        out.write_all(chunk.text.as_bytes())
            .and_then(|()| out.flush())
            .map_err(Error::Stdout)?;
        logprobs.extend(
            chunk
                .logprobs
                .iter()
                .map(|l| serde_json::json!({ "token": l.token_id, "logprob": l.logprob })),
        );
        if chunk.finish_reason != v1::FinishReason::Unspecified as i32 {
            finish = v1::FinishReason::try_from(chunk.finish_reason)
                .unwrap_or(v1::FinishReason::Unspecified);
        }
        usage = chunk.usage.or(usage);
    }
    writeln!(out).map_err(Error::Stdout)?;
    let end = Instant::now();
    let first = first_token.unwrap_or(end);
    let u = usage.unwrap_or_default();
    writeln!(
        diag,
        "prompt {} tokens ({} cached), completion {} tokens, finish {}; first token after \
         {:.0} ms, {:.1} tok/s after it (through {url})",
        u.prompt_tokens,
        u.cached_tokens,
        u.completion_tokens,
        finish
            .as_str_name()
            .trim_start_matches("FINISH_REASON_")
            .to_lowercase(),
        (first - start).as_secs_f64() * 1e3,
        if end > first && u.completion_tokens > 1 {
            f64::from(u.completion_tokens - 1) / (end - first).as_secs_f64()
        } else {
            0.0
        }
    )
    .map_err(Error::Stderr)?;
    if logprobs_line {
        let json = serde_json::json!({ "logprobs": logprobs });
        writeln!(diag, "{json}").map_err(Error::Stderr)?;
    }
    Ok(())
}

/// A task that ends when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
