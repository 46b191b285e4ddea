//! The cluster end to end: etcd, a router and prefill/decode workers as separate `nibble`
//! processes on loopback with the real model, driven through the router's gRPC Inference API.
//!
//! Each test checks that afterwards every live worker runs nothing and holds no page for a
//! request (pages are free or only in the prefix cache). The tests run one at a time: each
//! starts several processes on a small machine.

mod support;

use std::time::{Duration, Instant};

use nibble_engine::{ModelSource, Tokenizer};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_testkit::{generate, model_path, reference};
use support::cluster::{greedy, Cluster, Spec};
use tonic::Code;

const AUSTEN: &str =
    include_str!("../shared/engine/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt");
const NEW_TOKENS: u32 = 8;

/// One cluster test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn tokenizer() -> Tokenizer {
    ModelSource::open(model_path())
        .unwrap()
        .load_tokenizer()
        .unwrap()
}

/// The first `n` tokens of the Austen fixture (with the model's BOS).
fn austen_tokens(n: usize) -> Vec<u32> {
    let ids = tokenizer().encode(AUSTEN, true).unwrap();
    assert!(ids.len() >= n, "the fixture has {} tokens", ids.len());
    ids[..n].to_vec()
}

fn tokens_request(ids: &[u32], max_tokens: u32) -> v1::GenerateRequest {
    let mut request = greedy("", max_tokens);
    request.prompt = Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
        ids: ids.to_vec(),
    }));
    request
}

