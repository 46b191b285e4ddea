//! `nibble bench`'s flags, and the plan and target they describe.

use std::path::PathBuf;

use nibble_engine::Tokenizer;
use nibble_security::Peers;

use super::client::{Api, Client};
use super::scrape::Scraper;
use super::summary::{Load, Slo};
use super::workload::{Phase, Workload, DEFAULT_CORPUS};
use super::{Plan, Target};
use crate::cli::DEFAULT_MODEL;
use crate::{files, Error, Result};

/// Which kind of workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Every prompt --input-tokens, every answer --output-tokens.
    Fixed,
    /// Lognormal lengths with means --input-tokens and --output-tokens and shape --sigma.
    Lognormal,
    /// --groups system prompts of --system-tokens, each request one of them and a question of
    /// --input-tokens.
    SharedPrefix,
    /// --requests sessions of --turns turns, each turn the conversation so far plus a new user
    /// message of --input-tokens, --think-ms apart.
    MultiTurn,
}

/// Flags of `nibble bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// The router: its gRPC address (`--api grpc`) or its HTTP API's (`--api openai`). Not used
    /// with --suite.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:50051")]
    pub url: String,
    /// Which API the requests go through.
    #[arg(long, value_enum, default_value_t = Api::Grpc)]
    pub api: Api,
    /// Prometheus endpoints to read before, during and after each point (repeatable; default
    /// with --api openai: the API's own /metrics).
    #[arg(long = "metrics", value_name = "URL")]
    pub metrics: Vec<String>,
    /// The served model's file: its tokenizer builds the prompts (and, with --suite, the
    /// clusters serve it).
    #[arg(long, value_name = "PATH", env = "NIBBLE_MODEL", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// The model name requests ask for over HTTP (default: the first /v1/models lists).
    #[arg(long, value_name = "NAME")]
    pub served_model: Option<String>,
    /// A suite file (TOML): clusters to start one after another and measure under the same
    /// sweep (docs/BENCHMARKS.md).
    #[arg(long, value_name = "FILE")]
    pub suite: Option<PathBuf>,
    /// What the requests look like.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Fixed)]
    pub workload: WorkloadKind,
    /// Prompt tokens (the mean for lognormal; the question after the system prompt for
    /// shared-prefix; each new user message for multi-turn).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub input_tokens: usize,
    /// Tokens each answer asks for (the mean for lognormal).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub output_tokens: usize,
    /// The lognormal lengths' shape (the σ of their logarithm).
    #[arg(long, default_value_t = 0.5)]
    pub sigma: f64,
    /// Shared-prefix groups.
    #[arg(long, value_name = "G", default_value_t = 4)]
    pub groups: usize,
    /// Tokens of each group's system prompt.
    #[arg(long, value_name = "S", default_value_t = 512)]
    pub system_tokens: usize,
    /// Turns per multi-turn session.
    #[arg(long, value_name = "T", default_value_t = 4)]
    pub turns: usize,
    /// Think time between a session's turns, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub think_ms: u64,
    /// Requests per load point (sessions, for multi-turn).
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub requests: usize,
    /// Closed-loop sweep: requests in flight at each point, comma-separated.
    #[arg(
        long,
        value_name = "C,...",
        value_delimiter = ',',
        conflicts_with = "rate"
    )]
    pub concurrency: Vec<usize>,
    /// Open-loop sweep: Poisson arrival rates in requests per second, comma-separated.
    #[arg(long, value_name = "R,...", value_delimiter = ',')]
    pub rate: Vec<f64>,
    /// Requests sent before the first point and not measured.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub warmup: usize,
    /// Seed of the prompts and the arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Let an answer end at the model's end-of-sequence token instead of at exactly
    /// --output-tokens.
    #[arg(long)]
    pub respect_eos: bool,
    /// Each point's latencies and goodput are also summarized over windows of this many
    /// seconds (by when requests were sent), to show how they move over time.
    #[arg(long, value_name = "S", default_value_t = 10.0)]
    pub window_s: f64,
    /// Service-level objectives for goodput: `ttft=MS,itl=MS` (either or both; the ITL is each
    /// request's mean).
    #[arg(long, value_name = "ttft=MS,itl=MS", value_parser = Slo::parse)]
    pub slo: Option<Slo>,
    /// A UTF-8 text to cut prompts from (default: a chapter of Pride and Prejudice).
    #[arg(long, value_name = "FILE")]
    pub corpus: Option<PathBuf>,
    /// Where the results go (created; its files are replaced).
    #[arg(long, value_name = "DIR", default_value = "nibble-bench")]
    pub out: PathBuf,
    /// The router's API key.
    #[arg(long, env = "NIBBLE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The CA that signed the router's certificate (gRPC over TLS).
    #[arg(long, value_name = "PEM", env = "NIBBLE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

