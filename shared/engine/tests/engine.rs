//! The serving engine on the real model: continuous batching gives each request the tokens it
//! would get alone, the prefix cache is reused, stop conditions end requests, and every page
//! comes back.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use nibble_engine::sampling::{Param, SamplingParams};
use nibble_engine::scheduler::{FinishReason, SchedulerConfig, SeqId};
use nibble_engine::{CpuBackend, Engine, EngineConfig, Event, KvConfig, Model, Tokenizer, Usage};
use nibble_kvfmt::KvDtype;

struct Setup {
    model: Model<CpuBackend>,
    tokenizer: Arc<Tokenizer>,
}

fn setup() -> Setup {
    let file = common::open_model();
    Setup {
        model: Model::from_gguf(Arc::new(CpuBackend::new(2).unwrap()), &file).unwrap(),
        tokenizer: Arc::new(Tokenizer::from_gguf(&file).unwrap()),
    }
}

fn engine(
    s: &Setup,
    dtype: KvDtype,
    budget_pages: usize,
    scheduler: SchedulerConfig,
) -> Engine<CpuBackend> {
    let kv = KvConfig::new(dtype);
    let page_bytes = kv.layout(&s.model).unwrap().page_bytes();
    let config = EngineConfig {
        kv,
        kv_budget_bytes: budget_pages * page_bytes,
        scheduler,
    };
    Engine::new(s.model.clone(), Arc::clone(&s.tokenizer), config).unwrap()
}

#[derive(Debug, Default, Clone)]
struct Output {
    tokens: Vec<u32>,
    text: String,
    reason: Option<FinishReason>,
    usage: Usage,
    /// Scored prompt tokens (token, log-probability, alternatives), and whether each event of
    /// them came before the first token.
    prompt_logprobs: Vec<(u32, f32, usize)>,
    scored_before_tokens: bool,
}

fn run(engine: &mut Engine<CpuBackend>) -> HashMap<SeqId, Output> {
    let mut out: HashMap<SeqId, Output> = HashMap::new();
    let mut steps = 0;
    while engine.has_work() {
        steps += 1;
        assert!(steps < 10_000, "engine does not finish");
        for event in engine.step() {
            match event {
                Event::Token {
                    id, token, text, ..
                } => {
                    let o = out.entry(id).or_default();
                    o.tokens.push(token);
                    o.text.push_str(&text);
                }
                Event::Finished {
                    id,
                    reason,
                    text,
                    usage,
                    error,
                } => {
                    assert!(error.is_none(), "{error:?}");
                    let o = out.entry(id).or_default();
                    o.text.push_str(&text);
                    o.reason = Some(reason);
                    o.usage = usage;
                }
                Event::PromptLogprobs { id, logprobs } => {
                    let o = out.entry(id).or_default();
                    o.scored_before_tokens = o.tokens.is_empty();
                    let entries = logprobs.iter().map(|(t, l)| (*t, l.logprob, l.top.len()));
                    o.prompt_logprobs.extend(entries);
                }
                Event::Prefilled { id, .. } => panic!("{id:?} was not submitted prefill-only"),
            }
        }
    }
    out
}

fn prompt(s: &Setup, text: &str) -> Vec<u32> {
    s.tokenizer.encode(text, false).unwrap()
}

fn all_pages_back(engine: &mut Engine<CpuBackend>) {
    let state = engine.state();
    let cached = state.cache.len();
    assert_eq!(
        state.pool.free_pages() + cached,
        state.pool.total_pages(),
        "every page is free or cached"
    );
}

/// Batching changes only the summation order of the projections (the CPU backend picks GEMM or
/// GEMV kernels by row count). With BF16 K/V that noise stays far below any logit gap; NVFP4's
/// coarse rounding can amplify it into a different token at a near tie, so the exact comparison
/// uses bf16.
#[test]
fn batched_requests_match_requests_run_alone() {
    let s = setup();
    let prompts = PROMPTS;
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut e = engine(&s, KvDtype::Bf16, 64, SchedulerConfig::default());
            e.submit(SeqId(0), prompt(&s, p), SamplingParams::greedy(12))
                .unwrap();
            run(&mut e).remove(&SeqId(0)).unwrap().tokens
        })
        .collect();
    let together = run_together(&s, KvDtype::Bf16, &prompts, 12);
    for (i, (o, tokens)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(&o.tokens, tokens, "request {i}");
        assert_eq!(o.reason, Some(FinishReason::Length));
        assert_eq!(o.usage.completion_tokens, 12);
    }
}

