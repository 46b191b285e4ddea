//! [`WorkerConfig`]: a worker's configuration as the library takes it, and what follows from it
//! alone (the KV pool's budget, its cache configuration, the transport security).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use nibble_cuda::{Device, DeviceMemory};
use nibble_engine::calibrate::Calibration;
use nibble_engine::paged::WorkDtype;
use nibble_engine::KvConfig;
use nibble_kvfmt::{KvDtype, ScaleRule};
use nibble_security::{Security, SecurityArgs};

use crate::cli::TransferArgs;
use crate::error::{Error, Result};

/// A worker's configuration as the library takes it ([`run_on`](crate::run_on)): what [`WorkerArgs`](crate::WorkerArgs) parses
/// into, and what `nibble up` and the benchmarks build directly ([`WorkerConfig::new`] holds
/// every default). Field by field the flags of the same names.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The model: a GGUF file or a Hugging Face directory.
    pub model: PathBuf,
    /// The name the model is served under (default: the file or directory name).
    pub model_name: Option<String>,
    /// Address peers reach this worker at (default: the bound listen address).
    pub advertise: Option<String>,
    /// This worker's id, unique within its role (default: role-port).
    pub worker_id: Option<String>,
    /// KV-cache element format.
    pub kv_dtype: KvDtype,
    /// Tokens per KV page.
    pub page_size: usize,
    /// How NVFP4 block scales are chosen on write: mse (of the E4M3 codes near amax/6, the one
    /// with the least squared error over the block; the default) or amax (amax/6, the bytes other
    /// NVFP4 implementations write). Readers decode both alike.
    pub scale_rule: ScaleRule,
    /// Calibration JSON (from `nibble calibrate`) with per-layer K/V global scales and K's
    /// channel amax; without it every scale is the dtype's uncalibrated one. Prefill and decode
    /// workers must use the same file: the scales are part of the KV format their pages are
    /// checked against.
    pub calibration: Option<PathBuf>,
    /// Rotate K/V head vectors (and Q) by the normalized Hadamard matrix before quantizing
    /// (power-of-two head dims; on the CUDA backend, head dims 64 and 128).
    /// Prefill and decode workers must agree: the rotation is part of the KV format.
    pub hadamard: bool,
    /// Do not smooth K per channel with the calibration's channel amax (smoothed by default
    /// when --calibration measured channels). Prefill and decode workers must agree: the
    /// smoothing is part of the KV format.
    pub no_smooth_k: bool,
    /// Choose K's NVFP4 codes by rounding each value to its nearest code instead of for the
    /// queries the calibration measured (chosen for them by default when --calibration holds
    /// the queries' second moment). Prefill and decode workers must agree: the codes are part
    /// of the KV format peers compare.
    pub no_k_codes: bool,
    /// Tokens of each sequence's most recent K/V also kept in BF16, which attention reads
    /// instead of their pages; a multiple of --page-size, 0 for none [default: 48 for an nvfp4
    /// cache, rounded up to whole pages; 0 otherwise]. Prefill and decode workers must agree: it
    /// is part of the KV format.
    pub kv_window: Option<usize>,
    /// The dtype prefill and extend attention hold K/V in [default: bf16]. Prefill and decode
    /// workers must agree: it is part of the KV format peers compare.
    pub prefill_work: Option<WorkDtype>,
    /// Bytes of KV pages to allocate, in MiB [default: 256 on the CPU; on a GPU,
    /// --kv-memory-fraction of the GPU's memory].
    pub kv_budget_mib: Option<usize>,
    /// Without --kv-budget-mib, on a GPU: the share of the GPU's total memory the KV pages take,
    /// at most what is free once the model is loaded less 10% of the GPU (kept for activations,
    /// attention workspaces and cuBLAS).
    pub kv_memory_fraction: f64,
    /// CPU threads of the engine.
    pub threads: usize,
    /// Where the engine runs: cpu, cuda (GPU 0; the worker fails to start without it) or auto
    /// (CUDA when a GPU is found, else the CPU).
    pub device: Device,
    /// How long an unfilled reservation is kept, in milliseconds.
    pub reservation_ttl_ms: u64,
    /// etcd client URLs (comma-separated); none runs without registration.
    pub etcd_endpoints: Vec<String>,
    /// How often the registered capacity is refreshed, in milliseconds.
    pub capacity_interval_ms: u64,
    /// How often the planner's decision is read, in milliseconds (0: never).
    pub planner_poll_ms: u64,
    /// Address of the Prometheus endpoint, GET /metrics (port 0: any free port, printed).
    pub metrics_listen: SocketAddr,
    /// Serve no /metrics.
    pub no_metrics: bool,
    /// gRPC connections open at once; more are closed as they arrive.
    pub grpc_max_connections: usize,
    /// TLS and the internal token.
    pub security: SecurityArgs,
    /// Serve the internal API beyond loopback without the internal token or mutual TLS
    /// ([`check_exposure`]).
    pub allow_unauthenticated_internal: bool,
    /// How pages move between prefill and decode workers.
    pub transfer: TransferArgs,
}

