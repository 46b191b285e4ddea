//! Checks of OpenAI's log-probability shapes in the HTTP API's JSON (greedy decoding, so the
//! chosen token is always the most likely one).

use serde_json::{json, Value};

/// The completions `logprobs` object of every chunk of a stream, joined into one.
pub fn joined_completion_logprobs(chunks: &[Value]) -> Value {
    let mut joined =
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for chunk in chunks {
        for choice in chunk["choices"].as_array().unwrap() {
            let lp = &choice["logprobs"];
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let more = lp[key].as_array().unwrap().clone();
                joined[key].as_array_mut().unwrap().extend(more);
            }
        }
    }
    joined
}

/// Checks completions' `logprobs` for greedy decoding with `k` alternatives: per token an
/// object of at most k + 1 texts (the k most likely and the chosen one), where the chosen
/// token's value is its `token_logprobs` entry and the largest.
pub fn check_completion_logprobs(lp: &Value, k: usize, completion_tokens: usize) {
    let tokens = lp["tokens"].as_array().unwrap();
    let values = lp["token_logprobs"].as_array().unwrap();
    let top = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(tokens.len(), completion_tokens, "{lp}");
    assert_eq!(values.len(), completion_tokens);
    assert_eq!(top.len(), completion_tokens);
    assert_eq!(
        lp["text_offset"].as_array().unwrap().len(),
        completion_tokens
    );
    for ((token, value), top) in tokens.iter().zip(values).zip(top) {
        let (token, value) = (token.as_str().unwrap(), value.as_f64().unwrap());
        let top = top.as_object().unwrap();
        assert!((k..=k + 1).contains(&top.len()), "{top:?}");
        assert_eq!(top[token].as_f64(), Some(value), "{token:?} in {top:?}");
        for alt in top.values() {
            let alt = alt.as_f64().unwrap();
            assert!(
                alt <= 0.0 && alt <= value,
                "greedy takes the most likely: {top:?}"
            );
        }
    }
}

/// Checks chat's `logprobs.content` for greedy decoding with `k` alternatives per token.
pub fn check_chat_logprobs(content: &[Value], k: usize) {
    assert!(!content.is_empty());
    let bytes = |v: &Value| -> Vec<u8> {
        v["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect()
    };
    for entry in content {
        let token = entry["token"].as_str().unwrap();
        assert_eq!(bytes(entry), token.as_bytes(), "{entry}");
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), k, "{entry}");
        assert_eq!(
            top[0]["token"], entry["token"],
            "greedy takes the most likely: {entry}"
        );
        assert_eq!(top[0]["logprob"], entry["logprob"], "{entry}");
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "sorted: {entry}");
        assert!(values.iter().all(|v| *v <= 0.0), "{entry}");
        for alt in top {
            assert_eq!(
                bytes(alt),
                alt["token"].as_str().unwrap().as_bytes(),
                "{alt}"
            );
        }
    }
}
