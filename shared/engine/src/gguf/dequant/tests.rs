//! Dequantizer tests: hand-built blocks with values worked out by hand, plus cross-check vectors
//! produced by the `gguf` Python package (tests/fixtures/make_dequant_vectors.py).

use super::*;

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

fn run(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / ty.block_bytes().unwrap() * ty.block_len().unwrap();
    let mut out = vec![f32::NAN; n];
    assert!(
        dequantize(ty, bytes, &mut out),
        "{ty} rejected a well-formed input"
    );
    out
}

#[test]
fn plain_floats() {
    let mut b = Vec::new();
    for x in [1.5f32, -2.25, 0.0] {
        b.extend_from_slice(&x.to_le_bytes());
    }
    assert_eq!(run(GgmlType::F32, &b), [1.5, -2.25, 0.0]);

    // f16 0x3c00 = 1.0, 0xc000 = -2.0, 0x3555 ≈ 0.33325
    let b = [0x00, 0x3c, 0x00, 0xc0, 0x55, 0x35];
    assert_eq!(run(GgmlType::F16, &b), [1.0, -2.0, 0.333_251_95]);

    // bf16 is the top half of an f32: 0x3fc0 = 1.5, 0xc110 = -9.0
    let b = [0xc0, 0x3f, 0x10, 0xc1];
    assert_eq!(run(GgmlType::Bf16, &b), [1.5, -9.0]);
}

#[test]
fn q8_0_block() {
    let mut b = h(0.5).to_vec();
    b.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let want: Vec<f32> = (0..32).map(|i| 0.5 * (i as f32 - 16.0)).collect();
    assert_eq!(run(GgmlType::Q8_0, &b), want);
}

#[test]
fn q4_0_block() {
    // byte j = (hi << 4) | lo with lo = j, hi = 15 - j: value j = lo - 8, value j+16 = hi - 8.
    let mut b = h(2.0).to_vec();
    b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
    let mut want = vec![0.0; 32];
    for j in 0..16 {
        want[j] = 2.0 * (j as f32 - 8.0);
        want[j + 16] = 2.0 * (7.0 - j as f32);
    }
    assert_eq!(run(GgmlType::Q4_0, &b), want);
}

#[test]
fn q4_1_block() {
    let mut b = h(0.25).to_vec();
    b.extend_from_slice(&h(-1.0));
    b.extend((0..16u8).map(|j| (j << 4) | (15 - j)));
    let mut want = vec![0.0; 32];
    for j in 0..16 {
        want[j] = 0.25 * (15 - j) as f32 - 1.0;
        want[j + 16] = 0.25 * j as f32 - 1.0;
    }
    assert_eq!(run(GgmlType::Q4_1, &b), want);
}

/// A Q5_0/Q5_1 payload (4 bytes `qh`, 16 bytes nibbles) holding the 5-bit `codes` in value
/// order, packed as the module docs describe.
fn q5_payload(codes: &[u8; 32]) -> Vec<u8> {
    let qh = codes
        .iter()
        .enumerate()
        .fold(0u32, |acc, (j, &c)| acc | (u32::from(c >> 4) << j));
    let mut b = qh.to_le_bytes().to_vec();
    b.extend((0..16).map(|j| (codes[j] & 0x0f) | ((codes[j + 16] & 0x0f) << 4)));
    b
}

/// Codes that cover 0..32 in a scrambled order, so both halves of the block have values with
/// and without the fifth bit.
fn q5_codes() -> [u8; 32] {
    std::array::from_fn(|j| ((j * 7 + 3) % 32) as u8)
}

#[test]
fn q5_0_block() {
    let codes = q5_codes();
    let mut b = h(0.5).to_vec();
    b.extend(q5_payload(&codes));
    assert_eq!(b.len(), 22);
    let want: Vec<f32> = codes.iter().map(|&c| 0.5 * (f32::from(c) - 16.0)).collect();
    assert_eq!(run(GgmlType::Q5_0, &b), want);
}

#[test]
fn q5_1_block() {
    let codes = q5_codes();
    let mut b = h(0.25).to_vec();
    b.extend_from_slice(&h(-2.0));
    b.extend(q5_payload(&codes));
    assert_eq!(b.len(), 24);
    let want: Vec<f32> = codes.iter().map(|&c| 0.25 * f32::from(c) - 2.0).collect();
    assert_eq!(run(GgmlType::Q5_1, &b), want);
}

