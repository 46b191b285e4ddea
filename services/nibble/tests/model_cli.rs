//! Runs the built `nibble` binary on the real SmolLM2-135M-Instruct model: `generate` with every
//! KV dtype and with the chat template, `eval ppl` on the committed Austen fixture, `calibrate`
//! feeding `eval ppl`, and bad inputs (exit status 2, one `error:` line, no output file).
//!
//! The model is `$NIBBLE_MODEL` or `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`
//! (`bash scripts/fetch-model.sh` downloads it); without it these tests fail, they never pass
//! silently. Windows and generations are kept short so the file runs in well under a minute.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nibble_testkit::model_path as model;
use serde_json::Value;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn austen() -> PathBuf {
    workspace().join("shared/engine/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt")
}

/// Runs `nibble` with `args`, isolated from any NIBBLE_* settings of the caller.
fn nibble<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nibble"));
    for var in [
        "NIBBLE_MODEL",
        "NIBBLE_THREADS",
        "NIBBLE_KV_DTYPE",
        "NIBBLE_CALIBRATION",
        "NIBBLE_HADAMARD",
        "NIBBLE_PAGE_SIZE",
        "NIBBLE_KV_BUDGET_MIB",
    ] {
        cmd.env_remove(var);
    }
    cmd.args(args).output().expect("nibble runs")
}

/// `nibble <verb...> --model M <rest...>`.
fn with_model(verb: &[&str], rest: &[&str]) -> Output {
    let model = model();
    let mut args: Vec<&std::ffi::OsStr> = verb.iter().map(|s| s.as_ref()).collect();
    args.push("--model".as_ref());
    args.push(model.as_os_str());
    args.extend(rest.iter().map(|s| -> &std::ffi::OsStr { s.as_ref() }));
    nibble(&args)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "status {:?}, stderr: {}",
        out.status,
        text(&out.stderr)
    );
}

/// The number after `word` in `line` (`"prompt 12 tokens"` → 12).
fn count_after(line: &str, word: &str) -> usize {
    let rest = &line[line
        .find(word)
        .unwrap_or_else(|| panic!("{word:?} in {line:?}"))
        + word.len()..];
    rest.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a number after {word:?} in {line:?}"))
}

const PROMPT: &str = "The capital of France is";

#[test]
fn generate_greedy_with_every_kv_dtype() {
    for dtype in ["bf16", "fp8", "nvfp4"] {
        let out = with_model(
            &["generate"],
            &[
                "--kv-dtype",
                dtype,
                "--temperature",
                "0",
                "--max-tokens",
                "8",
                PROMPT,
            ],
        );
        assert_success(&out);
        let generated = text(&out.stdout);
        assert!(generated.ends_with('\n'), "{dtype}: {generated:?}");
        assert!(!generated.trim().is_empty(), "{dtype}: no text");
        if dtype == "bf16" {
            assert!(generated.contains("Paris"), "{dtype}: {generated:?}");
        }
        let summary = text(&out.stderr);
        assert_eq!(summary.lines().count(), 1, "{dtype}: {summary:?}");
        assert!(summary.starts_with("prompt "), "{summary:?}");
        assert_eq!(count_after(&summary, "prompt"), 5, "{summary:?}");
        let completion = count_after(&summary, "completion");
        assert!((1..=8).contains(&completion), "{summary:?}");
        assert!(summary.contains("finish "), "{summary:?}");
        assert!(summary.contains("tok/s"), "{summary:?}");
    }
}

