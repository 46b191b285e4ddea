//! A real cluster for tests: etcd (Debian's etcd-server) and the `nibble` binary's `router`,
//! `prefill` and `decode` commands as separate processes on loopback ports, with the real
//! model. Every process is killed when the [`Cluster`] drops; each one's stderr (its logs) is
//! kept in a temporary directory and shown when something fails.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_testkit::{model_path, wait, EtcdServer};
use tempfile::TempDir;
use tonic::transport::Channel;

/// How long a process may take to load the model and listen.
const START_WAIT: Duration = Duration::from_secs(120);

/// One `nibble` process.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
    /// The address it printed (`... listening on ADDR`; a planner's id, `... campaigning as ID`).
    pub address: String,
    /// Its /metrics address, if it printed one (`... metrics on ADDR`).
    pub metrics: Option<SocketAddr>,
    /// Its HTTP API's address, if it printed one (`... HTTP API on http://ADDR/v1`).
    pub http: Option<SocketAddr>,
}

/// An address a process printed on stdout.
enum Printed {
    Listening(String),
    Metrics(SocketAddr),
    Http(SocketAddr),
}

impl Proc {
    /// Starts `nibble ARGS` and waits for its `listening on` line; its logs are text, or JSON
    /// lines with `json_logs`.
    pub fn start(name: &str, args: &[String], dir: &Path, json_logs: bool) -> Self {
        let log = dir.join(format!("{name}.log"));
        let stderr = File::create(&log).expect("log file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_nibble"));
        command.args(args).env("RUST_LOG", "info");
        if json_logs {
            command.env("NIBBLE_LOG_FORMAT", "json");
        } else {
            command.env_remove("NIBBLE_LOG_FORMAT");
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start nibble");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                let printed = if let Some((_, address)) = line.split_once(" listening on ") {
                    Printed::Listening(address.trim().to_string())
                } else if let Some((_, id)) = line.split_once(" campaigning as ") {
                    // A planner listens on nothing but /metrics; it is up once it campaigns.
                    Printed::Listening(id.trim().to_string())
                } else if let Some((_, address)) = line.split_once(" metrics on ") {
                    Printed::Metrics(address.trim().parse().expect("a metrics address"))
                } else if let Some((_, url)) = line.split_once(" HTTP API on http://") {
                    let address = url.trim().trim_end_matches("/v1");
                    Printed::Http(address.parse().expect("an HTTP address"))
                } else {
                    continue;
                };
                let _ = tx.send(printed);
            }
        });
        let mut proc = Self {
            name: name.into(),
            child: Some(child),
            log,
            address: String::new(),
            metrics: None,
            http: None,
        };
        let start = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Printed::Listening(address)) => {
                    proc.address = address;
                    return proc;
                }
                Ok(Printed::Metrics(address)) => proc.metrics = Some(address),
                Ok(Printed::Http(address)) => proc.http = Some(address),
                Err(_) => {}
            }
            if let Some(status) = proc
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("{name} exited with {status}; its log:\n{}", proc.log());
            }
            assert!(
                start.elapsed() < START_WAIT,
                "{name} did not listen within {START_WAIT:?}; its log:\n{}",
                proc.log()
            );
        }
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills it (SIGKILL: no clean shutdown, as a crash) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM and waits up to `limit` for the process to exit; its exit status.
    #[allow(dead_code)] // tests/cluster.rs
    pub fn terminate(&mut self, limit: Duration) -> std::process::ExitStatus {
        let child = self.child.as_mut().expect("running");
        let pid = child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM {pid}");
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                self.child = None;
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "{} still running {limit:?} after SIGTERM; its log:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct Spec {
    pub kv_dtype: &'static str,
    pub prefills: usize,
    pub decodes: usize,
    /// Extra flags of the router.
    pub router_args: Vec<String>,
    /// MiB of KV pages per worker.
    pub kv_budget_mib: usize,
    /// Every process logs JSON lines (`NIBBLE_LOG_FORMAT=json`) instead of text.
    pub json_logs: bool,
}

impl Spec {
    /// One prefill and one decode worker of `kv_dtype`, every prompt prefilled by the prefill
    /// worker (no local prefill threshold).
    pub fn new(kv_dtype: &'static str) -> Self {
        Self {
            kv_dtype,
            prefills: 1,
            decodes: 1,
            router_args: vec!["--local-prefill-threshold".into(), "0".into()],
            kv_budget_mib: 32,
            json_logs: false,
        }
    }
}

/// etcd, workers and a router, as processes.
pub struct Cluster {
    #[allow(dead_code)] // tests/cluster.rs
    pub etcd: EtcdServer,
    pub prefills: Vec<Proc>,
    pub decodes: Vec<Proc>,
    pub router: Proc,
    pub spec: Spec,
    /// Every process's log, kept until the cluster drops.
    _dir: TempDir,
}

impl Cluster {
    /// Starts everything and waits until the router tracks every worker.
    pub async fn start(spec: Spec) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let etcd = EtcdServer::start();
        let model = model_path().display().to_string();
        let worker_args = |role: &str| worker_args(&spec, &etcd.endpoint(), role);
        let prefills = (0..spec.prefills)
            .map(|i| {
                let args = worker_args("prefill");
                Proc::start(&format!("prefill-{i}"), &args, dir.path(), spec.json_logs)
            })
            .collect();
        let decodes = (0..spec.decodes)
            .map(|i| {
                let args = worker_args("decode");
                Proc::start(&format!("decode-{i}"), &args, dir.path(), spec.json_logs)
            })
            .collect();
        let mut router_args: Vec<String> = [
            "router",
            "--model",
            &model,
            "--listen",
            "127.0.0.1:0",
            "--etcd-endpoints",
            &etcd.endpoint(),
            "--load-interval-ms",
            "100",
            "--http-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ]
        .map(String::from)
        .to_vec();
        router_args.extend(spec.router_args.iter().cloned());
        let router = Proc::start("router", &router_args, dir.path(), spec.json_logs);
        let cluster = Self {
            etcd,
            prefills,
            decodes,
            router,
            spec,
            _dir: dir,
        };
        cluster
            .wait_for_workers(cluster.spec.prefills, cluster.spec.decodes)
            .await;
        cluster
    }

