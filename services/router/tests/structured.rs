//! Structured outputs end to end on loopback with the real model: constraints through the
//! disaggregated path (the prefill worker samples the first token under the grammar, the decode
//! worker resumes it) over gRPC and the OpenAI HTTP API, compared with one engine, and refused
//! by name before anything is scheduled. Then tool calling over the HTTP API (the model's chat
//! template does not render tools, so nibble shows them in the system message, in the Hermes
//! format): `required` and a named function give calls whose arguments parse, streamed or not;
//! a two-turn conversation carries the call and its result back; bad tools are 400s by name.

#[path = "support/cluster.rs"]
mod cluster;
mod support;

use cluster::Cluster;
use nibble_engine::grammar::Constraint;
use nibble_engine::sampling::SamplingParams;
use nibble_kvfmt::KvDtype;
use nibble_proto::request::{refused_field, wire_constraint};
use nibble_proto::v1;
use nibble_router::HttpConfig;
use nibble_testkit::http_client::{post_json, HttpResponse};
use nibble_testkit::{generate, reference_with, RouterApi};
use serde_json::{json, Value};
use support::{greedy_request, prompt, MODEL};

const PERSON: &str = r#"{
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]}
    },
    "required": ["name", "age", "city"],
    "additionalProperties": false
}"#;

fn constrained(constraint: &Constraint, max_tokens: u32) -> v1::GenerateRequest {
    let mut request = greedy_request("");
    let sampling = request.sampling.as_mut().unwrap();
    sampling.constraint = Some(wire_constraint(constraint));
    request.stopping.as_mut().unwrap().max_tokens = Some(max_tokens);
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constrained_request_through_prefill_and_decode_equals_one_engine() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let mut client = cluster.router.client().await;
    for constraint in [
        Constraint::JsonSchema(PERSON.into()),
        Constraint::Regex(r"(yes|no), because [a-z ]{1,40}\.".into()),
    ] {
        let got = generate(&mut client, constrained(&constraint, 48))
            .await
            .unwrap();
        let params = SamplingParams {
            constraint: Some(constraint.clone()),
            ..SamplingParams::greedy(48)
        };
        let want = reference_with(KvDtype::Nvfp4, &[prompt()], &params).remove(0);
        assert_eq!(got.tokens, want, "{constraint:?}: {:?}", got.text);
        assert_eq!(got.finish_reason, v1::FinishReason::StopToken as i32);
        if let Constraint::JsonSchema(_) = constraint {
            let person: Value = serde_json::from_str(&got.text).unwrap();
            assert!(
                person["name"].is_string() && person["age"].is_i64(),
                "{person}"
            );
            assert!(["Paris", "London", "Rome"].contains(&person["city"].as_str().unwrap()));
        }
    }
    cluster.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constraint_that_cannot_be_followed_is_refused_before_scheduling() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let mut client = cluster.router.client().await;
    for bad in [
        Constraint::JsonSchema(r#"{"type": "object", "properties": 3}"#.into()),
        Constraint::JsonSchema("{not json".into()),
        Constraint::Regex("(unclosed".into()),
        Constraint::Lark("start: undefined_rule".into()),
    ] {
        let status = generate(&mut client, constrained(&bad, 8))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad:?}");
        assert_eq!(
            refused_field(&status),
            Some("sampling.constraint"),
            "{status:?}"
        );
    }
    let mut eos = constrained(&Constraint::JsonObject, 8);
    eos.stopping.as_mut().unwrap().ignore_eos = true;
    let status = generate(&mut client, eos).await.unwrap_err();
    assert_eq!(
        refused_field(&status),
        Some("sampling.constraint"),
        "{status:?}"
    );
    // Nothing reached a worker.
    assert_eq!(cluster.router.shared.router().stats().in_flight, 0);
    cluster.pages_back().await;
}

fn chat(format: Value) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a person living in Paris as JSON."}],
        "max_tokens": 80,
        "temperature": 0,
        "response_format": format,
    })
}

