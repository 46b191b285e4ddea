//! Runs the built `nibble` binary: `kv encode`/`kv decode` round trips that must match the library
//! byte for byte, `kv layout` JSON, and every kind of bad input (exit status 2, one `error:` line
//! on stderr, no output file left behind).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nibble_kvfmt::{interchange, KvDtype};
use serde_json::Value;

/// Runs `nibble` with `args`, isolated from any NIBBLE_* settings of the caller.
fn nibble<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .env_remove("NIBBLE_KV_DTYPE")
        .env_remove("NIBBLE_KV_GLOBAL_SCALE")
        .env_remove("NIBBLE_PAGE_SIZE")
        .output()
        .expect("nibble runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Four vectors of 64 values: ordinary values, an all-zero vector, large values that saturate
/// fp8, and tiny values in the E4M3 subnormal range.
fn sample() -> Vec<f32> {
    let mut x: Vec<f32> = (0..64)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
        .collect();
    x.extend([0.0; 64]);
    x.extend((0..64).map(|i| (i as f32 - 31.5) * 40.0));
    x.extend((0..64).map(|i| (i as f32 - 32.0) * 1e-4));
    x
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("readable dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn codec_args(verb: &str, dtype: &str, head_dim: &str, input: &Path, output: &Path) -> Vec<String> {
    vec![
        "kv".into(),
        verb.into(),
        "--dtype".into(),
        dtype.into(),
        "--head-dim".into(),
        head_dim.into(),
        "--global-scale".into(),
        "0.5".into(),
        input.display().to_string(),
        output.display().to_string(),
    ]
}

#[test]
fn encode_decode_match_the_library_for_every_dtype() {
    let dir = tempfile::tempdir().expect("temp dir");
    let x = sample();
    let input = dir.path().join("in.f32");
    fs::write(&input, f32_bytes(&x)).expect("write input");
    for dtype in KvDtype::ALL {
        let encoded = dir.path().join(format!("{dtype}.bin"));
        let decoded = dir.path().join(format!("{dtype}.f32"));

        let out = nibble(&codec_args("encode", dtype.name(), "64", &input, &encoded));
        assert!(out.status.success(), "{dtype} encode: {}", stderr(&out));
        assert!(out.stdout.is_empty() && out.stderr.is_empty());
        let expected = interchange::encode(dtype, 64, 0.5, &x).expect("library encodes");
        assert_eq!(fs::read(&encoded).expect("encoded"), expected, "{dtype}");
        assert_eq!(expected.len(), 4 * dtype.vector_bytes(64));

        let out = nibble(&codec_args(
            "decode",
            dtype.name(),
            "64",
            &encoded,
            &decoded,
        ));
        assert!(out.status.success(), "{dtype} decode: {}", stderr(&out));
        let back = interchange::decode(dtype, 64, 0.5, &expected).expect("library decodes");
        assert_eq!(
            fs::read(&decoded).expect("decoded"),
            f32_bytes(&back),
            "{dtype}"
        );
    }
    let mut expected = vec!["in.f32".to_string()];
    for dtype in KvDtype::ALL {
        expected.extend([format!("{dtype}.bin"), format!("{dtype}.f32")]);
    }
    expected.sort();
    assert_eq!(names_in(dir.path()), expected, "no temporary files left");
}

fn layout(args: &[&str]) -> Value {
    let mut full = vec!["kv", "layout"];
    full.extend_from_slice(args);
    let out = nibble(&full);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(
        text.lines().count(),
        1,
        "one JSON object on one line: {text}"
    );
    serde_json::from_str(&text).expect("JSON")
}

#[test]
fn layout_smollm2_nvfp4() {
    let v = layout(&[
        "--layers",
        "30",
        "--kv-heads",
        "3",
        "--head-dim",
        "64",
        "--dtype",
        "nvfp4",
    ]);
    assert_eq!(v["layers"], 30);
    assert_eq!(v["kv_heads"], 3);
    assert_eq!(v["head_dim"], 64);
    assert_eq!(v["page_size"], 16, "default page size");
    assert_eq!(v["dtype"], "nvfp4");
    assert_eq!(v["bytes_per_token_per_layer"], 2 * 3 * 36);
    assert_eq!(v["bytes_per_token"], 30 * 2 * 3 * 36);
    assert_eq!(v["page_bytes"], 103_680);
    assert_eq!(v["page_bytes"], 16 * 30 * 2 * 3 * 36);
    assert_eq!(v["ratio_vs_fp8"], 0.5625);
    assert_eq!(v["ratio_vs_bf16"], 0.28125);
}

#[test]
fn layout_llama3_8b_each_dtype() {
    for (dtype, per_token, vs_fp8, vs_bf16) in [
        ("bf16", 131_072, 2.0, 1.0),
        ("fp8", 65_536, 1.0, 0.5),
        ("nvfp4", 36_864, 0.5625, 0.28125),
    ] {
        let v = layout(&[
            "--layers",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--page-size",
            "32",
            "--dtype",
            dtype,
        ]);
        assert_eq!(v["bytes_per_token"], per_token, "{dtype}");
        assert_eq!(v["page_bytes"], 32 * per_token, "{dtype}");
        assert_eq!(v["ratio_vs_fp8"], vs_fp8, "{dtype}");
        assert_eq!(v["ratio_vs_bf16"], vs_bf16, "{dtype}");
    }
}

/// Asserts a failed run: status 2, nothing on stdout, one `error:` line mentioning `needle`.
fn assert_one_line_error(out: &Output, needle: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(out.stdout.is_empty(), "stdout: {:?}", out.stdout);
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(err.starts_with("error: "), "{err:?}");
    assert!(err.contains(needle), "{err:?} should mention {needle:?}");
}

/// A temp dir with `in.f32` holding `values`, and the path of an output that must not appear.
fn setup(values: &[f32]) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("in.f32");
    fs::write(&input, f32_bytes(values)).expect("write input");
    let output = dir.path().join("out.bin");
    (dir, input, output)
}

#[test]
fn encode_rejects_a_length_that_is_not_whole_vectors() {
    let (dir, input, output) = setup(&[1.0; 100]);
    let out = nibble(&codec_args("encode", "nvfp4", "64", &input, &output));
    assert_one_line_error(&out, &format!("{}: length 400 bytes", input.display()));
    assert!(stderr(&out).contains("not a multiple of 256 bytes"));
    assert_eq!(names_in(dir.path()), ["in.f32"]);
}

#[test]
fn decode_rejects_a_length_that_is_not_whole_vectors() {
    let (dir, input, output) = setup(&[1.0; 10]); // 40 bytes, nvfp4 D=64 vectors are 36
    let out = nibble(&codec_args("decode", "nvfp4", "64", &input, &output));
    assert_one_line_error(&out, "not a multiple of 36 bytes");
    assert!(stderr(&out).contains("in.f32"));
    assert_eq!(names_in(dir.path()), ["in.f32"]);
}

#[test]
fn rejects_a_head_dim_that_is_not_a_multiple_of_16() {
    let (dir, input, output) = setup(&[1.0; 48]);
    for verb in ["encode", "decode"] {
        let out = nibble(&codec_args(verb, "fp8", "24", &input, &output));
        assert_one_line_error(&out, "head dim must be a positive multiple of 16, got 24");
    }
    assert_eq!(names_in(dir.path()), ["in.f32"]);
}

#[test]
fn rejects_non_finite_values_by_index_and_keeps_the_old_output() {
    let mut x = vec![0.25f32; 128];
    x[70] = f32::INFINITY;
    let (dir, input, output) = setup(&x);
    fs::write(&output, b"previous").expect("pre-existing output");
    for dtype in ["nvfp4", "fp8", "bf16"] {
        let out = nibble(&codec_args("encode", dtype, "64", &input, &output));
        assert_one_line_error(&out, "value 70 (byte offset 280) is not finite (inf)");
        assert!(stderr(&out).contains("in.f32"));
        assert_eq!(fs::read(&output).expect("still there"), b"previous");
    }
    assert_eq!(names_in(dir.path()), ["in.f32", "out.bin"]);
}

#[test]
fn decode_rejects_nan_scale_codes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("in.bin");
    let mut bytes = vec![0u8; 2 * 9];
    bytes[17] = 0xFF; // scale of the second 16-value vector
    fs::write(&input, bytes).expect("write input");
    let output = dir.path().join("out.f32");
    let out = nibble(&codec_args("decode", "nvfp4", "16", &input, &output));
    assert_one_line_error(&out, "byte 17 is an E4M3 NaN code");
    assert_eq!(names_in(dir.path()), ["in.bin"]);
}

