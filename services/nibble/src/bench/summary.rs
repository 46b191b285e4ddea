//! What `nibble bench` writes: one [`RequestRecord`] per request (a JSON line each) and one
//! [`Summary`] per configuration and load point, computed from the records and the cluster's
//! metrics read before, during and after the point.

use serde::{Deserialize, Serialize};

use super::timeline::{self, PhaseStats, SplitChange, Window};

/// How load is offered at one point of a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Load {
    /// Closed loop: this many requests (or sessions) in flight at all times.
    Concurrency(usize),
    /// Open loop: requests (or sessions) arrive as a Poisson process of this many per second.
    Rate(f64),
}

impl Load {
    /// The number plotted on a load axis.
    pub fn value(self) -> f64 {
        match self {
            Load::Concurrency(c) => c as f64,
            Load::Rate(r) => r,
        }
    }

    /// A short label for plots and the progress bar: `c=4`, `r=2.5`.
    pub fn label(self) -> String {
        match self {
            Load::Concurrency(c) => format!("c={c}"),
            Load::Rate(r) => format!("r={r}"),
        }
    }

    /// The load axis' title.
    pub fn axis(self) -> &'static str {
        match self {
            Load::Concurrency(_) => "concurrency (requests in flight)",
            Load::Rate(_) => "request rate (requests/s)",
        }
    }
}

/// One request, as measured by the client.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The configuration's name (the suite's cluster, or `target` for a cluster given by URL).
    pub config: String,
    /// The load point's label (`c=4`, `r=2.5`).
    pub load: String,
    /// The request's number within its load point, in order of sending.
    pub index: usize,
    /// The shared-prefix group, or the multi-turn session, the request belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<usize>,
    /// The turn within its session (multi-turn workloads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<usize>,
    /// The phase of the load point it belongs to (plans of several phases).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<usize>,
    /// When it was sent, in seconds since the load point started.
    pub start_s: f64,
    /// Time to the first generated token, in milliseconds (`None` if none came).
    pub ttft_ms: Option<f64>,
    /// Every gap between consecutive generated tokens, in milliseconds. A chunk carrying k
    /// tokens counts as k gaps of a k-th of the time since the previous chunk each.
    pub itl_ms: Vec<f64>,
    /// From sending to the last byte of the answer, in milliseconds.
    pub e2e_ms: f64,
    /// Prompt tokens, as sent.
    pub prompt_tokens: u32,
    /// Prompt tokens the cluster served from a prefix cache (from the answer's usage).
    pub cached_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// The decode worker that generated it (over HTTP, from the `x-nibble-decode-worker`
    /// header).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_worker: Option<String>,
    /// The prefill worker that computed its prompt, when it was disaggregated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_worker: Option<String>,
    /// Whether a prefill worker computed the prompt and pushed its pages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disaggregated: Option<bool>,
    /// Why it failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl RequestRecord {
    /// Whether it completed without an error.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Generated tokens per second after the first one (`None` with fewer than two tokens).
    pub fn tokens_per_s(&self) -> Option<f64> {
        let ttft = self.ttft_ms?;
        let decode_ms = self.e2e_ms - ttft;
        (self.completion_tokens > 1 && decode_ms > 0.0)
            .then(|| f64::from(self.completion_tokens - 1) / (decode_ms / 1e3))
    }

    /// The mean gap between its tokens, in milliseconds.
    pub fn mean_itl_ms(&self) -> Option<f64> {
        (!self.itl_ms.is_empty())
            .then(|| self.itl_ms.iter().sum::<f64>() / self.itl_ms.len() as f64)
    }
}

/// Percentiles of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
    /// How many values.
    pub count: usize,
}

impl Percentiles {
    /// Of `values` (linear interpolation between the nearest ranks); `None` when empty.
    pub fn of(values: &[f64]) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let rank = q * (sorted.len() - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        };
        Some(Self {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            max: sorted[sorted.len() - 1],
            count: sorted.len(),
        })
    }
}

/// Service-level objectives a request must meet to count toward goodput.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token at most this many milliseconds.
    pub ttft_ms: Option<f64>,
    /// Mean inter-token latency at most this many milliseconds.
    pub itl_ms: Option<f64>,
}

