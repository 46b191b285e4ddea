//! The planner and role changes end to end: etcd, a router, workers and planners as separate
//! `nibble` processes with the real model. A worker told to change role finishes what it holds,
//! loses no request and no page; one planner leads at a time and a standby takes over when it
//! dies; with etcd down nothing changes role; a worker that dies mid-change leaves no decision
//! waiting for it.

mod support;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use nibble_discovery::{Discovery, EtcdConfig, EtcdDiscovery, KvKey};
use nibble_kvfmt::KvDtype;
use nibble_planner::{Ack, Decision, Desired, Reason, Role};
use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_testkit::{generate, reference, wait, EtcdServer};
use support::cluster::{greedy, Cluster, Proc, Spec};

const AUSTEN: &str =
    include_str!("../shared/engine/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt");

/// One cluster test at a time: each starts several processes on a small machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn austen_tokens(from: usize, n: usize) -> Vec<u32> {
    let source = nibble_engine::ModelSource::open(nibble_testkit::model_path()).unwrap();
    let ids = source
        .load_tokenizer()
        .unwrap()
        .encode(AUSTEN, true)
        .unwrap();
    ids[from..from + n].to_vec()
}

fn tokens_request(ids: &[u32], max_tokens: u32) -> v1::GenerateRequest {
    let mut request = greedy("", max_tokens);
    request.prompt = Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
        ids: ids.to_vec(),
    }));
    if let Some(stopping) = request.stopping.as_mut() {
        stopping.ignore_eos = true;
    }
    request
}

async fn session(etcd: &EtcdServer) -> EtcdDiscovery {
    EtcdDiscovery::connect(EtcdConfig::new([etcd.endpoint()]))
        .await
        .expect("connect to etcd")
}

/// The role a worker says it has (its Info).
async fn role_of(worker: &Proc) -> v1::WorkerRole {
    let mut client = WorkerClient::connect(format!("http://{}", worker.address))
        .await
        .expect("connect to a worker");
    let info = client.info(v1::InfoRequest {}).await.expect("Info");
    info.into_inner().role()
}

