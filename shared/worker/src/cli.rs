//! The command line of `nibble-prefill` and `nibble-decode` ([`WorkerArgs`], every flag also an
//! environment variable) and [`run`], which starts a worker from it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nibble_cuda::CudaContext;
use nibble_cuda::{Device, DeviceMemory, KvNeeds};
use nibble_discovery::{Discovery, EtcdConfig, EtcdDiscovery, NcclEndpoint, Role};
use nibble_engine::paged::WorkDtype;
use nibble_engine::scheduler::SchedulerConfig;
use nibble_engine::{CpuBackend, EngineConfig, ModelSource};
use nibble_kvfmt::{KvDtype, ScaleRule};
use nibble_proto::v1;
use nibble_security::SecurityArgs;
use nibble_telemetry::progress::{Bar, Unit};
use tokio::net::TcpListener;

use crate::actor::EngineHandle;
use crate::config::{
    check_exposure, kv_budget_bytes, kv_config, load_security, WorkerConfig,
    DEFAULT_KV_MEMORY_FRACTION,
};
use crate::error::{Error, Result};
use crate::service::{WorkerIdentity, WorkerState};
use crate::transfer::nccl::{
    offer_nccl, NcclLimits, NcclTimeouts, NcclTransport, PairFilter, TransferMode,
};
use crate::AbortOnDrop;
use nibble_nccl::link::NcclLinks;

