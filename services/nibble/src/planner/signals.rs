//! What the planner reads: each worker's load (its registration and its `Load` RPC) and the
//! routers' latency histograms (their `/metrics`, or the process's own recorder inside
//! `nibble up`).

use std::net::SocketAddr;
use std::time::Duration;

use nibble_discovery::{Role, WorkerInfo};
use nibble_planner::{Histogram, Latency, WorkerLoad};
use nibble_proto::v1;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_security::Peers;
use nibble_telemetry::Samples;

/// The router's histogram names (`nibble_router::metrics`).
const TTFT: &str = nibble_router::metrics::TIME_TO_FIRST_TOKEN_SECONDS;
const ITL: &str = nibble_router::metrics::INTER_TOKEN_LATENCY_SECONDS;
/// Longest wait for one worker's load.
const LOAD_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the routers' latency histograms are read.
#[derive(Debug, Clone)]
pub enum LatencySource {
    /// `GET /metrics` of each router: `host:port`, a name resolved at every read to all its
    /// addresses (a Kubernetes headless Service names every router pod).
    Scrape(Vec<String>),
    /// This process's recorder (the router runs in it: `nibble up`).
    Local,
}

impl LatencySource {
    /// The routers' histograms now (cumulative since they started), summed over routers and
    /// models. A router that cannot be read is left out, with a warning.
    pub async fn read(&self) -> Latency {
        let texts = match self {
            LatencySource::Local => vec![nibble_telemetry::install().render().await],
            LatencySource::Scrape(targets) => {
                let mut texts = Vec::with_capacity(targets.len());
                for target in targets {
                    for address in resolve(target).await {
                        match nibble_telemetry::scrape(address).await {
                            Ok(text) => texts.push(text),
                            Err(err) => {
                                tracing::warn!(%address, %err, "cannot read a router's /metrics")
                            }
                        }
                    }
                }
                texts
            }
        };
        let mut latency = Latency::default();
        for text in texts {
            let samples = Samples::parse(&text);
            let one = Latency {
                ttft: histogram(&samples, TTFT),
                itl: histogram(&samples, ITL),
            };
            latency = latency.merged(&one).unwrap_or_else(|err| {
                tracing::warn!(%err, "routers' latency buckets differ; using one router's");
                one
            });
        }
        latency
    }
}

/// Every address `target` (`host:port`) names now; none, with a warning, when it names none.
async fn resolve(target: &str) -> Vec<SocketAddr> {
    match tokio::net::lookup_host(target).await {
        Ok(addresses) => {
            let mut addresses: Vec<SocketAddr> = addresses.collect();
            addresses.sort();
            addresses.dedup();
            addresses
        }
        Err(err) => {
            tracing::warn!(%target, %err, "cannot resolve --router-metrics");
            Vec::new()
        }
    }
}

/// The histogram `name` in `samples`, its series summed over every label but `le`; empty when
/// absent or malformed.
pub fn histogram(samples: &Samples, name: &str) -> Histogram {
    let bucket = format!("{name}_bucket");
    let mut buckets: Vec<(f64, u64)> = Vec::new();
    for sample in samples.matching(&bucket, &[]) {
        let Some((_, le)) = sample.labels.iter().find(|(k, _)| k == "le") else {
            continue;
        };
        let bound = match le.as_str() {
            "+Inf" => f64::INFINITY,
            other => match other.parse::<f64>() {
                Ok(bound) => bound,
                Err(_) => continue,
            },
        };
        let count = sample.value.max(0.0) as u64;
        match buckets.iter_mut().find(|(b, _)| *b == bound) {
            Some((_, total)) => *total += count,
            None => buckets.push((bound, count)),
        }
    }
    if buckets.is_empty() {
        return Histogram::default();
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let sum = samples.get(&format!("{name}_sum"), &[]).unwrap_or(0.0);
    let count = buckets.last().map_or(0, |&(_, c)| c);
    Histogram::new(buckets, sum, count).unwrap_or_default()
}

/// The load of every prefill and decode worker of `workers` (the registrations). A worker that
/// does not answer is left out (the planner moves none it cannot see).
pub async fn worker_loads(workers: &[WorkerInfo], peers: &Peers) -> Vec<WorkerLoad> {
    let mut loads = Vec::with_capacity(workers.len());
    for worker in workers {
        let role = match worker.role {
            Role::Prefill => nibble_planner::Role::Prefill,
            Role::Decode => nibble_planner::Role::Decode,
            Role::Router => continue,
        };
        let reply = async {
            let channel = peers.connect_lazy(&worker.addresses.grpc)?;
            let mut client = WorkerClient::new(channel);
            let load = client.load(v1::LoadRequest {}).await?.into_inner();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(load)
        };
        match tokio::time::timeout(LOAD_TIMEOUT, reply).await {
            Ok(Ok(load)) => loads.push(WorkerLoad {
                id: worker.id.to_string(),
                role,
                queued_prefill_tokens: load.queued_prefill_tokens,
                running: load.running_requests,
                waiting: load.waiting_requests,
                used_pages: load
                    .total_pages
                    .saturating_sub(load.free_pages + load.evictable_pages),
                total_pages: load.total_pages,
                draining: worker.draining,
            }),
            Ok(Err(err)) => {
                tracing::warn!(worker = %worker.id, %err, "cannot read a worker's load")
            }
            Err(_) => {
                tracing::warn!(worker = %worker.id, "a worker's load did not come in {LOAD_TIMEOUT:?}")
            }
        }
    }
    loads
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_sum_over_models_and_keep_their_buckets() {
        let text = "\
# TYPE nibble_router_time_to_first_token_seconds histogram
nibble_router_time_to_first_token_seconds_bucket{model=\"a\",le=\"0.5\"} 2
nibble_router_time_to_first_token_seconds_bucket{model=\"a\",le=\"1\"} 3
nibble_router_time_to_first_token_seconds_bucket{model=\"a\",le=\"+Inf\"} 4
nibble_router_time_to_first_token_seconds_sum{model=\"a\"} 5.5
nibble_router_time_to_first_token_seconds_count{model=\"a\"} 4
nibble_router_time_to_first_token_seconds_bucket{model=\"b\",le=\"0.5\"} 1
nibble_router_time_to_first_token_seconds_bucket{model=\"b\",le=\"1\"} 1
nibble_router_time_to_first_token_seconds_bucket{model=\"b\",le=\"+Inf\"} 1
nibble_router_time_to_first_token_seconds_sum{model=\"b\"} 0.25
nibble_router_time_to_first_token_seconds_count{model=\"b\"} 1
";
        let h = histogram(&Samples::parse(text), TTFT);
        assert_eq!(h.buckets(), &[(0.5, 3), (1.0, 4), (f64::INFINITY, 5)]);
        assert_eq!(h.count(), 5);
        assert!((h.sum() - 5.75).abs() < 1e-12);
        assert_eq!(histogram(&Samples::parse(text), ITL).count(), 0);
    }
}