/// `worker`'s acknowledgement of decision `id`, waiting up to `limit`.
async fn ack_of(discovery: &dyn Discovery, worker: &str, id: u64, limit: Duration) -> Ack {
    let key = KvKey::new(nibble_planner::wire::applied_key(worker)).unwrap();
    let found = wait::until(limit, Duration::from_millis(100), || async {
        match discovery.get(&key).await {
            Ok(Some(bytes)) => match Ack::parse(&bytes) {
                Ok(ack) if ack.decision == id => Ok(ack),
                other => Err(format!("{other:?}")),
            },
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    found.unwrap_or_else(|last| panic!("no acknowledgement of {id} by {worker}: {last}"))
}

/// `nibble planner status` against `etcd`.
fn status(etcd: &EtcdServer) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["planner", "status", "--etcd-endpoints", &etcd.endpoint()])
        .output()
        .expect("run nibble planner status");
    assert!(
        out.status.success(),
        "planner status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Waits until `nibble planner status` names `planner` (a planner process) as the leader.
async fn wait_for_leader(etcd: &EtcdServer, planner: &Proc) {
    let name = format!("leader: {}", planner.address);
    let leads = wait::until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let text = status(etcd);
            match text.contains(&name) {
                true => Ok(()),
                false => Err(text),
            }
        },
    )
    .await;
    leads.unwrap_or_else(|text| {
        panic!(
            "{} does not lead: {text}\n{}",
            planner.address,
            planner.log()
        )
    });
}

fn planner(
    name: &str,
    etcd: &EtcdServer,
    router_metrics: &str,
    extra: &[&str],
    dir: &std::path::Path,
) -> Proc {
    let mut args: Vec<String> = [
        "planner",
        "--etcd-endpoints",
        &etcd.endpoint(),
        "--router-metrics",
        router_metrics,
        "--id",
        name,
        "--lease-ttl-s",
        "2",
        "--metrics-listen",
        "127.0.0.1:0",
        "--load-poll-ms",
        "200",
        "--interval-ms",
        "1000",
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::start(name, &args, dir, false)
}

/// Sends short requests (latency for the planner to read) until a decision is written; the
/// decision and the index of the one decode worker it moves to prefill.
async fn decode_worker_moved(
    cluster: &Cluster,
    discovery: &dyn Discovery,
    planner: &Proc,
    prompt: &[u32],
) -> (Decision, usize) {
    let key = KvKey::new(nibble_planner::wire::DECISION_KEY).unwrap();
    let decided = wait::until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let mut client = cluster.client().await;
            let _ = generate(&mut client, tokens_request(prompt, 2)).await;
            match discovery.get(&key).await {
                Ok(Some(bytes)) => Ok(bytes),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let bytes = decided.unwrap_or_else(|e| panic!("no decision ({e}); {}", planner.log()));
    let ids: Vec<String> = cluster.decodes.iter().map(Cluster::worker_id).collect();
    let known: Vec<&str> = ids.iter().map(String::as_str).collect();
    let (decision, _) = Decision::parse(&bytes, &known).unwrap();
    let moved: Vec<usize> = (0..ids.len())
        .filter(|&i| decision.role_of(&ids[i]) == Some(Role::Prefill))
        .collect();
    assert_eq!(moved.len(), 1, "one decode worker moves: {decision:?}");
    (decision, moved[0])
}

/// Flags under which any TTFT breaks the SLO and no ITL does: the planner wants every decode
/// worker it can spare to prefill, and acts at its first decision.
const WANTS_PREFILL: &[&str] = &[
    "--slo-ttft-ms",
    "1",
    "--slo-itl-ms",
    "600000",
    "--patience",
    "1",
    "--min-change-interval-ms",
    "1000",
];

/// A decode worker told (by a decision written by hand) to become a prefill worker while
/// requests run: every request, before, during and after, gets exactly one engine's greedy
/// tokens; the worker keeps its prefix cache and prefills afterwards; every page comes back.
/// BF16 K/V: requests batched together sum their projections in another order than alone,
/// which NVFP4's rounding can turn into another token at a near tie (see the engine's
/// `batched_requests_match_requests_run_alone`).
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_changes_role_under_load_and_every_request_keeps_its_tokens() {
    let _serial = SERIAL.lock().await;
    let spec = Spec {
        prefills: 1,
        decodes: 2,
        kv_budget_mib: 96,
        ..Spec::new("bf16")
    };
    let cluster = Cluster::start(spec).await;
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| austen_tokens(i * 400, 150 + 40 * i))
        .collect();
    let expected = reference(KvDtype::Bf16, &prompts, 24);
    let send = |i: usize| {
        let request = tokens_request(&prompts[i], 24);
        let client = cluster.client();
        async move {
            let mut client = client.await;
            generate(&mut client, request).await
        }
    };
    let moving = Cluster::worker_id(&cluster.decodes[1]);
    let roles: BTreeMap<String, Role> = [
        (Cluster::worker_id(&cluster.prefills[0]), Role::Prefill),
        (Cluster::worker_id(&cluster.decodes[0]), Role::Decode),
        (moving.clone(), Role::Prefill),
    ]
    .into();
    let decision = Decision {
        id: 7,
        issued_unix_ms: 0,
        leader: "by hand".into(),
        roles,
        reason: Reason::default(),
        desired: Desired::default(),
    };
    let discovery = session(&cluster.etcd).await;
    let key = KvKey::new(nibble_planner::wire::DECISION_KEY).unwrap();
    // Requests in flight while the decision lands.
    let during = tokio::join!(send(0), send(1), send(2), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        discovery.put(&key, decision.to_json()).await.unwrap();
    });
    let ack = ack_of(&discovery, &moving, 7, Duration::from_secs(120)).await;
    assert!(ack.applied, "{ack:?}; logs:\n{}", cluster.logs());
    assert_eq!(ack.role, Role::Prefill);
    cluster.wait_for_workers(2, 1).await;
    assert_eq!(role_of(&cluster.decodes[1]).await, v1::WorkerRole::Prefill);
    let after = tokio::join!(send(3), send(4), send(5));
    let got = [during.0, during.1, during.2, after.0, after.1, after.2];
    for (i, (got, want)) in got.into_iter().zip(&expected).enumerate() {
        let got = got.unwrap_or_else(|s| panic!("request {i}: {s}; logs:\n{}", cluster.logs()));
        assert_eq!(&got.tokens, want, "request {i}; logs:\n{}", cluster.logs());
    }
    // The moved worker now prefills: its log says so.
    let log = cluster.decodes[1].log();
    assert!(log.contains("changed role"), "{log}");
    cluster.assert_pages_back().await;
    // The same decision read again changes nothing.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(role_of(&cluster.decodes[1]).await, v1::WorkerRole::Prefill);
    discovery.close().await.unwrap();
}

/// One planner leads; killed, a standby leads within its lease (2 s) plus a poll, and
/// `nibble planner status` names it.
#[tokio::test(flavor = "multi_thread")]
async fn one_planner_leads_and_a_standby_takes_over_when_it_dies() {
    let _serial = SERIAL.lock().await;
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    // No router: the planners lead, read no latency and decide nothing.
    let mut first = planner("planner-a", &etcd, "127.0.0.1:9", &[], dir.path());
    wait_for_leader(&etcd, &first).await;
    let second = planner("planner-b", &etcd, "127.0.0.1:9", &[], dir.path());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        status(&etcd).contains("leader: planner-a"),
        "the first keeps leading"
    );
    first.kill();
    let died = Instant::now();
    wait_for_leader(&etcd, &second).await;
    // Lease 2 s, poll 0.2 s, and the time `planner status` itself takes.
    assert!(
        died.elapsed() < Duration::from_secs(6),
        "took {:?}",
        died.elapsed()
    );
    let metrics = second.metrics.expect("the planner's /metrics");
    let text = nibble_telemetry::scrape(metrics).await.unwrap();
    let samples = nibble_telemetry::Samples::parse(&text);
    assert_eq!(samples.get("nibble_planner_leader", &[]), Some(1.0));
}