#[test]
fn generate_stops_on_a_stop_string() {
    let out = with_model(
        &["generate"],
        &[
            "--kv-dtype",
            "bf16",
            "--temperature",
            "0",
            "--max-tokens",
            "16",
            "--stop",
            ".",
            PROMPT,
        ],
    );
    assert_success(&out);
    assert_eq!(text(&out.stdout), " Paris\n");
    assert!(
        text(&out.stderr).contains("finish stop"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn chat_template_and_logprobs() {
    let out = with_model(
        &["generate"],
        &[
            "--chat",
            "--system",
            "You are a helpful assistant.",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            "--logprobs",
            "What is the capital of France?",
        ],
    );
    assert_success(&out);
    assert!(!text(&out.stdout).trim().is_empty());
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "summary and logprobs: {stderr:?}");
    // The template adds both turns' headers around the 7-token question.
    assert!(count_after(lines[0], "prompt") > 20, "{}", lines[0]);
    let completion = count_after(lines[0], "completion");
    let json: Value = serde_json::from_str(lines[1]).expect("logprobs JSON");
    let logprobs = json["logprobs"].as_array().expect("array");
    assert_eq!(logprobs.len(), completion);
    for lp in logprobs {
        let p = lp["logprob"].as_f64().expect("number");
        assert!(p <= 0.0 && p.is_finite(), "{lp}");
        assert!(
            lp["token"].as_u64().is_some() && lp["text"].is_string(),
            "{lp}"
        );
    }
}

#[test]
fn hugging_face_directories_load_too() {
    // Tiny random checkpoints (the engine's fixtures): the text is noise, the plumbing is real.
    let fixtures = workspace().join("shared/engine/tests/fixtures/hf");
    for (name, chat) in [("llama", false), ("qwen2", true), ("qwen3", false)] {
        let dir = fixtures.join(name);
        let mut args = vec![
            "generate",
            "--model",
            dir.to_str().expect("utf-8 path"),
            "--temperature",
            "0",
            "--max-tokens",
            "4",
        ];
        if chat {
            args.push("--chat");
        }
        args.push("Elizabeth");
        let out = nibble(&args);
        assert_success(&out);
        let summary = text(&out.stderr);
        assert!(
            count_after(&summary, "completion") >= 1,
            "{name}: {summary}"
        );
    }
}

fn ppl(rest: &[&str]) -> Value {
    let fixture = austen();
    let mut args = vec!["--text", fixture.to_str().expect("utf-8 path"), "--json"];
    args.extend_from_slice(rest);
    let out = with_model(&["eval", "ppl"], &args);
    assert_success(&out);
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "one JSON object: {stdout}");
    serde_json::from_str(&stdout).expect("JSON")
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is a number"))
}

#[test]
fn eval_ppl_reports_every_window_and_the_means() {
    let v = ppl(&[
        "--kv-dtype",
        "nvfp4",
        "--window",
        "64",
        "--windows",
        "2",
        "--path",
        "decode",
    ]);
    let s = &v["settings"];
    assert_eq!(s["kv_dtype"], "nvfp4");
    assert_eq!(s["path"], "decode");
    assert_eq!(s["window"], 64);
    assert_eq!(s["windows"], 2);
    assert_eq!(s["calibrated"], false);
    assert_eq!(s["hadamard"], false);
    assert!(s["model"].as_str().expect("path").ends_with(".gguf"));
    assert!(s["text_tokens"].as_u64().expect("count") > 2000);
    let windows = v["windows"].as_array().expect("windows");
    assert_eq!(windows.len(), 2);
    for (i, w) in windows.iter().enumerate() {
        assert_eq!(w["index"], i);
        let (nll, ppl, top1) = (
            f(&w["mean_nll"]),
            f(&w["perplexity"]),
            f(&w["top1_agreement"]),
        );
        let reference = f(&w["reference_perplexity"]);
        assert!((ppl - nll.exp()).abs() < 1e-9 * ppl, "{w}");
        assert!((10.0..100.0).contains(&ppl), "{w}");
        assert!((10.0..100.0).contains(&reference), "{w}");
        assert!((ppl / reference - 1.0).abs() < 0.2, "{w}");
        assert!((0.6..=1.0).contains(&top1), "{w}");
    }
    let m = &v["mean"];
    let mean_nll = (f(&windows[0]["mean_nll"]) + f(&windows[1]["mean_nll"])) / 2.0;
    assert!((f(&m["mean_nll"]) - mean_nll).abs() < 1e-12);
    assert!((f(&m["perplexity"]) - mean_nll.exp()).abs() < 1e-9);
    let top1 = (f(&windows[0]["top1_agreement"]) + f(&windows[1]["top1_agreement"])) / 2.0;
    assert!((f(&m["top1_agreement"]) - top1).abs() < 1e-12);
}

#[test]
fn eval_ppl_f32_is_the_reference_and_bf16_prefill_stays_close() {
    let reference = ppl(&["--kv-dtype", "f32", "--window", "64", "--path", "prefill"]);
    let w = &reference["windows"][0];
    assert_eq!(f(&w["top1_agreement"]), 1.0);
    assert_eq!(f(&w["perplexity"]), f(&w["reference_perplexity"]));
    let bf16 = ppl(&["--kv-dtype", "bf16", "--window", "64", "--path", "extend"]);
    let b = &bf16["windows"][0];
    assert_eq!(
        f(&b["reference_mean_nll"]),
        f(&w["mean_nll"]),
        "same reference"
    );
    assert!((f(&b["mean_nll"]) - f(&w["mean_nll"])).abs() < 0.02, "{b}");
    assert!(f(&b["top1_agreement"]) >= 0.9, "{b}");
}

#[test]
fn calibration_file_feeds_eval() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out_path = dir.path().join("scales.json");
    let fixture = austen();
    let out = with_model(
        &["calibrate"],
        &[
            "--text",
            fixture.to_str().expect("utf-8 path"),
            "--window",
            "128",
            "--max-tokens",
            "256",
            "--nvfp4-window",
            "64",
            out_path.to_str().expect("utf-8 path"),
        ],
    );
    assert_success(&out);
    assert!(out.stdout.is_empty());
    let cal: Value =
        serde_json::from_str(&fs::read_to_string(&out_path).expect("written")).expect("JSON");
    assert_eq!(cal["tokens"], 256);
    assert_eq!(cal["nvfp4_window"], 64);
    for key in ["k_amax", "v_amax"] {
        let amax = cal[key].as_array().expect("per layer");
        assert_eq!(amax.len(), 30, "{key}");
        assert!(amax.iter().all(|a| f(a) > 0.0), "{key}");
    }
    assert_eq!(cal["nvfp4"]["k"].as_array().expect("scales").len(), 30);
    // Every layer's 3 KV heads x 64 K channels, whose largest is the layer's K amax.
    let channels = cal["k_channel_amax"].as_array().expect("per layer");
    assert_eq!(channels.len(), 30);
    for (layer, c) in channels.iter().enumerate() {
        let c = c.as_array().expect("channels");
        assert_eq!(c.len(), 192, "layer {layer}");
        let max = c.iter().map(f).fold(0.0, f64::max);
        assert_eq!(max, f(&cal["k_amax"][layer]), "layer {layer}");
    }
    // The queries' second moment: per layer, 3 KV heads' upper triangles of 64 x 64, each
    // diagonal entry a mean square (positive).
    let moment = cal["q_second_moment"].as_array().expect("per layer");
    assert_eq!(moment.len(), 30);
    for (layer, m) in moment.iter().enumerate() {
        let m = m.as_array().expect("triangles");
        assert_eq!(m.len(), 3 * 64 * 65 / 2, "layer {layer}");
        assert!(f(&m[0]) > 0.0 && f(&m[64]) > 0.0, "layer {layer}: diagonal");
    }
    // And the amax of rotated vectors, for a --hadamard cache.
    for key in ["k_amax", "v_amax", "smoothed_k_amax"] {
        let amax = cal["hadamard"][key].as_array().expect("per layer");
        assert_eq!(amax.len(), 30, "hadamard {key}");
        assert!(amax.iter().all(|a| f(a) > 0.0), "hadamard {key}");
    }

    // Calibrated nvfp4 prefill runs over the FP8 work dtype: it must stay as close to the
    // reference as uncalibrated (no saturation at the nvfp4 global scale). The file's channels
    // smooth K unless told not to, and a rotated cache takes the rotated amax: every variant as
    // close to the reference.
    let cal_arg = out_path.to_str().expect("utf-8 path");
    let calibrated = |path: &str, extra: &[&str]| {
        let mut args = vec![
            "--kv-dtype",
            "nvfp4",
            "--calibration",
            cal_arg,
            "--window",
            "64",
            "--path",
            path,
        ];
        args.extend_from_slice(extra);
        let v = ppl(&args);
        assert_eq!(v["settings"]["calibrated"], true);
        assert_eq!(v["settings"]["calibration"], cal_arg);
        let w = &v["windows"][0];
        let ratio = f(&w["perplexity"]) / f(&w["reference_perplexity"]);
        assert!((ratio - 1.0).abs() < 0.15, "{path} {extra:?}: {w}");
        assert!(f(&w["top1_agreement"]) >= 0.7, "{path} {extra:?}: {w}");
        v
    };
    for path in ["prefill", "extend"] {
        calibrated(path, &[]);
    }
    let smoothed = calibrated("decode", &[]);
    assert_eq!(
        smoothed["settings"]["kv_window"], 64,
        "the calibration's nvfp4 window"
    );
    let plain = calibrated("decode", &["--no-smooth-k", "--kv-window", "32"]);
    assert_eq!(plain["settings"]["kv_window"], 32, "--kv-window wins");
    calibrated("decode", &["--hadamard"]);
    // K's codes are chosen for the queries unless --no-k-codes: another cache (seen through
    // extend over two 64-token chunks, the second reading the first's pages), as close.
    let extend = |extra: &[&str]| {
        let mut args = vec!["--kv-dtype", "nvfp4", "--calibration", cal_arg];
        args.extend_from_slice(&["--window", "128", "--path", "extend"]);
        args.extend_from_slice(extra);
        let v = ppl(&args);
        let w = v["windows"][0].clone();
        assert!(
            f(&w["perplexity"]) / f(&w["reference_perplexity"]) < 1.15,
            "{w}"
        );
        v
    };
    let (codes, nearest) = (extend(&[]), extend(&["--no-k-codes"]));
    assert_eq!(codes["settings"]["k_codes"], true);
    assert_eq!(nearest["settings"]["k_codes"], false);
    assert_ne!(
        nearest["windows"][0]["perplexity"], codes["windows"][0]["perplexity"],
        "the codes differ"
    );
    assert_eq!(smoothed["settings"]["smooth_k"], true);
    assert_eq!(plain["settings"]["smooth_k"], false);
    let (w, s) = (&plain["windows"][0], &smoothed["windows"][0]);
    assert_ne!(w["perplexity"], s["perplexity"], "not the same cache");
    assert_eq!(
        w["reference_perplexity"], s["reference_perplexity"],
        "the reference is the model's own"
    );
}

