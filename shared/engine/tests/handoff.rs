//! Prefill/decode hand-off between two engines in one process: a prefill engine computes the
//! prompt, its pages' bytes move to a decode engine, and the decode engine continues. Greedy
//! tokens must equal those of one engine doing both, for every KV dtype, with and without a
//! cached prefix.

mod common;

use std::sync::Arc;

use common::engine;
use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::SeqId;
use nibble_engine::{CpuBackend, Engine, Event, Model, Tokenizer};
use nibble_kvfmt::KvDtype;

const WARMUP: &str =
    "It is a truth universally acknowledged, that a single man in possession of a \
                      good fortune, must be in want of a wife.";
const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a \
                      good fortune, must be in want of a wife. However little known the feelings";

/// Runs to completion, returning the tokens of `id`.
fn drain(e: &mut Engine<CpuBackend>, id: SeqId, mut tokens: Vec<u32>) -> Vec<u32> {
    while e.has_work() {
        for event in e.step() {
            if let Event::Token { id: i, token, .. } = event {
                if i == id {
                    tokens.push(token);
                }
            }
        }
    }
    tokens
}

fn generate(e: &mut Engine<CpuBackend>, id: u64, prompt: &[u32], n: u32) -> Vec<u32> {
    e.submit(SeqId(id), prompt.to_vec(), SamplingParams::greedy(n))
        .unwrap();
    drain(e, SeqId(id), Vec::new())
}

fn pages_back(e: &Engine<CpuBackend>) {
    let s = e.state();
    assert_eq!(s.held(), 0);
    assert_eq!(s.pool.free_pages() + s.cache.len(), s.pool.total_pages());
}

#[test]
fn handed_off_requests_decode_the_same_tokens() {
    let file = common::open_model();
    let model = Model::from_gguf(Arc::new(CpuBackend::new(2).unwrap()), &file).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let prompt = tokenizer.encode(PROMPT, false).unwrap();
    let warmup = tokenizer.encode(WARMUP, false).unwrap();
    for dtype in KvDtype::ALL {
        for warm in [false, true] {
            let mut reference = engine(&model, &tokenizer, dtype);
            let mut prefill = engine(&model, &tokenizer, dtype);
            let mut decode = engine(&model, &tokenizer, dtype);
            if warm {
                // The same history everywhere: each cache holds the warm-up prompt's pages.
                for e in [&mut reference, &mut prefill, &mut decode] {
                    generate(e, 100, &warmup, 2);
                }
            }
            let expected = generate(&mut reference, 1, &prompt, 10);

            let id = SeqId(1);
            prefill
                .submit_prefill(id, prompt.clone(), SamplingParams::greedy(10))
                .unwrap();
            let mut handoff = None;
            while prefill.has_work() {
                for event in prefill.step() {
                    if let Event::Prefilled {
                        token,
                        pages,
                        usage,
                        ..
                    } = event
                    {
                        handoff = Some((token, pages, usage));
                    }
                }
            }
            let (first, p_pages, usage) = handoff.expect("prefill reports its pages");
            assert_eq!(usage.prompt_tokens, prompt.len());
            let reservation = decode.reserve(id, &prompt).unwrap();
            assert_eq!(reservation.pages.len(), p_pages.len());
            let page_size = 16;
            let skip = reservation.cached_tokens / page_size;
            assert_eq!(
                skip > 0,
                warm,
                "{dtype}: the decode worker reuses its cached prefix"
            );
            let mut bytes = Vec::new();
            let mut moved = 0;
            for (src, dst) in p_pages.iter().zip(&reservation.pages).skip(skip) {
                prefill.export_page(*src, &mut bytes).unwrap();
                decode.import_page(*dst, &bytes).unwrap();
                moved += bytes.len();
            }
            assert!(prefill.release(id));
            let events = decode
                .start_decode(id, first, SamplingParams::greedy(10))
                .unwrap();
            assert!(matches!(events[0], Event::Token { token, .. } if token == first));
            let got = drain(&mut decode, id, vec![first]);
            assert_eq!(
                got, expected,
                "{dtype}, warm cache {warm}: moved {moved} bytes"
            );
            pages_back(&prefill);
            pages_back(&decode);
        }
    }
}

#[test]
fn reservations_are_released_and_unknown_requests_refused() {
    let file = common::open_model();
    let model = Model::from_gguf(Arc::new(CpuBackend::new(2).unwrap()), &file).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let mut d = engine(&model, &tokenizer, KvDtype::Nvfp4);
    let prompt = tokenizer.encode(PROMPT, false).unwrap();
    d.reserve(SeqId(7), &prompt).unwrap();
    assert!(d.reserve(SeqId(7), &prompt).is_err(), "duplicate");
    assert!(d.abort(SeqId(7)), "a reservation can be aborted");
    pages_back(&d);
    let err = d
        .start_decode(SeqId(8), 1, SamplingParams::greedy(4))
        .unwrap_err();
    assert!(err.to_string().contains("not held"), "{err}");
    let err = d
        .import_page(nibble_kvcache::PageId(0), &[0u8; 3])
        .unwrap_err();
    assert!(
        err.to_string().contains("not allocated") || err.to_string().contains("bytes"),
        "{err}"
    );
}
