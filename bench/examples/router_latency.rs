//! The router's added latency: time to first token through the router minus time to first
//! token asking the decode worker directly, for the same request.
//!
//!     cargo run --release -p nibble-bench --example router_latency [-- REQUESTS PROMPT_TOKENS [LOAD]]
//!
//! With LOAD, that many other clients keep streaming requests through the router the whole time
//! (each a new 128-token prompt and 32 generated tokens, one after another), so the router is
//! measured under load: admission, routing and relays of other streams compete with each probe.
//! One prefill worker, one decode worker and a router, real gRPC servers on loopback ports.
//! The router's local-prefill threshold is above the prompt, so through the router the decode
//! worker prefills the prompt itself — exactly the work a direct `Decode` call asks of it — and
//! the difference is what the router adds: its gRPC hop, validation, tokenization-free token
//! ids, block hashing, the routing decision and the relay of the stream. The prompt is cached
//! on the decode worker after the first request, so each request computes one token and the
//! measurement is not buried under model time. Requests alternate between the two paths.

use std::time::Instant;

use nibble_bench::cluster::{quantile, text_tokens, LocalCluster, Setup};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_proto::v1::worker_client::WorkerClient;

fn sampling() -> Option<v1::SamplingParams> {
    Some(v1::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    })
}

fn stopping() -> Option<v1::StoppingCriteria> {
    Some(v1::StoppingCriteria {
        max_tokens: Some(1),
        ..Default::default()
    })
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let requests: usize = args.next().map_or(400, |a| a.parse().expect("REQUESTS"));
    let prompt_tokens: usize = args
        .next()
        .map_or(64, |a| a.parse().expect("PROMPT_TOKENS"));
    let load: usize = args.next().map_or(0, |a| a.parse().expect("LOAD"));
    let prompt = text_tokens(prompt_tokens);
    let cluster = LocalCluster::start(&Setup {
        kv_dtype: KvDtype::Nvfp4,
        kv_budget_mib: 64,
        threads: 2,
        local_prefill_threshold: prompt_tokens + 1,
    })
    .await;
    let mut router = InferenceClient::connect(format!("http://{}", cluster.router))
        .await
        .expect("connect to the router");
    let mut decode = WorkerClient::connect(format!("http://{}", cluster.decode))
        .await
        .expect("connect to the decode worker");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut background = Vec::new();
    let corpus = text_tokens(4096);
    for client in 0..load {
        let mut router = router.clone();
        let stop = stop_rx.clone();
        let corpus = corpus.clone();
        background.push(tokio::spawn(async move {
            let mut sent = 0usize;
            while !*stop.borrow() {
                // A new prompt each time (not cached), from its own place in the text.
                let at = (client * 997 + sent * 131) % (corpus.len() - 128);
                let request = v1::GenerateRequest {
                    prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
                        ids: corpus[at..at + 128].to_vec(),
                    })),
                    sampling: sampling(),
                    stopping: Some(v1::StoppingCriteria {
                        max_tokens: Some(32),
                        ignore_eos: true,
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                let mut stream = router
                    .generate(request)
                    .await
                    .expect("Generate")
                    .into_inner();
                while stream.message().await.expect("stream").is_some() {}
                sent += 1;
            }
            sent
        }));
    }
    let (mut direct, mut routed) = (Vec::new(), Vec::new());
    for i in 0..requests + 10 {
        let start = Instant::now();
        let mut stream = decode
            .decode(v1::DecodeRequest {
                request_id: format!("direct-{i}"),
                token_ids: prompt.clone(),
                handoff: None,
                sampling: sampling(),
                stopping: stopping(),
                logprobs: None,
                skip_special_tokens: None,
                generated_token_ids: Vec::new(),
            })
            .await
            .expect("Decode")
            .into_inner();
        stream.message().await.expect("a token").expect("a chunk");
        let direct_ttft = start.elapsed();
        while stream.message().await.expect("stream").is_some() {}

        let start = Instant::now();
        let mut stream = router
            .generate(v1::GenerateRequest {
                request_id: format!("routed-{i}"),
                prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
                    ids: prompt.clone(),
                })),
                sampling: sampling(),
                stopping: stopping(),
                ..Default::default()
            })
            .await
            .expect("Generate")
            .into_inner();
        stream.message().await.expect("a token").expect("a chunk");
        let routed_ttft = start.elapsed();
        while stream.message().await.expect("stream").is_some() {}
        if i >= 10 {
            direct.push(direct_ttft.as_secs_f64() * 1e3);
            routed.push(routed_ttft.as_secs_f64() * 1e3);
        }
    }
    let _ = stop_tx.send(true);
    let mut streamed = 0;
    for task in background {
        streamed += task.await.expect("a background client");
    }
    if load > 0 {
        println!("under load: {load} clients streamed {streamed} other requests meanwhile");
    }
    let mut added: Vec<f64> = routed.iter().zip(&direct).map(|(r, d)| r - d).collect();
    println!(
        "| path | requests | p50 TTFT ms | p90 TTFT ms | p99 TTFT ms |\n| --- | --- | --- | --- | --- |"
    );
    for (name, samples) in [
        ("direct to decode", &mut direct),
        ("through the router", &mut routed),
    ] {
        println!(
            "| {name} | {} | {:.3} | {:.3} | {:.3} |",
            samples.len(),
            quantile(samples, 0.5),
            quantile(samples, 0.9),
            quantile(samples, 0.99)
        );
    }
    let p50_added = quantile(&mut added, 0.5);
    println!(
        "router added latency (paired difference): p50 {:.3} ms, p90 {:.3} ms; \
         difference of medians {:.3} ms",
        p50_added,
        quantile(&mut added, 0.9),
        quantile(&mut routed, 0.5) - quantile(&mut direct, 0.5)
    );
}
