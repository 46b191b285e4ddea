//! Hugging Face model directories: tiny random Llama, Mistral, Qwen2 and Qwen3 checkpoints
//! (tests/fixtures/hf/, made by tests/fixtures/make_hf_fixtures.py) against an independent
//! float64 numpy forward pass with `transformers` semantics, and the loader's errors.
//!
//! Tolerance: |Δ| ≤ 1e-3 on every logit of every position (logits span about ±20; the engine
//! computes in f32 from the same stored BF16/F16/F32 values and the measured worst difference
//! is printed), and the reference's top-1 token must be the engine's at every position where
//! the reference's top-1 margin exceeds 2e-3. The token ids of each prompt must equal those of
//! the PyPI `tokenizers` package with `add_special_tokens=True`.

use nibble_engine::safetensors::SafetensorsFile;
use nibble_engine::{
    eval, Architecture, ChatMessage, CpuBackend, Error, Logits, Model, ModelSource, SeqInput,
    Tokenizer,
};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const TOLERANCE: f64 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new(2).unwrap())
}

struct Reference {
    prompt: String,
    tokens: Vec<u32>,
    top1: Vec<u32>,
    margins: Vec<f64>,
    logits: Vec<Vec<f64>>,
}

fn reference(name: &str) -> Reference {
    let path = fixture(&format!("reference_{name}.json"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let list = |key: &str| v[key].as_array().unwrap().clone();
    Reference {
        prompt: v["prompt"].as_str().unwrap().to_string(),
        tokens: list("tokens")
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect(),
        top1: list("top1")
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect(),
        margins: list("top1_margin")
            .iter()
            .map(|m| m.as_f64().unwrap())
            .collect(),
        logits: list("logits")
            .iter()
            .map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            })
            .collect(),
    }
}

/// Runs `chunks` of the reference tokens through one sequence, returning the logits of every
/// position (`Logits::All` for each chunk).
fn run_chunks(model: &Model<CpuBackend>, tokens: &[u32], chunks: &[usize]) -> Vec<f32> {
    let mut kv = model.new_kv(4);
    let mut ws = model.workspace();
    let (mut out, mut step) = (Vec::new(), Vec::new());
    let mut start = 0;
    for &n in chunks {
        let chunk = &tokens[start..(start + n).min(tokens.len())];
        start += chunk.len();
        model
            .forward(
                &mut ws,
                &mut [SeqInput {
                    tokens: chunk,
                    kv: &mut kv,
                }],
                Logits::All,
                &mut step,
            )
            .unwrap();
        out.extend_from_slice(&step);
    }
    assert_eq!(start, tokens.len());
    out
}

/// Compares every position's logits with the reference; returns the worst difference.
fn compare(name: &str, what: &str, got: &[f32], want: &Reference, vocab: usize) -> f64 {
    assert_eq!(got.len(), want.tokens.len() * vocab, "{name} {what}");
    let mut worst = 0f64;
    for (pos, (row, reference)) in got.chunks_exact(vocab).zip(&want.logits).enumerate() {
        for (id, (&g, &r)) in row.iter().zip(reference).enumerate() {
            let d = (g as f64 - r).abs();
            worst = worst.max(d);
            assert!(
                d <= TOLERANCE,
                "{name} {what}: position {pos} token {id}: engine {g}, reference {r}"
            );
        }
        if want.margins[pos] > 2.0 * TOLERANCE {
            assert_eq!(
                eval::argmax(row),
                want.top1[pos],
                "{name} {what}: top-1 at position {pos}"
            );
        }
    }
    worst
}

fn check_model(name: &str, arch: Architecture) {
    let dir = fixture(name);
    let want = reference(name);
    let source = ModelSource::open(&dir).unwrap();
    assert!(matches!(source, ModelSource::HuggingFace(_)));
    let config = source.config().unwrap();
    assert_eq!(config.architecture, arch);

    let tokenizer = source.load_tokenizer().unwrap();
    assert_eq!(
        tokenizer.encode(&want.prompt, true).unwrap(),
        want.tokens,
        "{name}: token ids differ from the `tokenizers` package's"
    );
    assert_eq!(
        tokenizer.decode(&want.tokens, false).unwrap(),
        if tokenizer.adds_bos() {
            format!("<s>{}", want.prompt)
        } else {
            want.prompt.clone()
        }
    );

    let model = source.load_model(backend()).unwrap();
    let vocab = config.vocab_size;
    let n = want.tokens.len();
    let whole = run_chunks(&model, &want.tokens, &[n]);
    let worst = compare(name, "prefill", &whole, &want, vocab);
    // The same positions through the cache: a prompt chunk, then one token at a time.
    let mut chunks = vec![n / 2];
    chunks.extend(std::iter::repeat_n(1, n - n / 2));
    let stepped = run_chunks(&model, &want.tokens, &chunks);
    let worst = worst.max(compare(name, "decode", &stepped, &want, vocab));
    eprintln!("{name}: worst |engine - reference| over {n} x {vocab} logits: {worst:.2e}");
}