    /// The worker id a worker process registered under (its role and port, by default).
    #[allow(dead_code)] // tests/planner.rs
    pub fn worker_id(proc: &Proc) -> String {
        let port = proc.address.rsplit(':').next().expect("host:port");
        let role = proc.name.split('-').next().expect("role-index");
        format!("{role}-{port}")
    }

    /// The flags a worker of `role` (`prefill` or `decode`) of this cluster starts with, to
    /// start one again after it was killed.
    #[allow(dead_code)] // tests/chaos.rs
    pub fn worker_args(&self, role: &str) -> Vec<String> {
        worker_args(&self.spec, &self.etcd.endpoint(), role)
    }

    /// Where the processes' logs are kept.
    #[allow(dead_code)] // tests/chaos.rs
    pub fn log_dir(&self) -> &Path {
        self._dir.path()
    }

    /// Every process's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut all = String::new();
        for p in self
            .prefills
            .iter()
            .chain(&self.decodes)
            .chain([&self.router])
        {
            all.push_str(&format!("--- {} ---\n{}\n", p.name, p.log()));
        }
        all
    }

    pub async fn client(&self) -> InferenceClient<Channel> {
        InferenceClient::connect(format!("http://{}", self.router.address))
            .await
            .expect("connect to the router")
    }

    /// Waits until the router tracks `prefills` prefill and `decodes` decode workers.
    pub async fn wait_for_workers(&self, prefills: usize, decodes: usize) {
        let client = self.client().await;
        let tracked = wait::until(Duration::from_secs(60), Duration::from_millis(100), || {
            let mut client = client.clone();
            async move {
                let models = client
                    .list_models(v1::ListModelsRequest {})
                    .await
                    .expect("ListModels")
                    .into_inner();
                let m = &models.models[0];
                let tracked = (m.prefill_workers as usize, m.decode_workers as usize);
                if tracked == (prefills, decodes) {
                    Ok(())
                } else {
                    Err(tracked)
                }
            }
        })
        .await;
        if let Err((p, d)) = tracked {
            panic!(
                "the router tracks {p} prefill and {d} decode workers, not {prefills} and \
                 {decodes}; logs:\n{}",
                self.logs()
            );
        }
    }

    /// Every live worker's `Load`.
    pub async fn loads(&self) -> Vec<(String, v1::LoadResponse)> {
        let mut loads = Vec::new();
        for p in self.prefills.iter().chain(&self.decodes) {
            if !p.is_running() {
                continue;
            }
            let mut client = WorkerClient::connect(format!("http://{}", p.address))
                .await
                .expect("connect to a worker");
            let load = client.load(v1::LoadRequest {}).await.expect("Load");
            loads.push((p.name.clone(), load.into_inner()));
        }
        loads
    }

    /// Waits until every live worker runs nothing, holds no reservation and no page for a
    /// request: each page is free or only in the prefix cache (evictable). Fails after 20 s.
    #[allow(dead_code)] // tests/cluster.rs, tests/planner.rs
    pub async fn assert_pages_back(&self) {
        if let Err(busy) = self.pages_back(Duration::from_secs(20)).await {
            panic!("pages still held: {busy:?}; logs:\n{}", self.logs());
        }
    }

    /// [`Self::assert_pages_back`]'s wait, up to `limit`; the workers still holding something.
    pub async fn pages_back(&self, limit: Duration) -> Result<(), Vec<(String, v1::LoadResponse)>> {
        wait::until(limit, Duration::from_millis(100), || async {
            let busy: Vec<_> = self
                .loads()
                .await
                .into_iter()
                .filter(|(_, l)| {
                    l.running_requests != 0
                        || l.waiting_requests != 0
                        || l.pending_reservations != 0
                        || l.free_pages + l.evictable_pages != l.total_pages
                })
                .collect();
            match busy.is_empty() {
                true => Ok(()),
                false => Err(busy),
            }
        })
        .await
    }
}

/// The flags of a worker of `role` in a cluster of `spec` whose etcd is at `etcd`.
fn worker_args(spec: &Spec, etcd: &str, role: &str) -> Vec<String> {
    let model = model_path().display().to_string();
    [
        role,
        "--model",
        &model,
        "--listen",
        "127.0.0.1:0",
        "--etcd-endpoints",
        etcd,
        "--kv-dtype",
        spec.kv_dtype,
        "--kv-budget-mib",
        &spec.kv_budget_mib.to_string(),
        "--threads",
        "1",
        "--capacity-interval-ms",
        "200",
        "--planner-poll-ms",
        "200",
        // A retried prefill of a long prompt on a busy 2-core machine can outlast the
        // 30 s default before it pushes its pages.
        "--reservation-ttl-ms",
        "180000",
    ]
    .map(String::from)
    .to_vec()
}

/// A greedy request for `prompt` (text), `max_tokens` long.
#[allow(dead_code)] // tests/cluster.rs, tests/planner.rs
pub fn greedy(prompt: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Text(prompt.into())),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: Some(max_tokens),
            ..Default::default()
        }),
        ..Default::default()
    }
}
