//! GGUF parsing tests on images built in memory.

use super::*;

fn sample() -> GgufBuilder {
    GgufBuilder::new()
        .meta("general.architecture", Value::String("llama".into()))
        .meta("a.u8", Value::U8(7))
        .meta("a.i8", Value::I8(-7))
        .meta("a.u16", Value::U16(700))
        .meta("a.i16", Value::I16(-700))
        .meta("a.u32", Value::U32(70_000))
        .meta("a.i32", Value::I32(-70_000))
        .meta("a.f32", Value::F32(1.5))
        .meta("a.bool", Value::Bool(true))
        .meta("a.u64", Value::U64(1 << 40))
        .meta("a.i64", Value::I64(-(1 << 40)))
        .meta("a.f64", Value::F64(-0.25))
        .meta(
            "a.strs",
            Value::Array(vec![Value::String("x".into()), Value::String("yz".into())]),
        )
        .meta(
            "a.nested",
            Value::Array(vec![Value::Array(vec![Value::I32(1), Value::I32(2)])]),
        )
        .tensor_f32("w", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        .tensor_f32("b", &[2], &[-1.0, 1.0])
}

#[test]
fn parses_metadata_of_every_type() {
    let f = GgufFile::from_bytes(sample().build()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.require_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get("a.u8"), Some(&Value::U8(7)));
    assert_eq!(f.get("a.i8"), Some(&Value::I8(-7)));
    assert_eq!(f.get("a.u16"), Some(&Value::U16(700)));
    assert_eq!(f.get("a.i16"), Some(&Value::I16(-700)));
    assert_eq!(f.require_u64("a.u32").unwrap(), 70_000);
    assert_eq!(f.get("a.i32").and_then(Value::as_i64), Some(-70_000));
    assert_eq!(f.require_f64("a.f32").unwrap(), 1.5);
    assert_eq!(f.get("a.bool").and_then(Value::as_bool), Some(true));
    assert_eq!(f.require_u64("a.u64").unwrap(), 1 << 40);
    assert_eq!(f.get("a.i64").and_then(Value::as_i64), Some(-(1 << 40)));
    assert_eq!(f.require_f64("a.f64").unwrap(), -0.25);
    assert_eq!(f.require_str_array("a.strs").unwrap(), ["x", "yz"]);
    let nested = f.get("a.nested").and_then(Value::as_array).unwrap();
    assert_eq!(nested[0], Value::Array(vec![Value::I32(1), Value::I32(2)]));
}

#[test]
fn reads_tensors_at_aligned_offsets() {
    let f = GgufFile::from_bytes(sample().build()).unwrap();
    assert_eq!(f.data_offset() % 32, 0);
    let b = f.tensor("b").unwrap();
    assert_eq!(b.offset, 32); // 24 bytes of `w`, padded to 32
    assert_eq!(f.dequantize("w").unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(f.dequantize_shaped("b", &[2]).unwrap(), [-1.0, 1.0]);
}

#[test]
fn honours_custom_alignment() {
    let image = GgufBuilder::new()
        .alignment(64)
        .tensor_f32("a", &[1], &[1.0])
        .tensor_f32("b", &[1], &[2.0])
        .build();
    let f = GgufFile::from_bytes(image).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor("b").unwrap().offset, 64);
    assert_eq!(f.dequantize("b").unwrap(), [2.0]);
}

#[test]
fn errors_name_what_is_wrong() {
    let f = GgufFile::from_bytes(sample().build()).unwrap();
    let e = f.dequantize("missing.weight").unwrap_err();
    assert!(
        matches!(&e, Error::MissingTensor(n) if n == "missing.weight"),
        "{e}"
    );
    let e = f.dequantize_shaped("w", &[2, 3]).unwrap_err();
    assert!(e.to_string().contains("`w`"), "{e}");
    let e = f.require_u64("general.architecture").unwrap_err();
    assert!(e.to_string().contains("general.architecture"), "{e}");
    let e = f.require("nope").unwrap_err();
    assert!(matches!(e, Error::MissingMetadata(_)));
}

/// Q5_0 (id 6) and Q5_1 (id 7) tensors round-trip through the file: type ids, byte sizes and
/// dequantization. One block each, every 5-bit code 0..32 once (value j has code j).
#[test]
fn reads_q5_tensors() {
    let f16 = |x: f32| half::f16::from_f32(x).to_bits().to_le_bytes();
    // Codes j: the fifth bit is set for j >= 16, the low nibble of j and j+16 is j.
    let mut payload = 0xffff_0000u32.to_le_bytes().to_vec();
    payload.extend((0..16u8).map(|j| (j << 4) | j));
    let q5_0 = [f16(0.5).as_slice(), &payload].concat();
    let q5_1 = [f16(0.5).as_slice(), &f16(1.0), &payload].concat();
    let image = GgufBuilder::new()
        .tensor_raw("a", &[32], GgmlType::Q5_0, q5_0)
        .tensor_raw("b", &[32], GgmlType::Q5_1, q5_1)
        .build();
    let f = GgufFile::from_bytes(image).unwrap();
    assert_eq!(f.tensor("a").unwrap().ggml_type, GgmlType::Q5_0);
    assert_eq!(f.tensor("b").unwrap().ggml_type, GgmlType::Q5_1);
    assert_eq!(f.tensor_bytes("a").unwrap().len(), 22);
    assert_eq!(f.tensor_bytes("b").unwrap().len(), 24);
    let want_a: Vec<f32> = (0..32).map(|j| 0.5 * (j as f32 - 16.0)).collect();
    let want_b: Vec<f32> = (0..32).map(|j| 0.5 * j as f32 + 1.0).collect();
    assert_eq!(f.dequantize("a").unwrap(), want_a);
    assert_eq!(f.dequantize("b").unwrap(), want_b);
    assert_eq!(GgmlType::Q5_0.to_string(), "Q5_0");
    assert_eq!(GgmlType::Q5_1.to_string(), "Q5_1");
}

#[test]
fn unsupported_tensor_type_is_named() {
    let image = GgufBuilder::new()
        // Q5_K (id 13, 256 values in 176 bytes) has no decoder.
        .tensor_raw("q5k", &[256], GgmlType::Other(13), vec![0; 176])
        .build();
    let f = GgufFile::from_bytes(image).unwrap();
    let e = f.dequantize("q5k").unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("q5k") && msg.contains("ggml type 13"), "{msg}");
}