impl Slo {
    /// Parses `ttft=500,itl=50` (milliseconds; either may be left out).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut slo = Slo::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not KEY=MILLISECONDS"))?;
            let ms: f64 = value
                .trim_end_matches("ms")
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("`{value}` is not a positive number of milliseconds"))?;
            match key {
                "ttft" => slo.ttft_ms = Some(ms),
                "itl" => slo.itl_ms = Some(ms),
                other => return Err(format!("unknown SLO `{other}` (ttft or itl)")),
            }
        }
        if slo.ttft_ms.is_none() && slo.itl_ms.is_none() {
            return Err("an SLO needs ttft=MS, itl=MS or both".into());
        }
        Ok(slo)
    }

    /// Whether `record` met every objective.
    pub fn met(&self, record: &RequestRecord) -> bool {
        let ttft = match (self.ttft_ms, record.ttft_ms) {
            (None, _) => true,
            (Some(limit), Some(ttft)) => ttft <= limit,
            (Some(_), None) => false,
        };
        let itl = match (self.itl_ms, record.mean_itl_ms()) {
            (None, _) | (Some(_), None) => true,
            (Some(limit), Some(itl)) => itl <= limit,
        };
        record.ok() && ttft && itl
    }
}

/// The cluster's counters over one load point, from its /metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterStats {
    /// Prefix-cache hits over lookups on the workers during the point (`None`: no lookup).
    pub prefix_cache_hit_rate: Option<f64>,
    /// The largest fraction of the decode workers' KV pages in use seen while it ran.
    pub peak_kv_usage: Option<f64>,
    /// The most sequences resident on the decode workers at once, as sampled.
    pub peak_running: Option<f64>,
    /// KV bytes sent from prefill to decode workers during the point.
    pub transfer_bytes: Option<f64>,
}

/// One sample of the cluster's state while a point ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the point started.
    pub t_s: f64,
    /// Sequences resident on the decode workers (being prefilled or decoded there).
    pub running: f64,
    /// Fraction of the decode workers' KV pages in use.
    pub kv_usage: Option<f64>,
    /// Prefill workers the router saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_workers: Option<f64>,
    /// Decode workers the router saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_workers: Option<f64>,
    /// Moves the cluster's planner has decided so far (`nibble_planner_decisions_total` of
    /// outcome `change`), where it runs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner_changes: Option<f64>,
}

/// What a point's summary is of: the configuration, its load, and how it is judged.
#[derive(Debug, Clone, Copy)]
pub struct Of<'a> {
    pub config: &'a str,
    pub load: Load,
    /// Workers (prefill and decode: GPUs, where each has one), for per-worker throughput.
    pub workers: usize,
    /// The objectives goodput counts.
    pub slo: Option<Slo>,
    /// The width of the windows latencies over time are summarized in, seconds.
    pub window_s: f64,
}

/// One configuration at one load point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub config: String,
    pub load: Load,
    /// Workers, prefill and decode (GPUs, where each has one), for per-worker throughput.
    pub workers: usize,
    pub requests: usize,
    pub errors: usize,
    /// From the first request sent to the last answer, in seconds.
    pub duration_s: f64,
    pub ttft_ms: Option<Percentiles>,
    /// Over every inter-token gap of every request.
    pub itl_ms: Option<Percentiles>,
    pub e2e_ms: Option<Percentiles>,
    /// Generated tokens per second, over the point.
    pub output_tokens_per_s: f64,
    /// Prompt and generated tokens per second.
    pub total_tokens_per_s: f64,
    pub requests_per_s: f64,
    /// Generated tokens per second per worker.
    pub output_tokens_per_s_per_worker: f64,
    /// The median over requests of each one's generated tokens per second after its first.
    pub tokens_per_s_per_user: Option<f64>,
    /// Prompt tokens served from a prefix cache over prompt tokens sent.
    pub cached_fraction: f64,
    /// Requests that were disaggregated over requests whose route is known.
    pub disaggregated_fraction: Option<f64>,
    /// The objectives goodput counts, when given.
    pub slo: Option<Slo>,
    /// Requests per second that met the SLO.
    pub goodput_requests_per_s: Option<f64>,
    /// The fraction of requests that met the SLO.
    pub goodput_fraction: Option<f64>,
    pub cluster: ClusterStats,
    /// The cluster's state over time.
    pub timeline: Vec<Sample>,
    /// Latencies and goodput over time, by when requests were sent.
    #[serde(default)]
    pub windows: Vec<Window>,
    /// Each phase's, for a point of several phases.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseStats>,
    /// Each change of the prefill/decode split while the point ran.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub split_changes: Vec<SplitChange>,
}