/// With etcd down the planner decides nothing and every worker keeps its role (requests still
/// served); once etcd is back the planner moves a decode worker to prefill on the TTFT it
/// reads, the worker acknowledges, and the history says why.
#[tokio::test(flavor = "multi_thread")]
async fn with_etcd_down_nothing_moves_and_once_it_is_back_the_planner_acts() {
    let _serial = SERIAL.lock().await;
    let spec = Spec {
        prefills: 1,
        decodes: 2,
        ..Spec::new("nvfp4")
    };
    let mut cluster = Cluster::start(spec).await;
    let router_metrics = cluster.router.metrics.expect("router /metrics").to_string();
    let dir = tempfile::tempdir().unwrap();
    let planner = planner(
        "planner-a",
        &cluster.etcd,
        &router_metrics,
        WANTS_PREFILL,
        dir.path(),
    );
    // It leads (no request has run: no latency, no decision), then loses etcd.
    wait_for_leader(&cluster.etcd, &planner).await;
    cluster.etcd.kill();
    let prompt = austen_tokens(0, 200);
    let expected = reference(KvDtype::Nvfp4, std::slice::from_ref(&prompt), 8);
    for _ in 0..3 {
        let mut client = cluster.client().await;
        let got = generate(&mut client, tokens_request(&prompt, 8))
            .await
            .unwrap();
        assert_eq!(got.tokens, expected[0]);
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    for worker in &cluster.decodes {
        assert_eq!(role_of(worker).await, v1::WorkerRole::Decode, "fail static");
    }
    assert!(
        !planner.log().contains("planner: decided"),
        "{}",
        planner.log()
    );

    cluster.etcd.restart(false);
    let discovery = session(&cluster.etcd).await;
    let (decision, moved) = decode_worker_moved(&cluster, &discovery, &planner, &prompt).await;
    let ids: Vec<String> = cluster.decodes.iter().map(Cluster::worker_id).collect();
    let ack = ack_of(
        &discovery,
        &ids[moved],
        decision.id,
        Duration::from_secs(60),
    )
    .await;
    assert!(ack.applied, "{ack:?}");
    cluster.wait_for_workers(2, 1).await;
    let text = status(&cluster.etcd);
    assert!(text.contains("TTFT p90"), "{text}");
    assert!(text.contains(&format!("#{}", decision.id)), "{text}");
    cluster.assert_pages_back().await;
    discovery.close().await.unwrap();
}

/// The worker a decision moves dies while it drains (a long request keeps it busy): the
/// decision resolves as soon as its registration goes, without waiting for the timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_that_dies_while_changing_role_leaves_no_decision_waiting() {
    let _serial = SERIAL.lock().await;
    let spec = Spec {
        prefills: 1,
        decodes: 2,
        ..Spec::new("nvfp4")
    };
    let mut cluster = Cluster::start(spec).await;
    let router_metrics = cluster.router.metrics.expect("router /metrics").to_string();
    let dir = tempfile::tempdir().unwrap();
    let mut flags = WANTS_PREFILL.to_vec();
    flags.extend(["--ack-timeout-ms", "600000"]);
    let planner = planner(
        "planner-a",
        &cluster.etcd,
        &router_metrics,
        &flags,
        dir.path(),
    );
    // Long answers on both decode workers: whichever moves drains for a long time.
    let prompt = austen_tokens(0, 64);
    let router = format!("http://{}", cluster.router.address);
    let long = |offset: usize| {
        let request = tokens_request(&austen_tokens(offset, 64), 3000);
        let router = router.clone();
        tokio::spawn(async move {
            let mut client = InferenceClient::connect(router).await.unwrap();
            let _ = generate(&mut client, request).await;
        })
    };
    let runs = [long(1000), long(2000)];
    let discovery = session(&cluster.etcd).await;
    let (_, index) = decode_worker_moved(&cluster, &discovery, &planner, &prompt).await;
    let ids: Vec<String> = cluster.decodes.iter().map(Cluster::worker_id).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        role_of(&cluster.decodes[index]).await,
        v1::WorkerRole::Decode,
        "still draining"
    );
    cluster.decodes[index].kill();
    // Its registration goes with its lease (10 s); the planner then resolves the decision.
    let resolved = wait::until(
        Duration::from_secs(40),
        Duration::from_millis(500),
        || async {
            let text = status(&cluster.etcd);
            match text.contains(&format!("{} left before answering", ids[index])) {
                true => Ok(()),
                false => Err(text),
            }
        },
    )
    .await;
    resolved.unwrap_or_else(|text| panic!("the decision still waits: {text}\n{}", planner.log()));
    for run in runs {
        run.abort();
    }
    // The other decode worker's long answer was cancelled with its client: its pages are back.
    cluster.assert_pages_back().await;
    discovery.close().await.unwrap();
}
