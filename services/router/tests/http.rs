//! The router's OpenAI-compatible HTTP API end to end on loopback with the real model: the same
//! in-process workers and router as the gRPC tests (`support`), driven over raw HTTP/1.1 so the
//! bytes on the wire (status, headers, server-sent-event framing) are what is checked, and by the
//! official `openai` Python package (`openai_client.py`).

#[path = "support/cluster.rs"]
mod cluster;
mod support;

/// The common parameters (penalties, logit_bias, n, best_of, echo, prompt lists, usage).
#[path = "http/params.rs"]
mod params;

use std::time::Duration;

use cluster::Cluster;
use logprobs::{check_chat_logprobs, check_completion_logprobs, joined_completion_logprobs};
use nibble_discovery::{Role, StaticRegistry};
use nibble_engine::scheduler::SchedulerConfig;
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_router::HttpConfig;
use nibble_testkit::http_client::{self, get, post_json, HttpResponse};
use nibble_testkit::python;
use nibble_testkit::{generate, Generated, RouterApi, WorkerApi};
use serde_json::{json, Value};
use support::{
    engine_with, greedy_request, prompt, RouterServer, Worker, MODEL, NEW_TOKENS, PROMPT,
};
use tokio::io::AsyncReadExt;
use tonic::transport::Channel;

const QUESTION: &str = "What is the capital of France?";

/// The gRPC path's greedy answer once the prompt's pages are cached (run twice: the first run
/// caches, so every later run, over HTTP too, starts from the same cache).
async fn warm_grpc(
    client: &mut InferenceClient<Channel>,
    request: v1::GenerateRequest,
) -> (String, v1::Usage, &'static str) {
    let warm_up = generate(client, request.clone()).await.unwrap();
    warm_up.usage.expect("the last chunk carries usage");
    let Generated {
        tokens,
        text,
        usage,
        finish_reason: finish,
        ..
    } = generate(client, request).await.unwrap();
    let usage = usage.expect("the last chunk carries usage");
    assert_eq!(tokens.len(), usage.completion_tokens as usize);
    let finish = if finish == v1::FinishReason::Length as i32 {
        "length"
    } else {
        "stop"
    };
    (text, usage, finish)
}

/// [`greedy_request`] for `prompt`, with no request id.
fn grpc_request(prompt: v1::generate_request::Prompt) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(prompt),
        ..greedy_request("")
    }
}