/// `(pages, bytes)` of every "pushed pages" line in a prefill worker's log, in order.
fn pushes(log: &str) -> Vec<(u64, u64)> {
    let field = |line: &str, name: &str| -> u64 {
        let at = line
            .find(&format!(" {name}="))
            .unwrap_or_else(|| panic!("no {name}= in {line:?}"));
        line[at + name.len() + 2..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap()
    };
    log.lines()
        .filter(|l| l.contains("pushed pages"))
        .map(|l| (field(l, "pages"), field(l, "bytes")))
        .collect()
}

/// For bf16, fp8 and nvfp4: the tokens through router → prefill → transfer → decode equal one
/// engine's, cold and then with the prefix cached on both workers (prompts of 300 and 420
/// tokens: more than one prompt block of 256); and the pages moved for the same prompt are in
/// the ratio of the formats (nvfp4 = 0.5625 × fp8 = 0.28125 × bf16).
#[tokio::test(flavor = "multi_thread")]
async fn tokens_through_the_cluster_match_one_engine_for_every_kv_dtype() {
    let _serial = SERIAL.lock().await;
    let cold = austen_tokens(300);
    let mut warm = cold.clone();
    warm.extend(austen_tokens(420)[300..].iter());
    let mut moved = Vec::new();
    for dtype in KvDtype::ALL {
        let expected = reference(dtype, &[cold.clone(), warm.clone()], NEW_TOKENS);
        let cluster = Cluster::start(Spec::new(dtype.name())).await;
        let mut client = cluster.client().await;
        for (prompt, want) in [&cold, &warm].into_iter().zip(&expected) {
            let got = generate(&mut client, tokens_request(prompt, NEW_TOKENS))
                .await
                .unwrap_or_else(|s| panic!("{dtype}: {s}; logs:\n{}", cluster.logs()));
            assert_eq!(&got.tokens, want, "{dtype}, {} prompt tokens", prompt.len());
            let usage = got.usage.expect("usage");
            assert_eq!(usage.prompt_tokens as usize, prompt.len());
            assert_eq!(usage.completion_tokens, NEW_TOKENS);
        }
        let usage_of_warm = {
            // The second prompt found the first one's pages on the decode worker.
            let again = generate(&mut client, tokens_request(&warm, 1))
                .await
                .unwrap();
            again.usage.unwrap().cached_tokens
        };
        assert!(
            usage_of_warm >= 288,
            "{dtype}: {usage_of_warm} cached tokens"
        );
        cluster.assert_pages_back().await;
        let log = cluster.prefills[0].log();
        let pushes = pushes(&log);
        assert!(!pushes.is_empty(), "{dtype}: no transfer logged:\n{log}");
        // The cold prompt's 300 tokens: 18 full pages of 16 and one partial page, then the
        // recent window's pages (nvfp4's default window of 48 tokens: 11 pages of SmolLM2).
        let window = match dtype {
            KvDtype::Nvfp4 => 11,
            KvDtype::Fp8 | KvDtype::Bf16 => 0,
        };
        assert_eq!(pushes[0].0, 19 + window, "{dtype}: {pushes:?}");
        moved.push((dtype, pushes[0].1 / pushes[0].0));
    }
    // Bytes per page moved.
    let bytes = |d: KvDtype| moved.iter().find(|(m, _)| *m == d).unwrap().1;
    let (bf16, fp8, nvfp4) = (
        bytes(KvDtype::Bf16),
        bytes(KvDtype::Fp8),
        bytes(KvDtype::Nvfp4),
    );
    assert_eq!(
        nvfp4 * 16,
        fp8 * 9,
        "nvfp4 pages are 0.5625x fp8's: {moved:?}"
    );
    assert_eq!(fp8 * 2, bf16, "fp8 pages are half of bf16's: {moved:?}");
}

/// Cancelling frees the request's pages on both workers; invalid requests are refused naming
/// the field; more requests than the router admits wait in its queue, then are refused.
#[tokio::test(flavor = "multi_thread")]
async fn cancel_invalid_requests_and_a_full_queue() {
    let _serial = SERIAL.lock().await;
    let mut spec = Spec::new("nvfp4");
    spec.router_args.extend(
        ["--max-running", "1", "--max-queued", "1"]
            .into_iter()
            .map(String::from),
    );
    let cluster = Cluster::start(spec).await;
    let mut client = cluster.client().await;

    // Cancel mid-stream.
    let mut stream = client
        .generate(tokens_request(&austen_tokens(100), 500))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..2 {
        stream.message().await.unwrap().expect("a chunk");
    }
    drop(stream);
    cluster.assert_pages_back().await;

    // Invalid requests name the field.
    let context = 8192; // SmolLM2's
    let too_long = tokens_request(&vec![1; context], 16);
    let mut zero = greedy("hello", 1);
    zero.stopping.as_mut().unwrap().max_tokens = Some(0);
    let mut top_p = greedy("hello", 4);
    top_p.sampling.as_mut().unwrap().top_p = Some(1.5);
    let mut model = greedy("hello", 4);
    model.model = "no-such-model".into();
    for (request, field) in [
        (greedy("", 4), "prompt"),
        (too_long, "prompt"),
        (zero, "stopping.max_tokens"),
        (top_p, "sampling.top_p"),
        (model, "model"),
    ] {
        let status = generate(&mut client, request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().starts_with(field), "{field}: {status:?}");
    }

    // One running, one queued, the third refused; the first two finish.
    let long = tokens_request(&austen_tokens(40), 48);
    let mut first = client.generate(long.clone()).await.unwrap().into_inner();
    first
        .message()
        .await
        .unwrap()
        .expect("the first request runs");
    let queued = tokio::spawn({
        let mut client = cluster.client().await;
        let long = long.clone();
        async move { generate(&mut client, long).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = generate(&mut client, long.clone()).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    while first.message().await.unwrap().is_some() {}
    let queued = queued
        .await
        .unwrap()
        .expect("the queued request runs once the first ends");
    assert_eq!(queued.tokens.len(), 48);
    cluster.assert_pages_back().await;
}

/// A prefill worker killed while it serves a request: with another prefill worker the router
/// retries there, and with none left the decode worker prefills the prompt itself; either way
/// the request gets the tokens one engine gives, in bounded time, and no page is left held.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_prefill_worker_is_retried_elsewhere_then_prefilled_on_the_decode_worker() {
    let _serial = SERIAL.lock().await;
    // Three prompt blocks: long enough to be caught mid-prefill, short enough that the retried
    // prefill (one thread per worker, a debug build on a 2-core CI machine: ~22 ms a token)
    // answers well inside the bound below.
    let prompt = austen_tokens(768);
    // The second round's prompt shares nothing with the first (which the workers now cache).
    let other = austen_tokens(1536)[768..].to_vec();
    let expected = reference(KvDtype::Nvfp4, &[prompt.clone(), other.clone()], 4);
    let mut spec = Spec::new("nvfp4");
    spec.prefills = 2;
    let mut cluster = Cluster::start(spec).await;

    for (round, prompt) in [&prompt, &other].into_iter().enumerate() {
        let mut client = cluster.client().await;
        let mut request = tokio::spawn({
            let request = tokens_request(prompt, 4);
            async move { generate(&mut client, request).await }
        });
        // Kill the prefill worker that is prefilling it.
        let start = Instant::now();
        let busy = loop {
            let loads = cluster.loads().await;
            if let Some((name, _)) = loads
                .iter()
                .find(|(n, l)| n.starts_with("prefill") && l.running_requests > 0)
            {
                break name.clone();
            }
            if request.is_finished() {
                let result = (&mut request).await.unwrap();
                panic!("the request ended before a prefill worker ran it: {result:?}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no prefill started"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        cluster
            .prefills
            .iter_mut()
            .find(|p| p.name == busy)
            .unwrap()
            .kill();
        let killed = Instant::now();
        let result = tokio::time::timeout(Duration::from_secs(60), request)
            .await
            .expect("the request ends in bounded time")
            .unwrap();
        let got = result.unwrap_or_else(|s| panic!("{s}; logs:\n{}", cluster.logs()));
        // Round 0 moves to the other prefill worker; round 1, with no prefill worker left, is
        // prefilled on the decode worker: the same tokens either way.
        assert_eq!(got.tokens, expected[round], "round {round}");
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "answered {:?} after the kill",
            killed.elapsed()
        );
        cluster.assert_pages_back().await;
    }
}

/// A decode worker killed mid-stream ends the client's stream with an error, promptly.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_decode_worker_ends_the_stream_with_an_error() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(Spec::new("nvfp4")).await;
    let mut client = cluster.client().await;
    let mut stream = client
        .generate(tokens_request(&austen_tokens(64), 1000))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().expect("a first chunk");
    cluster.decodes[0].kill();
    let killed = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return Ok(()),
                Err(status) => return Err(status),
            }
        }
    })
    .await
    .expect("the stream ends in bounded time");
    let status = ended.expect_err("the stream ends with an error, not a clean end");
    assert_ne!(status.code(), Code::Ok);
    assert!(killed.elapsed() < Duration::from_secs(15));
    cluster.assert_pages_back().await;
}

