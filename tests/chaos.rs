//! The randomized chaos test of issue 18: etcd, a router, one prefill and two decode workers as
//! real `nibble` processes on loopback with the real model, driven by a seeded random sequence
//! of operations in batches: greedy requests over gRPC and HTTP (streamed and not), clients that
//! hang up mid-stream, SIGKILL of a worker and its restart, etcd stopped and started again, and
//! role changes (planner decisions written to etcd). A fault lands while its batch's requests
//! run. After every batch it checks what must always hold:
//!
//! * no leaked page or reservation: on every live worker nothing runs or waits, no reservation
//!   is pending, and every page is free or only in the prefix cache (the workers' `Load`);
//! * no hung request: each one ends within [`REQUEST_BOUND`];
//! * every completed request carries the tokens (gRPC) or the text (HTTP) its prompt gave when
//!   it ran alone on the healthy cluster at the start (greedy, `ignore_eos`);
//! * every failure is a clean status: a gRPC code or an HTTP status with a stable message in
//!   OpenAI's error shape, never a transport error string, a reset connection or a truncated
//!   stream; and in a batch with no fault (and no role change settling from the batch before)
//!   while a decode worker is up, no request fails at all.
//!
//! `NIBBLE_CHAOS_OPS` sets the number of operations (default [`CI_OPS`], a couple of minutes;
//! OPERATIONS.md records a run of 1,000), `NIBBLE_CHAOS_SEED` the seed (default: the clock; it
//! is printed first, so a failing run can be repeated). Run with `--nocapture` to see the
//! summary.

mod support;

#[path = "chaos/calls.rs"]
mod calls;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use calls::{Api, Call, Outcome, Solo};
use nibble_discovery::{Discovery, EtcdConfig, EtcdDiscovery, KvKey};
use nibble_planner::{Decision, Desired, Reason, Role};
use nibble_proto::v1;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_testkit::model_path;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::cluster::{Cluster, Proc, Spec};

const AUSTEN: &str =
    include_str!("../shared/engine/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt");

/// Operations of a run in the ordinary test command.
const CI_OPS: usize = 120;
/// How long any one request may take, from its first byte to its end: a prompt behind a
/// worker's restart on a busy 2-core machine in a debug build stays well inside it.
const REQUEST_BOUND: Duration = Duration::from_secs(60);
/// How long the workers may take to give every page back once the batch's requests ended.
const SETTLE_BOUND: Duration = Duration::from_secs(30);
/// Tokens each prompt generates alone; a gRPC request asks for any prefix of them.
const SOLO_TOKENS: u32 = 12;

/// The prompts requests draw from, as `(offset, length)` in the fixture's tokens: several
/// share a prefix longer than a prompt block (256), so the prefix cache is hit and missed.
const PROMPTS: [(usize, usize); 10] = [
    (0, 9),
    (0, 40),
    (100, 70),
    (0, 130),
    (500, 24),
    (900, 180),
    (0, 290),
    (0, 310),
    (2000, 64),
    (3000, 12),
];

/// A worker of the cluster as the test tracks it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Slot {
    /// Its role when it (re)starts; role changes may have moved it since.
    starts_as: Role,
    /// Times it has been started.
    generation: usize,
}

/// One thing the chaos does besides requests.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill(usize),
    Restart(usize),
    EtcdStop,
    EtcdStart,
    RoleChange(usize),
}

/// What a run did, for its summary and OPERATIONS.md.
#[derive(Debug, Default)]
struct Tally {
    operations: usize,
    batches: usize,
    requests: BTreeMap<&'static str, usize>,
    completed: usize,
    hung_up: usize,
    /// Clean failures by kind (gRPC code or HTTP status): how many, and the first message.
    failed: BTreeMap<String, (usize, String)>,
    faults: BTreeMap<&'static str, usize>,
    slowest: Duration,
}