#[test]
fn llama_matches_reference() {
    check_model("llama", Architecture::Llama);
}

#[test]
fn mistral_matches_reference() {
    check_model("mistral", Architecture::Mistral);
}

#[test]
fn qwen2_matches_reference() {
    check_model("qwen2", Architecture::Qwen2);
}

#[test]
fn qwen3_matches_reference() {
    check_model("qwen3", Architecture::Qwen3);
}

#[test]
fn configs_follow_the_checkpoints() {
    let config = |name: &str| ModelSource::open(fixture(name)).unwrap().config().unwrap();
    let c = config("llama");
    assert_eq!(
        (c.head_dim, c.max_context, c.tie_word_embeddings),
        (16, 128, false)
    );
    // sliding_window 4096 caps max_position_embeddings 32768.
    let c = config("mistral");
    assert_eq!((c.max_context, c.tie_word_embeddings), (4096, true));
    let c = config("qwen2");
    assert_eq!((c.vocab_size, c.qkv_bias, c.max_context), (304, true, 512));
    let c = config("qwen3");
    assert_eq!((c.head_dim, c.q_dim(), c.qk_norm), (32, 128, true));
    assert_eq!(c.rope_theta, 1e6);
}

#[test]
fn tokenizers_take_special_tokens_and_templates_from_the_directory() {
    // Llama: add_bos_token in tokenizer_config.json; eos from its eos_token.
    let t = Tokenizer::load(fixture("llama")).unwrap();
    assert_eq!((t.bos_token_id(), t.eos_token_id()), (Some(1), Some(2)));
    assert!(t.adds_bos());
    assert_eq!(t.eos_token_ids(), [2]);
    let chat = t
        .render_chat(
            &[
                ChatMessage::new("user", "Hi"),
                ChatMessage::new("assistant", "Hello"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(chat, "<s>[INST] Hi [/INST] Hello</s>");

    // Mistral: bos_token as an AddedToken object, BOS found in the post-processor.
    let t = Tokenizer::load(fixture("mistral")).unwrap();
    assert_eq!(t.bos_token_id(), Some(1));
    assert!(t.adds_bos());
    assert_eq!(t.encode("a", true).unwrap()[0], 1);
    assert_ne!(t.encode("a", false).unwrap()[0], 1);

    // Qwen2: no BOS; eos_token <|im_end|> plus generation_config.json's list.
    let t = Tokenizer::load(fixture("qwen2")).unwrap();
    let (end_of_text, im_end) = (
        t.token_to_id("<|endoftext|>").unwrap(),
        t.token_to_id("<|im_end|>").unwrap(),
    );
    assert_eq!((t.bos_token_id(), t.eos_token_id()), (None, Some(im_end)));
    assert!(!t.adds_bos());
    assert_eq!(t.eos_token_ids(), [im_end, end_of_text]);
    let chatml = t
        .render_chat(&[ChatMessage::new("user", "Hi")], true)
        .unwrap();
    assert_eq!(
        chatml,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = t.encode(&chatml, true).unwrap();
    assert_eq!(ids[0], t.token_to_id("<|im_start|>").unwrap());
    assert_eq!(t.decode(&ids, true).unwrap(), "user\nHi\nassistant\n");

    // Qwen3: the template lives in chat_template.jinja.
    let t = Tokenizer::load(fixture("qwen3")).unwrap();
    assert!(t.chat_template().unwrap().contains("<|im_start|>"));
}

// ---- errors -------------------------------------------------------------------------------

/// A copy of fixture `name` in a temporary directory.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    tmp
}

/// One tensor to write: name, dtype, shape, bytes.
type Tensor = (String, String, Vec<usize>, Vec<u8>);

/// The tensors of a safetensors file, as written.
fn read_tensors(path: &Path) -> Vec<Tensor> {
    let file = SafetensorsFile::open(path).unwrap();
    file.names()
        .map(|name| {
            let info = file.tensor(name).unwrap();
            (
                name.to_string(),
                info.dtype.name().to_string(),
                info.shape.clone(),
                file.bytes(name).unwrap().to_vec(),
            )
        })
        .collect()
}

fn write_tensors(path: &Path, tensors: &[Tensor]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

/// Loads the model in `dir` and returns the error.
fn load_error(dir: &Path) -> Error {
    match ModelSource::open(dir).and_then(|s| s.load_model(backend())) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    }
}

/// Rewrites qwen2's model.safetensors through `edit` and returns the load error.
fn edited_qwen2_error(edit: impl FnOnce(&mut Vec<Tensor>)) -> Error {
    let dir = copy_fixture("qwen2");
    let path = dir.path().join("model.safetensors");
    let mut tensors = read_tensors(&path);
    edit(&mut tensors);
    write_tensors(&path, &tensors);
    load_error(dir.path())
}

fn find<'a>(tensors: &'a mut [Tensor], name: &str) -> &'a mut Tensor {
    tensors.iter_mut().find(|t| t.0 == name).unwrap()
}

#[test]
fn missing_tensor_is_named() {
    let e = edited_qwen2_error(|t| t.retain(|t| t.0 != "model.layers.1.self_attn.k_proj.bias"));
    assert!(
        matches!(&e, Error::MissingTensor(n) if n == "model.layers.1.self_attn.k_proj.bias"),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named() {
    let e = edited_qwen2_error(|t| {
        find(t, "model.layers.0.self_attn.k_proj.weight").2 = vec![64, 32];
    });
    assert_eq!(
        e.to_string(),
        "tensor `model.layers.0.self_attn.k_proj.weight` has shape [64, 32], expected [32, 64]"
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let e = edited_qwen2_error(|t| {
        let norm = find(t, "model.norm.weight");
        norm.1 = "I16".into();
    });
    assert_eq!(
        e.to_string(),
        "tensor `model.norm.weight` has unsupported dtype I16 (supported: F32, F16, BF16)"
    );
}

#[test]
fn unused_tensor_is_named() {
    let e = edited_qwen2_error(|t| {
        t.push((
            "model.layers.0.self_attn.o_proj.bias".into(),
            "BF16".into(),
            vec![64],
            vec![0; 128],
        ))
    });
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert!(
        e.to_string()
            .contains("`model.layers.0.self_attn.o_proj.bias` has no place"),
        "{e}"
    );
}

#[test]
fn untied_model_without_lm_head_is_refused() {
    let dir = copy_fixture("qwen2");
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["tie_word_embeddings"] = Value::Bool(false);
    std::fs::write(&path, config.to_string()).unwrap();
    let e = load_error(dir.path());
    assert!(
        matches!(&e, Error::MissingTensor(n) if n == "lm_head.weight"),
        "{e}"
    );
}

#[test]
fn unknown_architecture_is_named() {
    let dir = copy_fixture("llama");
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    config["model_type"] = "gpt_neox".into();
    std::fs::write(&path, config.to_string()).unwrap();
    let e = load_error(dir.path());
    assert_eq!(
        e.to_string(),
        "unsupported architecture `GPTNeoXForCausalLM` (supported: llama, mistral, qwen2, qwen3)"
    );
}

#[test]
fn sharded_index_naming_a_missing_file_is_refused() {
    let dir = copy_fixture("llama");
    let shard = dir.path().join("model-00002-of-00002.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let e = load_error(dir.path());
    assert!(
        matches!(&e, Error::Io { path, .. } if *path == shard),
        "{e}"
    );
    assert!(e.to_string().contains("model-00002-of-00002.safetensors"));
}

#[test]
fn sharded_index_misplacing_a_tensor_is_refused() {
    let dir = copy_fixture("llama");
    let path = dir.path().join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    let moved = "model.norm.weight";
    let other = if map[moved] == "model-00001-of-00002.safetensors" {
        "model-00002-of-00002.safetensors"
    } else {
        "model-00001-of-00002.safetensors"
    };
    map[moved] = other.into();
    std::fs::write(&path, index.to_string()).unwrap();
    let e = ModelSource::open(dir.path()).err().unwrap();
    assert!(matches!(e, Error::MalformedSafetensors { .. }), "{e}");
    assert!(e.to_string().contains("`model.norm.weight`"), "{e}");

    // A weight_map entry that escapes the directory is refused too.
    let mut index: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    index["weight_map"][moved] = "../model.safetensors".into();
    std::fs::write(&path, index.to_string()).unwrap();
    let e = ModelSource::open(dir.path()).err().unwrap();
    assert!(
        e.to_string().contains("not a file in the model directory"),
        "{e}"
    );
}

#[test]
fn directories_without_config_or_weights_are_refused() {
    let dir = copy_fixture("mistral");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let e = load_error(dir.path());
    assert!(e.to_string().contains("no model.safetensors"), "{e}");
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let e = load_error(dir.path());
    assert!(
        matches!(&e, Error::Io { path, .. } if path.ends_with("config.json")),
        "{e}"
    );
    // A file that is neither a directory nor GGUF.
    let e = ModelSource::open(dir.path().join("tokenizer.json"))
        .err()
        .unwrap();
    assert!(matches!(e, Error::BadMagic(_)), "{e}");
}