/// Asserts a failed run: status 2, nothing on stdout, one `error:` line mentioning `needle`.
fn assert_one_line_error(out: &Output, needle: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(out.stdout.is_empty(), "stdout: {}", text(&out.stdout));
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(err.starts_with("error: "), "{err:?}");
    assert!(err.contains(needle), "{err:?} should mention {needle:?}");
}

#[test]
fn a_missing_model_says_how_to_fetch_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out_path = dir.path().join("scales.json");
    let fixture = austen();
    let missing = dir.path().join("no-such-model.gguf");
    let missing = missing.to_str().expect("utf-8 path");
    let fixture = fixture.to_str().expect("utf-8 path");
    let runs: [&[&str]; 3] = [
        &["generate", "--model", missing, "hello"],
        &[
            "eval",
            "ppl",
            "--model",
            missing,
            "--kv-dtype",
            "fp8",
            "--text",
            fixture,
            "--window",
            "64",
        ],
        &[
            "calibrate",
            "--model",
            missing,
            "--text",
            fixture,
            out_path.to_str().expect("utf-8 path"),
        ],
    ];
    for args in runs {
        let out = nibble(args);
        assert_one_line_error(&out, missing);
        assert!(text(&out.stderr).contains("fetched on first use"));
    }
    assert!(!out_path.exists());
    // Without --model, the default is relative to the current directory and fetched on first
    // use; with no python3 to fetch it, that fails with one line and leaves nothing behind.
    let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["generate", "hello"])
        .env_remove("NIBBLE_MODEL")
        .env("PATH", dir.path())
        .current_dir(dir.path())
        .output()
        .expect("nibble runs");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(out.stdout.is_empty());
    // A progress line ("fetching ..."), then the one-line error.
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(
            "error: cannot fetch the default model to models/SmolLM2-135M-Instruct.Q4_1.gguf"
        ) && last.contains("python3"),
        "{err:?}"
    );
    let models = dir.path().join("models");
    let left: Vec<_> = fs::read_dir(&models).map_or(Vec::new(), |d| d.collect());
    assert!(left.is_empty(), "a failed fetch left {left:?}");
}