fn seed() -> u64 {
    match std::env::var("NIBBLE_CHAOS_SEED") {
        Ok(seed) => seed.parse().expect("NIBBLE_CHAOS_SEED is a number"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    }
}

fn operations() -> usize {
    std::env::var("NIBBLE_CHAOS_OPS")
        .map(|n| n.parse().expect("NIBBLE_CHAOS_OPS is a number"))
        .unwrap_or(CI_OPS)
}

fn prompts() -> Vec<Vec<u32>> {
    let source = nibble_engine::ModelSource::open(model_path()).unwrap();
    let ids = source
        .load_tokenizer()
        .unwrap()
        .encode(AUSTEN, true)
        .unwrap();
    PROMPTS
        .iter()
        .map(|&(from, n)| ids[from..from + n].to_vec())
        .collect()
}

/// The worker process in slot `i`: the prefill workers first, then the decode workers.
fn proc_mut(cluster: &mut Cluster, i: usize) -> &mut Proc {
    let prefills = cluster.prefills.len();
    match i.checked_sub(prefills) {
        None => &mut cluster.prefills[i],
        Some(d) => &mut cluster.decodes[d],
    }
}

fn proc_of(cluster: &Cluster, i: usize) -> &Proc {
    let prefills = cluster.prefills.len();
    match i.checked_sub(prefills) {
        None => &cluster.prefills[i],
        Some(d) => &cluster.decodes[d],
    }
}

/// The chaos: the cluster, what the test knows of it, and the random source.
struct Chaos {
    cluster: Cluster,
    slots: Vec<Slot>,
    etcd_up: bool,
    decision: u64,
    rng: StdRng,
    seed: u64,
    solo: Vec<Solo>,
    tally: Tally,
}

impl Chaos {
    fn live(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| proc_of(&self.cluster, i).is_running())
            .collect()
    }

    fn dead(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| !proc_of(&self.cluster, i).is_running())
            .collect()
    }

    /// The live workers' roles, as each one's `Info` says (a decision may not have been
    /// applied: a worker reads decisions only while etcd answers).
    async fn roles(&self) -> Vec<(usize, Role)> {
        let mut roles = Vec::new();
        for i in self.live() {
            let address = format!("http://{}", proc_of(&self.cluster, i).address);
            let info = match WorkerClient::connect(address).await {
                Ok(mut client) => client.info(v1::InfoRequest {}).await,
                Err(e) => self.fail(&format!("connect to worker {i}: {e}")),
            };
            let role = match info.map(|i| i.into_inner().role()) {
                Ok(v1::WorkerRole::Prefill) => Role::Prefill,
                Ok(_) => Role::Decode,
                Err(status) => self.fail(&format!("Info of worker {i}: {status:?}")),
            };
            roles.push((i, role));
        }
        roles
    }

    async fn live_of(&self, role: Role) -> usize {
        self.roles()
            .await
            .iter()
            .filter(|(_, r)| *r == role)
            .count()
    }

    /// Fails the test with the seed and every process's log.
    fn fail(&self, what: &str) -> ! {
        panic!(
            "chaos seed {} after {} operations: {what}\nlogs:\n{}",
            self.seed,
            self.tally.operations,
            self.cluster.logs()
        );
    }

    /// A random request of the batch.
    fn call(&mut self) -> Call {
        let rng = &mut self.rng;
        let prompt = rng.gen_range(0..self.solo.len());
        let api = [Api::Grpc, Api::Grpc, Api::Http, Api::HttpStream][rng.gen_range(0..4)];
        // gRPC asks for any prefix of the solo tokens; HTTP (compared by text) for all.
        let max_tokens = match api {
            Api::Grpc => rng.gen_range(1..=SOLO_TOKENS),
            Api::Http | Api::HttpStream => SOLO_TOKENS,
        };
        let hang_up = rng.gen_bool(0.2).then(|| rng.gen_range(1..4));
        Call {
            prompt,
            api,
            max_tokens,
            hang_up,
        }
    }

    /// A fault the cluster's state allows, if the dice want one.
    fn fault(&mut self) -> Option<Fault> {
        if !self.rng.gen_bool(0.35) {
            return None;
        }
        let (live, dead) = (self.live(), self.dead());
        let mut choices: Vec<(u32, Fault)> = Vec::new();
        if let Some(&i) = live.get(self.rng.gen_range(0..live.len().max(1))) {
            choices.push((3, Fault::Kill(i)));
            if self.etcd_up && live.len() >= 2 {
                choices.push((2, Fault::RoleChange(i)));
            }
        }
        if let Some(&i) = dead.get(self.rng.gen_range(0..dead.len().max(1))) {
            choices.push((5, Fault::Restart(i)));
        }
        choices.push(match self.etcd_up {
            true => (1, Fault::EtcdStop),
            false => (3, Fault::EtcdStart),
        });
        let total: u32 = choices.iter().map(|(w, _)| w).sum();
        let mut pick = self.rng.gen_range(0..total);
        for (weight, fault) in choices {
            if pick < weight {
                return Some(fault);
            }
            pick -= weight;
        }
        unreachable!("the pick is below the total")
    }

    async fn apply(&mut self, fault: Fault) {
        let name = match fault {
            Fault::Kill(_) => "kill",
            Fault::Restart(_) => "restart",
            Fault::EtcdStop => "etcd_stop",
            Fault::EtcdStart => "etcd_start",
            Fault::RoleChange(_) => "role_change",
        };
        *self.tally.faults.entry(name).or_default() += 1;
        self.tally.operations += 1;
        match fault {
            Fault::Kill(i) => proc_mut(&mut self.cluster, i).kill(),
            Fault::Restart(i) => self.restart(i).await,
            Fault::EtcdStop => {
                self.cluster.etcd.kill();
                self.etcd_up = false;
            }
            Fault::EtcdStart => {
                self.cluster.etcd.restart(false);
                self.etcd_up = true;
            }
            Fault::RoleChange(i) => self.change_role(i).await,
        }
    }

    /// Starts slot `i`'s worker again (its start-up role, a new port). A worker registers
    /// before it says it listens, so with etcd down it is started and etcd then brought back.
    async fn restart(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        slot.generation += 1;
        let role = slot.starts_as.name();
        let name = format!("{role}-{i}.{}", slot.generation);
        let args = self.cluster.worker_args(role);
        let dir = self.cluster.log_dir().to_path_buf();
        let started = tokio::task::spawn_blocking(move || Proc::start(&name, &args, &dir, false));
        if !self.etcd_up {
            tokio::time::sleep(Duration::from_millis(500)).await;
            self.cluster.etcd.restart(false);
            self.etcd_up = true;
            *self.tally.faults.entry("etcd_start").or_default() += 1;
            self.tally.operations += 1;
        }
        match started.await {
            Ok(proc) => *proc_mut(&mut self.cluster, i) = proc,
            Err(err) => self.fail(&format!("restarting worker {i}: {err}")),
        }
    }

    /// Writes a planner decision that moves slot `i`'s worker to the other role, unless that
    /// would leave no decode worker, in which case the decision moves nothing.
    async fn change_role(&mut self, i: usize) {
        let mut roles = self.roles().await;
        let decodes = roles.iter().filter(|(_, r)| *r == Role::Decode).count();
        if let Some((_, role)) = roles.iter_mut().find(|(w, _)| *w == i) {
            if *role == Role::Prefill || decodes >= 2 {
                *role = role.other();
            }
        }
        self.decision += 1;
        let roles = roles
            .into_iter()
            .map(|(w, role)| (Cluster::worker_id(proc_of(&self.cluster, w)), role))
            .collect();
        let decision = Decision {
            id: self.decision,
            issued_unix_ms: 0,
            leader: "chaos".into(),
            roles,
            reason: Reason::default(),
            desired: Desired::default(),
        };
        let discovery = EtcdDiscovery::connect(EtcdConfig::new([self.cluster.etcd.endpoint()]))
            .await
            .unwrap_or_else(|e| self.fail(&format!("connect to etcd: {e}")));
        let key = KvKey::new(nibble_planner::wire::DECISION_KEY).unwrap();
        if let Err(e) = discovery.put(&key, decision.to_json()).await {
            self.fail(&format!("write a decision: {e}"));
        }
        let _ = discovery.close().await;
    }

    /// One batch: its requests at once, a fault (maybe) while they run; then the invariants.
    /// Whether the batch changed a role (the next one may see the move settle).
    async fn batch(&mut self, settling: bool) -> bool {
        let calls: Vec<Call> = (0..self.rng.gen_range(1..=5))
            .map(|_| self.call())
            .collect();
        let fault = self.fault();
        let address = self.cluster.router.address.clone();
        let http = self.cluster.router.http.expect("the router's HTTP API");
        let tasks: Vec<_> = calls
            .iter()
            .map(|call| {
                let (call, solo) = (call.clone(), self.solo[call.prompt].clone());
                let address = address.clone();
                tokio::spawn(async move {
                    let start = Instant::now();
                    let outcome = tokio::time::timeout(
                        REQUEST_BOUND,
                        calls::run(&call, &solo, &address, http),
                    )
                    .await;
                    (outcome, start.elapsed())
                })
            })
            .collect();
        let delay = self.rng.gen_range(0..1500);
        if let Some(fault) = fault {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            self.apply(fault).await;
        }
        // A decode worker up when the batch ends: requests of a quiet batch must all succeed.
        let decode_up = self.live_of(Role::Decode).await > 0;
        let quiet = fault.is_none() && !settling && decode_up;
        for (call, task) in calls.iter().zip(tasks) {
            self.tally.operations += 1;
            *self.tally.requests.entry(call.api.name()).or_default() += 1;
            let (outcome, took) = task.await.expect("a request task");
            self.tally.slowest = self.tally.slowest.max(took);
            let outcome = match outcome {
                Err(_) => self.fail(&format!("{call:?} hung: no end within {REQUEST_BOUND:?}")),
                Ok(Err(unclean)) => self.fail(&format!("{call:?}: {unclean}")),
                Ok(Ok(outcome)) => outcome,
            };
            match outcome {
                Outcome::Completed => self.tally.completed += 1,
                Outcome::HungUp => self.tally.hung_up += 1,
                Outcome::Failed(status) if quiet => {
                    self.fail(&format!("{call:?} failed in a quiet batch: {status}"))
                }
                Outcome::Failed(status) => {
                    let kind = status.split(':').next().unwrap_or_default().to_string();
                    self.tally.failed.entry(kind).or_insert((0, status)).0 += 1;
                }
            }
        }
        self.settle().await;
        self.tally.batches += 1;
        matches!(fault, Some(Fault::RoleChange(_)))
    }

    /// Waits until no live worker runs, queues or reserves anything and every page is free or
    /// only cached.
    async fn settle(&self) {
        if let Err(held) = self.cluster.pages_back(SETTLE_BOUND).await {
            self.fail(&format!("pages or reservations still held: {held:?}"));
        }
    }

    /// Brings every worker and etcd back, waits until the router tracks them all, and runs
    /// every prompt once more: the cluster serves as it did before the chaos.
    async fn recover(&mut self) {
        if !self.etcd_up {
            self.apply(Fault::EtcdStart).await;
        }
        for i in self.dead() {
            self.apply(Fault::Restart(i)).await;
        }
        // The router tracks every worker in the role it has now, once any move has settled.
        let settled = Duration::from_secs(60);
        let start = Instant::now();
        let mut roles = self.roles().await;
        while start.elapsed() < settled {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = self.roles().await;
            if now == roles {
                break;
            }
            roles = now;
        }
        let prefills = roles.iter().filter(|(_, r)| *r == Role::Prefill).count();
        self.cluster
            .wait_for_workers(prefills, roles.len() - prefills)
            .await;
        let address = self.cluster.router.address.clone();
        let http = self.cluster.router.http.expect("the router's HTTP API");
        for (prompt, solo) in self.solo.iter().enumerate() {
            let call = Call {
                prompt,
                api: Api::Grpc,
                max_tokens: SOLO_TOKENS,
                hang_up: None,
            };
            match calls::run(&call, solo, &address, http).await {
                Ok(Outcome::Completed) => {}
                other => self.fail(&format!("after the chaos, {call:?}: {other:?}")),
            }
        }
        self.settle().await;
    }
}

