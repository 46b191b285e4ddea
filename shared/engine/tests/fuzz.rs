//! Fuzz targets for the model-file readers (see `nibble_testkit::fuzz`): any bytes given as a
//! GGUF image or a safetensors file are parsed, and every tensor they declare is read and
//! dequantized, without a panic, an abort or an allocation the bytes cannot back. Seeds: small
//! valid files of each format; the corpus under `tests/__fuzz__/` replays what was found.

use std::io::Write;

use nibble_engine::gguf::{GgmlType, GgufBuilder, GgufFile, Value};
use nibble_engine::safetensors::SafetensorsFile;
use nibble_testkit::fuzz::{mutate, ITERATIONS};

/// A GGUF with metadata of several types and an f32, a q8_0 and a q4_1 tensor.
fn gguf_seed() -> Vec<u8> {
    GgufBuilder::new()
        .meta("general.architecture", Value::String("llama".into()))
        .meta("llama.block_count", Value::U32(1))
        .meta("llama.rope.freq_base", Value::F32(10000.0))
        .meta(
            "tokenizer.ggml.tokens",
            Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
        )
        .tensor_f32("f", &[4, 2], &[0.5, -1.0, 2.0, 3.5, 0.0, 1.0, -2.0, 8.0])
        .tensor_raw("q8", &[32], GgmlType::Q8_0, vec![7; 34])
        .tensor_raw("q4", &[32], GgmlType::Q4_1, vec![3; 20])
        .build()
}

#[test]
fn gguf_images_parse_or_are_refused() {
    let seed = gguf_seed();
    assert!(
        GgufFile::from_bytes(seed.clone()).is_ok(),
        "the seed is valid"
    );
    bolero::check!()
        .with_iterations(ITERATIONS)
        .for_each(|input: &[u8]| {
            let bytes = mutate(&[&seed], input);
            if let Ok(file) = GgufFile::from_bytes(bytes) {
                let names: Vec<String> = file.tensors().iter().map(|t| t.name.clone()).collect();
                for name in names {
                    let _ = file.tensor_bytes(&name);
                    let _ = file.dequantize(&name);
                }
                let _ = file.require_str_array("tokenizer.ggml.tokens");
            }
        });
}

/// A safetensors file of an f32 and a bf16 tensor.
fn safetensors_seed() -> Vec<u8> {
    let header = br#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},"__metadata__":{"format":"pt"}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend((0..22u8).map(|i| i.wrapping_mul(37)));
    bytes
}

#[test]
fn safetensors_files_parse_or_are_refused() {
    let seed = safetensors_seed();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, &seed).unwrap();
    assert!(SafetensorsFile::open(&path).is_ok(), "the seed is valid");
    bolero::check!()
        .with_iterations(ITERATIONS)
        .for_each(|input: &[u8]| {
            let bytes = mutate(&[&seed], input);
            let mut file = std::fs::File::create(&path).unwrap();
            file.write_all(&bytes).unwrap();
            drop(file);
            if let Ok(file) = SafetensorsFile::open(&path) {
                let names: Vec<String> = file.names().map(str::to_string).collect();
                for name in names {
                    let _ = file.bytes(&name);
                    let _ = file.to_f32(&name);
                }
            }
        });
}
