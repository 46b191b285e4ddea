//! `nibble planner`: the leader-elected planner that balances prefill and decode workers to the
//! load (the policy is `nibble-planner`'s; this is the process around it), and
//! `nibble planner status`.
//!
//! Every instance campaigns for `planner/leader` in the cluster's key-value store; the one
//! holding it reads each worker's load every `--load-poll-ms` and the routers' TTFT and ITL
//! histograms every `--interval-ms`, decides, and writes its decision under
//! `planner/decision`. Workers follow it ([`nibble_worker::planned`]) and acknowledge under
//! `planner/applied/{worker}`. The desired worker counts (`planner/desired`, and the gauge
//! `nibble_planner_desired_workers`) are for an autoscaler; the last decisions and how they
//! ended are in `planner/history`. `docs/OPERATIONS.md` explains the signals, flags and keys.

mod leader;
mod metrics;
mod signals;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand};
use nibble_discovery::{Discovery, EtcdConfig, EtcdDiscovery, KvKey};
use nibble_planner::{Desired, History, Leader, PlannerConfig};
use nibble_security::SecurityArgs;

pub use leader::PlannerTask;
pub use signals::LatencySource;

use crate::{Error, Result};

/// `nibble planner [status]`.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PlannerCommand {
    #[command(subcommand)]
    pub status: Option<StatusCommand>,
    #[command(flatten)]
    pub run: PlannerArgs,
}

/// `nibble planner status`.
#[derive(Debug, Clone, Subcommand)]
pub enum StatusCommand {
    /// Print the leader, the desired worker counts and the last decisions with their reasons.
    Status(StatusArgs),
}

/// Flags of `nibble planner status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// etcd client URLs (comma-separated).
    #[arg(
        long,
        env = "NIBBLE_ETCD_ENDPOINTS",
        value_delimiter = ',',
        required = true
    )]
    pub etcd_endpoints: Vec<String>,
}

/// What the planner aims for and how fast it may act (shared by `nibble planner` and
/// `nibble up --planner`).
#[derive(Debug, Clone, Args)]
pub struct PolicyArgs {
    /// Target time to first token at the 90th percentile, in milliseconds.
    #[arg(long, env = "NIBBLE_SLO_TTFT_MS", default_value_t = 2_000)]
    pub slo_ttft_ms: u64,
    /// Target inter-token latency at the 90th percentile, in milliseconds.
    #[arg(long, env = "NIBBLE_SLO_ITL_MS", default_value_t = 100)]
    pub slo_itl_ms: u64,
    /// How often the planner decides (and the latency window each decision reads), in ms.
    #[arg(long, env = "NIBBLE_PLANNER_INTERVAL_MS", default_value_t = 10_000)]
    pub interval_ms: u64,
    /// How often the leader reads every worker's load (and a standby campaigns), in ms.
    #[arg(long, env = "NIBBLE_PLANNER_LOAD_POLL_MS", default_value_t = 1_000)]
    pub load_poll_ms: u64,
    /// No change within this long of the last one, in milliseconds.
    #[arg(
        long,
        env = "NIBBLE_PLANNER_MIN_CHANGE_INTERVAL_MS",
        default_value_t = 60_000
    )]
    pub min_change_interval_ms: u64,
    /// How long the changed workers have to acknowledge a decision, in milliseconds.
    #[arg(long, env = "NIBBLE_PLANNER_ACK_TIMEOUT_MS", default_value_t = 60_000)]
    pub ack_timeout_ms: u64,
    /// A role gives a worker away only while its latency p90 is below (1 − this) × its SLO.
    #[arg(long, env = "NIBBLE_PLANNER_HYSTERESIS", default_value_t = 0.2)]
    pub hysteresis: f64,
    /// Consecutive decisions a violation must persist before the planner acts.
    #[arg(long, env = "NIBBLE_PLANNER_PATIENCE", default_value_t = 2)]
    pub patience: u32,
    /// Fewest prefill workers to leave (0: decode workers then prefill their own prompts).
    #[arg(long, env = "NIBBLE_PLANNER_MIN_PREFILL", default_value_t = 0)]
    pub min_prefill: usize,
    /// Fewest decode workers to leave (at least 1).
    #[arg(long, env = "NIBBLE_PLANNER_MIN_DECODE", default_value_t = 1)]
    pub min_decode: usize,
}

