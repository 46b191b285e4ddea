//! The common OpenAI parameters end to end: presence and frequency penalties, `logit_bias`, `n`
//! and `best_of`, `echo` with `max_tokens: 0` (scoring the prompt), a list of prompts, and
//! `stream_options.continuous_usage_stats`.

use nibble_proto::v1;
use nibble_router::HttpConfig;
use nibble_testkit::http_client::post_json;
use nibble_testkit::{generate, model, RouterApi};
use serde_json::{json, Value};

use super::support::{greedy_request, prompt, PROMPT};
use super::{sse_chunks, Cluster};

fn completion(j: &Value, i: usize) -> &str {
    j["choices"][i]["text"].as_str().unwrap()
}

async fn complete(http: &str, body: Value) -> Value {
    let r = post_json(http, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

/// The greedy tokens the gRPC path gives for `ids` under `sampling`.
async fn grpc_tokens(cluster: &Cluster, ids: Vec<u32>, sampling: v1::SamplingParams) -> Vec<u32> {
    let mut client = cluster.router.client().await;
    let request = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds { ids })),
        sampling: Some(sampling),
        ..greedy_request("")
    };
    generate(&mut client, request).await.unwrap().tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_and_logit_bias_change_the_greedy_tokens() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();
    let tokenizer = &model().1;
    let greedy = v1::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    };
    let plain = grpc_tokens(&cluster, prompt(), greedy.clone()).await;

    // +100 forces a token at every position, over gRPC and HTTP.
    let forced = tokenizer.encode(" banana", false).unwrap()[0];
    let biased = v1::SamplingParams {
        logit_bias: [(forced, 100.0)].into_iter().collect(),
        ..greedy.clone()
    };
    let tokens = grpc_tokens(&cluster, prompt(), biased).await;
    assert!(tokens.iter().all(|t| *t == forced), "{tokens:?}");
    let j = complete(
        http,
        json!({"prompt": prompt(), "max_tokens": 3, "temperature": 0,
               "logit_bias": {forced.to_string(): 100}}),
    )
    .await;
    let expected = tokenizer.decode(&[forced; 3], true).unwrap();
    assert_eq!(completion(&j, 0), expected);

    // -100 bans the greedy first token.
    let banned = v1::SamplingParams {
        logit_bias: [(plain[0], -100.0)].into_iter().collect(),
        ..greedy.clone()
    };
    let tokens = grpc_tokens(&cluster, prompt(), banned).await;
    assert_ne!(tokens[0], plain[0]);
    assert!(!tokens.contains(&plain[0]), "{tokens:?} holds {}", plain[0]);

    // Penalties change the greedy continuation (and a repeated one less than none).
    let body = |extra: Value| {
        let mut body = json!({"prompt": PROMPT, "max_tokens": 32, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let none = complete(http, body(json!({}))).await;
    let frequency = complete(http, body(json!({"frequency_penalty": 2.0}))).await;
    let presence = complete(http, body(json!({"presence_penalty": 2.0}))).await;
    assert_ne!(completion(&none, 0), completion(&frequency, 0));
    assert_ne!(completion(&none, 0), completion(&presence, 0));
    let again = complete(http, body(json!({"frequency_penalty": 2.0}))).await;
    assert_eq!(completion(&frequency, 0), completion(&again, 0));
    cluster.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_the_prompts_pages_and_best_of_ranks_them() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();
    // Long enough (> 256 + the 48-token window) that a prompt block can be reused.
    let long = PROMPT.repeat(12);
    // Temperature 1.5: at 1.0 the repeated prompt's next words are all but certain, and three
    // seeds draw the same four tokens.
    let body = |n: u32, seed: u64| {
        json!({"prompt": long, "max_tokens": 4, "temperature": 1.5, "seed": seed,
               "ignore_eos": true, "n": n, "logprobs": 0})
    };
    let j = complete(http, body(3, 7)).await;
    let choices = j["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
    }
    let usage = &j["usage"];
    assert_eq!(usage["completion_tokens"], 12, "summed over the choices");
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 320, "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        prompt_tokens + 12,
        "the prompt counted once"
    );
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 256,
        "the later choices reuse the first one's prompt pages: {usage}"
    );
    // Choice i is seeded seed + i (`choices::fan_out`'s test): they differ. (Not compared with
    // single requests of those seeds: decoding beside other sequences sums in another order,
    // and through NVFP4 pages a near tie can tip a draw.)
    let texts: Vec<&str> = (0..3).map(|i| completion(&j, i)).collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    let one = complete(http, body(1, 7)).await;
    assert_eq!(one["choices"].as_array().unwrap().len(), 1);
    assert_eq!(one["usage"]["prompt_tokens"], prompt_tokens);

    // best_of 3, n 2: the two of highest cumulative logprob, most likely first, and every
    // candidate's tokens in the usage. (Which three are drawn can differ from the run above:
    // a batch of another shape sums in another order, and a near tie can tip a draw.)
    let cumulative = |c: &Value| -> f64 {
        let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
        lps.iter().map(|l| l.as_f64().unwrap()).sum()
    };
    let mut best = body(2, 7);
    best["best_of"] = json!(3);
    let b = complete(http, best).await;
    let chosen = b["choices"].as_array().unwrap();
    assert_eq!(chosen.len(), 2);
    assert_eq!(
        (chosen[0]["index"].clone(), chosen[1]["index"].clone()),
        (json!(0), json!(1))
    );
    assert!(cumulative(&chosen[0]) >= cumulative(&chosen[1]));
    assert_eq!(
        b["usage"]["completion_tokens"], 12,
        "every candidate counts"
    );
    cluster.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_max_tokens_0_scores_the_prompt() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();
    let tokenizer = &model().1;
    let greedy = v1::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    };
    // The greedy next token and its logprob, as generated.
    let next = grpc_tokens(&cluster, prompt(), greedy).await[0];
    let generated = complete(
        http,
        json!({"prompt": prompt(), "max_tokens": 1, "temperature": 0, "logprobs": 0}),
    )
    .await;
    let generated_lp = generated["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();

    // Scoring the prompt with that token appended: lm-eval's loglikelihood request.
    let mut ids = prompt();
    ids.push(next);
    let j = complete(
        http,
        json!({"prompt": ids, "max_tokens": 0, "echo": true, "logprobs": 1, "temperature": 0}),
    )
    .await;
    let choice = &j["choices"][0];
    assert_eq!(choice["text"], tokenizer.decode(&ids, true).unwrap());
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(j["usage"]["completion_tokens"], 0);
    assert_eq!(j["usage"]["prompt_tokens"], ids.len());
    let lp = &choice["logprobs"];
    let values = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(values.len(), ids.len());
    assert_eq!(lp["tokens"].as_array().unwrap().len(), ids.len());
    assert!(values[0].is_null(), "nothing comes before the first token");
    assert!(lp["top_logprobs"][0].is_null());
    for (v, top) in values[1..]
        .iter()
        .zip(&lp["top_logprobs"].as_array().unwrap()[1..])
    {
        assert!(v.as_f64().unwrap() <= 0.0);
        let top = top.as_object().unwrap();
        assert!((1..=2).contains(&top.len()), "{top:?}");
    }
    let scored = values.last().unwrap().as_f64().unwrap();
    assert!(
        (scored - generated_lp).abs() < 0.02,
        "scored {scored}, generated {generated_lp}"
    );

    // Streamed alike: the echo leads the first chunk, the entries add up to the same.
    let streamed = json!({"prompt": ids, "max_tokens": 0, "echo": true, "logprobs": 1,
                              "temperature": 0, "stream": true});
    let chunks = sse_chunks(&post_json(http, "/v1/completions", &streamed).await);
    let text: String = (chunks.iter())
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, tokenizer.decode(&ids, true).unwrap());
    let streamed_values: Vec<Value> = (chunks.iter())
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .clone()
        })
        .collect();
    assert_eq!(&streamed_values, values);

    // Echo with tokens to generate: the prompt's text, then the completion's.
    let j = complete(
        http,
        json!({"prompt": PROMPT, "max_tokens": 3, "echo": true, "temperature": 0}),
    )
    .await;
    assert!(completion(&j, 0).starts_with(PROMPT));
    assert!(completion(&j, 0).len() > PROMPT.len());
    cluster.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_prompts_and_continuous_usage_while_streaming() {
    let cluster = Cluster::start(HttpConfig::default()).await;
    let http = cluster.http();
    let prompts = ["The capital of France is", PROMPT];
    let one = |p: &str| json!({"prompt": p, "max_tokens": 3, "temperature": 0});
    let alone = [
        complete(http, one(prompts[0])).await,
        complete(http, one(prompts[1])).await,
    ];
    let j = complete(
        http,
        json!({"prompt": prompts, "max_tokens": 3, "temperature": 0, "n": 2, "echo": true}),
    )
    .await;
    let choices = j["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        // index = prompt * n + choice, as vLLM numbers them; the echo shows which prompt.
        assert_eq!(c["index"], i);
        let text = c["text"].as_str().unwrap();
        assert!(text.starts_with(prompts[i / 2]), "choice {i}: {text:?}");
        assert!(text.len() > prompts[i / 2].len(), "choice {i}: {text:?}");
    }
    let prompt_tokens: u64 = alone
        .iter()
        .map(|a| a["usage"]["prompt_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(j["usage"]["prompt_tokens"], prompt_tokens);

    // Streamed, two choices interleave by index, every chunk carries the usage so far.
    let body = json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "n": 2,
                      "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
    let r = post_json(http, "/v1/completions", &body).await;
    let chunks = sse_chunks(&r);
    let (last, rest) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 8);
    let mut texts = [String::new(), String::new()];
    let mut so_far = 0;
    for chunk in rest {
        let usage = &chunk["usage"];
        let completion_tokens = usage["completion_tokens"].as_u64().unwrap();
        assert!(completion_tokens >= so_far, "{chunk}");
        so_far = completion_tokens;
        assert!(usage["prompt_tokens"].as_u64().unwrap() > 0, "{chunk}");
        let c = &chunk["choices"][0];
        texts[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
    }
    assert_eq!(so_far, 8);
    assert!(!texts[0].is_empty() && !texts[1].is_empty(), "{texts:?}");

    // Chat takes n too; streamed, each choice opens with its own role delta and finishes.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                      "temperature": 0, "n": 2});
    let r = post_json(http, "/v1/chat/completions", &chat).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    let choices = j["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert!(choices.iter().all(|c| c["message"]["role"] == "assistant"));
    assert_eq!(
        (choices[0]["index"].clone(), choices[1]["index"].clone()),
        (json!(0), json!(1))
    );
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let chunks = sse_chunks(&post_json(http, "/v1/chat/completions", &streamed).await);
    for index in 0..2 {
        let mine: Vec<&Value> = (chunks.iter().map(|c| &c["choices"][0]))
            .filter(|c| c["index"] == index)
            .collect();
        assert_eq!(mine[0]["delta"]["role"], "assistant", "choice {index}");
        assert!(
            mine.last().unwrap()["finish_reason"].is_string(),
            "choice {index}"
        );
    }
    cluster.pages_back().await;
}
