//! Fuzz targets for what clients send the router (see `nibble_testkit::fuzz`): OpenAI request
//! bodies and gRPC `GenerateRequest` messages, valid ones edited at random, are parsed and
//! validated into a refusal that names what was wrong or a request, never a panic. Seeds:
//! requests using most parameters.

use std::sync::Arc;

use nibble_engine::ModelSource;
use nibble_proto::v1;
use nibble_testkit::fuzz::{mutate, ITERATIONS};
use prost::Message;

use crate::http::{chat::ChatRequest, completions::CompletionRequest, params::parse_body};
use crate::service::validate::validate;
use crate::service::ServiceConfig;
use crate::RouterConfig;

const COMPLETION: &str = r#"{"model":"m","prompt":["Hello there",[1,2,3]],"max_tokens":16,
"temperature":0.7,"top_p":0.9,"n":2,"best_of":3,"stop":["\n","END"],"logprobs":2,"echo":true,
"logit_bias":{"50":-100},"presence_penalty":0.5,"frequency_penalty":-0.5,"seed":7,
"stream":true,"stream_options":{"include_usage":true},"response_format":{"type":"json_object"}}"#;

const CHAT: &str = r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},
{"role":"user","content":[{"type":"text","text":"Hi"}]},{"role":"assistant","content":null,
"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},
{"role":"tool","tool_call_id":"c1","content":"2"}],"tools":[{"type":"function","function":
{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"integer"}}}}}],
"tool_choice":"auto","max_completion_tokens":8,"logprobs":true,"top_logprobs":3,
"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object"}}}}"#;

#[test]
fn request_bodies_parse_or_are_refused() {
    bolero::check!()
        .with_iterations(ITERATIONS)
        .for_each(|input: &[u8]| {
            let body = mutate(&[COMPLETION.as_bytes(), CHAT.as_bytes()], input);
            let _ = parse_body::<CompletionRequest>(&body);
            let _ = parse_body::<ChatRequest>(&body);
        });
}

#[test]
fn generate_messages_validate_or_are_refused() {
    let source = ModelSource::open(nibble_testkit::model_path()).unwrap();
    let tokenizer = Arc::new(source.load_tokenizer().unwrap());
    let mut config = ServiceConfig::new(RouterConfig::new("m", 16), tokenizer, 2048);
    config.max_prompt_bytes = Some(4096);
    // Read-only here: a panic in one input cannot leave it half changed.
    let config = std::panic::AssertUnwindSafe(config);
    let seed = v1::GenerateRequest {
        request_id: "r1".into(),
        model: "m".into(),
        prompt: Some(v1::generate_request::Prompt::Text("It is a truth".into())),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.8),
            top_p: Some(0.9),
            top_k: Some(40),
            seed: Some(3),
            ..Default::default()
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: Some(16),
            stop: vec!["END".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let tokens = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
            ids: vec![1, 2, 3, 49_000],
        })),
        ..Default::default()
    }
    .encode_to_vec();
    bolero::check!()
        .with_iterations(ITERATIONS)
        .for_each(|input: &[u8]| {
            let bytes = mutate(&[&seed, &tokens], input);
            if let Ok(request) = v1::GenerateRequest::decode(bytes.as_slice()) {
                let _ = validate(request, &config);
            }
        });
}