/// Membership through etcd survives an etcd restart (the same data) and a lost lease (etcd
/// restarted empty): workers register again and requests go through.
#[tokio::test(flavor = "multi_thread")]
async fn the_cluster_survives_an_etcd_restart_and_lost_leases() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(Spec::new("nvfp4")).await;
    let prompt = austen_tokens(40);
    // The first round prefills the prompt; later rounds find it cached.
    let expected = reference(
        KvDtype::Nvfp4,
        &[prompt.clone(), prompt.clone()],
        NEW_TOKENS,
    );
    for (round, wipe) in [false, true].into_iter().enumerate() {
        let expected = &expected[round.min(1)];
        cluster.etcd.restart(wipe);
        let start = Instant::now();
        loop {
            let mut client = cluster.client().await;
            match generate(&mut client, tokens_request(&prompt, NEW_TOKENS)).await {
                Ok(got) => {
                    assert_eq!(&got.tokens, expected, "round {round}");
                    break;
                }
                Err(status) => assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "after an etcd restart (wipe {wipe}): {status:?}; logs:\n{}",
                    cluster.logs()
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The workers are registered in etcd again.
        let discovery =
            nibble_discovery::EtcdDiscovery::connect(nibble_discovery::EtcdConfig::new(vec![
                cluster.etcd.endpoint(),
            ]))
            .await
            .unwrap();
        let start = Instant::now();
        loop {
            use nibble_discovery::Discovery;
            let listed = discovery.list(None).await.unwrap();
            if listed.len() == 2 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "registered after restart (wipe {wipe}): {listed:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let _ = nibble_discovery::Discovery::close(&discovery).await;
        cluster.wait_for_workers(1, 1).await;
    }
    cluster.assert_pages_back().await;
}

/// The JSON log lines of `log` (a process run with `NIBBLE_LOG_FORMAT=json`) that carry
/// `request_id` in their span.
fn lines_of_request(log: &str, request_id: &str) -> Vec<serde_json::Value> {
    log.lines()
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"))
        })
        .filter(|line| line["span"]["request_id"] == request_id)
        .collect()
}