/// Prompts of different lengths, for batches.
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "It is a truth universally acknowledged, that a single man in possession",
];

/// Greedy answers of `n` tokens to every prompt, submitted together to one engine with a
/// `dtype` cache of 64 pages, in the prompts' order; every page comes back.
fn run_together(s: &Setup, dtype: KvDtype, prompts: &[&str], n: u32) -> Vec<Output> {
    let mut e = engine(s, dtype, 64, SchedulerConfig::default());
    for (i, p) in prompts.iter().enumerate() {
        e.submit(SeqId(i as u64), prompt(s, p), SamplingParams::greedy(n))
            .unwrap();
    }
    let mut out = run(&mut e);
    all_pages_back(&mut e);
    (0..prompts.len() as u64)
        .map(|i| out.remove(&SeqId(i)).unwrap())
        .collect()
}

#[test]
fn decode_steps_whose_layers_run_twice_give_the_same_tokens() {
    // A backend that records decode steps as device graphs runs their host side twice (a dry
    // pass, then a capture): the engine must issue the same work both times.
    let s = setup();
    let prompts = PROMPTS;
    for dtype in [KvDtype::Nvfp4, KvDtype::Fp8] {
        let mut tokens = Vec::new();
        for repeat in [false, true] {
            s.model.backend().repeat_decode_layers(repeat);
            let out = run_together(&s, dtype, &prompts, 10);
            tokens.push(out.into_iter().map(|o| o.tokens).collect::<Vec<_>>());
        }
        s.model.backend().repeat_decode_layers(false);
        assert_eq!(tokens[0], tokens[1], "{dtype}");
        assert!(tokens[0].iter().all(|t| t.len() == 10));
    }
}

#[test]
fn prefix_cache_is_reused_and_stop_strings_end_requests() {
    let s = setup();
    let mut e = engine(&s, KvDtype::Nvfp4, 64, SchedulerConfig::default());
    // 400 tokens: a 256-token prompt block is reusable (the rest of the prompt, within a block
    // or the nvfp4 cache's recent window of 48 tokens, is computed again).
    let p = austen(&s, 400);
    e.submit(SeqId(1), p.clone(), SamplingParams::greedy(4))
        .unwrap();
    let first = run(&mut e).remove(&SeqId(1)).unwrap();
    assert_eq!(first.usage.cached_tokens, 0);
    e.submit(SeqId(2), p.clone(), SamplingParams::greedy(4))
        .unwrap();
    let second = run(&mut e).remove(&SeqId(2)).unwrap();
    assert_eq!(second.usage.cached_tokens, 256);
    assert_eq!(second.tokens, first.tokens);
    assert!(second.usage.cached_tokens > 0);
    // A stop string cuts the text before it and ends the request.
    let stop = first.text.chars().skip(2).take(3).collect::<String>();
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..SamplingParams::greedy(4)
    };
    e.submit(SeqId(3), p, params).unwrap();
    let third = run(&mut e).remove(&SeqId(3)).unwrap();
    assert_eq!(third.reason, Some(FinishReason::Stop));
    assert!(
        !third.text.contains(&stop),
        "{:?} contains {stop:?}",
        third.text
    );
    assert!(first.text.starts_with(&third.text));
    all_pages_back(&mut e);
}

#[test]
fn a_small_pool_preempts_and_still_finishes_every_request() {
    let s = setup();
    let config = SchedulerConfig {
        max_batch_tokens: 64,
        ..SchedulerConfig::default()
    };
    let mut e = engine(&s, KvDtype::Fp8, 8, config);
    for i in 0..4u64 {
        let p = prompt(
            &s,
            &format!("Request number {i} asks the model to count: 1, 2, 3,"),
        );
        e.submit(SeqId(i), p, SamplingParams::greedy(24)).unwrap();
    }
    let out = run(&mut e);
    for i in 0..4u64 {
        assert_eq!(out[&SeqId(i)].usage.completion_tokens, 24, "request {i}");
    }
    assert!(
        e.state().preemptions() > 0,
        "the pool is small enough to force preemption"
    );
    all_pages_back(&mut e);
}