/// A worker's configuration.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The model: a GGUF file or a Hugging Face directory.
    #[arg(long, env = "NIBBLE_MODEL")]
    pub model: PathBuf,
    /// The name the model is served under (default: the file or directory name).
    #[arg(long, env = "NIBBLE_MODEL_NAME")]
    pub model_name: Option<String>,
    /// Address to listen on for gRPC (Worker, and KvTransfer on decode workers).
    #[arg(long, env = "NIBBLE_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Address peers reach this worker at (default: the bound listen address).
    #[arg(long, env = "NIBBLE_ADVERTISE")]
    pub advertise: Option<String>,
    /// This worker's id, unique within its role (default: role-port).
    #[arg(long, env = "NIBBLE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// KV-cache element format.
    #[arg(long, env = "NIBBLE_KV_DTYPE", default_value = "nvfp4", value_parser = KvDtype::parse)]
    pub kv_dtype: KvDtype,
    /// Tokens per KV page.
    #[arg(long, env = "NIBBLE_PAGE_SIZE", default_value_t = 16)]
    pub page_size: usize,
    /// How NVFP4 block scales are chosen on write: mse (of the E4M3 codes near amax/6, the one
    /// with the least squared error over the block; the default) or amax (amax/6, the bytes other
    /// NVFP4 implementations write). Readers decode both alike.
    #[arg(long, value_name = "RULE", env = "NIBBLE_KV_SCALE_RULE", default_value = "mse",
          value_parser = ScaleRule::parse)]
    pub scale_rule: ScaleRule,
    /// Calibration JSON (from `nibble calibrate`) with per-layer K/V global scales and K's
    /// channel amax; without it every scale is the dtype's uncalibrated one. Prefill and decode
    /// workers must use the same file: the scales are part of the KV format their pages are
    /// checked against.
    #[arg(long, value_name = "FILE", env = "NIBBLE_CALIBRATION")]
    pub calibration: Option<PathBuf>,
    /// Rotate K/V head vectors (and Q) by the normalized Hadamard matrix before quantizing
    /// (power-of-two head dims; on the CUDA backend, head dims 64 and 128).
    /// Prefill and decode workers must agree: the rotation is part of the KV format.
    #[arg(long, env = "NIBBLE_HADAMARD")]
    pub hadamard: bool,
    /// Do not smooth K per channel with the calibration's channel amax (smoothed by default
    /// when --calibration measured channels). Prefill and decode workers must agree: the
    /// smoothing is part of the KV format.
    #[arg(long, env = "NIBBLE_NO_SMOOTH_K")]
    pub no_smooth_k: bool,
    /// Choose K's NVFP4 codes by rounding each value to its nearest code instead of for the
    /// queries the calibration measured (chosen for them by default when --calibration holds
    /// the queries' second moment). Prefill and decode workers must agree: the codes are part
    /// of the KV format peers compare.
    #[arg(long, env = "NIBBLE_NO_K_CODES")]
    pub no_k_codes: bool,
    /// Tokens of each sequence's most recent K/V also kept in BF16, which attention reads
    /// instead of their pages; a multiple of --page-size, 0 for none [default: 48 for an nvfp4
    /// cache, rounded up to whole pages; 0 otherwise]. Prefill and decode workers must agree: it
    /// is part of the KV format.
    #[arg(long, value_name = "TOKENS", env = "NIBBLE_KV_WINDOW")]
    pub kv_window: Option<usize>,
    /// The dtype prefill and extend attention hold K/V in: fp8 or bf16 (bf16 is the only one
    /// for a bf16 cache) [default: bf16]. Prefill and decode workers must agree: it decides a
    /// prompt's tokens, so it is part of the KV format peers compare.
    #[arg(long, value_name = "DTYPE", env = "NIBBLE_PREFILL_WORK", value_parser = WorkDtype::parse)]
    pub prefill_work: Option<WorkDtype>,
    /// Bytes of KV pages to allocate, in MiB [default: 256 on the CPU; on a GPU,
    /// --kv-memory-fraction of the GPU's memory].
    #[arg(long, env = "NIBBLE_KV_BUDGET_MIB")]
    pub kv_budget_mib: Option<usize>,
    /// Without --kv-budget-mib, on a GPU: the share of the GPU's total memory the KV pages take,
    /// at most what is free once the model is loaded less 10% of the GPU (kept for activations,
    /// attention workspaces and cuBLAS).
    #[arg(long, env = "NIBBLE_KV_MEMORY_FRACTION", default_value_t = DEFAULT_KV_MEMORY_FRACTION,
          value_parser = parse_fraction)]
    pub kv_memory_fraction: f64,
    /// CPU threads of the engine.
    #[arg(long, env = "NIBBLE_THREADS", default_value_t = 2)]
    pub threads: usize,
    /// Where the engine runs: cpu, cuda (GPU 0; the worker fails to start without it) or auto
    /// (CUDA when a GPU is found, else the CPU).
    #[arg(long, env = "NIBBLE_DEVICE", default_value = "auto")]
    pub device: Device,
    /// How long an unfilled reservation is kept, in milliseconds.
    #[arg(long, env = "NIBBLE_RESERVATION_TTL_MS", default_value_t = 30_000)]
    pub reservation_ttl_ms: u64,
    /// etcd client URLs (comma-separated); none runs without registration.
    #[arg(long, env = "NIBBLE_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// How often the registered capacity is refreshed, in milliseconds.
    #[arg(long, env = "NIBBLE_CAPACITY_INTERVAL_MS", default_value_t = 1_000)]
    pub capacity_interval_ms: u64,
    /// How often the planner's decision is read from etcd, in milliseconds (0: never; the
    /// worker keeps its role whatever a planner decides).
    #[arg(long, env = "NIBBLE_PLANNER_POLL_MS", default_value_t = 1_000)]
    pub planner_poll_ms: u64,
    /// Address of the Prometheus endpoint, GET /metrics (port 0: any free port, printed).
    #[arg(long, env = "NIBBLE_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    pub metrics_listen: SocketAddr,
    /// Serve no /metrics.
    #[arg(long, env = "NIBBLE_NO_METRICS")]
    pub no_metrics: bool,
    /// gRPC connections open at once; more are closed as they arrive.
    #[arg(long, env = "NIBBLE_GRPC_MAX_CONNECTIONS",
          default_value_t = nibble_proto::serving::DEFAULT_MAX_CONNECTIONS)]
    pub grpc_max_connections: usize,
    /// TLS and the internal token.
    #[command(flatten)]
    pub security: SecurityArgs,
    /// Serve the internal API (Worker, KvTransfer) on an address beyond loopback without
    /// --internal-token or mutual TLS; without this flag such a worker refuses to start. Only
    /// for a network that nothing but the cluster's services can reach.
    #[arg(long, env = "NIBBLE_ALLOW_UNAUTHENTICATED_INTERNAL")]
    pub allow_unauthenticated_internal: bool,
    /// How pages move between prefill and decode workers.
    #[command(flatten)]
    pub transfer: TransferArgs,
}

impl WorkerArgs {
    /// The library configuration these flags describe (all but `--listen`, which [`run`] binds).
    pub fn config(&self) -> WorkerConfig {
        WorkerConfig {
            model: self.model.clone(),
            model_name: self.model_name.clone(),
            advertise: self.advertise.clone(),
            worker_id: self.worker_id.clone(),
            kv_dtype: self.kv_dtype,
            page_size: self.page_size,
            scale_rule: self.scale_rule,
            calibration: self.calibration.clone(),
            hadamard: self.hadamard,
            no_smooth_k: self.no_smooth_k,
            no_k_codes: self.no_k_codes,
            kv_window: self.kv_window,
            prefill_work: self.prefill_work,
            kv_budget_mib: self.kv_budget_mib,
            kv_memory_fraction: self.kv_memory_fraction,
            threads: self.threads,
            device: self.device,
            reservation_ttl_ms: self.reservation_ttl_ms,
            etcd_endpoints: self.etcd_endpoints.clone(),
            capacity_interval_ms: self.capacity_interval_ms,
            planner_poll_ms: self.planner_poll_ms,
            metrics_listen: self.metrics_listen,
            no_metrics: self.no_metrics,
            grpc_max_connections: self.grpc_max_connections,
            security: self.security.clone(),
            allow_unauthenticated_internal: self.allow_unauthenticated_internal,
            transfer: self.transfer.clone(),
        }
    }
}