impl PolicyArgs {
    /// The policy's configuration, checked: a contradiction names its flag.
    pub fn config(&self) -> Result<PlannerConfig> {
        let ms = Duration::from_millis;
        let config = PlannerConfig {
            slo_ttft: ms(self.slo_ttft_ms),
            slo_itl: ms(self.slo_itl_ms),
            interval: ms(self.interval_ms),
            load_poll: ms(self.load_poll_ms),
            min_change_interval: ms(self.min_change_interval_ms),
            ack_timeout: ms(self.ack_timeout_ms),
            hysteresis: self.hysteresis,
            patience: self.patience,
            min_prefill: self.min_prefill,
            min_decode: self.min_decode,
        };
        config.validate().map_err(|e| {
            Error::Cluster(format!("nibble planner: {}", flag_names(&e.to_string())))
        })?;
        Ok(config)
    }
}

/// The policy crate names durations as `--interval`; this command line takes milliseconds.
fn flag_names(message: &str) -> String {
    [
        "--slo-ttft",
        "--slo-itl",
        "--interval",
        "--load-poll",
        "--min-change-interval",
        "--ack-timeout",
    ]
    .iter()
    .fold(message.to_string(), |text, flag| {
        text.replace(&format!("{flag} "), &format!("{flag}-ms "))
            .replace(&format!("{flag}:"), &format!("{flag}-ms:"))
            .replace(&format!("{flag})"), &format!("{flag}-ms)"))
    })
}

/// Flags of `nibble planner`.
#[derive(Debug, Clone, Args)]
pub struct PlannerArgs {
    /// etcd client URLs (comma-separated).
    #[arg(long, env = "NIBBLE_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// The routers' Prometheus endpoints (`host:port`, comma-separated), where TTFT and ITL are
    /// read; a name is resolved at every read to all its addresses (a headless Service's pods).
    #[arg(long, env = "NIBBLE_ROUTER_METRICS", value_delimiter = ',')]
    pub router_metrics: Vec<String>,
    /// This instance's name in `planner/leader` (default: planner-HOST-PID).
    #[arg(long, env = "NIBBLE_PLANNER_ID")]
    pub id: Option<String>,
    /// How long this planner's office outlives it, in seconds: a standby leads within this
    /// plus one --load-poll-ms of the leader's death.
    #[arg(long, env = "NIBBLE_PLANNER_LEASE_TTL_S", default_value_t = 10)]
    pub lease_ttl_s: u64,
    /// Address of the Prometheus endpoint, GET /metrics (port 0: any free port, printed).
    #[arg(long, env = "NIBBLE_METRICS_LISTEN", default_value = "127.0.0.1:9091")]
    pub metrics_listen: SocketAddr,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// TLS and the internal token (sent to workers' Load calls).
    #[command(flatten)]
    pub security: SecurityArgs,
}

/// This instance's default name.
pub fn default_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into());
    format!("planner-{host}-{}", std::process::id())
}

/// `nibble planner` and `nibble planner status`.
pub fn run(command: &PlannerCommand, out: &mut impl std::io::Write) -> Result<()> {
    nibble_telemetry::logging::init();
    let runtime = crate::cluster::runtime()?;
    match &command.status {
        Some(StatusCommand::Status(args)) => runtime.block_on(status(args, out)),
        None => runtime.block_on(serve(&command.run)),
    }
}

fn etcd_endpoints(endpoints: &[String]) -> Result<Vec<String>> {
    let endpoints: Vec<String> = endpoints
        .iter()
        .filter(|e| !e.trim().is_empty())
        .cloned()
        .collect();
    if endpoints.is_empty() {
        return Err(Error::Cluster(
            "nibble planner: --etcd-endpoints: the planner coordinates through etcd \
             (`nibble up --planner` runs one without etcd)"
                .into(),
        ));
    }
    Ok(endpoints)
}

async fn serve(args: &PlannerArgs) -> Result<()> {
    let config = args.policy.config()?;
    let endpoints = etcd_endpoints(&args.etcd_endpoints)?;
    if args.router_metrics.is_empty() {
        return Err(Error::Cluster(
            "nibble planner: --router-metrics: the planner reads TTFT and ITL from the routers' \
             /metrics (host:port of each router's --metrics-listen)"
                .into(),
        ));
    }
    if args.lease_ttl_s == 0 {
        return Err(Error::Cluster(
            "nibble planner: --lease-ttl-s must be at least 1".into(),
        ));
    }
    let security = args
        .security
        .load()
        .map_err(|e| Error::Cluster(format!("nibble planner: {e}")))?;
    let peers = security
        .peers()
        .map_err(|e| Error::Cluster(format!("nibble planner: {e}")))?;
    let metrics = nibble_telemetry::bind(args.metrics_listen)
        .await
        .map_err(|e| Error::Cluster(format!("nibble planner: --metrics-listen: {e}")))?;
    let _metrics = nibble_telemetry::start_bound(Some(metrics), "nibble-planner")
        .map_err(|e| Error::Cluster(format!("nibble planner: {e}")))?;
    metrics::describe();
    let etcd = EtcdConfig {
        lease_ttl: Duration::from_secs(args.lease_ttl_s),
        ..EtcdConfig::new(endpoints)
    };
    let id = args.id.clone().unwrap_or_else(default_id);
    // Up from here: it leads once etcd answers and no other planner holds the office.
    println!("nibble-planner campaigning as {id}");
    let discovery: Arc<dyn Discovery> = tokio::select! {
        d = EtcdDiscovery::connect_retrying(etcd) => Arc::new(d),
        () = nibble_proto::serving::interrupted() => return Ok(()),
    };
    let task = PlannerTask {
        id,
        config,
        discovery: Arc::clone(&discovery),
        peers,
        latency: LatencySource::Scrape(args.router_metrics.clone()),
    };
    tokio::select! {
        () = task.run() => {}
        () = nibble_proto::serving::interrupted() => {}
    }
    // Leaves the office at once, for a standby to take.
    let _ = discovery.close().await;
    Ok(())
}