#[test]
fn rejects_an_unknown_dtype() {
    let (dir, input, output) = setup(&[1.0; 64]);
    let out = nibble(&codec_args("encode", "fp16", "64", &input, &output));
    assert_one_line_error(&out, "unknown KV dtype \"fp16\"");
    assert_eq!(names_in(dir.path()), ["in.f32"]);
}

#[test]
fn rejects_a_bad_global_scale() {
    let (dir, input, output) = setup(&[1.0; 64]);
    let mut args = codec_args("encode", "fp8", "64", &input, &output);
    args[7] = "-2".into();
    let out = nibble(&args);
    assert_one_line_error(&out, "global scale must be finite and > 0, got -2");
    assert_eq!(names_in(dir.path()), ["in.f32"]);
}

#[test]
fn names_an_unreadable_input() {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("missing.f32");
    let output = dir.path().join("out.bin");
    let out = nibble(&codec_args("encode", "nvfp4", "64", &input, &output));
    assert_one_line_error(&out, &format!("cannot read {}", input.display()));
    // A directory is not a readable input either.
    let out = nibble(&codec_args("decode", "nvfp4", "64", dir.path(), &output));
    assert_one_line_error(&out, &format!("cannot read {}", dir.path().display()));
    assert!(names_in(dir.path()).is_empty());
}

