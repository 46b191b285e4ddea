use std::sync::{Arc, OnceLock};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::sampling::{Sampler, SamplingParams};

/// The test model's tokenizer (SmolLM2's byte-level BPE), loaded once.
fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::load(nibble_testkit::model_path()).unwrap())
}

fn compiler() -> &'static Arc<GrammarCompiler> {
    tokenizer().grammars().unwrap()
}

/// Generates under `constraint` from random logits (a model that would write anything): greedy
/// over noise, so every token comes from the mask. Returns the text and whether it ended with
/// end-of-sequence within `max` tokens.
fn generate(constraint: Constraint, seed: u64, prefix: &[u32], max: usize) -> (Vec<u32>, bool) {
    let grammar = Grammar::start(Arc::clone(compiler()), constraint, prefix);
    let mut sampler = Sampler::new(SamplingParams::greedy(max as u32)).with_grammar(grammar);
    assert!(
        !sampler.is_greedy(),
        "a constrained sampler needs the logits"
    );
    let vocab = tokenizer().vocab_size();
    let eos = tokenizer().eos_token_ids();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = prefix.to_vec();
    for _ in 0..max {
        let mut logits: Vec<f32> = (0..vocab).map(|_| rng.gen_range(-4.0..4.0)).collect();
        let token = sampler.sample(&mut logits, &out).token;
        assert!(
            sampler.grammar_error().is_none(),
            "{:?}",
            sampler.grammar_error()
        );
        if eos.contains(&token) {
            return (out, true);
        }
        out.push(token);
    }
    (out, false)
}

fn text(tokens: &[u32]) -> String {
    tokenizer().decode(tokens, false).unwrap()
}

const PERSON: &str = r#"{
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": false
}"#;

#[test]
fn noise_under_a_json_schema_is_a_valid_instance() {
    for seed in 0..4 {
        let (tokens, ended) = generate(Constraint::JsonSchema(PERSON.into()), seed, &[], 200);
        assert!(
            ended,
            "seed {seed}: no end within 200 tokens: {:?}",
            text(&tokens)
        );
        let value: serde_json::Value = serde_json::from_str(&text(&tokens))
            .unwrap_or_else(|e| panic!("seed {seed}: {e}: {:?}", text(&tokens)));
        let object = value.as_object().unwrap();
        let keys: Vec<&str> = object.keys().map(String::as_str).collect();
        assert_eq!(keys, ["name", "age", "tags"], "{value}");
        assert!(object["name"].as_str().unwrap().chars().count() <= 12);
        assert!((0..=150).contains(&object["age"].as_i64().unwrap()));
        let tags = object["tags"].as_array().unwrap();
        assert!(tags.len() <= 3 && tags.iter().all(|t| t == "a" || t == "b"));
        // Compact separators: no free whitespace.
        assert!(!text(&tokens).contains('\n'));
    }
}

#[test]
fn noise_under_json_object_is_an_object() {
    let (tokens, ended) = generate(Constraint::JsonObject, 1, &[], 400);
    if ended {
        let value: serde_json::Value = serde_json::from_str(&text(&tokens)).unwrap();
        assert!(value.is_object(), "{value}");
    } else {
        // Noise may nest without end; what is there is still the start of an object.
        assert!(text(&tokens).starts_with('{'), "{:?}", text(&tokens));
    }
}

#[test]
fn noise_under_a_regex_and_a_lark_grammar_matches_them() {
    let (tokens, ended) = generate(Constraint::Regex(r"[0-9]{3}-[0-9]{4}".into()), 2, &[], 50);
    assert!(ended);
    let phone = text(&tokens);
    assert_eq!(phone.len(), 8, "{phone:?}");
    assert!(phone.bytes().enumerate().all(|(i, b)| if i == 3 {
        b == b'-'
    } else {
        b.is_ascii_digit()
    }));

    let lark = r#"start: "yes" | "no" | "maybe""#;
    let (tokens, ended) = generate(Constraint::Lark(lark.into()), 3, &[], 20);
    assert!(ended);
    assert!(["yes", "no", "maybe"].contains(&text(&tokens).as_str()));
}

#[test]
fn a_grammar_resumes_after_the_tokens_another_worker_generated() {
    // What a decode worker does: start after the prefill worker's first token.
    let first = tokenizer().encode("{", false).unwrap();
    let (tokens, ended) = generate(Constraint::JsonSchema(PERSON.into()), 5, &first, 200);
    assert!(ended);
    let value: serde_json::Value = serde_json::from_str(&text(&tokens)).unwrap();
    assert!(value["name"].is_string(), "{value}");
}

#[test]
fn a_resumed_grammar_that_cannot_take_the_prefix_fails_by_name() {
    let prefix = tokenizer().encode("hello", false).unwrap();
    let grammar = Grammar::start(Arc::clone(compiler()), Constraint::JsonObject, &prefix);
    let mut sampler = Sampler::new(SamplingParams::greedy(4)).with_grammar(grammar);
    let mut logits = vec![0.0; tokenizer().vocab_size()];
    let token = sampler.sample(&mut logits, &prefix).token;
    assert!(sampler.grammar_error().is_some());
    // Only end-of-sequence is left: the output ends where it failed.
    assert!(tokenizer().eos_token_ids().contains(&token));
}

#[test]
fn bad_constraints_are_refused_with_what_is_wrong() {
    let c = compiler();
    let refused = |constraint: Constraint| match c.compile(&constraint) {
        Ok(_) => panic!("{constraint:?} compiled"),
        Err(e) => e.0,
    };
    assert!(refused(Constraint::JsonSchema("{".into())).contains("not valid JSON"));
    assert!(refused(Constraint::JsonSchema("[1]".into())).contains("JSON object"));
    let unknown_type = refused(Constraint::JsonSchema(r#"{"type": "strung"}"#.into()));
    assert!(unknown_type.contains("strung"), "{unknown_type}");
    let unsatisfiable = refused(Constraint::JsonSchema(
        r#"{"type": "integer", "minimum": 5, "maximum": 1}"#.into(),
    ));
    assert!(!unsatisfiable.is_empty());
    // A keyword llguidance does not implement is refused, not ignored.
    let unsupported = refused(Constraint::JsonSchema(
        r#"{"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}"#.into(),
    ));
    assert!(unsupported.contains("if"), "{unsupported}");
    let empty = refused(Constraint::Regex(r"[^\s\S]".into()));
    assert!(!empty.is_empty(), "a regex that matches nothing");
    assert!(!refused(Constraint::Regex("(".into())).is_empty());
    assert!(!refused(Constraint::Lark("start: (".into())).is_empty());
    let large = Constraint::Regex("a".repeat(MAX_CONSTRAINT_BYTES + 1));
    assert!(refused(large).contains("more than"));
}

#[test]
fn checking_reports_the_compile_time() {
    let took = compiler()
        .check(&Constraint::JsonSchema(PERSON.into()))
        .unwrap();
    assert!(took > Duration::ZERO);
}
