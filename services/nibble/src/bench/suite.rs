//! Suites: clusters `nibble bench` starts itself, one after the other on this machine, each a
//! `nibble up` process with the suite's flags, measured under the same plan (so that they share
//! the machine and the moment), then stopped.
//!
//! A suite file is TOML. Its top-level keys override the command line's plan; each
//! `[[cluster]]` names a configuration, the `nibble up` flags that make it, and optionally its
//! own sweep (iso-capacity comparisons raise the concurrency to what each KV dtype fits):
//!
//! A load that shifts during each point is a list of phases instead of one workload, each
//! with its own request count, sent one after the other:
//!
//! ```toml
//! [[phase]]
//! workload = { kind = "fixed", input = 1024, output = 8 }
//! requests = 48
//! [[phase]]
//! workload = { kind = "fixed", input = 32, output = 128 }
//! requests = 48
//! ```
//!
//! ```toml
//! requests = 16
//! concurrency = [1, 4]
//! slo = "ttft=2000,itl=200"
//! workload = { kind = "shared-prefix", groups = 4, system = 256, input = 32, output = 16 }
//!
//! [[cluster]]
//! name = "prefix-aware"
//! args = ["--prefill-workers", "0", "--decode-workers", "2"]
//!
//! [[cluster]]
//! name = "round-robin"
//! args = ["--prefill-workers", "0", "--decode-workers", "2", "--routing", "round-robin"]
//! concurrency = [2, 8]
//! ```

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use nibble_engine::Tokenizer;
use serde::Deserialize;

use super::client::{Api, Client};
use super::scrape::Scraper;
use super::summary::{Load, Slo};
use super::workload::{Phase, Workload};
use super::{measure, BenchArgs, Plan, Results, Target};
use crate::{Error, Result};

/// How long a cluster may take to load its model and register its workers.
const START_TIMEOUT: Duration = Duration::from_secs(600);

/// One configuration of a suite.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Its name in the results and plots.
    pub name: String,
    /// `nibble up` flags (`--listen`, `--http-listen` and `--model` are the suite's).
    #[serde(default)]
    pub args: Vec<String>,
    /// Its own closed-loop sweep.
    pub concurrency: Option<Vec<usize>>,
    /// Its own open-loop sweep.
    pub rate: Option<Vec<f64>>,
}

/// A suite file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct SuiteFile {
    workload: Option<Workload>,
    requests: Option<usize>,
    #[serde(rename = "phase")]
    phases: Option<Vec<Phase>>,
    window_s: Option<f64>,
    warmup: Option<usize>,
    seed: Option<u64>,
    concurrency: Option<Vec<usize>>,
    rate: Option<Vec<f64>>,
    slo: Option<String>,
    api: Option<String>,
    respect_eos: Option<bool>,
    #[serde(rename = "cluster")]
    clusters: Vec<ClusterSpec>,
}

/// A suite, read and checked.
pub struct Suite {
    path: PathBuf,
    model: PathBuf,
    api: Api,
    overrides: SuiteFile,
    clusters: Vec<ClusterSpec>,
}

fn loads(concurrency: &Option<Vec<usize>>, rate: &Option<Vec<f64>>) -> Option<Vec<Load>> {
    match (rate, concurrency) {
        (Some(r), _) if !r.is_empty() => Some(r.iter().map(|r| Load::Rate(*r)).collect()),
        (_, Some(c)) if !c.is_empty() => Some(c.iter().map(|c| Load::Concurrency(*c)).collect()),
        _ => None,
    }
}