#[test]
fn names_an_unwritable_output() {
    let (dir, input, _) = setup(&[1.0; 64]);
    let output = dir.path().join("no-such-dir").join("out.bin");
    let out = nibble(&codec_args("encode", "nvfp4", "64", &input, &output));
    assert_one_line_error(&out, &format!("cannot write {}", output.display()));
    // An existing directory cannot be replaced by the output; it is left as it was.
    let taken = dir.path().join("taken");
    fs::create_dir(&taken).expect("mkdir");
    let out = nibble(&codec_args("encode", "nvfp4", "64", &input, &taken));
    assert_one_line_error(&out, &format!("cannot write {}", taken.display()));
    assert!(taken.is_dir() && names_in(&taken).is_empty());
    assert_eq!(names_in(dir.path()), ["in.f32", "taken"]);
}

#[test]
fn layout_rejects_bad_geometry() {
    let out = nibble(&[
        "kv",
        "layout",
        "--layers",
        "0",
        "--kv-heads",
        "3",
        "--head-dim",
        "64",
        "--dtype",
        "nvfp4",
    ]);
    assert_one_line_error(&out, "layers must be between 1 and 4096, got 0");
    let out = nibble(&[
        "kv",
        "layout",
        "--layers",
        "30",
        "--kv-heads",
        "3",
        "--head-dim",
        "72",
        "--dtype",
        "fp8",
    ]);
    assert_one_line_error(&out, "head dim must be a positive multiple of 16, got 72");
}

#[test]
fn usage_errors_exit_2_on_one_line() {
    let cases: [(&[&str], &str); 4] = [
        (&["frobnicate"], "unrecognized subcommand 'frobnicate'"),
        (
            &["kv", "encode", "--dtype", "fp8", "a", "b"],
            "--head-dim <D>",
        ),
        (
            &["kv", "layout", "--layers", "x"],
            "invalid value 'x' for '--layers <LAYERS>'",
        ),
        (
            &["kv", "decode", "--bogus"],
            "unexpected argument '--bogus'",
        ),
    ];
    for (args, needle) in cases {
        assert_one_line_error(&nibble(args), needle);
    }
}

#[test]
fn help_and_version_succeed() {
    let out = nibble(&["kv", "encode", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--global-scale <G>"), "{help}");
    assert!(help.contains("NIBBLE_KV_DTYPE"), "{help}");
    let out = nibble(&["--version"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("nibble "));
    // No arguments at all: help on stderr, usage status.
    let out = nibble::<&str>(&[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("Usage:"));
}
