//! Requests survive a dead decode worker: etcd, a router and workers as separate `nibble`
//! processes with the real model. A decode worker killed (SIGKILL)
//! while a greedy request streams is replaced: the request is resumed on another decode worker
//! and the client's stream carries exactly the tokens, text and usage of an undisturbed run,
//! with no error. Once a request has used its `--max-resumes`, the next break ends its stream
//! with an error that says so.

mod support;

use std::time::{Duration, Instant};

use nibble_engine::{ModelSource, Tokenizer};
use nibble_proto::v1;
use nibble_testkit::{model_path, Generated};
use support::cluster::{greedy, Cluster, Spec};
use tonic::Code;

const AUSTEN: &str =
    include_str!("../shared/engine/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt");
const NEW_TOKENS: u32 = 48;

/// One cluster test at a time (each starts several processes on a small machine).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A greedy request for the first `n` tokens of the Austen fixture.
fn request(n: usize) -> v1::GenerateRequest {
    let tokenizer: Tokenizer = ModelSource::open(model_path())
        .unwrap()
        .load_tokenizer()
        .unwrap();
    let ids = tokenizer.encode(AUSTEN, true).unwrap()[..n].to_vec();
    let mut request = greedy("", NEW_TOKENS);
    request.prompt = Some(v1::generate_request::Prompt::Tokens(v1::TokenIds { ids }));
    request
}

/// A request streaming through the router, read chunk by chunk.
struct Streaming {
    stream: tonic::Streaming<v1::GenerateResponse>,
    got: Generated,
    /// When each chunk with tokens came.
    arrivals: Vec<Instant>,
}

impl Streaming {
    async fn start(cluster: &Cluster, request: v1::GenerateRequest) -> Self {
        let mut client = cluster.client().await;
        let stream = client.generate(request).await.unwrap().into_inner();
        Self {
            stream,
            got: Generated::default(),
            arrivals: Vec::new(),
        }
    }

    /// Reads chunks until at least `tokens` tokens came (`Ok(false)`: the stream ended first).
    async fn read_until(&mut self, tokens: usize) -> Result<bool, tonic::Status> {
        while self.got.tokens.len() < tokens {
            let Some(chunk) = self.stream.message().await? else {
                return Ok(false);
            };
            if !chunk.token_ids.is_empty() {
                self.arrivals.push(Instant::now());
            }
            self.got.tokens.extend(chunk.token_ids);
            self.got.text.push_str(&chunk.text);
            if chunk.route.is_some() {
                self.got.route = chunk.route;
            }
            if let Some(usage) = chunk.usage {
                self.got.usage = Some(usage);
                self.got.finish_reason = chunk.finish_reason;
            }
        }
        Ok(true)
    }

    /// Reads the rest of the stream, bounded in time.
    async fn finish(mut self) -> Result<(Generated, Vec<Instant>), tonic::Status> {
        tokio::time::timeout(Duration::from_secs(120), self.read_until(usize::MAX))
            .await
            .expect("the stream ends in bounded time")?;
        Ok((self.got, self.arrivals))
    }

    /// The decode worker its first chunk named.
    fn decode_worker(&self) -> String {
        self.got
            .route
            .as_ref()
            .expect("a route")
            .decode_worker
            .clone()
    }
}

/// Kills the decode worker registered as `id` (SIGKILL, as a crash).
fn kill_decode(cluster: &mut Cluster, id: &str) {
    let proc = (cluster.decodes.iter_mut())
        .find(|p| p.is_running() && Cluster::worker_id(p) == id)
        .unwrap_or_else(|| panic!("no live decode worker {id}"));
    proc.kill();
}

