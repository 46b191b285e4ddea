//! The end-to-end decode benchmark's code path on the CPU backend with a tiny random model (the
//! CUDA example `e2e_decode` runs the same `DecodeBench::run` with Llama-3-8B's shape): every
//! batch measured with finite positive speed and valid tokens, batches over the budget reported
//! as not fitting, and the tokens the engine decoded over the imported pages equal a greedy
//! decode straight through `Model::forward_batch` over pages holding the same bytes.

use std::sync::Arc;

use nibble_engine::decode_bench::{random_pages, window_page, DecodeBench, Outcome, Run};
use nibble_engine::eval::argmax;
use nibble_engine::synthetic::{random_model, tiny_llama, tokenizer};
use nibble_engine::{Backend, CpuBackend, KvConfig, Logits, Model, PagedBatch, PagedSeq};
use nibble_kvcache::{PagePool, PageTable, PoolPlan};
use nibble_kvfmt::KvDtype;

const CONTEXT: usize = 256;

fn bench() -> DecodeBench {
    DecodeBench {
        batches: vec![4, 1, 2, 64],
        context: CONTEXT,
        warmup: 1,
        steps: 4,
        baseline_context: Some(16),
        distinct_pages: 3,
        seed: 11,
        hadamard: false,
        k_codes: false,
    }
}

fn model(max_context: usize) -> Model<CpuBackend> {
    random_model(
        Arc::new(CpuBackend::new(2).unwrap()),
        tiny_llama(max_context),
        5,
    )
    .unwrap()
}

/// Greedy tokens of sequence 0 decoded without the engine: its pages written with the bytes the
/// bench imports, then one `forward_batch` per token.
fn reference(model: &Model<CpuBackend>, b: &DecodeBench, dtype: KvDtype) -> Vec<u32> {
    let be = model.backend();
    let kv = b.kv_config(model, dtype);
    let layout = kv.layout(model).unwrap();
    let scales = kv.scales_for(layout.layers()).unwrap();
    let sources = random_pages(layout, &scales, b.distinct_pages, b.seed).unwrap();
    let window_pages = kv.window_layout(&layout).unwrap().pages();
    let plan =
        PoolPlan::for_pages(layout, b.max_tokens_held().div_ceil(16) + window_pages).unwrap();
    let mut pool = PagePool::new(plan);
    let mut pages = be
        .new_pages(plan, kv.encoding(layout.layers()).unwrap())
        .unwrap();
    // The recent window (nvfp4's) holds the bench's BF16 page, as its hand-off imports it.
    let window = pool.alloc(window_pages).unwrap();
    for &page in &window {
        be.write_page(&mut pages, &pool, page, &window_page(&layout, b.seed))
            .unwrap();
    }
    let mut table = PageTable::new();
    let (_, first) = b.sequence(model.config().vocab_size, 0, CONTEXT);
    table.append(&mut pool, CONTEXT).unwrap();
    for (j, &page) in table.pages().iter().enumerate() {
        be.write_page(&mut pages, &pool, page, &sources[b.source_page(0, j)])
            .unwrap();
    }
    let (mut ws, mut logits, mut tokens) = (model.workspace(), Vec::new(), vec![first]);
    for _ in 0..b.warmup + b.steps {
        let stored = table.len();
        let slots = table.append(&mut pool, 1).unwrap();
        let mut batch = PagedBatch::<CpuBackend> {
            pages: &mut pages,
            pool: &pool,
            seqs: vec![PagedSeq {
                pages: table.pages(),
                stored,
                slots: &slots,
                window: &window,
            }],
        };
        let last = [*tokens.last().unwrap()];
        model
            .forward_batch(&mut ws, &[&last], &mut batch, Logits::Last, &mut logits)
            .unwrap();
        tokens.push(argmax(&logits));
    }
    tokens
}

#[test]
fn decode_bench_measures_every_batch_that_fits() {
    measures_every_batch_that_fits(&bench(), &KvDtype::ALL);
}