impl BenchArgs {
    /// The workload the flags describe, checked.
    pub fn workload(&self) -> Result<Workload> {
        let (input, output) = (self.input_tokens, self.output_tokens);
        let workload = match self.workload {
            WorkloadKind::Fixed => Workload::Fixed { input, output },
            WorkloadKind::Lognormal => Workload::Lognormal {
                input,
                output,
                sigma: self.sigma,
            },
            WorkloadKind::SharedPrefix => Workload::SharedPrefix {
                groups: self.groups,
                system: self.system_tokens,
                input,
                output,
            },
            WorkloadKind::MultiTurn => Workload::MultiTurn {
                turns: self.turns,
                input,
                output,
                think_ms: self.think_ms,
            },
        };
        workload.check().map_err(|reason| Error::Flag {
            flag: "--workload",
            reason,
        })?;
        Ok(workload)
    }

    /// The sweep: `--rate` points, else `--concurrency` points (default: 1).
    pub fn loads(&self) -> Result<Vec<Load>> {
        if let Some(bad) = self.rate.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
            return Err(Error::Flag {
                flag: "--rate",
                reason: format!("{bad} is not a positive number of requests per second"),
            });
        }
        if self.concurrency.contains(&0) {
            return Err(Error::Flag {
                flag: "--concurrency",
                reason: "0 requests in flight sends nothing".into(),
            });
        }
        Ok(match (self.rate.is_empty(), self.concurrency.is_empty()) {
            (false, _) => self.rate.iter().map(|r| Load::Rate(*r)).collect(),
            (true, false) => self
                .concurrency
                .iter()
                .map(|c| Load::Concurrency(*c))
                .collect(),
            (true, true) => vec![Load::Concurrency(1)],
        })
    }

    /// The plan the flags describe.
    pub fn plan(&self) -> Result<Plan> {
        if self.requests == 0 {
            return Err(Error::Flag {
                flag: "--requests",
                reason: "must be at least 1".into(),
            });
        }
        if !(self.window_s.is_finite() && self.window_s > 0.0) {
            return Err(Error::Flag {
                flag: "--window-s",
                reason: format!("{} is not a positive number of seconds", self.window_s),
            });
        }
        Ok(Plan {
            phases: vec![Phase {
                workload: self.workload()?,
                requests: self.requests,
            }],
            loads: self.loads()?,
            warmup: self.warmup,
            seed: self.seed,
            ignore_eos: !self.respect_eos,
            slo: self.slo,
            window_s: self.window_s,
        })
    }

    /// The corpus' tokens.
    pub fn corpus_tokens(&self, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
        let text = match &self.corpus {
            None => DEFAULT_CORPUS.to_string(),
            Some(path) => String::from_utf8(files::read(path)?).map_err(|e| Error::NotUtf8 {
                path: path.clone(),
                offset: e.utf8_error().valid_up_to(),
            })?,
        };
        let tokens = tokenizer.encode(&text, false).map_err(|e| Error::Flag {
            flag: "--corpus",
            reason: e.to_string(),
        })?;
        if tokens.is_empty() {
            return Err(Error::Flag {
                flag: "--corpus",
                reason: "the text has no tokens".into(),
            });
        }
        Ok(tokens)
    }

    /// How gRPC dials the router: the CA and the API key.
    pub fn peers(&self) -> Result<Peers> {
        crate::cluster::client_peers(self.tls_ca.clone(), self.api_key.as_deref())
    }

    /// The cluster at `--url`, connected.
    pub async fn target(&self) -> Result<Target> {
        let cannot_reach = |reason: String| Error::Flag {
            flag: "--url",
            reason,
        };
        let (client, mut metrics) = match self.api {
            Api::Grpc => (
                Client::grpc(&self.url, &self.peers()?)
                    .await
                    .map_err(cannot_reach)?,
                Vec::new(),
            ),
            Api::Openai => {
                let client = Client::http(
                    &self.url,
                    self.served_model.as_deref(),
                    self.api_key.as_deref(),
                )
                .await
                .map_err(cannot_reach)?;
                let Client::Http { base, .. } = &client else {
                    unreachable!("Client::http makes an HTTP client")
                };
                let metrics = vec![format!("{base}/metrics")];
                (client, metrics)
            }
        };
        if !self.metrics.is_empty() {
            metrics = self.metrics.clone();
        }
        Ok(Target {
            name: "target".into(),
            client,
            scraper: Scraper::new(metrics),
            loads: None,
        })
    }
}