/// The JSON chunks of an SSE response, after checking its framing: `text/event-stream`, every
/// event a `data:` line, the last one `[DONE]`.
fn sse_chunks(response: &HttpResponse) -> Vec<Value> {
    assert_eq!(response.status, 200, "{}", response.text());
    assert!(
        response
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream")),
        "{:?}",
        response.headers
    );
    let mut data = response.sse_data();
    assert_eq!(
        data.pop().as_deref(),
        Some("[DONE]"),
        "the stream ends with [DONE]"
    );
    assert!(!data.iter().any(|d| d == "[DONE]"), "[DONE] only once");
    data.iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// The usage chunk that ends a stream with `include_usage` (no choices), after checking that
/// every other chunk carries `"usage": null`.
fn usage_chunk(chunks: &[Value]) -> &Value {
    let (last, rest) = chunks.split_last().expect("chunks");
    assert_eq!(last["choices"], json!([]), "{last}");
    for chunk in rest {
        assert!(chunk["usage"].is_null(), "{chunk}");
        assert!(
            chunk.get("usage").is_some(),
            "usage: null is present: {chunk}"
        );
    }
    &last["usage"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_give_the_grpc_paths_greedy_output() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();
    let mut client = cluster.router.client().await;
    let prompt_tokens = prompt();

    // Completions, token-id prompt, against the gRPC path on the same tokens.
    let (text, usage, finish) = warm_grpc(
        &mut client,
        grpc_request(v1::generate_request::Prompt::Tokens(v1::TokenIds {
            ids: prompt_tokens.clone(),
        })),
    )
    .await;
    assert!(!text.is_empty());
    assert_eq!(
        finish, "length",
        "the prompt's greedy text runs past the limit"
    );
    let body = json!({
        "model": MODEL, "prompt": prompt_tokens, "max_tokens": NEW_TOKENS,
        "temperature": 0, "logprobs": 0,
    });
    let r = post_json(http, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    assert_eq!(j["object"], "text_completion");
    assert_eq!(j["model"], MODEL);
    assert!(j["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(r.header("x-request-id"), j["id"].as_str());
    // Which workers served it, as gRPC's route says (benchmarks read it).
    assert_eq!(r.header("x-nibble-decode-worker"), Some("d0"));
    assert_eq!(r.header("x-nibble-prefill-worker"), Some("p0"));
    assert_eq!(j["choices"][0]["text"], text.as_str(), "HTTP = gRPC");
    assert_eq!(j["choices"][0]["finish_reason"], "length");
    assert_eq!(j["usage"]["prompt_tokens"], prompt_tokens.len());
    assert_eq!(j["usage"]["completion_tokens"], NEW_TOKENS);
    assert_eq!(
        j["usage"]["total_tokens"],
        prompt_tokens.len() + NEW_TOKENS as usize
    );
    assert_eq!(
        j["usage"]["prompt_tokens_details"]["cached_tokens"],
        usage.cached_tokens
    );
    let logprobs = &j["choices"][0]["logprobs"];
    assert_eq!(
        logprobs["tokens"].as_array().unwrap().len(),
        NEW_TOKENS as usize
    );
    assert!(logprobs["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|l| l.as_f64().unwrap() <= 0.0));
    // logprobs: 0 still lists the chosen token (OpenAI: up to logprobs + 1 entries).
    for (top, token) in logprobs["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(logprobs["tokens"].as_array().unwrap())
    {
        let top = top.as_object().unwrap();
        assert_eq!(top.len(), 1, "{top:?}");
        assert!(top.contains_key(token.as_str().unwrap()), "{top:?}");
    }

    // Streamed, with usage.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    streamed.as_object_mut().unwrap().remove("logprobs");
    let r = post_json(http, "/v1/completions", &streamed).await;
    assert_eq!(r.header("x-nibble-decode-worker"), Some("d0"));
    let chunks = sse_chunks(&r);
    let usage_json = usage_chunk(&chunks);
    assert_eq!(usage_json["completion_tokens"], NEW_TOKENS);
    let choices: Vec<&Value> = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .collect();
    let joined: String = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(joined, text, "streamed text = gRPC text");
    assert_eq!(choices.last().unwrap()["finish_reason"], "length");
    assert!(choices[..choices.len() - 1]
        .iter()
        .all(|c| c["finish_reason"].is_null()));
    // Without include_usage there is no usage chunk.
    streamed.as_object_mut().unwrap().remove("stream_options");
    let chunks = sse_chunks(&post_json(http, "/v1/completions", &streamed).await);
    assert!(chunks
        .iter()
        .all(|c| c.get("usage").is_none() && c["choices"].as_array().unwrap().len() == 1));

    // A stop string cuts the text before its match.
    let word = text
        .split_whitespace()
        .nth(1)
        .expect("the greedy text has two words");
    let expected = &text[..text.find(word).unwrap()];
    let mut stopped = body.clone();
    stopped["stop"] = json!([word]);
    let j = post_json(http, "/v1/completions", &stopped).await.json();
    assert_eq!(j["choices"][0]["text"], expected, "stop {word:?}");
    assert_eq!(j["choices"][0]["finish_reason"], "stop");

    // Chat, against the gRPC chat prompt.
    let (chat_text, chat_usage, chat_finish) = warm_grpc(
        &mut client,
        grpc_request(v1::generate_request::Prompt::Chat(v1::ChatPrompt {
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: QUESTION.into(),
                ..Default::default()
            }],
            add_generation_prompt: None,
            tools: Vec::new(),
        })),
    )
    .await;
    let body = json!({
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": true,
    });
    let j = post_json(http, "/v1/chat/completions", &body).await.json();
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["choices"][0]["message"]["role"], "assistant");
    assert_eq!(j["choices"][0]["message"]["content"], chat_text.as_str());
    assert_eq!(j["choices"][0]["finish_reason"], chat_finish);
    assert_eq!(
        j["usage"]["completion_tokens"],
        chat_usage.completion_tokens
    );
    assert_eq!(
        j["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len(),
        chat_usage.completion_tokens as usize
    );
    // Content given as parts, streamed, with max_completion_tokens.
    let body = json!({
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        "max_completion_tokens": NEW_TOKENS, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let chunks = sse_chunks(&post_json(http, "/v1/chat/completions", &body).await);
    assert_eq!(
        usage_chunk(&chunks)["completion_tokens"],
        chat_usage.completion_tokens
    );
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let deltas: Vec<&Value> = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .collect();
    let joined: String = deltas
        .iter()
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect();
    assert_eq!(joined, chat_text, "streamed chat = gRPC chat");
    assert_eq!(deltas.last().unwrap()["finish_reason"], chat_finish);

    // The model list, liveness, readiness.
    let j = get(http, "/v1/models").await.json();
    assert_eq!(j["object"], "list");
    assert_eq!(j["data"][0]["id"], MODEL);
    assert_eq!(
        get(http, &format!("/v1/models/{MODEL}")).await.json()["id"],
        MODEL
    );
    assert_eq!(get(http, "/health").await.status, 200);
    let r = get(http, "/ready").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["decode_workers"], 1);

    cluster.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_logprobs_have_openais_shape_streamed_or_not() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();

    // Completions, logprobs: 3, against the same request without logprobs (run twice: the first
    // run caches the prompt, and a cached prefix may change the greedy tokens).
    let plain = json!({
        "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
    });
    post_json(http, "/v1/completions", &plain).await;
    let text =
        post_json(http, "/v1/completions", &plain).await.json()["choices"][0]["text"].clone();
    let mut body = plain.clone();
    body["logprobs"] = json!(3);
    let j = post_json(http, "/v1/completions", &body).await.json();
    assert_eq!(j["choices"][0]["text"], text, "logprobs change no token");
    let lp = &j["choices"][0]["logprobs"];
    check_completion_logprobs(lp, 3, NEW_TOKENS as usize);
    body["stream"] = json!(true);
    let chunks = sse_chunks(&post_json(http, "/v1/completions", &body).await);
    assert_eq!(
        &joined_completion_logprobs(&chunks),
        lp,
        "streamed = not streamed"
    );

    // Chat, logprobs: true with top_logprobs: 3 (twice again, to cache the prompt).
    let body = json!({
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": true, "top_logprobs": 3,
    });
    post_json(http, "/v1/chat/completions", &body).await;
    let j = post_json(http, "/v1/chat/completions", &body).await.json();
    let content = j["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len(),
        j["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    check_chat_logprobs(content, 3);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = sse_chunks(&post_json(http, "/v1/chat/completions", &streamed).await);
    let streamed_content: Vec<Value> = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .filter_map(|c| c["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(&streamed_content, content, "streamed = not streamed");

    cluster.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_stream_frees_the_requests_pages() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let (stream, seen) = stream_to_first_text(&cluster, 512).await;
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
    assert!(cluster.router.shared.router().stats().in_flight == 1);
    drop(stream);
    cluster.pages_back().await;
}

/// Starts a long greedy streamed completion (`max_tokens`, EOS ignored) and reads until its first
/// text chunk; returns the open connection and the bytes read so far (headers included).
async fn stream_to_first_text(
    cluster: &Cluster,
    max_tokens: u32,
) -> (tokio::net::TcpStream, Vec<u8>) {
    let body = json!({
        "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": true,
    })
    .to_string();
    let mut stream = http_client::send(
        cluster.http(),
        "POST",
        "/v1/completions",
        &[],
        Some(body.as_bytes()),
    )
    .await;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"text\":") {
        let n = tokio::time::timeout(Duration::from_secs(60), stream.read(&mut buf))
            .await
            .expect("a first chunk")
            .unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    (stream, seen)
}

fn assert_error(r: &HttpResponse, status: u16, param: Option<&str>) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    let j = r.json();
    let e = &j["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{j}");
    assert!(e["type"].is_string(), "{j}");
    assert!(e.get("code").is_some() && e.get("param").is_some(), "{j}");
    if let Some(param) = param {
        assert_eq!(e["param"], param, "{j}");
        if status == 400 {
            assert!(e["message"].as_str().unwrap().starts_with(param), "{j}");
        }
    }
    j
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_openais_shape_and_status() {
    let registry = StaticRegistry::new();
    let router = RouterServer::start(
        &registry,
        16,
        HttpConfig {
            api_key: None,
            max_body_bytes: 2048,
            ..HttpConfig::default()
        },
        |_| {},
    )
    .await;
    let http = router.http_address();
    let ok_completion = json!({"prompt": "Hello", "max_tokens": 4});
    let with = |base: &Value, key: &str, value: Value| {
        let mut body = base.clone();
        body[key] = value;
        body
    };
    let ok_chat = json!({"messages": [{"role": "user", "content": "Hi"}]});

    let completion_cases = [
        (with(&ok_completion, "temperature", json!(3)), "temperature"),
        (
            with(&ok_completion, "temperature", json!("hot")),
            "temperature",
        ),
        (with(&ok_completion, "top_p", json!(0)), "top_p"),
        (with(&ok_completion, "n", json!(17)), "n"),
        (with(&ok_completion, "n", json!(0)), "n"),
        (with(&ok_completion, "best_of", json!(17)), "best_of"),
        (json!({"prompt": "Hello", "n": 2, "best_of": 1}), "best_of"),
        (
            json!({"prompt": "Hello", "best_of": 2, "stream": true}),
            "best_of",
        ),
        (
            with(&ok_completion, "presence_penalty", json!(2.5)),
            "presence_penalty",
        ),
        (
            with(&ok_completion, "frequency_penalty", json!(-3)),
            "frequency_penalty",
        ),
        (
            with(&ok_completion, "logit_bias", json!({"1": 101})),
            "logit_bias",
        ),
        (
            with(&ok_completion, "logit_bias", json!({"x": 1})),
            "logit_bias",
        ),
        // Outside the vocabulary (49152).
        (
            with(&ok_completion, "logit_bias", json!({"49152": 1})),
            "logit_bias",
        ),
        (
            json!({"prompt": "Hello", "echo": true, "max_tokens": 0, "logprobs": 6}),
            "logprobs",
        ),
        (with(&ok_completion, "suffix", json!("x")), "suffix"),
        (with(&ok_completion, "max_tokens", json!(0)), "max_tokens"),
        (with(&ok_completion, "max_tokens", json!(-1)), "max_tokens"),
        (with(&ok_completion, "logprobs", json!(6)), "logprobs"),
        (with(&ok_completion, "logprobs", json!(-1)), "logprobs"),
        (with(&ok_completion, "stop", json!([""])), "stop"),
        (with(&ok_completion, "prompt", json!("")), "prompt"),
        (with(&ok_completion, "prompt", json!([])), "prompt"),
        (
            with(&ok_completion, "prompt", Value::from(vec!["a"; 65])),
            "prompt",
        ),
        // One bad prompt of a list: refused by name before anything is scheduled.
        (with(&ok_completion, "prompt", json!(["a", ""])), "prompt"),
        (json!({"max_tokens": 4}), "prompt"),
        (
            with(
                &ok_completion,
                "stream_options",
                json!({"include_usage": true}),
            ),
            "stream_options",
        ),
        // Longer than the context (2048) with max_tokens.
        (with(&ok_completion, "max_tokens", json!(4000)), "prompt"),
    ];
    for (body, param) in completion_cases {
        let r = post_json(http, "/v1/completions", &body).await;
        assert_error(&r, 400, Some(param));
    }
    // A value that fits none of a field's forms is described in the API's terms, never by
    // the Rust type that parses it.
    let r = post_json(
        http,
        "/v1/completions",
        &with(&ok_completion, "prompt", json!({"text": "Hello"})),
    )
    .await;
    let message = assert_error(&r, 400, Some("prompt"))["error"]["message"].to_string();
    assert!(
        !message.contains("enum") && !message.contains("PromptInput"),
        "{message}"
    );
    let chat_cases = [
        (json!({"messages": []}), "messages"),
        (json!({}), "messages"),
        (
            with(&ok_chat, "max_completion_tokens", json!(0)),
            "max_completion_tokens",
        ),
        (with(&ok_chat, "n", json!(17)), "n"),
        (
            with(&ok_chat, "presence_penalty", json!(-2.5)),
            "presence_penalty",
        ),
        // top_logprobs needs logprobs: true, and is 0 to 20.
        (with(&ok_chat, "top_logprobs", json!(2)), "top_logprobs"),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}], "logprobs": true,
                   "top_logprobs": 21}),
            "top_logprobs",
        ),
        // A function tool without its function.
        (
            with(&ok_chat, "tools", json!([{"type": "function"}])),
            "tools[0].function",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content",
        ),
    ];
    for (body, param) in chat_cases {
        let r = post_json(http, "/v1/chat/completions", &body).await;
        assert_error(&r, 400, Some(param));
    }
    // Not JSON at all.
    let r = http_client::request(http, "POST", "/v1/completions", &[], Some(b"{nope")).await;
    assert_error(&r, 400, None);

    // 404: an unknown model, an unknown route.
    let r = post_json(
        http,
        "/v1/completions",
        &with(&ok_completion, "model", json!("gpt-9")),
    )
    .await;
    let j = assert_error(&r, 404, Some("model"));
    assert_eq!(j["error"]["code"], "model_not_found");
    assert_error(&get(http, "/v1/models/gpt-9").await, 404, None);
    assert_error(&get(http, "/v1/nothing").await, 404, None);
    assert_error(&get(http, "/v1/completions").await, 405, None);

    // 413 past the body limit.
    let big = with(&ok_completion, "prompt", json!("x".repeat(4096)));
    assert_error(&post_json(http, "/v1/completions", &big).await, 413, None);
    // A declared length over the limit is refused at once, without waiting for the body.
    let mut conn = tokio::net::TcpStream::connect(http).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                Content-Length: 10000000000\r\n\r\n";
    tokio::io::AsyncWriteExt::write_all(&mut conn, head.as_bytes())
        .await
        .unwrap();
    let mut answer = vec![0u8; 512];
    let n = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read(&mut conn, &mut answer),
    )
    .await
    .expect("an answer without the body")
    .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");

    // 503 while no worker is known, for requests and readiness; liveness stays up.
    for (path, body) in [
        ("/v1/completions", &ok_completion),
        ("/v1/chat/completions", &ok_chat),
    ] {
        let r = post_json(http, path, body).await;
        assert_error(&r, 503, None);
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    assert_eq!(get(http, "/ready").await.status, 503);
    assert_eq!(get(http, "/health").await.status, 200);

    // 401 without the key, when one is configured; probes need none.
    let keyed = RouterServer::start(
        &registry,
        16,
        HttpConfig {
            api_key: Some("sesame".into()),
            ..HttpConfig::default()
        },
        |_| {},
    )
    .await;
    let http = keyed.http_address();
    for headers in [
        &[][..],
        &[("Authorization", "Bearer sesam")][..],
        &[("Authorization", "sesame")][..],
    ] {
        let r = http_client::request(http, "GET", "/v1/models", headers, None).await;
        let j = assert_error(&r, 401, None);
        assert_eq!(j["error"]["code"], "invalid_api_key");
        let body = ok_completion.to_string();
        let r = http_client::request(
            http,
            "POST",
            "/v1/completions",
            headers,
            Some(body.as_bytes()),
        )
        .await;
        assert_error(&r, 401, None);
    }
    for auth in ["Bearer sesame", "bearer sesame"] {
        let r =
            http_client::request(http, "GET", "/v1/models", &[("Authorization", auth)], None).await;
        assert_eq!(r.status, 200, "{auth}");
    }
    assert_eq!(get(http, "/health").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_out_of_room_is_429() {
    // A decode worker that queues nothing refuses every request with RESOURCE_EXHAUSTED.
    let registry = StaticRegistry::new();
    let full = SchedulerConfig {
        max_waiting: 0,
        ..SchedulerConfig::default()
    };
    let decode = Worker::start_with(
        &registry,
        Role::Decode,
        "d0",
        engine_with(KvDtype::Nvfp4, full),
    )
    .await;
    let page_size = decode.state.engine().info().page_size as u32;
    let router = RouterServer::start(&registry, page_size, HttpConfig::default(), |_| {}).await;
    router.wait_for_workers(0, 1).await;
    let http = router.http_address();
    for stream in [false, true] {
        let body = json!({"prompt": "Hello", "max_tokens": 4, "stream": stream});
        let r = post_json(http, "/v1/completions", &body).await;
        let j = assert_error(&r, 429, None);
        assert_eq!(j["error"]["type"], "rate_limit_error");
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    decode.pages_back().await;
}

/// The official `openai` Python client against the API (`openai_client.py`). Python and the
/// package are required: scripts/deps.sh installs them; their absence fails this test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_against_the_api() {
    let cluster = Cluster::start(HttpConfig {
        api_key: Some("test-key".into()),
        ..HttpConfig::default()
    })
    .await;
    let base_url = format!("http://{}/v1", cluster.http());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let args = [base_url.as_str(), MODEL, "test-key"].map(String::from);
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        python::run_checks(script.as_ref(), &args)
    })
    .await
    .unwrap();
    cluster.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_before_a_whole_answer_frees_the_requests_pages() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let body = json!({
        "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": true,
    })
    .to_string();
    let stream = http_client::send(
        cluster.http(),
        "POST",
        "/v1/completions",
        &[],
        Some(body.as_bytes()),
    )
    .await;
    // Wait until the decode worker generates.
    for _ in 0..400 {
        if cluster.decode.load().await.running_requests == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(cluster.decode.load().await.running_requests, 1);
    let dropped = std::time::Instant::now();
    drop(stream);
    cluster.pages_back().await;
    // 2,000 tokens take the CPU engine far longer than this: the request was cut short.
    assert!(
        dropped.elapsed() < Duration::from_secs(5),
        "pages came back {:?} after the hang-up",
        dropped.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_both_apis() {
    let registry = StaticRegistry::new();
    let config = support::service_config(16);
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_address = http.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(nibble_router::serve_with_http(
        grpc,
        Some(nibble_router::HttpListener {
            listener: http,
            config: HttpConfig::default(),
        }),
        config,
        std::sync::Arc::new(registry.session()),
        async move {
            let _ = stopped.await;
        },
    ));
    assert_eq!(get(&http_address, "/health").await.status, 200);
    drop(stop);
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("both servers stop")
        .unwrap()
        .unwrap();
    assert!(tokio::net::TcpStream::connect(&http_address).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_mid_stream_ends_with_an_error_event_and_done() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let (mut stream, mut seen) = stream_to_first_text(&cluster, 1000).await;
    // The response id is the request id the workers know: abort it on the decode worker.
    let head = String::from_utf8_lossy(&seen).to_string();
    let id = head
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .expect("an x-request-id header")
        .trim()
        .to_string();
    assert!(head.contains(&format!("\"id\":\"{id}\"")), "{head}");
    let mut worker = nibble_proto::v1::worker_client::WorkerClient::connect(format!(
        "http://{}",
        cluster.decode.address
    ))
    .await
    .unwrap();
    worker
        .abort(v1::AbortRequest {
            request_id: id.clone(),
        })
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut seen))
        .await
        .expect("the stream ends")
        .unwrap();
    let response = http_client::parse(&seen);
    let mut data = response.sse_data();
    assert_eq!(data.pop().as_deref(), Some("[DONE]"));
    let error: Value = serde_json::from_str(&data.pop().unwrap()).unwrap();
    assert!(error["error"]["message"].is_string(), "{error}");
    assert!(error["error"]["type"].is_string(), "{error}");
    assert!(data.iter().all(|d| !d.contains("\"error\"")));
    cluster.pages_back().await;
}

/// Checks of OpenAI's log-probability shapes in the HTTP API's JSON (greedy decoding, so the
/// chosen token is always the most likely one).
mod logprobs {
    use serde_json::{json, Value};

    /// The completions `logprobs` object of every chunk of a stream, joined into one.
    pub fn joined_completion_logprobs(chunks: &[Value]) -> Value {
        let mut joined =
            json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
        for chunk in chunks {
            for choice in chunk["choices"].as_array().unwrap() {
                let lp = &choice["logprobs"];
                for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                    let more = lp[key].as_array().unwrap().clone();
                    joined[key].as_array_mut().unwrap().extend(more);
                }
            }
        }
        joined
    }

    /// Checks completions' `logprobs` for greedy decoding with `k` alternatives: per token an
    /// object of at most k + 1 texts (the k most likely and the chosen one), where the chosen
    /// token's value is its `token_logprobs` entry and the largest.
    pub fn check_completion_logprobs(lp: &Value, k: usize, completion_tokens: usize) {
        let tokens = lp["tokens"].as_array().unwrap();
        let values = lp["token_logprobs"].as_array().unwrap();
        let top = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(tokens.len(), completion_tokens, "{lp}");
        assert_eq!(values.len(), completion_tokens);
        assert_eq!(top.len(), completion_tokens);
        assert_eq!(
            lp["text_offset"].as_array().unwrap().len(),
            completion_tokens
        );
        for ((token, value), top) in tokens.iter().zip(values).zip(top) {
            let (token, value) = (token.as_str().unwrap(), value.as_f64().unwrap());
            let top = top.as_object().unwrap();
            assert!((k..=k + 1).contains(&top.len()), "{top:?}");
            assert_eq!(top[token].as_f64(), Some(value), "{token:?} in {top:?}");
            for alt in top.values() {
                let alt = alt.as_f64().unwrap();
                assert!(
                    alt <= 0.0 && alt <= value,
                    "greedy takes the most likely: {top:?}"
                );
            }
        }
    }

    /// Checks chat's `logprobs.content` for greedy decoding with `k` alternatives per token.
    pub fn check_chat_logprobs(content: &[Value], k: usize) {
        assert!(!content.is_empty());
        let bytes = |v: &Value| -> Vec<u8> {
            v["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect()
        };
        for entry in content {
            let token = entry["token"].as_str().unwrap();
            assert_eq!(bytes(entry), token.as_bytes(), "{entry}");
            let top = entry["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), k, "{entry}");
            assert_eq!(
                top[0]["token"], entry["token"],
                "greedy takes the most likely: {entry}"
            );
            assert_eq!(top[0]["logprob"], entry["logprob"], "{entry}");
            let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
            assert!(values.windows(2).all(|w| w[0] >= w[1]), "sorted: {entry}");
            assert!(values.iter().all(|v| *v <= 0.0), "{entry}");
            for alt in top {
                assert_eq!(
                    bytes(alt),
                    alt["token"].as_str().unwrap().as_bytes(),
                    "{alt}"
                );
            }
        }
    }
}

/// `/tokenize` and `/detokenize` round-trip a prompt through the served model's tokenizer, as
/// vLLM's endpoints do, and refuse what they cannot do by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip() {
    let registry = StaticRegistry::new();
    let router = RouterServer::start(&registry, 16, HttpConfig::default(), |_| {}).await;
    let http = router.http_address();
    let text = "It is a truth universally acknowledged";
    let r = post_json(
        http,
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    let tokens: Vec<u32> = serde_json::from_value(j["tokens"].clone()).unwrap();
    assert!(!tokens.is_empty());
    assert_eq!(j["count"], tokens.len());
    assert_eq!(j["token_strs"].as_array().unwrap().len(), tokens.len());
    assert!(j["max_model_len"].as_u64().unwrap() > 0);
    let r = post_json(http, "/detokenize", &json!({"tokens": tokens})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["prompt"], text);

    assert_error(
        &post_json(http, "/tokenize", &json!({})).await,
        400,
        Some("prompt"),
    );
    let out_of_vocab = json!({"tokens": [1, 99_999_999]});
    assert_error(
        &post_json(http, "/detokenize", &out_of_vocab).await,
        400,
        Some("tokens"),
    );
    let other = json!({"model": "gpt-9", "prompt": "x"});
    assert_error(
        &post_json(http, "/tokenize", &other).await,
        404,
        Some("model"),
    );
}
