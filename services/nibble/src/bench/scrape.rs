//! The cluster's own numbers, read from its Prometheus `/metrics` endpoints before, during and
//! after a load point: prefix-cache hits, KV pages in use, running requests and transfer bytes.
//!
//! Resident sequences are the decode workers' `nibble_worker_running_requests`, summed; the KV
//! in use is the router's `nibble_router_kv_cache_usage{role="decode"}` (over its decode
//! workers' load reports); the workers' counters (`nibble_worker_prefix_cache_{hits,queries}_total`,
//! `nibble_worker_kv_transfer_bytes_total{direction="sent"}`) are summed over every series of
//! every endpoint given. `nibble up` serves all of them on its HTTP port.

use std::time::{Duration, Instant};

use super::summary::{ClusterStats, Sample};

/// One sample: a metric's name, its labels and its value.
type Series = (String, Vec<(String, String)>, f64);

/// One scrape: every sample of every endpoint.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    samples: Vec<Series>,
}

impl Metrics {
    /// Parses Prometheus text exposition (comments and malformed lines are skipped).
    pub fn parse(text: &str) -> Self {
        let mut samples = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (series, value) = match line.rsplit_once(' ') {
                Some(split) => split,
                None => continue,
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                None => (series, Vec::new()),
                Some((name, rest)) => (name, labels(rest.trim_end_matches('}'))),
            };
            samples.push((name.to_string(), labels, value));
        }
        Self { samples }
    }

    /// Adds another endpoint's samples.
    pub fn extend(&mut self, other: Metrics) {
        self.samples.extend(other.samples);
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        filter: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = f64> + 'a {
        self.samples
            .iter()
            .filter(move |(n, labels, _)| {
                n == name
                    && filter
                        .iter()
                        .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, v)| *v)
    }

    /// The sum of `name`'s samples whose labels include `filter` (`None`: there are none).
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        self.matching(name, filter)
            .fold(None, |s, v| Some(s.unwrap_or(0.0) + v))
    }

    /// The largest of them.
    pub fn max(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        self.matching(name, filter)
            .fold(None, |m, v| Some(m.map_or(v, |m: f64| m.max(v))))
    }

    /// Sequences resident on the decode workers (being prefilled or decoded there), else the
    /// router's running requests (which counts those waiting on a worker too).
    pub fn running(&self) -> Option<f64> {
        self.sum("nibble_worker_running_requests", &[("role", "decode")])
            .or_else(|| self.sum("nibble_router_running_requests", &[]))
    }

    /// The decode workers' share of KV pages in use: the router's, else the fullest worker's.
    pub fn kv_usage(&self) -> Option<f64> {
        self.max("nibble_router_kv_cache_usage", &[("role", "decode")])
            .or_else(|| self.max("nibble_worker_kv_cache_usage", &[("role", "decode")]))
    }

    /// The workers of `role` the routers see (the most any router sees).
    pub fn workers(&self, role: &str) -> Option<f64> {
        self.max("nibble_router_workers", &[("role", role)])
    }

    /// Moves the planner has decided: 0 before its first (the counter appears with it) where a
    /// planner runs, `None` where none does.
    pub fn planner_changes(&self) -> Option<f64> {
        let changes = self.sum("nibble_planner_decisions_total", &[("outcome", "change")]);
        let planner = self.sum("nibble_planner_leader", &[]).is_some();
        changes.or(planner.then_some(0.0))
    }

    fn hits(&self) -> Option<(f64, f64)> {
        Some((
            self.sum("nibble_worker_prefix_cache_hits_total", &[])?,
            self.sum("nibble_worker_prefix_cache_queries_total", &[])?,
        ))
    }

    fn transfer_bytes(&self) -> Option<f64> {
        self.sum(
            "nibble_worker_kv_transfer_bytes_total",
            &[("direction", "sent")],
        )
    }
}

/// `a="x",b="y"` as pairs (values unescaped only as far as `\"` and `\\`).
fn labels(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, next)) = chars.next() {
                        value.push(next);
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key.trim_start_matches(',').trim().to_string(), value));
        rest = &after[end..];
    }
    out
}

/// The `/metrics` endpoints of one cluster.
#[derive(Clone)]
pub struct Scraper {
    http: reqwest::Client,
    urls: Vec<String>,
}

impl Scraper {
    /// Over `urls` (none: every read is empty).
    pub fn new(urls: Vec<String>) -> Self {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("a plain HTTP client builds");
        Self { http, urls }
    }