#[test]
fn bad_flags_and_files_are_one_line_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fixture = austen();
    let fixture = fixture.to_str().expect("utf-8 path");
    let empty = dir.path().join("empty.txt");
    fs::write(&empty, "").expect("write");
    let empty = empty.to_str().expect("utf-8 path");
    let bad_cal = dir.path().join("bad.json");
    fs::write(
        &bad_cal,
        // A well-formed calibration of a one-layer model.
        r#"{"source":"x","tokens":1,"k_amax":[1.0],"v_amax":[1.0],
            "nvfp4":{"k":[1.0],"v":[1.0]},"fp8":{"k":[1.0],"v":[1.0]}}"#,
    )
    .expect("write");
    let bad_cal = bad_cal.to_str().expect("utf-8 path");
    let eval = |rest: &[&str]| -> Vec<String> {
        let mut args = vec!["eval", "ppl", "--text", fixture];
        args.extend_from_slice(rest);
        args.into_iter().map(String::from).collect()
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            eval(&["--kv-dtype", "fp16", "--window", "64"]),
            "unknown KV dtype \"fp16\"",
        ),
        (
            vec![
                "generate".into(),
                "--kv-dtype".into(),
                "int4".into(),
                "x".into(),
            ],
            "unknown KV dtype \"int4\"",
        ),
        (
            eval(&["--kv-dtype", "nvfp4", "--window", "2000", "--windows", "2"]),
            "has 3012 tokens, fewer than 4000 (2 windows of 2000 tokens)",
        ),
        (
            eval(&["--kv-dtype", "nvfp4", "--window", "0"]),
            "a window must be at least 2 tokens, got 0",
        ),
        (
            eval(&["--kv-dtype", "nvfp4", "--window", "64", "--windows", "0"]),
            "--windows",
        ),
        (
            eval(&[
                "--kv-dtype",
                "nvfp4",
                "--window",
                "64",
                "--path",
                "sideways",
            ]),
            "unknown path \"sideways\"",
        ),
        (
            eval(&["--kv-dtype", "f32", "--hadamard", "--window", "64"]),
            "--hadamard: applies to a quantized cache",
        ),
        (
            eval(&["--kv-dtype", "f32", "--kv-window", "64", "--window", "64"]),
            "--kv-window: applies to a quantized cache",
        ),
        (
            eval(&[
                "--kv-dtype",
                "f32",
                "--prefill-work",
                "bf16",
                "--window",
                "64",
            ]),
            "--prefill-work: applies to a quantized cache",
        ),
        (
            eval(&[
                "--kv-dtype",
                "bf16",
                "--prefill-work",
                "fp8",
                "--window",
                "64",
            ]),
            "--prefill-work: fp8 needs an fp8 or nvfp4 cache",
        ),
        (
            eval(&[
                "--kv-dtype",
                "nvfp4",
                "--prefill-work",
                "fp4",
                "--window",
                "64",
            ]),
            "unknown work dtype \"fp4\": expected fp8 or bf16",
        ),
        (
            eval(&["--kv-dtype", "nvfp4", "--kv-window", "40", "--window", "64"]),
            "--kv-window: 40 tokens is not a multiple of the page size (16)",
        ),
        (
            eval(&[
                "--kv-dtype",
                "nvfp4",
                "--kv-window",
                "65536",
                "--window",
                "64",
            ]),
            "--kv-window: 65536 tokens is larger than the model's context (8192)",
        ),
        (
            eval(&[
                "--kv-dtype",
                "nvfp4",
                "--calibration",
                bad_cal,
                "--window",
                "64",
            ]),
            "the model has 30 layers",
        ),
        (
            vec![
                "generate".into(),
                "--top-p".into(),
                "1.5".into(),
                "x".into(),
            ],
            "top_p must be in (0, 1], got 1.5",
        ),
        (
            vec![
                "generate".into(),
                "--temperature".into(),
                "-1".into(),
                "x".into(),
            ],
            "temperature must be between 0 and 2, got -1",
        ),
        (
            vec![
                "generate".into(),
                "--max-tokens".into(),
                "0".into(),
                "x".into(),
            ],
            "max_tokens must be between 1 and 32768 (0 only to score the prompt), got 0",
        ),
        (
            vec![
                "generate".into(),
                "--system".into(),
                "hi".into(),
                "x".into(),
            ],
            "--chat",
        ),
        (
            vec![
                "generate".into(),
                "--kv-dtype".into(),
                "bf16".into(),
                "--prefill-work".into(),
                "fp8".into(),
                "x".into(),
            ],
            "--prefill-work: fp8 needs an fp8 or nvfp4 cache",
        ),
    ];
    let model = model();
    for (args, needle) in cases {
        let mut full = args.clone();
        full.insert(
            if full[0] == "eval" { 2 } else { 1 },
            model.display().to_string(),
        );
        full.insert(if full[0] == "eval" { 2 } else { 1 }, "--model".into());
        let out = nibble(&full);
        assert_one_line_error(&out, needle);
    }

    // Calibration inputs that fail leave no output file.
    let out_path = dir.path().join("scales.json");
    let out_arg = out_path.to_str().expect("utf-8 path");
    let missing_text = dir.path().join("missing.txt");
    let missing_text = missing_text.to_str().expect("utf-8 path");
    for (text_file, needle) in [(empty, "has 0 tokens"), (missing_text, "cannot read")] {
        let out = with_model(&["calibrate"], &["--text", text_file, out_arg]);
        assert_one_line_error(&out, needle);
        assert!(!out_path.exists(), "{needle}");
    }
    let out = with_model(
        &["calibrate"],
        &["--text", fixture, "--window", "0", out_arg],
    );
    assert_one_line_error(&out, "--window");
    assert!(!Path::new(out_arg).exists());
}