#[test]
fn truncated_files_fail_with_the_position() {
    let image = sample().build();
    // Cut inside the tensor data: the tensor is named.
    let e = GgufFile::from_bytes(image[..image.len() - 4].to_vec())
        .err()
        .unwrap();
    assert!(e.to_string().contains("tensor `b`"), "{e}");
    // Cut inside the metadata.
    let e = GgufFile::from_bytes(image[..40].to_vec()).err().unwrap();
    assert!(matches!(e, Error::Truncated { .. }), "{e}");
    // Not GGUF at all.
    let e = GgufFile::from_bytes(b"GGML\0\0\0\0".to_vec())
        .err()
        .unwrap();
    assert!(matches!(e, Error::BadMagic(_)), "{e}");
}

#[test]
fn opens_files_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, sample().build()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensors().len(), 2);
    let e = GgufFile::open(dir.path().join("absent.gguf"))
        .err()
        .unwrap();
    assert!(e.to_string().contains("absent.gguf"), "{e}");
}

#[test]
fn absurd_dims_are_rejected() {
    let image = GgufBuilder::new()
        .tensor_raw("huge", &[1 << 40, 1 << 40], GgmlType::F32, vec![0; 4])
        .build();
    let e = GgufFile::from_bytes(image).err().unwrap();
    assert!(e.to_string().contains("`huge`"), "{e}");
}