#[test]
fn abort_and_bad_requests() {
    let s = setup();
    let mut e = engine(&s, KvDtype::Nvfp4, 64, SchedulerConfig::default());
    e.submit(
        SeqId(1),
        prompt(&s, "Hello there"),
        SamplingParams::greedy(100),
    )
    .unwrap();
    e.step();
    e.step();
    assert!(e.abort(SeqId(1)));
    assert!(!e.has_work());
    all_pages_back(&mut e);
    let bad = SamplingParams {
        top_p: 1.5,
        ..SamplingParams::greedy(4)
    };
    let err = e.submit(SeqId(2), prompt(&s, "x"), bad).unwrap_err();
    assert_eq!(err.to_string(), "top_p must be in (0, 1], got 1.5");
    let err = e
        .submit(SeqId(3), vec![1 << 30], SamplingParams::greedy(4))
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let err = e
        .submit(SeqId(4), vec![], SamplingParams::greedy(4))
        .unwrap_err();
    assert_eq!(err.to_string(), "prompt is empty");
}

/// Greedy with `top_logprobs`: every token event (and a prefill-only request's first token)
/// carries that many alternatives of the model's distribution, the chosen token first.
#[test]
fn token_events_carry_the_top_alternatives() {
    let s = setup();
    let params = SamplingParams {
        logprobs: true,
        top_logprobs: 5,
        ..SamplingParams::greedy(6)
    };
    let check = |token: u32, lp: &nibble_engine::sampling::TokenLogprobs| {
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0].token, token, "greedy picks the most likely token");
        assert_eq!(lp.top[0].logprob, lp.logprob);
        assert!(lp.logprob <= 0.0);
        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        let total: f32 = lp.top.iter().map(|t| t.logprob.exp()).sum();
        assert!(total <= 1.0 + 1e-4, "{total}");
    };
    let mut e = engine(&s, KvDtype::Nvfp4, 64, SchedulerConfig::default());
    let p = prompt(&s, "The capital of France is");
    e.submit(SeqId(1), p.clone(), params.clone()).unwrap();
    let mut tokens = Vec::new();
    while e.has_work() {
        for event in e.step() {
            if let Event::Token {
                token, logprobs, ..
            } = event
            {
                check(token, logprobs.as_ref().expect("asked for"));
                tokens.push(token);
            }
        }
    }
    assert_eq!(tokens.len(), 6);

    e.submit_prefill(SeqId(2), p, params).unwrap();
    let mut prefilled = None;
    while e.has_work() {
        for event in e.step() {
            if let Event::Prefilled {
                token, logprobs, ..
            } = event
            {
                prefilled = Some((token, logprobs.expect("asked for")));
            }
        }
    }
    let (token, lp) = prefilled.expect("prefilled");
    check(token, &lp);
    assert!(e.release(SeqId(2)));
    all_pages_back(&mut e);
}

/// A batch of greedy requests takes each token from `Backend::argmax_rows`, without the logits;
/// the same requests asking for log-probabilities go through the logits and the sampler. Both
/// give the same tokens, and a batch mixing the two kinds samples every row from logits.
#[test]
fn greedy_tokens_from_the_backend_match_the_sampler() {
    let s = setup();
    let texts = [
        "The capital of France is",
        "1, 2, 3, 4,",
        "Once upon a time",
    ];
    let with_logprobs = SamplingParams {
        logprobs: true,
        ..SamplingParams::greedy(10)
    };
    let run_all = |params: &[SamplingParams]| {
        let mut e = engine(&s, KvDtype::Bf16, 64, SchedulerConfig::default());
        for (i, (t, p)) in texts.iter().zip(params).enumerate() {
            e.submit(SeqId(i as u64), prompt(&s, t), p.clone()).unwrap();
        }
        let out = run(&mut e);
        all_pages_back(&mut e);
        (0..texts.len())
            .map(|i| out[&SeqId(i as u64)].tokens.clone())
            .collect::<Vec<_>>()
    };
    let greedy = run_all(&vec![SamplingParams::greedy(10); 3]);
    let sampled = run_all(&vec![with_logprobs.clone(); 3]);
    let mixed = run_all(&[
        SamplingParams::greedy(10),
        with_logprobs,
        SamplingParams::greedy(10),
    ]);
    assert!(greedy.iter().all(|t| t.len() == 10));
    assert_eq!(greedy, sampled);
    assert_eq!(greedy, mixed);
}

/// The Austen fixture's first `n` tokens.
fn austen(s: &Setup, n: usize) -> Vec<u32> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt"
    );
    let tokens = prompt(s, &std::fs::read_to_string(path).unwrap());
    tokens[..n].to_vec()
}