    /// Whether there is anything to read.
    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }

    /// Reads every endpoint; one that fails is named in the error.
    pub async fn read(&self) -> Result<Metrics, String> {
        let mut all = Metrics::default();
        for url in &self.urls {
            let text = async {
                let response = self.http.get(url).send().await?.error_for_status()?;
                response.text().await
            }
            .await
            .map_err(|e| format!("cannot read {url}: {e}"))?;
            all.extend(Metrics::parse(&text));
        }
        Ok(all)
    }

    /// Samples the cluster every `every` until `done` resolves; returns the samples (times from
    /// `start`). Failed reads are skipped.
    pub async fn sample_until(
        &self,
        start: Instant,
        every: Duration,
        done: impl std::future::Future<Output = ()>,
    ) -> Vec<Sample> {
        let mut samples = Vec::new();
        if self.is_empty() {
            done.await;
            return samples;
        }
        tokio::pin!(done);
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                () = &mut done => return samples,
                _ = tick.tick() => {
                    if let Ok(m) = self.read().await {
                        samples.push(Sample {
                            t_s: start.elapsed().as_secs_f64(),
                            running: m.running().unwrap_or(0.0),
                            kv_usage: m.kv_usage(),
                            prefill_workers: m.workers("prefill"),
                            decode_workers: m.workers("decode"),
                            planner_changes: m.planner_changes(),
                        });
                    }
                }
            }
        }
    }
}

/// What changed between `before` and `after`, with the peaks of `samples`.
pub fn stats(before: &Metrics, after: &Metrics, samples: &[Sample]) -> ClusterStats {
    let hit_rate = match (before.hits(), after.hits()) {
        (Some((h0, q0)), Some((h1, q1))) if q1 > q0 => Some((h1 - h0) / (q1 - q0)),
        _ => None,
    };
    let transfer = match (before.transfer_bytes(), after.transfer_bytes()) {
        (b, Some(a)) => Some(a - b.unwrap_or(0.0)),
        _ => None,
    };
    let peak = |f: fn(&Sample) -> Option<f64>| {
        samples
            .iter()
            .filter_map(f)
            .fold(None, |m, v| Some(m.map_or(v, |m: f64| m.max(v))))
    };
    ClusterStats {
        prefix_cache_hit_rate: hit_rate,
        peak_kv_usage: peak(|s| s.kv_usage),
        peak_running: peak(|s| Some(s.running)),
        transfer_bytes: transfer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP nibble_router_running_requests Requests holding a running place.
# TYPE nibble_router_running_requests gauge
nibble_router_running_requests 9
nibble_worker_running_requests{role="decode",worker="d0"} 1
nibble_worker_running_requests{role="decode",worker="d1"} 2
nibble_worker_running_requests{role="prefill",worker="p0"} 5
nibble_router_kv_cache_usage{role="decode"} 0.25
nibble_router_workers{role="prefill"} 1
nibble_router_workers{role="decode"} 3
nibble_router_kv_cache_usage{role="prefill"} 0.75
nibble_worker_prefix_cache_hits_total{role="decode"} 32
nibble_worker_prefix_cache_hits_total{role="prefill"} 16
nibble_worker_prefix_cache_queries_total{role="decode"} 64
nibble_worker_prefix_cache_queries_total{role="prefill"} 64
nibble_worker_kv_transfer_bytes_total{role="prefill",direction="sent"} 1000
nibble_worker_kv_transfer_bytes_total{role="decode",direction="received"} 1000
weird{a="x\"y",b="z"} 1
garbage line
"#;

    #[test]
    fn metrics_parse_and_add_up() {
        let m = Metrics::parse(TEXT);
        assert_eq!(m.running(), Some(3.0));
        assert_eq!(m.kv_usage(), Some(0.25));
        assert_eq!(
            (m.workers("prefill"), m.workers("decode")),
            (Some(1.0), Some(3.0))
        );
        assert_eq!(m.planner_changes(), None, "no planner");
        let leading = Metrics::parse("nibble_planner_leader 1\n");
        assert_eq!(leading.planner_changes(), Some(0.0));
        let moved = Metrics::parse(
            "nibble_planner_leader 1\nnibble_planner_decisions_total{outcome=\"change\"} 2\n\
             nibble_planner_decisions_total{outcome=\"hold\"} 9\n",
        );
        assert_eq!(moved.planner_changes(), Some(2.0));
        assert_eq!(m.hits(), Some((48.0, 128.0)));
        assert_eq!(m.transfer_bytes(), Some(1000.0));
        assert_eq!(m.sum("weird", &[("a", "x\"y"), ("b", "z")]), Some(1.0));
        assert_eq!(m.sum("absent", &[]), None);
    }

    #[test]
    fn stats_are_differences_and_peaks() {
        let before = Metrics::parse(TEXT);
        let after = Metrics::parse(
            "nibble_worker_prefix_cache_hits_total 148\n\
             nibble_worker_prefix_cache_queries_total 328\n\
             nibble_worker_kv_transfer_bytes_total{direction=\"sent\"} 5000\n",
        );
        let samples = [
            Sample {
                t_s: 0.0,
                running: 2.0,
                kv_usage: Some(0.1),
                ..Sample::default()
            },
            Sample {
                t_s: 0.5,
                running: 5.0,
                kv_usage: Some(0.4),
                ..Sample::default()
            },
        ];
        let s = stats(&before, &after, &samples);
        assert_eq!(s.prefix_cache_hit_rate, Some(0.5));
        assert_eq!(s.transfer_bytes, Some(4000.0));
        assert_eq!((s.peak_running, s.peak_kv_usage), (Some(5.0), Some(0.4)));
    }
}