/// The decode worker running a request now.
async fn busy_decode(cluster: &Cluster) -> String {
    let start = Instant::now();
    loop {
        let loads = cluster.loads().await;
        let busy = loads
            .iter()
            .find(|(n, l)| n.starts_with("decode") && l.running_requests > 0);
        if let Some((name, _)) = busy {
            let proc = cluster.decodes.iter().find(|p| &p.name == name).unwrap();
            return Cluster::worker_id(proc);
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no decode runs");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The router's metrics now.
async fn router_metrics(cluster: &Cluster) -> nibble_telemetry::Samples {
    let address = (cluster.router.metrics).expect("the router's metrics address");
    let text = nibble_telemetry::scrape(address)
        .await
        .expect("GET /metrics");
    nibble_telemetry::Samples::parse(&text)
}

async fn resumes(cluster: &Cluster, outcome: &str) -> f64 {
    router_metrics(cluster)
        .await
        .value("nibble_router_resumes_total", &[("outcome", outcome)])
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_whose_decode_worker_dies_mid_stream_continues_exactly_then_resumes_run_out() {
    let _serial = SERIAL.lock().await;
    let mut spec = Spec::new("nvfp4");
    spec.decodes = 3;
    spec.router_args
        .extend(["--max-resumes".into(), "1".into()]);
    let mut cluster = Cluster::start(spec).await;
    let prompt = request(64);

    // The undisturbed run.
    let sent = Instant::now();
    let (solo, arrivals) = Streaming::start(&cluster, prompt.clone())
        .await
        .finish()
        .await
        .unwrap_or_else(|s| panic!("{s}; logs:\n{}", cluster.logs()));
    let ttft = arrivals[0].duration_since(sent);
    assert_eq!(solo.tokens.len(), NEW_TOKENS as usize);
    let usage = solo.usage.expect("usage");
    assert_eq!(usage.completion_tokens, NEW_TOKENS);

    // Its decode worker killed after 8 tokens: the stream goes on, the same to the byte.
    let mut streaming = Streaming::start(&cluster, prompt.clone()).await;
    assert!(
        streaming.read_until(8).await.unwrap(),
        "the stream ended early"
    );
    let first = streaming.decode_worker();
    kill_decode(&mut cluster, &first);
    let killed = Instant::now();
    let (got, arrivals) = streaming
        .finish()
        .await
        .unwrap_or_else(|s| panic!("the client saw {s}; logs:\n{}", cluster.logs()));
    assert_eq!(got.tokens, solo.tokens, "logs:\n{}", cluster.logs());
    assert_eq!(got.text, solo.text);
    assert_eq!(got.finish_reason, solo.finish_reason);
    let resumed_usage = got.usage.expect("usage");
    assert_eq!(
        (resumed_usage.prompt_tokens, resumed_usage.completion_tokens),
        (usage.prompt_tokens, usage.completion_tokens)
    );
    let after = arrivals
        .iter()
        .find(|t| **t > killed)
        .expect("tokens after the kill");
    eprintln!(
        "resumed: the next token {:?} after the kill (undisturbed: first token {ttft:?} after \
         the request)",
        after.duration_since(killed)
    );
    assert_eq!(resumes(&cluster, "started").await, 1.0);
    assert_eq!(resumes(&cluster, "completed").await, 1.0);
    cluster.assert_pages_back().await;

    // Another request: resumed once after its decode worker dies, then its new decode worker
    // dies too. `--max-resumes 1`: its stream ends with an error that says why.
    let mut streaming = Streaming::start(&cluster, prompt.clone()).await;
    assert!(
        streaming.read_until(4).await.unwrap(),
        "the stream ended early"
    );
    kill_decode(&mut cluster, &streaming.decode_worker());
    assert!(
        streaming.read_until(12).await.unwrap(),
        "the stream ended early"
    );
    let second = busy_decode(&cluster).await;
    kill_decode(&mut cluster, &second);
    let status = streaming.finish().await.expect_err("resumes are exhausted");
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert!(
        status.message().contains("failed mid-stream")
            && status.message().contains("the most this router allows"),
        "{status}"
    );
    assert_eq!(resumes(&cluster, "started").await, 2.0);
    assert_eq!(resumes(&cluster, "exhausted").await, 1.0);
    assert_eq!(resumes(&cluster, "failed").await, 0.0);
    cluster.assert_pages_back().await;
}

/// What a streamed OpenAI response carried: its content, its usage, its finish reason.
#[derive(Debug, PartialEq)]
struct Sse {
    content: String,
    usage: serde_json::Value,
    finish_reason: serde_json::Value,
}

impl Sse {
    fn of(response: &nibble_testkit::http_client::HttpResponse) -> Self {
        assert_eq!(response.status, 200, "{}", response.text());
        let chunks: Vec<serde_json::Value> = (response.sse_data().iter())
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        for chunk in &chunks {
            assert!(chunk.get("error").is_none(), "an error event: {chunk}");
        }
        let choice = |field: &str| -> Vec<&serde_json::Value> {
            (chunks.iter())
                .filter_map(|c| c["choices"].get(0))
                .map(|c| &c[field])
                .collect()
        };
        Self {
            content: (choice("delta").iter())
                .filter_map(|d| d["content"].as_str())
                .collect(),
            usage: chunks.last().expect("chunks")["usage"].clone(),
            finish_reason: (choice("finish_reason").into_iter())
                .find(|r| !r.is_null())
                .cloned()
                .unwrap_or_default(),
        }
    }
}

/// Tokens the router streamed to clients so far.
async fn streamed(cluster: &Cluster) -> f64 {
    router_metrics(cluster)
        .await
        .get("nibble_router_generation_tokens_total", &[])
        .unwrap_or(0.0)
}

/// Through the OpenAI HTTP API, streamed (SSE), a constrained (JSON schema) chat request whose
/// decode worker is killed mid-stream, in a cluster without prefill workers (a decode worker
/// prefills its prompts itself): the stream goes on with no error event, and its text, finish
/// reason and usage are the undisturbed run's, the JSON valid. The grammar is replayed over the
/// tokens already streamed.
#[tokio::test(flavor = "multi_thread")]
async fn a_constrained_http_stream_is_resumed_on_a_decode_worker_that_prefills_itself() {
    use serde_json::json;
    let _serial = SERIAL.lock().await;
    let mut spec = Spec::new("nvfp4");
    (spec.prefills, spec.decodes) = (0, 2);
    let mut cluster = Cluster::start(spec).await;
    let http = cluster
        .router
        .http
        .expect("the router's HTTP address")
        .to_string();
    let schema = json!({"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "city": {"type": "string", "maxLength": 20},
                       "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                   "minItems": 2, "maxItems": 3}},
        "required": ["name", "city", "hobbies"], "additionalProperties": false});
    let body = json!({
        "messages": [{"role": "user", "content": "Describe a person living in Paris as JSON."}],
        "max_tokens": 60, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "person", "schema": schema}},
    });
    let post = |body: serde_json::Value| {
        let http = http.clone();
        tokio::spawn(async move {
            nibble_testkit::http_client::post_json(&http, "/v1/chat/completions", &body).await
        })
    };
    let solo = Sse::of(&post(body.clone()).await.unwrap());
    let person: serde_json::Value = serde_json::from_str(&solo.content).unwrap();
    assert!(person["hobbies"].is_array(), "{person}");

    let before = streamed(&cluster).await;
    let call = post(body);
    let start = Instant::now();
    while streamed(&cluster).await < before + 6.0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no tokens streamed"
        );
        assert!(!call.is_finished(), "the request ended before the kill");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let busy = busy_decode(&cluster).await;
    kill_decode(&mut cluster, &busy);
    let resumed = Sse::of(&call.await.unwrap());
    assert_eq!(resumed, solo, "logs:\n{}", cluster.logs());
    assert_eq!(resumes(&cluster, "started").await, 1.0);
    assert_eq!(resumes(&cluster, "completed").await, 1.0);
    cluster.assert_pages_back().await;
}