impl Summary {
    /// Summarizes `records` of one point that took `duration_s`, with what the cluster's
    /// metrics said of it.
    pub fn new(
        of: Of<'_>,
        records: &[RequestRecord],
        duration_s: f64,
        cluster: ClusterStats,
        timeline: Vec<Sample>,
    ) -> Self {
        let Of {
            config,
            load,
            workers,
            slo,
            window_s,
        } = of;
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
        let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
        let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
        let output: u64 = ok.iter().map(|r| u64::from(r.completion_tokens)).sum();
        let prompt: u64 = ok.iter().map(|r| u64::from(r.prompt_tokens)).sum();
        let cached: u64 = ok.iter().map(|r| u64::from(r.cached_tokens)).sum();
        let per_user: Vec<f64> = ok.iter().filter_map(|r| r.tokens_per_s()).collect();
        let routed: Vec<bool> = ok.iter().filter_map(|r| r.disaggregated).collect();
        let seconds = duration_s.max(1e-9);
        let good = slo.map(|slo| records.iter().filter(|r| slo.met(r)).count());
        Self {
            config: config.to_string(),
            load,
            workers,
            requests: records.len(),
            errors: records.len() - ok.len(),
            duration_s,
            ttft_ms: Percentiles::of(&ttft),
            itl_ms: Percentiles::of(&itl),
            e2e_ms: Percentiles::of(&e2e),
            output_tokens_per_s: output as f64 / seconds,
            total_tokens_per_s: (output + prompt) as f64 / seconds,
            requests_per_s: ok.len() as f64 / seconds,
            output_tokens_per_s_per_worker: output as f64 / seconds / workers.max(1) as f64,
            tokens_per_s_per_user: Percentiles::of(&per_user).map(|p| p.p50),
            cached_fraction: match prompt {
                0 => 0.0,
                _ => cached as f64 / prompt as f64,
            },
            disaggregated_fraction: (!routed.is_empty())
                .then(|| routed.iter().filter(|d| **d).count() as f64 / routed.len() as f64),
            slo,
            goodput_requests_per_s: good.map(|g| g as f64 / seconds),
            goodput_fraction: good.map(|g| match records.len() {
                0 => 0.0,
                n => g as f64 / n as f64,
            }),
            cluster,
            windows: timeline::windows(records, window_s, slo),
            phases: timeline::phases(records, &timeline, slo),
            split_changes: timeline::changes(&timeline),
            timeline,
        }
    }

