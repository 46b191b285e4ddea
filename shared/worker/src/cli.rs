//! The command line of `nibble-prefill` and `nibble-decode` ([`WorkerArgs`], every flag also an
//! environment variable) and [`run`], which starts a worker from it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use nibble_discovery::{Discovery, EtcdConfig, EtcdDiscovery, NcclEndpoint, Role};
use nibble_engine::scheduler::SchedulerConfig;
use nibble_engine::{CpuBackend, EngineConfig, KvConfig, ModelSource};
use nibble_kernels::{Device, KvNeeds};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_security::{Security, SecurityArgs};
use tokio::net::TcpListener;

use crate::actor::EngineHandle;
use crate::error::{Error, Result};
use crate::service::{WorkerIdentity, WorkerState};
use crate::transfer::link::NcclLinks;
use crate::transfer::nccl::{offer_nccl, NcclTimeouts, NcclTransport, TransferMode};

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
    #[arg(long, env = "NIBBLE_KV_DTYPE", default_value = "nvfp4", value_parser = parse_dtype)]
    pub kv_dtype: KvDtype,
    /// Tokens per KV page.
    #[arg(long, env = "NIBBLE_PAGE_SIZE", default_value_t = 16)]
    pub page_size: usize,
    /// Bytes of KV pages to allocate, in MiB.
    #[arg(long, env = "NIBBLE_KV_BUDGET_MIB", default_value_t = 256)]
    pub kv_budget_mib: usize,
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
    /// Address of the Prometheus endpoint, GET /metrics (port 0: any free port, printed).
    #[arg(long, env = "NIBBLE_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    pub metrics_listen: SocketAddr,
    /// Serve no /metrics.
    #[arg(long, env = "NIBBLE_NO_METRICS")]
    pub no_metrics: bool,
    /// TLS and the internal token.
    #[command(flatten)]
    pub security: SecurityArgs,
    /// How pages move between prefill and decode workers.
    #[command(flatten)]
    pub transfer: TransferArgs,
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
    /// This machine's name in the NCCL endpoint this worker advertises (default: the hostname).
    #[arg(long, env = "NIBBLE_HOST_ID")]
    pub host_id: Option<String>,
}