/// A seeded random sequence of requests, hang-ups, worker kills and restarts, etcd stops and
/// role changes on a real cluster leaks no page or reservation, hangs no request, changes no
/// greedy token and fails every failed request cleanly.
#[tokio::test(flavor = "multi_thread")]
async fn random_faults_leak_nothing_hang_nothing_and_change_no_token() {
    let seed = seed();
    let target = operations();
    eprintln!("chaos: seed {seed}, {target} operations");
    let started = Instant::now();
    // BF16 K/V: batched requests give exactly the tokens they give alone (the planner tests).
    let mut spec = Spec::new("bf16");
    (spec.decodes, spec.kv_budget_mib) = (2, 96);
    let cluster = Cluster::start(spec).await;
    let address = cluster.router.address.clone();
    let mut solo = Vec::new();
    for ids in prompts() {
        match Solo::run(&address, ids).await {
            Ok(s) => solo.push(s),
            Err(e) => panic!("a prompt alone: {e}; logs:\n{}", cluster.logs()),
        }
    }
    let slot = |role| Slot {
        starts_as: role,
        generation: 0,
    };
    let slots = std::iter::repeat_n(slot(Role::Prefill), cluster.prefills.len())
        .chain(std::iter::repeat_n(
            slot(Role::Decode),
            cluster.decodes.len(),
        ))
        .collect();
    let mut chaos = Chaos {
        cluster,
        slots,
        etcd_up: true,
        decision: 0,
        rng: StdRng::seed_from_u64(seed),
        seed,
        solo,
        tally: Tally::default(),
    };
    let mut settling = false;
    let mut reported = 0;
    while chaos.tally.operations < target {
        settling = chaos.batch(settling).await;
        if chaos.tally.operations >= reported + 100 {
            reported = chaos.tally.operations;
            eprintln!(
                "chaos: {reported} operations, {:.0} s; faults {:?}",
                started.elapsed().as_secs_f64(),
                chaos.tally.faults
            );
        }
    }
    chaos.recover().await;
    let tally = &chaos.tally;
    eprintln!(
        "chaos: seed {seed}: {} operations in {} batches, {:.0} s; requests {:?}: {} completed \
         with their solo tokens, {} hung up by the client, failed cleanly {:?}; faults {:?}; \
         slowest request {:.1} s; leaked pages 0, leaked reservations 0",
        tally.operations,
        tally.batches,
        started.elapsed().as_secs_f64(),
        tally.requests,
        tally.completed,
        tally.hung_up,
        tally.failed,
        tally.faults,
        tally.slowest.as_secs_f64()
    );
    assert!(tally.completed > 0, "{tally:?}");
}