/// Scrapes `address` until `ready` holds (a worker counts a decode call when it drops the
/// stream, just after the router saw its end), for at most 10 s.
async fn scrape_until(
    address: std::net::SocketAddr,
    ready: impl Fn(&nibble_telemetry::Samples) -> bool,
) -> nibble_telemetry::Samples {
    let start = Instant::now();
    loop {
        let text = nibble_telemetry::scrape(address)
            .await
            .expect("GET /metrics");
        let samples = nibble_telemetry::Samples::parse(&text);
        if ready(&samples) {
            return samples;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{address}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends an OpenAI completion to the router's HTTP API and returns its `x-request-id`.
async fn http_completion(address: std::net::SocketAddr, prompt: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0 })
        .to_string();
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.0\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.0 200"), "{response}");
    response
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("x-request-id")
                .then(|| value.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no x-request-id: {response}"))
}

/// Every process serves /metrics, and what each counts agrees with the others (the prefill
/// worker's bytes sent are the decode worker's received); every process's JSON log lines about
/// a request carry the router's request id, from the gRPC API's id and from the HTTP API's
/// `x-request-id` alike.
#[tokio::test(flavor = "multi_thread")]
async fn every_process_serves_metrics_and_logs_one_request_id() {
    use nibble_router::metrics as router;
    use nibble_worker::metrics as worker;
    let _serial = SERIAL.lock().await;
    let mut spec = Spec::new("nvfp4");
    spec.json_logs = true;
    let cluster = Cluster::start(spec).await;
    let mut client = cluster.client().await;
    let mut stream = client
        .generate(greedy("It is a truth universally acknowledged", NEW_TOKENS))
        .await
        .unwrap()
        .into_inner();
    let mut grpc_id = String::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        grpc_id = chunk.request_id;
    }
    assert!(grpc_id.starts_with("router-"), "{grpc_id}");
    let http = cluster
        .router
        .http
        .expect("the router printed its HTTP address");
    let http_id = http_completion(http, "However little known the feelings or views").await;
    cluster.assert_pages_back().await;

    let metrics = |p: &support::cluster::Proc| {
        p.metrics
            .unwrap_or_else(|| panic!("{} printed no metrics address", p.name))
    };
    let r = scrape_until(metrics(&cluster.router), |s| {
        s.get(router::REQUESTS_TOTAL, &[("outcome", "finished")]) == Some(2.0)
    })
    .await;
    let count = |s: &nibble_telemetry::Samples, name: &str| s.value(&format!("{name}_count"), &[]);
    assert_eq!(count(&r, router::TIME_TO_FIRST_TOKEN_SECONDS), 2.0);
    assert_eq!(count(&r, router::REQUEST_DURATION_SECONDS), 2.0);
    assert_eq!(
        r.value(router::DECISIONS_TOTAL, &[("reason", "disaggregated")]),
        2.0
    );
    assert_eq!(r.value(router::WORKERS, &[("role", "decode")]), 1.0);

    let p = scrape_until(metrics(&cluster.prefills[0]), |_| true).await;
    let d = scrape_until(metrics(&cluster.decodes[0]), |s| {
        s.get(
            worker::REQUESTS_TOTAL,
            &[("call", "decode"), ("code", "ok")],
        ) == Some(2.0)
    })
    .await;
    assert_eq!(
        p.value(
            worker::REQUESTS_TOTAL,
            &[("call", "prefill"), ("code", "ok")]
        ),
        2.0
    );
    assert_eq!(
        d.value(
            worker::REQUESTS_TOTAL,
            &[("call", "reserve"), ("code", "ok")]
        ),
        2.0
    );
    let sent = p.value(worker::KV_TRANSFER_BYTES_TOTAL, &[("direction", "sent")]);
    let received = d.value(
        worker::KV_TRANSFER_BYTES_TOTAL,
        &[("direction", "received")],
    );
    assert!(
        sent > 0.0 && sent == received,
        "{sent} sent, {received} received"
    );
    assert_eq!(
        d.value(worker::GENERATION_TOKENS_TOTAL, &[]),
        f64::from(2 * NEW_TOKENS)
    );
    assert!(p.value(worker::KV_PAGES_TOTAL, &[]) > 0.0);
    // Each process serves only its own series.
    assert_eq!(p.get(router::REQUESTS_TOTAL, &[]), None);
    assert_eq!(r.get(worker::KV_PAGES_TOTAL, &[]), None);
    // The router's request series carry the served model's name, and its KV-cache usage
    // (from the workers' load reports) is a share; the workers' own usage is one too.
    let model = ModelSource::default_name(&model_path());
    let finished = [("model_name", model.as_str()), ("outcome", "finished")];
    assert_eq!(r.value(router::REQUESTS_TOTAL, &finished), 2.0);
    let usage = r.value(router::KV_CACHE_USAGE, &[("role", "decode")]);
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert_eq!(d.value(worker::KV_CACHE_USAGE, &[]), 0.0, "nothing running");
    // The router's HTTP API port serves the same metrics.
    let on_api = nibble_telemetry::scrape(http).await.unwrap();
    let on_api = nibble_telemetry::Samples::parse(&on_api);
    assert_eq!(on_api.value(router::REQUESTS_TOTAL, &finished), 2.0);

    for id in [&grpc_id, &http_id] {
        for proc in [&cluster.router, &cluster.prefills[0], &cluster.decodes[0]] {
            let lines = lines_of_request(&proc.log(), id);
            assert!(
                !lines.is_empty(),
                "{}'s log has no line of request {id}:\n{}",
                proc.name,
                proc.log()
            );
        }
    }
    // The workers say what they did for it, under its id.
    let said = |proc: &support::cluster::Proc, id: &str| -> Vec<String> {
        lines_of_request(&proc.log(), id)
            .iter()
            .map(|l| {
                l["fields"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect()
    };
    for id in [&grpc_id, &http_id] {
        let prefill = said(&cluster.prefills[0], id);
        let decode = said(&cluster.decodes[0], id);
        let router = said(&cluster.router, id);
        assert!(prefill.iter().any(|m| m == "pushed pages"), "{prefill:?}");
        assert!(decode.iter().any(|m| m == "received pages"), "{decode:?}");
        assert!(decode.iter().any(|m| m == "decoded"), "{decode:?}");
        assert!(router.iter().any(|m| m == "finished"), "{router:?}");
    }
}

/// Every process serves gRPC reflection in both versions (v1, and v1alpha for grpcurl 1.8),
/// listing exactly the services it runs: the router `Inference`, every worker `Worker` and
/// `KvTransfer` (a prefill worker may become a decode worker in place); each with health and
/// reflection.
#[tokio::test(flavor = "multi_thread")]
async fn every_process_lists_only_its_services_through_both_reflection_versions() {
    use nibble_testkit::reflection::{expected_services, reflect, Version};
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Spec::new("nvfp4")).await;
    let cases = [
        (&cluster.router, vec!["nibble.v1.Inference"]),
        (
            &cluster.prefills[0],
            vec!["nibble.v1.KvTransfer", "nibble.v1.Worker"],
        ),
        (
            &cluster.decodes[0],
            vec!["nibble.v1.KvTransfer", "nibble.v1.Worker"],
        ),
    ];
    for (proc, own) in cases {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", proc.address))
            .unwrap()
            .connect()
            .await
            .unwrap();
        for version in Version::ALL {
            let reflected = reflect(channel.clone(), version, own[0]).await.unwrap();
            assert_eq!(
                reflected.services,
                expected_services(&own),
                "{} over {version:?}",
                proc.name
            );
            assert!(reflected.symbol_files > 0, "{}: {reflected:?}", proc.name);
        }
    }
}

/// `nibble up` starts a cluster in one process without etcd, answers `--prompt` through its
/// router, serves `nibble generate --url`, and stops cleanly on SIGINT.
#[tokio::test(flavor = "multi_thread")]
async fn nibble_up_answers_and_serves_generate_url_then_stops_on_sigint() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let _serial = SERIAL.lock().await;
    let mut up = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args([
            "up",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .args(["--prompt", "Who wrote Pride and Prejudice?"])
        .arg("--model")
        .arg(model_path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nibble up");
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    let mut address = None;
    // The ready line, the echoed prompt, then the answer's text.
    while let Some(Ok(line)) = lines.next() {
        if let Some(rest) = line.strip_prefix("nibble up: ready on ") {
            address = rest.split_whitespace().next().map(String::from);
        }
        let answered = seen
            .last()
            .is_some_and(|l: &String| l.starts_with("> Who wrote"));
        seen.push(line);
        if answered {
            break;
        }
    }
    let address = address.unwrap_or_else(|| panic!("no ready line: {seen:?}"));
    let answer = seen.last().unwrap();
    assert!(answer.contains("Austen"), "{seen:?}");

    let client = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["generate", "--url", &address, "--temperature", "0"])
        .args([
            "--max-tokens",
            "8",
            "It is a truth universally acknowledged",
        ])
        .output()
        .expect("run nibble generate --url");
    assert!(client.status.success(), "{client:?}");
    let text = String::from_utf8_lossy(&client.stdout);
    assert!(!text.trim().is_empty(), "no text: {client:?}");
    let summary = String::from_utf8_lossy(&client.stderr);
    assert!(summary.contains("completion 8 tokens"), "{summary}");

    let refused = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args([
            "generate",
            "--url",
            &address,
            "--model",
            "x",
            "--max-tokens",
            "0",
            "hi",
        ])
        .output()
        .expect("run nibble generate --url");
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");

    // SIGINT: the servers drain and the process exits.
    let pid = up.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    loop {
        if let Some(status) = up.try_wait().unwrap() {
            assert!(status.success(), "nibble up exited with {status}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "nibble up still running 20 s after SIGINT"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SIGTERM: a worker leaves the membership at once (the router stops routing to it without
/// waiting for its lease to expire), drains, and exits successfully.
#[tokio::test(flavor = "multi_thread")]
async fn a_terminated_worker_deregisters_and_exits() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(Spec::new("nvfp4")).await;
    let start = Instant::now();
    let status = cluster.decodes[0].terminate(Duration::from_secs(15));
    assert!(status.success(), "{status}");
    cluster.wait_for_workers(1, 0).await;
    // The lease's TTL is 10 s; leaving explicitly is faster.
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "gone after {:?}",
        start.elapsed()
    );
    let mut client = cluster.client().await;
    let status = generate(&mut client, greedy("hello", 4)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
}