/// Prints the leader, the desired counts and the decision history.
async fn status(args: &StatusArgs, out: &mut impl std::io::Write) -> Result<()> {
    let endpoints = etcd_endpoints(&args.etcd_endpoints)?;
    let discovery = EtcdDiscovery::connect(EtcdConfig::new(endpoints))
        .await
        .map_err(|e| Error::Cluster(format!("nibble planner status: {e}")))?;
    let text = status_text(&discovery).await;
    let _ = discovery.close().await;
    write!(out, "{}", text?).map_err(Error::Stdout)?;
    Ok(())
}

/// The status report, read from `discovery`.
pub async fn status_text(discovery: &dyn Discovery) -> Result<String> {
    use std::fmt::Write;
    let read = |name: &'static str| async move {
        let key = KvKey::new(name).expect("valid key");
        discovery
            .get(&key)
            .await
            .map_err(|e| Error::Cluster(format!("nibble planner status: {e}")))
    };
    let mut text = String::new();
    match read(nibble_planner::wire::LEADER_KEY).await? {
        Some(bytes) => match Leader::parse(&bytes) {
            Ok(leader) => writeln!(
                text,
                "leader: {} (since {})",
                leader.id,
                clock(leader.since_unix_ms)
            ),
            Err(e) => writeln!(text, "leader: unreadable ({e})"),
        },
        None => writeln!(text, "leader: none (no planner is running)"),
    }
    .expect("writing to a string");
    if let Some(bytes) = read(nibble_planner::wire::DESIRED_KEY).await? {
        if let Ok(desired) = Desired::parse(&bytes) {
            writeln!(
                text,
                "desired workers: {} prefill, {} decode",
                desired.prefill, desired.decode
            )
            .expect("writing to a string");
        }
    }
    let history = match read(nibble_planner::wire::HISTORY_KEY).await? {
        Some(bytes) => History::parse(&bytes).unwrap_or_default(),
        None => History::default(),
    };
    if history.entries.is_empty() {
        writeln!(text, "decisions: none yet").expect("writing to a string");
    } else {
        writeln!(text, "decisions (newest last):").expect("writing to a string");
    }
    for entry in &history.entries {
        let decision = &entry.decision;
        let outcome = entry
            .resolution
            .as_deref()
            .unwrap_or("awaiting acknowledgement");
        writeln!(
            text,
            "  #{} at {} by {}: {} [{}]",
            decision.id,
            clock(decision.issued_unix_ms),
            decision.leader,
            decision.reason.summary,
            outcome
        )
        .expect("writing to a string");
    }
    Ok(text)
}

/// A Unix time in ms as `YYYY-MM-DD HH:MM:SS UTC`.
fn clock(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_reads_as_utc() {
        assert_eq!(clock(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(clock(1_796_256_000_000), "2026-12-03 00:00:00 UTC");
    }

    #[test]
    fn contradictory_flags_name_the_flag() {
        let policy = PolicyArgs {
            slo_ttft_ms: 2000,
            slo_itl_ms: 100,
            interval_ms: 500,
            load_poll_ms: 1000,
            min_change_interval_ms: 60_000,
            ack_timeout_ms: 60_000,
            hysteresis: 0.2,
            patience: 2,
            min_prefill: 0,
            min_decode: 1,
        };
        let err = policy.config().unwrap_err().to_string();
        assert!(err.contains("--interval-ms"), "{err}");
        let err = PolicyArgs {
            slo_itl_ms: 0,
            interval_ms: 10_000,
            ..policy.clone()
        }
        .config()
        .unwrap_err()
        .to_string();
        assert!(err.contains("--slo-itl-ms"), "{err}");
        let err = PolicyArgs {
            min_decode: 0,
            interval_ms: 10_000,
            ..policy
        }
        .config()
        .unwrap_err()
        .to_string();
        assert!(err.contains("--min-decode"), "{err}");
    }
}