impl WorkerConfig {
    /// The flags' defaults for serving `model`.
    pub fn new(model: PathBuf) -> Self {
        Self {
            model,
            model_name: None,
            advertise: None,
            worker_id: None,
            kv_dtype: KvDtype::Nvfp4,
            page_size: 16,
            scale_rule: ScaleRule::default(),
            calibration: None,
            hadamard: false,
            no_smooth_k: false,
            no_k_codes: false,
            kv_window: None,
            prefill_work: None,
            kv_budget_mib: None,
            kv_memory_fraction: DEFAULT_KV_MEMORY_FRACTION,
            threads: 2,
            device: Device::default(),
            reservation_ttl_ms: 30_000,
            etcd_endpoints: Vec::new(),
            capacity_interval_ms: 1_000,
            planner_poll_ms: 1_000,
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            no_metrics: false,
            grpc_max_connections: nibble_proto::serving::DEFAULT_MAX_CONNECTIONS,
            security: SecurityArgs::default(),
            allow_unauthenticated_internal: false,
            transfer: TransferArgs::default(),
        }
    }
}

/// The KV budget of a worker on the CPU when none is given.
pub const CPU_KV_BUDGET_MIB: usize = 256;
/// `--kv-memory-fraction`'s default: a worker alone on its GPU.
pub const DEFAULT_KV_MEMORY_FRACTION: f64 = 0.9;
/// The share of a GPU's memory a worker sized by `--kv-memory-fraction` leaves free.
const GPU_RESERVE_FRACTION: f64 = 0.1;

/// The bytes of KV pages a worker allocates: `--kv-budget-mib` when given; otherwise 256 MiB on
/// the CPU, and on a GPU (`gpu`: its memory once the model is loaded) `--kv-memory-fraction` of
/// the GPU's total memory, at most what is free less 10% of the total. Sizing by the total makes
/// two workers sharing a GPU (`nibble up`) get their shares whichever loads first.
pub fn kv_budget_bytes(args: &WorkerConfig, gpu: Option<DeviceMemory>) -> Result<usize> {
    if let Some(mib) = args.kv_budget_mib {
        tracing::info!(mib, "KV pool from --kv-budget-mib");
        return Ok(mib << 20);
    }
    let Some(memory) = gpu else {
        tracing::info!(mib = CPU_KV_BUDGET_MIB, "KV pool: the CPU default");
        return Ok(CPU_KV_BUDGET_MIB << 20);
    };
    let share = (memory.total as f64 * args.kv_memory_fraction) as usize;
    let reserve = (memory.total as f64 * GPU_RESERVE_FRACTION) as usize;
    let left = memory.free.saturating_sub(reserve);
    let budget = share.min(left);
    if budget < 1 << 20 {
        return Err(Error::InvalidArgument(format!(
            "no --kv-budget-mib given and the GPU has {} MiB free of {} MiB once the model is \
             loaded, less than the {} MiB it keeps in reserve: nothing is left for KV pages \
             (give --kv-budget-mib, or free GPU memory)",
            memory.free >> 20,
            memory.total >> 20,
            reserve >> 20
        )));
    }
    tracing::info!(
        mib = budget >> 20,
        fraction = args.kv_memory_fraction,
        gpu_free_mib = memory.free >> 20,
        gpu_total_mib = memory.total >> 20,
        "KV pool: --kv-memory-fraction of the GPU, at most its free memory less 10%"
    );
    Ok(budget)
}