#[test]
fn q4_k_block() {
    // d = 1, dmin = 0.5. Sub-block s gets scale 10+s and min 40+s (both need 6 bits, so
    // sub-blocks 4..8 exercise the split packing). Nibble of value l within its sub-block is
    // l % 16.
    let scale = |s: usize| 10 + s as u8;
    let min = |s: usize| 40 + s as u8;
    let mut packed = [0u8; 12];
    for s in 0..4 {
        packed[s] = scale(s) | ((scale(s + 4) >> 4) << 6);
        packed[s + 4] = min(s) | ((min(s + 4) >> 4) << 6);
        packed[s + 8] = (scale(s + 4) & 0x0f) | ((min(s + 4) & 0x0f) << 4);
    }
    let mut b = h(1.0).to_vec();
    b.extend_from_slice(&h(0.5));
    b.extend_from_slice(&packed);
    for _group in 0..4 {
        // 32 bytes: low nibble for sub-block 2g, high nibble for sub-block 2g+1; same l % 16.
        b.extend((0..32u8).map(|l| ((l % 16) << 4) | (l % 16)));
    }
    assert_eq!(b.len(), 144);
    let got = run(GgmlType::Q4K, &b);
    for s in 0..8 {
        for l in 0..32 {
            let want = f32::from(scale(s)) * (l % 16) as f32 - 0.5 * f32::from(min(s));
            assert_eq!(got[32 * s + l], want, "sub-block {s} value {l}");
        }
    }
}

#[test]
fn q6_k_block() {
    // Value v (0..256) gets the 6-bit code v % 64, and the scale of its 16-value group g is
    // g - 8 (signed). Build ql/qh from those codes following the layout described in the
    // module docs, then check x = d * scale * (code - 32).
    let code = |v: usize| (v % 64) as u8;
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        for l in 0..32 {
            let base = 128 * half;
            let c = [
                code(base + l),
                code(base + l + 32),
                code(base + l + 64),
                code(base + l + 96),
            ];
            ql[64 * half + l] = (c[0] & 0x0f) | ((c[2] & 0x0f) << 4);
            ql[64 * half + l + 32] = (c[1] & 0x0f) | ((c[3] & 0x0f) << 4);
            qh[32 * half + l] =
                (c[0] >> 4) | ((c[1] >> 4) << 2) | ((c[2] >> 4) << 4) | ((c[3] >> 4) << 6);
        }
    }
    let mut b = ql.to_vec();
    b.extend_from_slice(&qh);
    b.extend((0..16).map(|g| (g as i8 - 8) as u8));
    b.extend_from_slice(&h(0.125));
    assert_eq!(b.len(), 210);
    let got = run(GgmlType::Q6K, &b);
    for (v, &got) in got.iter().enumerate() {
        let want = 0.125 * ((v / 16) as f32 - 8.0) * (f32::from(code(v)) - 32.0);
        assert_eq!(got, want, "value {v}");
    }
}

#[test]
fn rejects_bad_lengths_and_unknown_types() {
    let mut out = [0.0; 32];
    assert!(!dequantize(GgmlType::Q8_0, &[0; 33], &mut out));
    assert!(!dequantize(GgmlType::Q8_0, &[0; 68], &mut out));
    assert!(!dequantize(GgmlType::Q5_0, &[0; 23], &mut out));
    assert!(!dequantize(GgmlType::Other(13), &[0; 176], &mut [0.0; 256]));
}

#[test]
fn matches_gguf_python_reference() {
    let text = include_str!("../../../tests/fixtures/dequant_vectors.json");
    let vectors: serde_json::Value = serde_json::from_str(text).unwrap();
    for (name, ty) in [
        ("Q8_0", GgmlType::Q8_0),
        ("Q4_0", GgmlType::Q4_0),
        ("Q4_1", GgmlType::Q4_1),
        ("Q4_K", GgmlType::Q4K),
        ("Q6_K", GgmlType::Q6K),
    ] {
        let v = &vectors[name];
        let hex = v["bytes"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<f32> = v["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let got = run(ty, &bytes);
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{name} value {i}: got {g}, reference {w}"
            );
        }
    }
}