/// Page transfer flags: NCCL (GPU to GPU) or the gRPC stream.
#[derive(Debug, Clone, clap::Args)]
pub struct TransferArgs {
    /// auto: offer NCCL when the engine runs on a GPU, NCCL (2.17+) loads and a coordination
    /// store (--etcd-endpoints, or `nibble up`'s registry) carries the ids; grpc: only the gRPC
    /// stream. Pages move over NCCL between two workers that both offer it on different GPUs.
    #[arg(long, env = "NIBBLE_KV_TRANSFER", default_value = "auto")]
    pub kv_transfer: TransferMode,
    /// Deadline of NCCL pair set-up and of each NCCL transfer, in milliseconds; past it the
    /// pair is torn down and the request moves over gRPC.
    #[arg(long, env = "NIBBLE_NCCL_TIMEOUT_MS", default_value_t = 10_000)]
    pub nccl_timeout_ms: u64,
    /// Idle NCCL staging buffers kept for reuse, in MiB (device memory on a GPU, both
    /// directions together); a buffer given back past it is freed.
    #[arg(long, env = "NIBBLE_NCCL_STAGING_POOL_MB", default_value_t = 2048)]
    pub nccl_staging_pool_mb: u64,
    /// NCCL transfers of one prefill/decode pair under way at once (one sends while the next
    /// gathers and the one before is scattered); more wait before they gather.
    #[arg(long, env = "NIBBLE_NCCL_MAX_IN_FLIGHT", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub nccl_max_in_flight: u32,
    /// This machine's name in the NCCL endpoint this worker advertises (default: the hostname).
    #[arg(long, env = "NIBBLE_HOST_ID")]
    pub host_id: Option<String>,
}

impl Default for TransferArgs {
    fn default() -> Self {
        Self {
            kv_transfer: TransferMode::Auto,
            nccl_timeout_ms: 10_000,
            nccl_staging_pool_mb: 2048,
            nccl_max_in_flight: 4,
            host_id: None,
        }
    }
}

/// Sets up NCCL on `state` when [`offer_nccl`] allows it (logging why not otherwise).
fn configure_nccl(
    args: &TransferArgs,
    cuda: Option<Arc<CudaContext>>,
    discovery: Option<&Arc<dyn Discovery>>,
    state: &WorkerState,
) -> Result<()> {
    let mut links = None;
    let offered = offer_nccl(
        args.kv_transfer,
        cuda.is_some(),
        discovery.is_some(),
        || {
            let ctx = cuda.clone().expect("checked: on a GPU");
            let made = NcclLinks::new(ctx).map_err(|e| e.to_string())?;
            let gpu = made.gpu_uuid().map_err(|e| e.to_string())?;
            links = Some((made, gpu));
            Ok(())
        },
    );
    let (Ok(()), Some((links, gpu)), Some(discovery)) = (offered.clone(), links, discovery) else {
        tracing::info!(why = %offered.err().unwrap_or_default(), "pages move over gRPC only");
        return Ok(());
    };
    let host = args.host_id.clone().unwrap_or_else(hostname);
    let (version, path) = nibble_nccl::version()?;
    tracing::info!(%version, path = %path.display(), %host, %gpu, "offering NCCL page transfer");
    state.set_nccl(Arc::new(NcclTransport::with_limits(
        Arc::new(links),
        Arc::clone(discovery),
        state.identity().worker_id.clone(),
        NcclEndpoint { host, gpu },
        NcclTimeouts {
            timeout: Duration::from_millis(args.nccl_timeout_ms.max(1)),
            ..NcclTimeouts::default()
        },
        NcclLimits {
            staging_pool_bytes: (args.nccl_staging_pool_mb as usize).saturating_mul(1 << 20),
            max_in_flight: args.nccl_max_in_flight as usize,
        },
    )))
}

/// The kernel's hostname, or "localhost".
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn parse_fraction(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("{s:?} is not a fraction in (0, 1]")),
    }
}