/// A request's greedy tokens do not depend on what the cache held or how its prompt was split
/// into steps: prompts run in whole blocks (256 tokens) and a cached prefix is reused only up to
/// a block boundary, so every attention path sees each key the same way.
#[test]
fn greedy_tokens_do_not_depend_on_the_cache_or_the_chunking() {
    let s = setup();
    let long = austen(&s, 700);
    let greedy = || SamplingParams::greedy(8);
    for dtype in [KvDtype::Nvfp4, KvDtype::Fp8] {
        // Cold, in an engine of its own.
        let mut e = engine(&s, dtype, 256, SchedulerConfig::default());
        e.submit(SeqId(1), long.clone(), greedy()).unwrap();
        let cold = run(&mut e).remove(&SeqId(1)).unwrap();
        assert_eq!(cold.usage.cached_tokens, 0);
        // The same engine again: its cache holds the whole prompt; 512 tokens (two blocks; the
        // last 64 are left for the recent window) are reused.
        e.submit(SeqId(2), long.clone(), greedy()).unwrap();
        let warm = run(&mut e).remove(&SeqId(2)).unwrap();
        assert_eq!(warm.usage.cached_tokens, 512, "{dtype}");
        assert_eq!(warm.tokens, cold.tokens, "{dtype}: warm against cold");
        // A fresh engine that first ran a 400-token prefix of it (one block is reusable), with
        // a smaller step budget, and the prompt in a batch with another request.
        let small = SchedulerConfig {
            max_batch_tokens: 320,
            ..SchedulerConfig::default()
        };
        let mut e = engine(&s, dtype, 256, small);
        e.submit(SeqId(3), long[..400].to_vec(), greedy()).unwrap();
        run(&mut e);
        e.submit(SeqId(4), long.clone(), greedy()).unwrap();
        e.submit(SeqId(5), austen(&s, 300), greedy()).unwrap();
        let mut both = run(&mut e);
        let partly = both.remove(&SeqId(4)).unwrap();
        assert_eq!(partly.usage.cached_tokens, 256, "{dtype}");
        assert_eq!(
            partly.tokens, cold.tokens,
            "{dtype}: partly cached against cold"
        );
        all_pages_back(&mut e);
    }
}

/// A window the context or the pool cannot hold is refused when the engine starts.
#[test]
fn a_window_that_does_not_fit_is_refused() {
    let s = setup();
    let kv = KvConfig::new(KvDtype::Nvfp4).with_window(Some(16384));
    let page_bytes = kv.layout(&s.model).unwrap().page_bytes();
    let config = |kv: KvConfig, pages: usize| EngineConfig {
        kv,
        kv_budget_bytes: pages * page_bytes,
        scheduler: SchedulerConfig::default(),
    };
    let err = Engine::new(s.model.clone(), Arc::clone(&s.tokenizer), config(kv, 2048))
        .err()
        .expect("too large a window");
    assert!(
        err.to_string()
            .contains("a KV window of 16384 tokens is larger than the context of 8192 tokens"),
        "{err}"
    );
    let kv = KvConfig::new(KvDtype::Nvfp4);
    let err = Engine::new(s.model.clone(), Arc::clone(&s.tokenizer), config(kv, 11))
        .err()
        .expect("no room beside the window");
    assert!(err.to_string().contains("window (11 pages)"), "{err}");
    let kv = KvConfig::new(KvDtype::Nvfp4).with_window(Some(24));
    let err = Engine::new(s.model.clone(), Arc::clone(&s.tokenizer), config(kv, 64))
        .err()
        .expect("not whole pages");
    assert!(
        err.to_string()
            .contains("not a multiple of the page size (16)"),
        "{err}"
    );
}