// Two random blocks each of Q5_0 and Q5_1 (one hex string per block) and their values from the
// PyPI `gguf` package 0.19.0 (`gguf.quants.dequantize`), generated once with (the printed hex
// split per block by hand):
//
//     import numpy as np
//     from gguf import GGMLQuantizationType as T
//     from gguf.quants import dequantize
//     rng = np.random.default_rng(55)
//     def f16(x): return np.array([x], dtype=np.float16).tobytes()
//     def block(n, has_min):
//         b = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
//         b[0:2] = f16(rng.uniform(-0.1, 0.1))      # finite scale d
//         if has_min: b[2:4] = f16(rng.uniform(-1, 0))  # finite min m
//         return bytes(b)
//     for name, qt, n, has_min in [("Q5_0", T.Q5_0, 22, False), ("Q5_1", T.Q5_1, 24, True)]:
//         raw = block(n, has_min) + block(n, has_min)
//         vals = dequantize(np.frombuffer(raw, dtype=np.uint8), qt).astype(np.float32).ravel()
//         print(f'const {name}_BYTES: &str = "{raw.hex()}";')
//         print(f"const {name}_VALUES: [f32; 64] = [{', '.join(str(v) for v in vals)}];")
//
// Every value is exactly representable (an f16 times a small integer, plus an f16 for Q5_1, in
// f32 as numpy computes it), so the comparison is bit for bit.
const Q5_0_BYTES: &str = concat!(
    "e9aaaef6a57a0ed5fa0744ba7ca1e2de05ebb538be90",
    "b92dc1966869247ec468f2565b37d3c0deaa86828693",
);
#[rustfmt::skip]
const Q5_0_VALUES: [f32; 64] = [
    0.10797119, -0.26992798, -0.53985596, -0.37789917, 0.64782715, -0.53985596, 0.21594238,
    -0.053985596, 0.75579834, -0.75579834, -0.26992798, 0.26992798, -0.26992798, -0.43188477,
    -0.75579834, -0.0, -0.0, 0.16195679, -0.80978394, 0.86376953, 0.64782715, -0.59384155,
    0.48587036, -0.53985596, 0.10797119, -0.70181274, 0.86376953, -0.75579834, -0.59384155,
    -0.16195679, -0.59384155, 0.37789917, 0.35766602, -0.17883301, -1.072998, -0.71533203,
    -1.251831, -0.89416504, 0.98358154, 0.6259155, -1.1624146, 0.0, 1.251831, -0.536499, 0.536499,
    -1.251831, -0.89416504, 0.2682495, -1.251831, -0.80474854, -0.35766602, 0.536499, -0.089416504,
    0.44708252, 0.44708252, -1.1624146, 1.1624146, -0.35766602, -0.2682495, 0.89416504,
    -0.71533203, 0.71533203, 0.71533203, -0.6259155,
];
const Q5_1_BYTES: &str = concat!(
    "3825a9bb3b605a11c28ea6b0856ab87d1088e45a4ce6a056",
    "8c24e1b70a1b0a57161c38b14448ea14aeebb87de51ca3f8",
);
#[rustfmt::skip]
const Q5_1_VALUES: [f32; 64] = [
    -0.5905762, -0.34594727, -0.8352051, -0.63134766, -0.52941895, -0.42749023, -0.7944336,
    -0.6925049, -0.95751953, -0.7944336, -0.87597656, -0.7536621, -0.7128906, -0.5090332,
    -0.63134766, -0.8352051, -0.7128906, -0.46826172, -0.7536621, -0.4071045, -0.46826172,
    -0.8352051, -0.4071045, -0.81481934, -0.6109619, -0.7944336, -0.67211914, -0.8555908,
    -0.5498047, -0.67211914, -0.7536621, -0.8555908, -0.38586426, 0.0048828125, -0.3503418,
    -0.19049072, -0.42138672, -0.3503418, -0.31481934, -0.42138672, 0.040405273, -0.012878418,
    -0.3503418, 0.022644043, -0.1194458, -0.27929688, -0.43914795, -0.3503418, -0.4746704,
    -0.19049072, -0.43914795, -0.012878418, -0.42138672, -0.42138672, -0.24377441, -0.4746704,
    -0.030639648, 0.040405273, -0.012878418, -0.36810303, 0.040405273, -0.4746704, -0.030639648,
    -0.22601318,
];

/// Bytes from a hex string.
fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn q5_matches_gguf_python_reference() {
    for (ty, hex, want) in [
        (GgmlType::Q5_0, Q5_0_BYTES, &Q5_0_VALUES),
        (GgmlType::Q5_1, Q5_1_BYTES, &Q5_1_VALUES),
    ] {
        let got = run(ty, &unhex(hex));
        assert_eq!(got.len(), want.len(), "{ty}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{ty} value {i}: got {g}, reference {w}"
            );
        }
    }
}
