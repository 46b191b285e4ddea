//! `nibble bench` end to end on the built binary: the CI suite (bench/suites/ci.toml) against
//! the clusters it starts itself, its files checked for form; a shifting load of two phases over
//! the HTTP API against a cluster with a planner; and its refusals: an unreachable
//! cluster, a malformed suite, a load the KV budget can never hold and a prompt longer than the
//! context are each one clear error before any request is sent; a cluster lost midway leaves
//! what was measured and a non-zero exit.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nibble_testkit::model_path;
use serde_json::Value;

fn nibble() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_nibble"));
    command
        .env_remove("NIBBLE_METRICS_LISTEN")
        .env_remove("NIBBLE_HTTP_LISTEN")
        .env_remove("NIBBLE_ROUTER_LISTEN")
        .env("NIBBLE_MODEL", model_path())
        .stdin(Stdio::null());
    command
}

fn bench(args: &[&str]) -> Output {
    nibble()
        .arg("bench")
        .args(args)
        .output()
        .expect("run nibble bench")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A PNG's width and height, after checking its signature.
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
    assert_eq!(&bytes[12..16], b"IHDR");
    let be = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
    (be(&bytes[16..20]), be(&bytes[20..24]))
}

#[test]
fn the_ci_suite_writes_records_summaries_and_plots() {
    let out = tempfile::tempdir().unwrap();
    let suite = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/suites/ci.toml");
    let started = Instant::now();
    let run = bench(&["--suite", suite, "--out", out.path().to_str().unwrap()]);
    assert!(run.status.success(), "{}", text(&run));
    eprintln!("the CI suite took {:.1} s", started.elapsed().as_secs_f64());

    let records: Vec<Value> = std::fs::read_to_string(out.path().join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    // Two clusters, two points, six requests each.
    assert_eq!(records.len(), 24);
    for r in &records {
        assert!(r.get("error").is_none(), "{r}");
        assert_eq!(r["prompt_tokens"], 336, "system prompt and question: {r}");
        assert_eq!(r["completion_tokens"], 4, "EOS ignored: {r}");
        assert!(r["ttft_ms"].as_f64().unwrap() > 0.0);
        assert_eq!(r["itl_ms"].as_array().unwrap().len(), 3);
        assert!(r["decode_worker"].is_string());
        assert!(r["group"].as_u64().unwrap() < 2);
    }
    // Cold prompts are disaggregated; once a group's system prompt is cached on its decode
    // worker (one 256-token block of it), the rest is under the local-prefill threshold.
    let prefix_aware: Vec<&Value> = records
        .iter()
        .filter(|r| r["config"] == "prefix-aware")
        .collect();
    assert!(prefix_aware.iter().any(|r| r["disaggregated"] == true));
    assert!(prefix_aware
        .iter()
        .any(|r| r["cached_tokens"].as_u64() == Some(256)));
    let round_robin_workers: std::collections::HashSet<&str> = records
        .iter()
        .filter(|r| r["config"] == "round-robin")
        .map(|r| r["decode_worker"].as_str().unwrap())
        .collect();
    assert_eq!(round_robin_workers.len(), 2, "round robin uses both");

    let summaries: Vec<Value> =
        serde_json::from_slice(&std::fs::read(out.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summaries.len(), 4);
    for s in &summaries {
        assert_eq!(s["requests"], 6);
        assert_eq!(s["errors"], 0);
        assert_eq!(s["workers"], 3, "one prefill and two decode workers");
        for key in ["ttft_ms", "itl_ms", "e2e_ms"] {
            let p = &s[key];
            assert!(
                p["p50"].as_f64().unwrap() <= p["p99"].as_f64().unwrap(),
                "{s}"
            );
        }
        assert!(s["output_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(s["goodput_requests_per_s"].is_number());
        let hit = s["cluster"]["prefix_cache_hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit), "{s}");
        assert!(
            s["cluster"]["transfer_bytes"].as_f64().unwrap() > 0.0,
            "{s}"
        );
        assert!(!s["timeline"].as_array().unwrap().is_empty(), "{s}");
    }
    for plot in ["pareto", "latency", "goodput", "resident"] {
        let (w, h) = png_size(&out.path().join(format!("{plot}.png")));
        assert!(w >= 640 && h >= 400, "{plot}: {w}x{h}");
    }
    // Each cluster's log is kept.
    assert!(out.path().join("prefix-aware.log").exists());
}

#[test]
fn a_load_of_phases_over_http_is_attributed_to_workers_and_timed_by_phase() {
    let out = tempfile::tempdir().unwrap();
    let suite = out.path().join("phases.toml");
    std::fs::write(
        &suite,
        r#"
        api = "openai"
        concurrency = [2]
        warmup = 1
        window_s = 2
        slo = "ttft=5000,itl=1000"
        [[phase]]
        workload = { kind = "fixed", input = 96, output = 3 }
        requests = 4
        [[phase]]
        workload = { kind = "fixed", input = 8, output = 12 }
        requests = 4
        [[cluster]]
        name = "planner"
        # SLOs no request misses: the planner runs and is sampled, but moves nothing, so every
        # prompt is prefilled on the prefill worker.
        args = ["--threads", "1", "--local-prefill-threshold", "0", "--planner",
                "--interval-ms", "1000", "--load-poll-ms", "500",
                "--slo-ttft-ms", "600000", "--slo-itl-ms", "600000"]
        "#,
    )
    .unwrap();
    let results = out.path().join("results");
    let run = bench(&[
        "--suite",
        suite.to_str().unwrap(),
        "--out",
        results.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", text(&run));
    assert!(text(&run).contains("phase 2 from"), "{}", text(&run));

    let records: Vec<Value> = std::fs::read_to_string(results.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 8);
    for (i, r) in records.iter().enumerate() {
        assert!(r.get("error").is_none(), "{r}");
        let phase = u64::from(i >= 4);
        assert_eq!(r["phase"], phase, "{r}");
        assert_eq!(r["completion_tokens"], [3, 12][phase as usize], "{r}");
        // Over HTTP too, each request names the workers that served it.
        assert!(
            r["decode_worker"].as_str().is_some_and(|w| !w.is_empty()),
            "{r}"
        );
        assert_eq!(r["disaggregated"], true, "{r}");
        assert!(r["prefill_worker"].is_string(), "{r}");
    }
    let summaries: Vec<Value> =
        serde_json::from_slice(&std::fs::read(results.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summaries.len(), 1);
    let s = &summaries[0];
    let phases = s["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2, "{s}");
    let start = |p: &Value| p["start_s"].as_f64().unwrap();
    assert!(start(&phases[0]) < 0.1, "{s}");
    assert!(start(&phases[1]) > start(&phases[0]), "{s}");
    for p in phases {
        assert_eq!(p["requests"], 4, "{s}");
        assert!(p["ttft_ms"]["p90"].as_f64().unwrap() > 0.0, "{s}");
        assert_eq!(p["split_at_start"], serde_json::json!([1, 1]), "{s}");
    }
    assert!(!s["windows"].as_array().unwrap().is_empty(), "{s}");
    let timeline = s["timeline"].as_array().unwrap();
    assert!(
        timeline.iter().all(|t| t["planner_changes"].is_number()),
        "{s}"
    );
    let (w, h) = png_size(&results.join("shift.png"));
    assert!(w >= 640 && h >= 400, "shift: {w}x{h}");
}

#[test]
fn a_synthetic_model_is_served_by_the_whole_cluster() {
    // `synthetic:<shape>` stands in for a checkpoint in every process: the workers draw the same
    // random weights, the router and the load generator use the synthetic tokenizer.
    let out = tempfile::tempdir().unwrap();
    let suite = out.path().join("synthetic.toml");
    std::fs::write(
        &suite,
        r#"
        requests = 3
        warmup = 0
        concurrency = [2]
        workload = { kind = "fixed", input = 300, output = 5 }
        [[cluster]]
        name = "pd"
        args = ["--threads", "1", "--local-prefill-threshold", "0"]
        "#,
    )
    .unwrap();
    let results = out.path().join("results");
    let run = bench(&[
        "--model",
        "synthetic:tiny-llama@3",
        "--suite",
        suite.to_str().unwrap(),
        "--out",
        results.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let records: Vec<Value> = std::fs::read_to_string(results.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 3);
    for r in &records {
        assert!(r.get("error").is_none(), "{r}");
        assert_eq!(r["prompt_tokens"], 300, "{r}");
        assert_eq!(r["completion_tokens"], 5, "{r}");
        assert_eq!(r["disaggregated"], true, "{r}");
    }
}

/// A `nibble up` of one core per worker on free ports; killed when dropped.
struct Up {
    child: Child,
    grpc: String,
    metrics: String,
}

impl Up {
    fn start(extra: &[&str]) -> Self {
        let mut child = nibble()
            .args([
                "up",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(["--threads", "1"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (mut grpc, mut metrics) = (String::new(), String::new());
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(address) = line.strip_prefix("nibble-router listening on ") {
                grpc = address.to_string();
            }
            if let Some(url) = line.strip_prefix("nibble-router OpenAI HTTP API on ") {
                metrics = format!("{}/metrics", url.trim_end_matches("/v1"));
            }
            if line.starts_with("nibble up: ready") {
                break;
            }
        }
        assert!(!grpc.is_empty(), "nibble up did not start");
        // nibble up prints its OpenAI hint after the ready line: keep reading, or that write
        // finds the pipe closed and nibble up exits before the test reaches it.
        std::thread::spawn(move || lines.for_each(drop));
        Self {
            child,
            grpc,
            metrics,
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn bad_targets_suites_and_loads_are_refused_before_any_request() {
    let out = tempfile::tempdir().unwrap();
    let out_arg = out.path().to_str().unwrap();
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let run = bench(&["--url", &closed, "--out", out_arg]);
    assert_eq!(run.status.code(), Some(2));
    let said = text(&run);
    assert!(said.contains("--url") && said.contains(&closed), "{said}");

    let suite = out.path().join("suite.toml");
    std::fs::write(&suite, "requests = 'many'\n[[cluster]]\nname = 'a'\n").unwrap();
    let run = bench(&["--suite", suite.to_str().unwrap(), "--out", out_arg]);
    assert_eq!(run.status.code(), Some(2));
    let said = text(&run);
    assert!(
        said.contains("suite.toml") && said.contains("requests"),
        "{said}"
    );

    let run = bench(&[
        "--workload",
        "shared-prefix",
        "--groups",
        "0",
        "--out",
        out_arg,
    ]);
    assert_eq!(run.status.code(), Some(2));
    assert!(
        text(&run).contains("groups must be at least 1"),
        "{}",
        text(&run)
    );

    // A running cluster whose decode worker holds 4 MiB of KV: a few hundred tokens.
    let up = Up::start(&["--kv-budget-mib", "4"]);
    // Let its first load report reach the router.
    std::thread::sleep(Duration::from_millis(800));
    let run = bench(&[
        "--url",
        &up.grpc,
        "--metrics",
        &up.metrics,
        "--out",
        out_arg,
        "--input-tokens",
        "256",
        "--output-tokens",
        "16",
        "--concurrency",
        "64",
    ]);
    assert_eq!(run.status.code(), Some(2));
    let said = text(&run);
    assert!(said.contains("concurrency 64 needs"), "{said}");
    let run = bench(&[
        "--url",
        &up.grpc,
        "--out",
        out_arg,
        "--input-tokens",
        "9000",
        "--output-tokens",
        "16",
    ]);
    assert_eq!(run.status.code(), Some(2));
    let said = text(&run);
    assert!(
        said.contains("9016 tokens of context, more than the model's"),
        "{said}"
    );
    // Nothing was sent: no record was written.
    let records = std::fs::read_to_string(out.path().join("requests.jsonl")).unwrap_or_default();
    assert!(records.is_empty(), "{records}");
}

#[test]
fn a_cluster_lost_midway_leaves_what_was_measured_and_fails() {
    let out = tempfile::tempdir().unwrap();
    let mut up = Up::start(&[]);
    let mut run = nibble()
        .arg("bench")
        .args(["--url", &up.grpc, "--out", out.path().to_str().unwrap()])
        .args([
            "--input-tokens",
            "16",
            "--output-tokens",
            "8",
            "--requests",
            "10000",
        ])
        .args(["--warmup", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    let _ = up.child.kill();
    let _ = up.child.wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "nibble bench still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = run.wait_with_output().unwrap();
    assert_eq!(status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains("lost the cluster"),
        "{}",
        text(&output)
    );
    let records = std::fs::read_to_string(out.path().join("requests.jsonl")).unwrap();
    let ok = records.lines().filter(|l| !l.contains("\"error\"")).count();
    assert!(ok > 0, "the requests before the loss are kept");
    let summaries: Vec<Value> =
        serde_json::from_slice(&std::fs::read(out.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summaries.len(), 1);
}