fn check_loads(loads: &[Load]) -> std::result::Result<(), String> {
    for load in loads {
        match *load {
            Load::Concurrency(0) => return Err("concurrency 0 sends nothing".into()),
            Load::Rate(r) if !(r.is_finite() && r > 0.0) => {
                return Err(format!(
                    "rate {r} is not a positive number of requests per second"
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

impl Suite {
    /// Reads and checks `path`: every error names the file and what is wrong in it.
    pub fn read(path: &Path, args: &BenchArgs) -> Result<Self> {
        let bad = |reason: String| Error::Bench(format!("{}: {reason}", path.display()));
        let text = crate::files::read(path)?;
        let text = String::from_utf8(text).map_err(|_| bad("not UTF-8 text".into()))?;
        let file: SuiteFile = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if file.clusters.is_empty() {
            return Err(bad("no [[cluster]] to run".into()));
        }
        let mut names = std::collections::HashSet::new();
        for cluster in &file.clusters {
            if cluster.name.is_empty() || !names.insert(cluster.name.as_str()) {
                return Err(bad(format!(
                    "cluster names must be unique and not empty: `{}`",
                    cluster.name
                )));
            }
            if let Some(loads) = loads(&cluster.concurrency, &cluster.rate) {
                check_loads(&loads).map_err(|e| bad(format!("cluster {}: {e}", cluster.name)))?;
            }
            for reserved in [
                "--listen",
                "--http-listen",
                "--model",
                "--prompt",
                "--no-http",
            ] {
                if cluster
                    .args
                    .iter()
                    .any(|a| a == reserved || a.starts_with(&format!("{reserved}=")))
                {
                    return Err(bad(format!(
                        "cluster {}: {reserved} is the suite's to set",
                        cluster.name
                    )));
                }
            }
        }
        if let Some(workload) = &file.workload {
            workload
                .check()
                .map_err(|e| bad(format!("workload: {e}")))?;
        }
        if let Some(phases) = &file.phases {
            if file.workload.is_some() || file.requests.is_some() {
                return Err(bad(
                    "[[phase]] and a top-level workload or requests exclude each other: each \
                     phase has its own"
                        .into(),
                ));
            }
            if phases.is_empty() {
                return Err(bad("phase: the list is empty".into()));
            }
            for (i, phase) in phases.iter().enumerate() {
                phase
                    .check()
                    .map_err(|e| bad(format!("phase {}: {e}", i + 1)))?;
            }
        }
        if let Some(w) = file.window_s.filter(|w| !(w.is_finite() && *w > 0.0)) {
            return Err(bad(format!(
                "window_s {w} is not a positive number of seconds"
            )));
        }
        if let Some(slo) = &file.slo {
            Slo::parse(slo).map_err(|e| bad(format!("slo: {e}")))?;
        }
        if let Some(loads) = loads(&file.concurrency, &file.rate) {
            check_loads(&loads).map_err(bad)?;
        }
        let api = match file.api.as_deref() {
            None => args.api,
            Some("grpc") => Api::Grpc,
            Some("openai") => Api::Openai,
            Some(other) => return Err(bad(format!("api `{other}` is not grpc or openai"))),
        };
        Ok(Self {
            path: path.to_path_buf(),
            model: args.model.clone(),
            api,
            clusters: file.clusters.clone(),
            overrides: file,
        })
    }

    /// `plan` with the suite's overrides.
    fn plan(&self, plan: &Plan) -> Plan {
        let o = &self.overrides;
        let phases = match &o.phases {
            Some(phases) => phases.clone(),
            None => vec![Phase {
                workload: o
                    .workload
                    .clone()
                    .unwrap_or_else(|| plan.workload().clone()),
                requests: o.requests.unwrap_or(plan.phases[0].requests).max(1),
            }],
        };
        Plan {
            phases,
            loads: loads(&o.concurrency, &o.rate).unwrap_or_else(|| plan.loads.clone()),
            window_s: o.window_s.unwrap_or(plan.window_s),
            warmup: o.warmup.unwrap_or(plan.warmup),
            seed: o.seed.unwrap_or(plan.seed),
            ignore_eos: o.respect_eos.map_or(plan.ignore_eos, |r| !r),
            slo: o
                .slo
                .as_deref()
                .and_then(|s| Slo::parse(s).ok())
                .or(plan.slo),
        }
    }

    /// Starts, measures and stops each cluster in turn.
    pub async fn run(
        &self,
        plan: &Plan,
        tokenizer: &Arc<Tokenizer>,
        corpus: &[u32],
        out_dir: &Path,
        results: &mut Results,
        out: &mut impl Write,
    ) -> Result<()> {
        let plan = self.plan(plan);
        writeln!(
            out,
            "nibble bench: suite {} ({} clusters, {})",
            self.path.display(),
            self.clusters.len(),
            plan.describe()
        )
        .map_err(Error::Stdout)?;
        std::fs::create_dir_all(out_dir).map_err(|source| Error::Write {
            path: out_dir.to_path_buf(),
            source,
        })?;
        for spec in &self.clusters {
            let log = out_dir.join(format!("{}.log", spec.name));
            let cluster = Running::start(&self.model, spec, &log)?;
            writeln!(
                out,
                "nibble bench: {} ready ({})",
                spec.name,
                spec.args.join(" ")
            )
            .map_err(Error::Stdout)?;
            let client = match self.api {
                Api::Grpc => Client::grpc(&cluster.grpc, &nibble_security::Peers::default()).await,
                Api::Openai => Client::http(&cluster.http, None, None).await,
            }
            .map_err(|e| Error::Bench(format!("{}: {e}", spec.name)))?;
            let target = Target {
                name: spec.name.clone(),
                client,
                scraper: Scraper::new(vec![format!("http://{}/metrics", cluster.http)]),
                loads: loads(&spec.concurrency, &spec.rate),
            };
            measure(&plan, target, tokenizer, corpus, out_dir, results, out).await?;
            drop(cluster);
        }
        Ok(())
    }
}

/// A `nibble up` child process; killed when dropped.
struct Running {
    child: Child,
    grpc: String,
    http: String,
}

impl Running {
    /// Starts `spec`'s cluster, its stderr into `log`, and waits until it is ready.
    fn start(model: &Path, spec: &ClusterSpec, log: &Path) -> Result<Self> {
        let fail = |reason: String| Error::Bench(format!("cluster {}: {reason}", spec.name));
        let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find nibble: {e}")))?;
        let stderr = std::fs::File::create(log).map_err(|source| Error::Write {
            path: log.to_path_buf(),
            source,
        })?;
        let mut child = Command::new(exe)
            .arg("up")
            .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
            .arg("--model")
            .arg(model)
            .args(&spec.args)
            .env_remove("NIBBLE_ROUTER_LISTEN")
            .env_remove("NIBBLE_HTTP_LISTEN")
            .env_remove("NIBBLE_METRICS_LISTEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| fail(format!("cannot start nibble up: {e}")))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut running = Running {
            child,
            grpc: String::new(),
            http: String::new(),
        };
        let deadline = std::time::Instant::now() + START_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(address) = line.strip_prefix("nibble-router listening on ") {
                        running.grpc = address.trim().to_string();
                    } else if let Some(url) = line.strip_prefix("nibble-router OpenAI HTTP API on ")
                    {
                        let url = url.trim().trim_start_matches("http://");
                        running.http = url.trim_end_matches("/v1").to_string();
                    } else if line.starts_with("nibble up: ready on ") {
                        if running.grpc.is_empty() || running.http.is_empty() {
                            return Err(fail("nibble up printed no addresses".into()));
                        }
                        return Ok(running);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(fail(format!(
                        "not ready after {} s (its log: {})",
                        START_TIMEOUT.as_secs(),
                        log.display()
                    )))
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = running.child.wait().ok();
                    let tail = std::fs::read_to_string(log).unwrap_or_default();
                    let last = tail
                        .lines()
                        .rev()
                        .find(|l| !l.trim().is_empty())
                        .unwrap_or("");
                    return Err(fail(format!(
                        "nibble up exited ({}) before it was ready: {last}",
                        status.map_or("unknown status".into(), |s| s.to_string())
                    )));
                }
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args() -> BenchArgs {
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            bench: BenchArgs,
        }
        Wrap::parse_from(["bench"]).bench
    }

    fn read(text: &str) -> Result<Suite> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("suite.toml");
        std::fs::write(&path, text).unwrap();
        Suite::read(&path, &args())
    }

    #[test]
    fn every_suite_in_the_repository_reads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/suites");
        let mut read = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let suite = Suite::read(&path, &args());
                assert!(
                    suite.is_ok(),
                    "{}: {}",
                    path.display(),
                    suite.err().unwrap()
                );
                read += 1;
            }
        }
        assert!(read >= 9, "{read} suites in {}", dir.display());
    }

    #[test]
    fn a_suite_overrides_the_plan_and_clusters_their_loads() {
        let suite = read(
            r#"
            requests = 5
            concurrency = [1, 2]
            slo = "ttft=100"
            workload = { kind = "fixed", input = 10, output = 3 }
            [[cluster]]
            name = "a"
            args = ["--kv-dtype", "fp8"]
            [[cluster]]
            name = "b"
            rate = [0.5]
            "#,
        )
        .unwrap();
        let plan = suite.plan(&args().plan().unwrap());
        assert_eq!(plan.phases.len(), 1);
        assert_eq!(plan.phases[0].requests, 5);
        assert_eq!(plan.loads, [Load::Concurrency(1), Load::Concurrency(2)]);
        assert_eq!(
            *plan.workload(),
            Workload::Fixed {
                input: 10,
                output: 3
            }
        );
        assert_eq!(plan.slo.unwrap().ttft_ms, Some(100.0));
        let b = &suite.clusters[1];
        assert_eq!(loads(&b.concurrency, &b.rate), Some(vec![Load::Rate(0.5)]));
    }

    #[test]
    fn a_suite_of_phases_replaces_the_workload_and_its_count() {
        let suite = read(
            r#"
            window_s = 5
            [[phase]]
            workload = { kind = "fixed", input = 100, output = 2 }
            requests = 4
            [[phase]]
            workload = { kind = "fixed", input = 8, output = 50 }
            requests = 6
            [[cluster]]
            name = "a"
            "#,
        )
        .unwrap();
        let plan = suite.plan(&args().plan().unwrap());
        let counts: Vec<_> = plan.phases.iter().map(|p| p.requests).collect();
        assert_eq!(counts, [4, 6]);
        assert_eq!(plan.window_s, 5.0);
        assert_eq!(plan.describe(), "fixed 100/2 x 4, then fixed 8/50 x 6",);
    }

    #[test]
    fn malformed_suites_name_the_file_and_the_problem() {
        let cases = [
            ("", "missing field `cluster`"),
            (
                "[[cluster]]\nname = \"a\"\n[[cluster]]\nname = \"a\"",
                "unique",
            ),
            (
                "[[cluster]]\nname = \"a\"\nargs = [\"--listen\", \"x\"]",
                "--listen is the suite's",
            ),
            (
                "concurrency = [0]\n[[cluster]]\nname = \"a\"",
                "concurrency 0",
            ),
            ("slo = \"p99=1\"\n[[cluster]]\nname = \"a\"", "unknown SLO"),
            (
                "workload = { kind = \"fixed\", input = 0, output = 1 }\n[[cluster]]\nname = \"a\"",
                "input tokens",
            ),
            (
                "bogus = 1\n[[cluster]]\nname = \"a\"",
                "unknown field `bogus`",
            ),
            (
                "requests = 3\n[[phase]]\nworkload = { kind = \"fixed\", input = 1, output = 1 }\n\
                 requests = 2\n[[cluster]]\nname = \"a\"",
                "exclude each other",
            ),
            (
                "[[phase]]\nworkload = { kind = \"fixed\", input = 1, output = 1 }\n\
                 requests = 0\n[[cluster]]\nname = \"a\"",
                "phase 1: requests must be at least 1",
            ),
            ("window_s = 0\n[[cluster]]\nname = \"a\"", "window_s 0"),
        ];
        for (text, wanted) in cases {
            let err = read(text).err().expect(text).to_string();
            assert!(err.contains("suite.toml"), "{err}");
            assert!(err.contains(wanted), "{text}: {err}");
        }
    }
}