fn content(r: &HttpResponse) -> String {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_format_gives_json_streamed_or_not() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();
    let schema: Value = serde_json::from_str(PERSON).unwrap();
    let format = json!({"type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": true}});
    let r = post_json(http, "/v1/chat/completions", &chat(format.clone())).await;
    let text = content(&r);
    let person: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(
        person.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["name", "age", "city"]
    );
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");

    let mut streamed = chat(format);
    streamed["stream"] = json!(true);
    let r = post_json(http, "/v1/chat/completions", &streamed).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let deltas: String = r
        .sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(deltas, text, "streamed = not streamed");

    // Any object is allowed, so the prompt asks for a small one: a free description can
    // repeat itself past max_tokens.
    let mut object = chat(json!({"type": "json_object"}));
    object["messages"][0]["content"] =
        json!("Return a JSON object with the keys name and age for a French programmer.");
    let r = post_json(http, "/v1/chat/completions", &object).await;
    let text = content(&r);
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop", "{text}");
    let any: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(any.is_object());

    // The extensions, on completions: a regex and a choice.
    let body = json!({"model": MODEL, "prompt": "The answer is", "max_tokens": 12,
        "temperature": 0, "guided_regex": " [0-9]{2,4}"});
    let r = post_json(http, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let number = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(
        number.starts_with(' ') && number[1..].parse::<u32>().is_ok(),
        "{number:?}"
    );
    let body = json!({"model": MODEL, "prompt": "Is Paris in France?", "max_tokens": 4,
        "temperature": 0.7, "seed": 3, "structured_outputs": {"choice": ["yes", "no"]}});
    let r = post_json(http, "/v1/completions", &body).await;
    let answer = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(answer == "yes" || answer == "no", "{answer:?}");
    cluster.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_structured_outputs_are_400s_naming_their_parameter() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();
    let cases = [
        (
            chat(json!({"type": "json_schema", "json_schema": {"name": "p",
                "schema": {"type": "object", "required": "name"}}})),
            "response_format",
        ),
        (chat(json!({"type": "yaml"})), "response_format"),
        (
            json!({"model": MODEL, "prompt": "x", "guided_regex": "(a"}),
            "guided_regex",
        ),
        (
            json!({"model": MODEL, "prompt": "x", "guided_grammar": "start: nowhere"}),
            "guided_grammar",
        ),
        (
            json!({"model": MODEL, "prompt": "x", "guided_regex": "a",
                "response_format": {"type": "json_object"}}),
            "guided_regex",
        ),
    ];
    for (body, param) in cases {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let r = post_json(http, path, &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let error = &r.json()["error"];
        assert_eq!(error["param"], param, "{body}: {error}");
        assert!(
            error["message"].as_str().unwrap().starts_with(param),
            "{error}"
        );
    }
    assert_eq!(cluster.router.shared.router().stats().in_flight, 0);
    cluster.pages_back().await;
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 32},
                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {
            "name": "get_time",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 32}},
                "required": ["city"], "additionalProperties": false}}}
    ])
}

fn ask(choice: Value) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools(),
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": 80,
    })
}

fn arguments(call: &Value) -> Value {
    let text = call["function"]["arguments"].as_str().unwrap();
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_through_the_http_api() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();

    // required: a call of one of the tools, with arguments under its schema.
    let r = post_json(http, "/v1/chat/completions", &ask(json!("required"))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let choice = &r.json()["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    let name = call["function"]["name"].as_str().unwrap().to_string();
    let args = arguments(call);
    assert!(args["city"].is_string(), "{args}");
    if name == "get_weather" {
        assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()));
    } else {
        assert_eq!(name, "get_time");
    }

    // A named function, streamed: the call arrives as a tool_calls delta.
    let mut named = ask(json!({"type": "function", "function": {"name": "get_time"}}));
    named["stream"] = json!(true);
    let r = post_json(http, "/v1/chat/completions", &named).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let chunks: Vec<Value> = r
        .sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    let call = &calls[0][0];
    assert_eq!(call["index"], 0);
    assert_eq!(call["function"]["name"], "get_time");
    assert!(arguments(call)["city"].is_string());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");

    // The second turn: the call and its result go back; the model answers in text.
    let arguments_text = call["function"]["arguments"].as_str().unwrap();
    let second = json!({
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "What time is it in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_time", "arguments": arguments_text}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"time\": \"14:05\"}"}
        ],
        "tools": tools(),
        "tool_choice": "none",
        "temperature": 0,
        "max_tokens": 24,
    });
    let r = post_json(http, "/v1/chat/completions", &second).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let message = &r.json()["choices"][0]["message"];
    assert!(
        message["content"].as_str().is_some_and(|c| !c.is_empty()),
        "{message}"
    );
    assert!(message.get("tool_calls").is_none());

    // Bad tools are refused by name, before anything is scheduled.
    let mut twice = ask(json!("auto"));
    twice["tools"] = json!([tools()[0], tools()[0]]);
    let mut unknown = ask(json!({"type": "function", "function": {"name": "nope"}}));
    unknown["stream"] = json!(false);
    let mut retrieval = ask(json!("auto"));
    retrieval["tools"] = json!([{"type": "retrieval"}]);
    let mut both = ask(json!("required"));
    both["response_format"] = json!({"type": "json_object"});
    for (body, param) in [
        (twice, "tools"),
        (unknown, "tool_choice"),
        (retrieval, "tools[0].type"),
        (both, "tool_choice"),
        (ask(json!("sometimes")), "tool_choice"),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "functions": [{"name": "f"}]}),
            "functions",
        ),
    ] {
        let r = post_json(http, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{}", r.text());
    }
    assert_eq!(cluster.router.shared.router().stats().in_flight, 0);
    cluster.pages_back().await;
}

/// The official `openai` Python client, with `jsonschema` validating its JSON
/// (`openai_structured.py`). Both packages are required: scripts/deps.sh installs them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_gets_structured_outputs_and_tool_calls() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let base_url = format!("http://{}/v1", cluster.http());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_structured.py");
    tokio::task::spawn_blocking(move || {
        nibble_testkit::python::run_checks(script.as_ref(), &[&base_url, MODEL])
    })
    .await
    .unwrap();
    cluster.pages_back().await;
}
