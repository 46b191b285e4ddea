//! Resuming a request on another engine after `k` of its tokens (its decode worker died
//! mid-stream): the prompt is computed again, locally or handed off from a prefill engine, the
//! `k` tokens are replayed through the decode path, and what follows is what an undisturbed run
//! gives: the same tokens (greedy, seeded, constrained), the same text once the two halves are
//! joined, and usage that counts every token once.

mod common;

use std::sync::Arc;

use common::engine;
use nibble_engine::grammar::Constraint;
use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::{FinishReason, SeqId};
use nibble_engine::{CpuBackend, Engine, Event, Model, Tokenizer};
use nibble_kvfmt::KvDtype;

const PROMPT: &str = "Write a short poem about the sea, in four lines.";
const PERSON: &str = r#"{"type": "object", "required": ["name", "city"],
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}}}"#;

/// What a run streamed: its tokens, the text of each token event, the text of its end, why it
/// ended and its completion tokens.
#[derive(Debug, Default, PartialEq)]
struct Run {
    tokens: Vec<u32>,
    texts: Vec<String>,
    tail: String,
    reason: Option<FinishReason>,
    completion_tokens: usize,
}

fn record(run: &mut Run, events: Vec<Event>) {
    for event in events {
        match event {
            Event::Token { token, text, .. } => {
                run.tokens.push(token);
                run.texts.push(text);
            }
            Event::Finished {
                reason,
                text,
                usage,
                error,
                ..
            } => {
                assert_eq!(error, None);
                run.tail = text;
                run.reason = Some(reason);
                run.completion_tokens = usage.completion_tokens;
            }
            _ => {}
        }
    }
}

fn drain(e: &mut Engine<CpuBackend>, mut run: Run) -> Run {
    while e.has_work() {
        let events = e.step();
        record(&mut run, events);
    }
    let s = e.state();
    assert_eq!(s.held(), 0);
    assert_eq!(s.pool.free_pages() + s.cache.len(), s.pool.total_pages());
    run
}

/// The text the client saw: every token's, then the end's.
fn text(runs: &[&Run]) -> String {
    let mut text: String = runs.iter().flat_map(|r| r.texts.iter().cloned()).collect();
    text.push_str(&runs.last().unwrap().tail);
    text
}

#[test]
fn a_resumed_request_continues_with_the_tokens_of_an_undisturbed_run() {
    let file = common::open_model();
    let model = Model::from_gguf(Arc::new(CpuBackend::new(2).unwrap()), &file).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let prompt = tokenizer.encode(PROMPT, false).unwrap();
    let greedy = SamplingParams {
        stop: vec!["\n\n\n".into()],
        ..SamplingParams::greedy(24)
    };
    let seeded = SamplingParams {
        temperature: 0.9,
        seed: Some(5),
        ..SamplingParams::greedy(24)
    };
    let constrained = SamplingParams {
        constraint: Some(Constraint::JsonSchema(PERSON.into())),
        ..SamplingParams::greedy(24)
    };
    for (name, params) in [
        ("greedy", greedy),
        ("seeded", seeded),
        ("constrained", constrained),
    ] {
        let mut reference = engine(&model, &tokenizer, KvDtype::Nvfp4);
        reference
            .submit(SeqId(1), prompt.clone(), params.clone())
            .unwrap();
        let whole = drain(&mut reference, Run::default());
        assert_eq!(whole.completion_tokens, whole.tokens.len(), "{name}");
        let n = whole.tokens.len();
        assert!(n > 8, "{name}: {:?}", text(&[&whole]));
        for k in [1, 7, n - 1, n] {
            let seen = Run {
                tokens: whole.tokens[..k].to_vec(),
                texts: whole.texts[..k].to_vec(),
                ..Run::default()
            };
            // What the resumed engine streams, after the `k` tokens seen, is the rest.
            let check = |rest: Run, how: &str| {
                let joined = [&seen.tokens[..], &rest.tokens].concat();
                assert_eq!(joined, whole.tokens, "{name}, {how}, after {k}");
                assert_eq!(text(&[&seen, &rest]), text(&[&whole]), "{name}, {how}, {k}");
                assert_eq!(
                    (rest.reason, rest.completion_tokens),
                    (whole.reason, whole.completion_tokens),
                    "{name}, {how}, after {k}"
                );
            };
            // On an engine that computes the prompt itself.
            let mut local = engine(&model, &tokenizer, KvDtype::Nvfp4);
            let events = local
                .submit_resumed(SeqId(2), prompt.clone(), &seen.tokens, params.clone())
                .unwrap();
            let mut rest = Run::default();
            record(&mut rest, events);
            check(drain(&mut local, rest), "local");

            // On an engine whose prompt a prefill engine computed.
            let mut prefill = engine(&model, &tokenizer, KvDtype::Nvfp4);
            let mut decode = engine(&model, &tokenizer, KvDtype::Nvfp4);
            prefill
                .submit_prefill(SeqId(3), prompt.clone(), params.clone())
                .unwrap();
            let mut pages = Vec::new();
            while prefill.has_work() {
                for event in prefill.step() {
                    if let Event::Prefilled { pages: p, .. } = event {
                        pages = p;
                    }
                }
            }
            let reservation = decode.reserve(SeqId(3), &prompt).unwrap();
            let mut bytes = Vec::new();
            for (src, dst) in pages.iter().zip(&reservation.pages) {
                prefill.export_page(*src, &mut bytes).unwrap();
                decode.import_page(*dst, &bytes).unwrap();
            }
            assert!(prefill.release(SeqId(3)));
            let events = (decode.resume_decode(SeqId(3), &seen.tokens, params.clone())).unwrap();
            let mut rest = Run::default();
            record(&mut rest, events);
            check(drain(&mut decode, rest), "handed off");
        }
    }
    // More output than max_tokens allows, or none, is refused; nothing is held.
    let mut e = engine(&model, &tokenizer, KvDtype::Nvfp4);
    let params = SamplingParams::greedy(3);
    let refused = e.submit_resumed(SeqId(4), prompt.clone(), &[1, 2, 3, 4], params.clone());
    assert!(refused
        .unwrap_err()
        .to_string()
        .contains("already generated all"));
    assert!(e.submit_resumed(SeqId(5), prompt, &[], params).is_err());
    assert!(!e.has_work());
}