/// A scoring request (prompt log-probabilities, `max_tokens` 0: what lm-eval's loglikelihood
/// sends) gets every prompt token after the first scored, over two prompt blocks, close to the
/// f32 reference `eval ppl` uses, even with its prompt cached (it computes it whole), and
/// generates nothing.
#[test]
fn a_scoring_request_gets_every_prompt_tokens_logprob() {
    let s = setup();
    let mut e = engine(&s, KvDtype::Bf16, 256, SchedulerConfig::default());
    let tokens = austen(&s, 300);
    // Cache the prompt first: the scoring request must not reuse it.
    e.submit(SeqId(1), tokens.clone(), SamplingParams::greedy(1))
        .unwrap();
    run(&mut e);
    let scoring = SamplingParams {
        max_tokens: 0,
        prompt_logprobs: Some(2),
        ..SamplingParams::greedy(1)
    };
    e.submit(SeqId(2), tokens.clone(), scoring.clone()).unwrap();
    let out = run(&mut e).remove(&SeqId(2)).unwrap();
    assert!(out.tokens.is_empty(), "max_tokens 0 generates nothing");
    assert_eq!(out.reason, Some(FinishReason::Length));
    assert_eq!(out.usage.completion_tokens, 0);
    assert_eq!(
        out.usage.cached_tokens, 0,
        "a scoring request reuses nothing"
    );
    let scored: Vec<u32> = out.prompt_logprobs.iter().map(|e| e.0).collect();
    assert_eq!(scored, tokens[1..]);
    assert!(out.prompt_logprobs.iter().all(|e| e.2 == 2 && e.1 <= 0.0));
    let reference = nibble_engine::eval::score_window(&s.model, &tokens).unwrap();
    let diffs: Vec<f64> = (out.prompt_logprobs.iter().zip(&reference.nll))
        .map(|(e, nll)| (e.1 as f64 + nll).abs())
        .collect();
    let mean = diffs.iter().sum::<f64>() / diffs.len() as f64;
    let worst = diffs.iter().fold(0.0f64, |m, d| m.max(*d));
    assert!(mean < 0.02 && worst < 0.25, "mean {mean}, worst {worst}");
    all_pages_back(&mut e);

    // With tokens to generate, the prompt's entries come first; they are those of max_tokens 0.
    let more = with_tokens_params();
    e.submit(SeqId(3), tokens.clone(), more).unwrap();
    let with_tokens = run(&mut e).remove(&SeqId(3)).unwrap();
    assert_eq!(with_tokens.tokens.len(), 2);
    assert!(with_tokens.scored_before_tokens);
    assert_eq!(with_tokens.prompt_logprobs, out.prompt_logprobs);
    // Beside a request that generates, in the same steps: each gets what it gets alone.
    let other = prompt(&s, "The capital of France is");
    e.submit(SeqId(6), other.clone(), SamplingParams::greedy(4))
        .unwrap();
    let alone = run(&mut e).remove(&SeqId(6)).unwrap().tokens;
    e.submit(SeqId(7), other, SamplingParams::greedy(4))
        .unwrap();
    e.submit(SeqId(8), tokens.clone(), with_tokens_params())
        .unwrap();
    let mut both = run(&mut e);
    assert_eq!(both.remove(&SeqId(7)).unwrap().tokens, alone);
    let batched = both.remove(&SeqId(8)).unwrap().prompt_logprobs;
    assert_eq!(batched.len(), out.prompt_logprobs.len());
    for (b, a) in batched.iter().zip(&out.prompt_logprobs) {
        assert_eq!(b.0, a.0);
        assert!((b.1 - a.1).abs() < 1e-3, "{b:?} vs {a:?}");
    }

    // max_tokens 0 is only for scoring, and scoring is not for a prefill worker.
    assert!(e
        .submit(SeqId(4), tokens.clone(), SamplingParams::greedy(0))
        .is_err());
    let prefill_only = e.submit_prefill(SeqId(5), tokens, with_tokens_params());
    assert!(matches!(
        prefill_only,
        Err(nibble_engine::RequestError::Param(p)) if p.field == Param::PromptLogprobs
    ));
    all_pages_back(&mut e);
}

fn with_tokens_params() -> SamplingParams {
    SamplingParams {
        max_tokens: 2,
        prompt_logprobs: Some(2),
        ..SamplingParams::greedy(1)
    }
}

/// The default scheduler serves the model's whole context (what the router checks and reports
/// as `max_model_len`), not a limit of its own: a model of 20,000 tokens takes a 9,000-token
/// prompt and refuses one that does not fit its context.
#[test]
fn the_default_context_is_the_models() {
    use nibble_engine::synthetic::{random_model, tiny_llama, tokenizer};
    let config = tiny_llama(20_000);
    let vocab = config.vocab_size;
    let model = random_model(Arc::new(CpuBackend::new(1).unwrap()), config, 0).unwrap();
    let kv = KvConfig::new(KvDtype::Nvfp4);
    let page_bytes = kv.layout(&model).unwrap().page_bytes();
    let config = EngineConfig {
        kv,
        kv_budget_bytes: 2_000 * page_bytes,
        scheduler: SchedulerConfig::default(),
    };
    let tokenizer = Arc::new(tokenizer(vocab).unwrap());
    let mut e = Engine::new(model, tokenizer, config).unwrap();
    let long: Vec<u32> = (0..9_000).map(|i| (i % 500) as u32 + 1).collect();
    e.submit(SeqId(1), long, SamplingParams::greedy(1)).unwrap();
    let too_long: Vec<u32> = (0..20_000).map(|i| (i % 500) as u32 + 1).collect();
    let err = e
        .submit(SeqId(2), too_long, SamplingParams::greedy(1))
        .unwrap_err();
    assert!(err.to_string().contains("at most 20000 tokens"), "{err}");
}