/// Loads the model, starts the engine thread and returns the worker's state, with the CUDA
/// context when the engine runs on a GPU.
pub fn start_engine(
    args: &WorkerConfig,
    role: Role,
    identity_port: u16,
) -> Result<(Arc<WorkerState>, Option<Arc<CudaContext>>)> {
    let security = load_security(args)?;
    let source = ModelSource::open(&args.model)?;
    let tokenizer = Arc::new(source.load_tokenizer()?);
    let kv = {
        let config = source.config()?;
        kv_config(args, config.num_layers, config.head_dim)?
    };
    let needs = KvNeeds::of(&source.config()?, args.page_size);
    let cuda = args
        .device
        .start(needs, |why| {
            tracing::warn!("--device auto: {why}; using the CPU")
        })
        .map_err(Error::DeviceStart)?;
    let context = cuda.as_ref().map(|b| Arc::clone(b.context()));
    let config = |gpu: Option<DeviceMemory>| -> Result<EngineConfig> {
        let _worker = tracing::info_span!("worker", %role).entered();
        Ok(EngineConfig {
            kv,
            kv_budget_bytes: kv_budget_bytes(args, gpu)?,
            scheduler: SchedulerConfig::default(),
        })
    };
    let engine = match cuda {
        Some(backend) => {
            // Two workers of one process sharing the GPU (`nibble up`) load, measure and
            // allocate one at a time, so each sees the other's memory in use.
            static GPU_START: std::sync::Mutex<()> = std::sync::Mutex::new(());
            let _one_at_a_time = GPU_START.lock().unwrap_or_else(|e| e.into_inner());
            let context = Arc::clone(backend.context());
            let bar = Bar::new(
                format!("{role}: loading weights on the GPU"),
                0,
                Unit::Steps,
            );
            let model = source.load_model_observed(Arc::new(backend), &|d, t| bar.track(d, t))?;
            drop(bar);
            let memory = DeviceMemory::of(&context)
                .map_err(|e| Error::InvalidArgument(format!("reading the GPU's memory: {e}")))?;
            EngineHandle::spawn(model, tokenizer, config(Some(memory))?)?
        }
        None => {
            let bar = Bar::new(format!("{role}: loading weights"), 0, Unit::Steps);
            let backend = Arc::new(CpuBackend::new(args.threads)?);
            let model = source.load_model_observed(backend, &|d, t| bar.track(d, t))?;
            drop(bar);
            EngineHandle::spawn(model, tokenizer, config(None)?)?
        }
    };
    let model_name = args
        .model_name
        .clone()
        .unwrap_or_else(|| ModelSource::default_name(&args.model));
    let state = WorkerState::with_security(
        engine,
        WorkerIdentity {
            worker_id: args
                .worker_id
                .clone()
                .unwrap_or_else(|| format!("{role}-{identity_port}")),
            role: match role {
                Role::Prefill => v1::WorkerRole::Prefill,
                Role::Decode => v1::WorkerRole::Decode,
                Role::Router => v1::WorkerRole::Router,
            },
            model: model_name,
            transfer_address: String::new(),
            reservation_ttl: Duration::from_millis(args.reservation_ttl_ms),
        },
        security,
    )?;
    Ok((state, context))
}

/// Runs a worker of `role` until Ctrl-C, registered in etcd when `--etcd-endpoints` names it.
pub async fn run(role: Role, flags: WorkerArgs) -> Result<()> {
    let args = flags.config();
    // Bad TLS files, and an open internal API, fail here, before the port is bound or the model
    // loaded.
    let security = load_security(&args)?;
    check_exposure(
        "--listen",
        flags.listen,
        &security,
        args.allow_unauthenticated_internal,
    )?;
    // Both listeners are bound before etcd is asked or the model loaded: a port in use fails
    // at once, naming its flag.
    let listener = nibble_telemetry::listen::bind("--listen", flags.listen).await?;
    let metrics = match args.no_metrics {
        true => None,
        false => Some(nibble_telemetry::bind(args.metrics_listen).await?),
    };
    // An empty value (`NIBBLE_ETCD_ENDPOINTS=`) means none.
    let endpoints: Vec<&String> = args
        .etcd_endpoints
        .iter()
        .filter(|e| !e.trim().is_empty())
        .collect();
    let discovery: Option<Arc<dyn Discovery>> = if endpoints.is_empty() {
        None
    } else {
        // Started before etcd (or while it is down), the worker waits for it.
        let connecting = EtcdDiscovery::connect_retrying(EtcdConfig::new(endpoints));
        tokio::select! {
            discovery = connecting => Some(Arc::new(discovery)),
            () = nibble_proto::serving::interrupted() => return Ok(()),
        }
    };
    let _metrics = nibble_telemetry::start_bound(metrics, &format!("nibble-{role}"))?;
    // Served above, from the listener bound first.
    let args = WorkerConfig {
        no_metrics: true,
        ..args
    };
    let shutdown = nibble_proto::serving::interrupted();
    let result = run_on(role, args, listener, discovery.clone(), shutdown).await;
    if let Some(discovery) = discovery {
        let _ = discovery.close().await;
    }
    result
}

