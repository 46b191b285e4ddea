use std::sync::{Arc, OnceLock};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::grammar::Grammar;
use crate::sampling::{Sampler, SamplingParams};

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::load(nibble_testkit::model_path()).unwrap())
}

fn weather() -> Tool {
    Tool {
        name: "get_weather".into(),
        description: Some("The weather in a city".into()),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        }),
    }
}

fn time() -> Tool {
    Tool {
        name: "get_time".into(),
        description: None,
        parameters: json!({"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"], "additionalProperties": false}),
    }
}

#[test]
fn each_format_is_found_by_its_template() {
    assert_eq!(ToolFormat::of_template(None), ToolFormat::Hermes);
    assert_eq!(
        ToolFormat::of_template(Some("{{ '[TOOL_CALLS]' }}")),
        ToolFormat::Mistral
    );
    assert_eq!(
        ToolFormat::of_template(Some("{{ '<|python_tag|>' }}")),
        ToolFormat::Llama3
    );
    assert!(ToolFormat::template_shows_tools(Some(
        "{% for t in tools %}"
    )));
    assert!(!ToolFormat::template_shows_tools(Some("{{ messages }}")));
}

#[test]
fn calls_are_read_out_of_each_format() {
    let hermes = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"zone\\\": \\\"CET\\\"}\"}\n</tool_call>";
    let out = ToolFormat::Hermes.parse(hermes);
    assert_eq!(out.content, "Let me check.");
    assert_eq!(
        out.calls,
        [
            ParsedCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            },
            ParsedCall {
                name: "get_time".into(),
                arguments: r#"{"zone": "CET"}"#.into()
            }
        ]
    );
    // An unclosed last block (the output ended at its end) still counts.
    let open = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}";
    assert_eq!(ToolFormat::Hermes.parse(open).calls.len(), 1);
    // Text without a well-formed call is content.
    let cut = format!("{open}\n<tool_call>\n{{\"name\": ");
    assert_eq!(
        ToolFormat::Hermes.parse(&cut).calls.len(),
        1,
        "a cut-off last call is dropped"
    );
    let broken = "<tool_call>\n{\"name\": ";
    let out = ToolFormat::Hermes.parse(broken);
    assert_eq!((out.content.as_str(), out.calls.len()), (broken, 0));
    assert!(ToolFormat::Hermes.parse("Just text.").calls.is_empty());

    let llama = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}; {\"name\": \"get_time\", \"parameters\": {}}";
    let out = ToolFormat::Llama3.parse(llama);
    assert_eq!(out.calls.len(), 2);
    assert_eq!(out.calls[0].arguments, r#"{"city":"Rome"}"#);
    assert!(ToolFormat::Llama3
        .parse("The weather is fine.")
        .calls
        .is_empty());

    let mistral = "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}]";
    let out = ToolFormat::Mistral.parse(mistral);
    assert_eq!(out.calls[0].name, "get_time");
    assert_eq!(out.content, "");
}

/// Greedy over noise under `constraint`: every token comes from the mask.
fn noise(constraint: Constraint, seed: u64) -> String {
    let compiler = Arc::clone(tokenizer().grammars().unwrap());
    let grammar = Grammar::start(compiler, constraint, &[]);
    let mut sampler = Sampler::new(SamplingParams::greedy(300)).with_grammar(grammar);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for _ in 0..300 {
        let mut logits: Vec<f32> = (0..tokenizer().vocab_size())
            .map(|_| rng.gen_range(-4.0..4.0))
            .collect();
        let token = sampler.sample(&mut logits, &out).token;
        assert!(
            sampler.grammar_error().is_none(),
            "{:?}",
            sampler.grammar_error()
        );
        if tokenizer().eos_token_ids().contains(&token) {
            return tokenizer().decode(&out, false).unwrap();
        }
        out.push(token);
    }
    panic!("no end: {:?}", tokenizer().decode(&out, false));
}

#[test]
fn the_required_grammar_of_each_format_gives_calls_that_parse() {
    let tools = [weather(), time()];
    for format in [ToolFormat::Hermes, ToolFormat::Llama3, ToolFormat::Mistral] {
        for (seed, parallel) in [(1, false), (2, true)] {
            let text = noise(format.grammar(&tools, parallel, tokenizer()), seed);
            let out = format.parse(&text);
            assert!(!out.calls.is_empty(), "{format:?}: {text:?}");
            if !parallel {
                assert_eq!(out.calls.len(), 1, "{text:?}");
            }
            for call in &out.calls {
                let args: Value = serde_json::from_str(&call.arguments).unwrap();
                match call.name.as_str() {
                    "get_weather" => {
                        assert!(args["city"].is_string(), "{args}");
                        assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()));
                    }
                    "get_time" => assert!(args["zone"].is_string(), "{args}"),
                    other => panic!("{other}"),
                }
            }
        }
    }
}

#[test]
fn the_preamble_lists_every_tool() {
    let text = ToolFormat::preamble(&[weather(), time()]);
    assert!(text.contains(r#""name":"get_weather""#), "{text}");
    assert!(text.contains("get_time") && text.contains("<tool_call>"));
}