    /// One line for the terminal.
    pub fn line(&self) -> String {
        let ms = |p: Option<Percentiles>| match p {
            Some(p) => format!("{:.1}/{:.1}/{:.1}", p.p50, p.p90, p.p99),
            None => "-".into(),
        };
        let mut line = format!(
            "{} {}: {} requests ({} failed) in {:.1} s; TTFT p50/p90/p99 {} ms; ITL {} ms; \
             {:.1} output tok/s ({:.1} per worker, {} per user); {:.2} req/s",
            self.config,
            self.load.label(),
            self.requests,
            self.errors,
            self.duration_s,
            ms(self.ttft_ms),
            ms(self.itl_ms),
            self.output_tokens_per_s,
            self.output_tokens_per_s_per_worker,
            self.tokens_per_s_per_user
                .map_or("-".into(), |t| format!("{t:.1}")),
            self.requests_per_s,
        );
        if let Some(good) = self.goodput_requests_per_s {
            line.push_str(&format!(
                "; goodput {good:.2} req/s ({:.0}%)",
                self.goodput_fraction.unwrap_or(0.0) * 100.0
            ));
        }
        if let Some(hit) = self.cluster.prefix_cache_hit_rate {
            line.push_str(&format!("; prefix-cache hits {:.0}%", hit * 100.0));
        }
        if let Some(peak) = self.cluster.peak_kv_usage {
            line.push_str(&format!("; peak KV {:.0}%", peak * 100.0));
        }
        for p in &self.phases {
            let p90 = |p: Option<Percentiles>| p.map_or("-".into(), |p| format!("{:.1}", p.p90));
            line.push_str(&format!(
                "\n  phase {} from {:.1} s: {} requests; TTFT p90 {} ms; ITL p90 {} ms",
                p.phase + 1,
                p.start_s,
                p.requests,
                p90(p.ttft_ms),
                p90(p.itl_ms),
            ));
            if let Some(good) = p.goodput_fraction {
                line.push_str(&format!("; goodput {:.0}%", good * 100.0));
            }
            if let Some((p0, d0)) = p.split_at_start {
                line.push_str(&format!("; began at {p0}P/{d0}D"));
            }
            if let Some(t) = p.reaction_s {
                line.push_str(&format!("; first move decided after {t:.1} s"));
            }
        }
        for c in &self.split_changes {
            let ((p0, d0), (p1, d1)) = (c.from, c.to);
            let decided = c
                .decided_s
                .map_or(String::new(), |t| format!("decided at {t:.1} s, "));
            line.push_str(&format!(
                "\n  split {p0}P/{d0}D -> {p1}P/{d1}D: {decided}in place at {:.1} s",
                c.changed_s
            ));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(ttft: f64, gaps: &[f64], tokens: u32) -> RequestRecord {
        RequestRecord {
            ttft_ms: Some(ttft),
            itl_ms: gaps.to_vec(),
            e2e_ms: ttft + gaps.iter().sum::<f64>(),
            prompt_tokens: 100,
            cached_tokens: 50,
            completion_tokens: tokens,
            disaggregated: Some(true),
            ..RequestRecord::default()
        }
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let p = Percentiles::of(&[4.0, 1.0, 3.0, 2.0, 5.0]).unwrap();
        assert_eq!((p.p50, p.mean, p.max, p.count), (3.0, 3.0, 5.0, 5));
        assert!((p.p90 - 4.6).abs() < 1e-12);
        assert!(Percentiles::of(&[]).is_none());
    }

    #[test]
    fn slos_parse_and_name_what_is_wrong() {
        let slo = Slo::parse("ttft=500,itl=50ms").unwrap();
        assert_eq!((slo.ttft_ms, slo.itl_ms), (Some(500.0), Some(50.0)));
        assert!(Slo::parse("ttft=-1").unwrap_err().contains("positive"));
        assert!(Slo::parse("tpot=5")
            .unwrap_err()
            .contains("unknown SLO `tpot`"));
        assert!(Slo::parse("").is_err());
    }

    #[test]
    fn a_summary_counts_tokens_goodput_and_failures() {
        let mut failed = record(10.0, &[], 0);
        failed.error = Some("UNAVAILABLE".into());
        let records = [
            record(100.0, &[10.0, 10.0, 10.0], 4),
            record(300.0, &[20.0, 20.0, 20.0], 4),
            failed,
        ];
        let slo = Slo::parse("ttft=200").unwrap();
        let of = Of {
            config: "x",
            load: Load::Concurrency(2),
            workers: 2,
            slo: Some(slo),
            window_s: 10.0,
        };
        let s = Summary::new(of, &records, 2.0, ClusterStats::default(), Vec::new());
        assert_eq!((s.requests, s.errors), (3, 1));
        assert_eq!(s.output_tokens_per_s, 4.0);
        assert_eq!(s.output_tokens_per_s_per_worker, 2.0);
        assert_eq!(s.total_tokens_per_s, 104.0);
        assert_eq!(s.goodput_requests_per_s, Some(0.5));
        assert_eq!(s.ttft_ms.unwrap().p50, 200.0);
        assert_eq!(s.itl_ms.unwrap().count, 6);
        assert_eq!(s.cached_fraction, 0.5);
        assert_eq!(s.disaggregated_fraction, Some(1.0));
        // 3 tokens after the first in 30 ms and in 60 ms: 100 and 50 tok/s, median 75.
        assert_eq!(s.tokens_per_s_per_user, Some(75.0));
    }
}