/// Runs a worker of `role` on a bound `listener` until `shutdown` completes, registered in
/// `discovery` when one is given. Unless `--no-metrics`, serves /metrics and prints
/// `nibble-ROLE metrics on ADDRESS`; prints `nibble-ROLE listening on ADDRESS` once the engine
/// is loaded and the worker registered.
pub async fn run_on(
    role: Role,
    args: WorkerConfig,
    listener: TcpListener,
    discovery: Option<Arc<dyn Discovery>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    if role == Role::Router {
        return Err(Error::InvalidArgument(
            "a worker is prefill or decode".into(),
        ));
    }
    let local = listener.local_addr()?;
    check_exposure(
        "--listen",
        local,
        &load_security(&args)?,
        args.allow_unauthenticated_internal,
    )?;
    let address = args.advertise.clone().unwrap_or_else(|| local.to_string());
    let metrics_listen = (!args.no_metrics).then_some(args.metrics_listen);
    let _metrics = nibble_telemetry::start(metrics_listen, &format!("nibble-{role}")).await?;
    let (state, cuda) = {
        let args = args.clone();
        tokio::task::spawn_blocking(move || start_engine(&args, role, local.port()))
            .await
            .map_err(|_| Error::EngineStopped)??
    };
    // Pages arrive on the same listener (a prefill worker may become a decode worker).
    let state = {
        let mut identity = state.identity().clone();
        identity.transfer_address = address.clone();
        WorkerState::with_security(state.engine().clone(), identity, state.security().clone())?
    };
    configure_nccl(&args.transfer, cuda, discovery.as_ref(), &state)?;
    let membership = match &discovery {
        None => None,
        Some(discovery) => {
            let interval = Duration::from_millis(args.capacity_interval_ms);
            let (membership, refresh) = crate::membership::register(
                Arc::clone(discovery),
                Arc::clone(&state),
                &address,
                interval,
            )
            .await?;
            // Planner decisions are followed unless --planner-poll-ms 0.
            let follow = (args.planner_poll_ms > 0).then(|| {
                let poll = Duration::from_millis(args.planner_poll_ms);
                AbortOnDrop(tokio::spawn(crate::planned::follow(
                    Arc::clone(&membership),
                    poll,
                )))
            });
            Some((membership, AbortOnDrop(refresh), follow))
        }
    };
    // NCCL pairs are set up as decode workers appear, not on a request's path.
    let pairing = match state.nccl() {
        Some(nccl) => Some(AbortOnDrop(nccl.spawn_pairing(
            state.security().peers()?,
            PairFilter {
                fingerprint: state.engine().info().fingerprint,
                is_sender: {
                    let state = Arc::clone(&state);
                    Arc::new(move || state.role() == v1::WorkerRole::Prefill)
                },
            },
        ))),
        None => None,
    };
    println!("nibble-{role} listening on {address}");
    // Stopping: leave the membership first, so routers stop sending new requests while open
    // ones drain.
    let id = state.identity().worker_id.clone();
    let engine = state.engine().clone();
    let shutdown = async move {
        // A failed engine leaves the membership at once: nothing it holds can be served.
        tokio::select! {
            () = shutdown => {}
            reason = engine.stopped() => tracing::error!(%reason, "leaving the membership"),
        }
        if let Some((membership, refresh, follow)) = membership {
            drop((follow, refresh));
            if let Err(err) = membership.leave().await {
                tracing::warn!(%err, "deregistering failed; the registration expires with its lease");
            }
        }
        tracing::info!(%id, "stopping: draining open calls");
    };
    let served = crate::server::serve_capped(
        Arc::clone(&state),
        listener,
        args.grpc_max_connections,
        shutdown,
    )
    .await;
    drop(pairing);
    if let Some(nccl) = state.nccl() {
        nccl.shutdown().await;
    }
    served?;
    // A worker whose engine failed exits with an error, for its supervisor to restart it.
    match state.engine().stop_reason() {
        Some(reason) => Err(Error::EngineFailed(reason)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
