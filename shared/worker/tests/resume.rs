//! A decode worker resumes a request another decode worker started (`Decode` with
//! `generated_token_ids`): it streams only what follows the tokens given, the tokens, text,
//! finish reason and usage of the undisturbed stream; output that already ends the request ends
//! it at once; and every page is back afterwards.

mod support;

use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_testkit::{greedy, model, WorkerApi};
use support::{engine, Server};

const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife. However little known the feelings";
const NEW_TOKENS: u32 = 16;

/// What a decode stream carried.
#[derive(Debug, Default)]
struct Streamed {
    tokens: Vec<u32>,
    /// Each chunk's text, in order.
    texts: Vec<String>,
    finish_reason: i32,
    usage: Option<v1::Usage>,
}

async fn decode(d: &Server, id: &str, generated: &[u32]) -> Streamed {
    let prompt = model().1.encode(PROMPT, false).unwrap();
    let mut stream = (d.client().await)
        .decode(v1::DecodeRequest {
            request_id: id.into(),
            token_ids: prompt,
            sampling: Some(greedy()),
            stopping: Some(v1::StoppingCriteria {
                max_tokens: Some(NEW_TOKENS),
                ignore_eos: true,
                ..Default::default()
            }),
            generated_token_ids: generated.to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Streamed::default();
    while let Some(chunk) = stream.message().await.unwrap() {
        out.tokens.extend(&chunk.token_ids);
        out.texts.push(chunk.text);
        if chunk.usage.is_some() {
            (out.finish_reason, out.usage) = (chunk.finish_reason, chunk.usage);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_resumes_after_the_tokens_another_streamed() {
    let d = Server::start(
        engine(KvDtype::Nvfp4),
        v1::WorkerRole::Decode,
        "decode-0".into(),
    )
    .await;

    let whole = decode(&d, "whole", &[]).await;
    assert_eq!(whole.tokens.len(), NEW_TOKENS as usize);
    // One token per chunk, then the end's chunk: the client had the first 5 chunks' text.
    let k = 5;
    let resumed = decode(&d, "resumed", &whole.tokens[..k]).await;
    assert_eq!(resumed.tokens, whole.tokens[k..]);
    assert_eq!(resumed.texts.concat(), whole.texts[k..].concat());
    assert_eq!(resumed.finish_reason, whole.finish_reason);
    assert_eq!(resumed.usage, whole.usage, "every token counted once");
    d.pages_back().await;

    // Every token sent, the end not: the stream ends at once, as the first one would have.
    let ended = decode(&d, "ended", &whole.tokens).await;
    assert!(ended.tokens.is_empty());
    assert_eq!(ended.finish_reason, whole.finish_reason);
    let usage = ended.usage.expect("usage");
    assert_eq!(usage.completion_tokens, NEW_TOKENS);
    d.pages_back().await;
}