impl Default for TransferArgs {
    fn default() -> Self {
        Self {
            kv_transfer: TransferMode::Auto,
            nccl_timeout_ms: 10_000,
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
    let (version, path) = nibble_kernels::nccl::version()?;
    tracing::info!(%version, path = %path.display(), %host, %gpu, "offering NCCL page transfer");
    state.set_nccl(Arc::new(NcclTransport::new(
        Arc::new(links),
        Arc::clone(discovery),
        state.identity().worker_id.clone(),
        NcclEndpoint { host, gpu },
        NcclTimeouts {
            timeout: Duration::from_millis(args.nccl_timeout_ms.max(1)),
            ..NcclTimeouts::default()
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

fn parse_dtype(s: &str) -> std::result::Result<KvDtype, String> {
    KvDtype::ALL
        .into_iter()
        .find(|d| d.to_string() == s)
        .ok_or_else(|| format!("unknown KV dtype {s:?} (expected bf16, fp8 or nvfp4)"))
}

/// The worker's security settings, checked: a worker serving TLS dials other workers over TLS,
/// so it needs the CA too.
pub fn load_security(args: &WorkerArgs) -> Result<Security> {
    let security = args.security.load()?;
    if let Some(tls) = &security.tls {
        if !tls.serves() {
            return Err(Error::InvalidArgument(
                "--tls-ca needs --tls-cert and --tls-key on a worker (it serves TLS with them)"
                    .into(),
            ));
        }
        if !tls.has_ca() {
            return Err(Error::InvalidArgument(
                "--tls-cert needs --tls-ca on a worker (the CA it verifies its peers against)"
                    .into(),
            ));
        }
    }
    Ok(security)
}

/// Loads the model, starts the engine thread and returns the worker's state, with the CUDA
/// context when the engine runs on a GPU.
pub fn start_engine(
    args: &WorkerArgs,
    role: Role,
    identity_port: u16,
) -> Result<(Arc<WorkerState>, Option<Arc<CudaContext>>)> {
    let security = load_security(args)?;
    let source = ModelSource::open(&args.model)?;
    let tokenizer = Arc::new(source.load_tokenizer()?);
    let mut kv = KvConfig::new(args.kv_dtype);
    kv.page_size = args.page_size;
    let config = EngineConfig {
        kv,
        kv_budget_bytes: args.kv_budget_mib << 20,
        scheduler: SchedulerConfig::default(),
    };
    let needs = KvNeeds {
        head_dim: source.config()?.head_dim,
        page_size: args.page_size,
        hadamard: false,
    };
    let cuda = args
        .device
        .start(needs, |why| {
            tracing::warn!("--device auto: {why}; using the CPU")
        })
        .map_err(|e| Error::InvalidArgument(format!("--device cuda: {e}")))?;
    let context = cuda.as_ref().map(|b| Arc::clone(b.context()));
    let engine = match cuda {
        Some(backend) => {
            EngineHandle::spawn(source.load_model(Arc::new(backend))?, tokenizer, config)?
        }
        None => EngineHandle::spawn(
            source.load_model(Arc::new(CpuBackend::new(args.threads)?))?,
            tokenizer,
            config,
        )?,
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
pub async fn run(role: Role, args: WorkerArgs) -> Result<()> {
    // Bad TLS files fail here, before the port is bound or the model loaded.
    load_security(&args)?;
    let listener = TcpListener::bind(args.listen).await?;
    // An empty value (`NIBBLE_ETCD_ENDPOINTS=`) means none.
    let endpoints: Vec<&String> = args
        .etcd_endpoints
        .iter()
        .filter(|e| !e.trim().is_empty())
        .collect();
    let discovery: Option<Arc<dyn Discovery>> = if endpoints.is_empty() {
        None
    } else {
        Some(Arc::new(
            EtcdDiscovery::connect(EtcdConfig::new(endpoints)).await?,
        ))
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
    args: WorkerArgs,
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
    let address = args.advertise.clone().unwrap_or_else(|| local.to_string());
    let metrics_listen = (!args.no_metrics).then_some(args.metrics_listen);
    let _metrics = nibble_telemetry::start(metrics_listen, &format!("nibble-{role}")).await?;
    let (state, cuda) = {
        let args = args.clone();
        tokio::task::spawn_blocking(move || start_engine(&args, role, local.port()))
            .await
            .map_err(|_| Error::EngineStopped)??
    };
    let state = if role == Role::Decode {
        // Pages arrive on the same listener.
        let mut identity = state.identity().clone();
        identity.transfer_address = address.clone();
        WorkerState::with_security(state.engine().clone(), identity, state.security().clone())?
    } else {
        state
    };
    configure_nccl(&args.transfer, cuda, discovery.as_ref(), &state)?;
    let registration = match &discovery {
        None => None,
        Some(discovery) => Some(
            crate::registration::register(
                Arc::clone(discovery),
                Arc::clone(&state),
                role,
                &address,
                Duration::from_millis(args.capacity_interval_ms),
            )
            .await
            .map(AbortOnDrop)?,
        ),
    };
    println!("nibble-{role} listening on {address}");
    // Stopping: leave the membership first, so routers stop sending new requests while open
    // ones drain.
    let id = state.identity().worker_id.clone();
    let shutdown = async move {
        shutdown.await;
        drop(registration);
        if let (Some(discovery), Ok(id)) = (discovery, nibble_discovery::WorkerId::new(id)) {
            if let Err(err) = discovery.deregister(role, &id).await {
                tracing::warn!(%err, "deregistering failed; the registration expires with its lease");
            }
        }
        tracing::info!(%role, "stopping: draining open calls");
    };
    let served = crate::server::serve(Arc::clone(&state), listener, shutdown).await;
    if let Some(nccl) = state.nccl() {
        nccl.shutdown().await;
    }
    served
}

/// Aborts a background task when dropped (a detached task would outlive a failed server).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