#[test]
fn decode_bench_with_k_codes_decodes_the_tokens_of_its_pages() {
    let b = DecodeBench {
        k_codes: true,
        ..bench()
    };
    let model = model(b.max_tokens_held());
    assert!(b.kv_config(&model, KvDtype::Nvfp4).k_codes.is_some());
    assert!(b.kv_config(&model, KvDtype::Fp8).k_codes.is_none());
    measures_every_batch_that_fits(&b, &[KvDtype::Nvfp4]);
}

fn measures_every_batch_that_fits(b: &DecodeBench, dtypes: &[KvDtype]) {
    let model = model(b.max_tokens_held());
    let tok = Arc::new(tokenizer(model.config().vocab_size).unwrap());
    let vocab = model.config().vocab_size as u32;
    for &dtype in dtypes {
        let layout = KvConfig::new(dtype).layout(&model).unwrap();
        let budget = b.pool_bytes(&layout, 4);
        let mut reported = Vec::new();
        let outcomes = b
            .run(&model, &tok, dtype, budget, &|| {}, &mut |o| {
                reported.push(o.clone())
            })
            .unwrap();
        assert_eq!(outcomes, reported, "{dtype}: every outcome reported");
        let runs: Vec<&Run> = outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Ran(r) => Some(&**r),
                Outcome::DoesNotFit { .. } => None,
            })
            .collect();
        assert_eq!(
            runs.iter().map(|r| r.batch).collect::<Vec<_>>(),
            [1, 2, 4],
            "{dtype}: ascending, every batch within the budget"
        );
        assert!(matches!(
            outcomes.last(),
            Some(Outcome::DoesNotFit { batch: 64, needed_bytes, budget_bytes, .. })
                if needed_bytes > budget_bytes
        ));
        for r in &runs {
            let tps = r.main.tokens_per_s();
            assert!(
                tps.is_finite() && tps > 0.0,
                "{dtype} batch {}: {tps}",
                r.batch
            );
            assert!(r.main.ms_per_step() > 0.0);
            assert_eq!((r.main.context, r.main.steps), (CONTEXT, b.steps));
            let baseline = r.baseline.expect("baseline asked for");
            assert_eq!((baseline.context, baseline.batch), (16, r.batch));
            assert!(r.context_share().unwrap().is_finite());
            assert_eq!(r.tokens.len(), r.batch);
            for t in &r.tokens {
                assert_eq!(t.len(), 1 + b.warmup + b.steps);
                assert!(t.iter().all(|&x| x < vocab), "{t:?}");
            }
            // Sequences of a smaller batch come back from the prefix cache, the rest are
            // imported: 16 pages per 256-token prompt, and every sequence's window pages.
            let window = KvConfig::new(dtype).window_layout(&layout).unwrap().pages();
            assert_eq!(r.fill.pages + r.fill.cached_pages, (16 + window) * r.batch);
            assert_eq!(r.fill.bytes, r.fill.pages * layout.page_bytes());
        }
        assert_eq!(runs[0].fill.cached_pages, 0);
        assert_eq!(runs[1].fill.cached_pages, 16, "sequence 0 reused");
        // The same sequence decodes the same tokens at every batch, and they are the tokens of
        // the model over those pages.
        let expected = reference(&model, b, dtype);
        for r in &runs {
            assert_eq!(r.tokens[0], expected, "{dtype} batch {}", r.batch);
        }
    }
}

#[test]
fn decode_bench_refuses_what_it_cannot_measure() {
    let model = model(64);
    let tok = Arc::new(tokenizer(model.config().vocab_size).unwrap());
    let run = |b: DecodeBench| b.run(&model, &tok, KvDtype::Fp8, 1 << 30, &|| {}, &mut |_| {});
    let b = DecodeBench {
        batches: vec![1],
        context: 60,
        warmup: 1,
        steps: 8,
        baseline_context: None,
        distinct_pages: 1,
        seed: 0,
        hadamard: false,
        k_codes: false,
    };
    let e = run(b.clone()).unwrap_err().to_string();
    assert!(e.contains("context length 64"), "{e}");
    let e = run(DecodeBench {
        baseline_context: Some(32),
        context: 16,
        ..b.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("baseline context 32"), "{e}");
    let e = run(DecodeBench {
        batches: vec![0, 1],
        context: 16,
        ..b
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("batch of 0"), "{e}");
}