/// The KV cache the worker's flags ask for, its calibration file read and checked against the
/// model's `layers` (of heads of `head_dim` values).
pub(crate) fn kv_config(args: &WorkerConfig, layers: usize, head_dim: usize) -> Result<KvConfig> {
    let calibration = match &args.calibration {
        Some(path) => {
            let fail = |why: String| {
                Error::InvalidArgument(format!("--calibration {}: {why}", path.display()))
            };
            let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
            let calibration =
                Calibration::from_json(&text, layers).map_err(|e| fail(e.to_string()))?;
            Some((path, calibration))
        }
        None => None,
    };
    let mut kv = KvConfig::new(args.kv_dtype);
    kv.page_size = args.page_size;
    kv.scale_rule = args.scale_rule;
    kv.hadamard = args.hadamard;
    let (window, from_file) = KvConfig::chosen_window(
        args.kv_dtype,
        args.page_size,
        args.kv_window,
        calibration.as_ref().map(|(_, c)| c),
    );
    kv.window = window;
    if let Some(work) = args.prefill_work {
        work.check_cache(args.kv_dtype).map_err(|why| {
            Error::InvalidArgument(format!("--prefill-work {}: {why}", work.name()))
        })?;
    }
    kv.prefill_work = args.prefill_work;
    if !kv.window.is_multiple_of(kv.page_size) {
        let source = match (&calibration, from_file) {
            (Some((path, _)), true) => format!("--calibration {}: nvfp4_window", path.display()),
            _ => "--kv-window".to_string(),
        };
        return Err(Error::InvalidArgument(format!(
            "{source} {}: not a multiple of the page size ({})",
            kv.window, kv.page_size
        )));
    }
    if let Some((path, calibration)) = &calibration {
        kv = kv
            .with_calibration(calibration, !args.no_smooth_k)
            .and_then(|kv| kv.with_k_codes(calibration, head_dim, !args.no_k_codes))
            .map_err(|e| {
                Error::InvalidArgument(format!("--calibration {}: {e}", path.display()))
            })?;
    }
    Ok(kv)
}

/// The worker's security settings, checked: a worker serving TLS dials other workers over TLS,
/// so it needs the CA too.
pub fn load_security(args: &WorkerConfig) -> Result<Security> {
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

/// Refuses to serve a worker's internal API (Worker, KvTransfer: reserving and writing KV pages,
/// starting and aborting requests) on `listen` beyond loopback without authentication: the
/// internal token or mutual TLS (a worker with TLS always verifies clients against its CA),
/// unless `allow` (`--allow-unauthenticated-internal`) says the network is trusted. `flag` is
/// the flag that gave `listen`.
pub fn check_exposure(
    flag: &str,
    listen: SocketAddr,
    security: &Security,
    allow: bool,
) -> Result<()> {
    let authenticated = security.internal_token.is_some() || security.tls.is_some();
    if authenticated || allow || loopback(listen.ip()) {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{flag} {listen} takes connections from other machines, and without authentication \
         anyone who reaches it may reserve and write KV pages and start or abort requests: set \
         --internal-token (NIBBLE_INTERNAL_TOKEN; the same on the router and every worker), or \
         mutual TLS with --tls-cert, --tls-key and --tls-ca (the CA verifies clients), or pass \
         --allow-unauthenticated-internal if only the cluster's services can reach this address"
    )))
}

/// Whether `ip` is a loopback address (an IPv4-mapped IPv6 one too).
fn loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}
