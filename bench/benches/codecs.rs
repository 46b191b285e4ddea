//! CPU throughput of the KV codecs in `nibble-kvfmt` on 1 Mi values (the unchecked fast paths
//! that a quantize-on-write or dequantize loop calls).
//!
//! Each operation is measured twice, once reporting elements/s and once bytes/s (criterion 0.5
//! takes one throughput unit per benchmark). Bytes are the *encoded* bytes: written by quantize,
//! read by dequantize (NVFP4: 9 per 16 values, FP8: 1 per value); the f32 side is 4 per element.

use std::hint::black_box;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use nibble_bench::{kv_values, VALUES};
use nibble_kvfmt::{fp8, nvfp4};

/// Global scale of the benchmarks (uncalibrated).
const G: f32 = 1.0;

/// Registers `f` as `name/elements` and `name/bytes`.
fn both_units(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    encoded_bytes: usize,
    mut f: impl FnMut(),
) {
    for (unit, throughput) in [
        ("elements", Throughput::Elements(VALUES as u64)),
        ("bytes", Throughput::Bytes(encoded_bytes as u64)),
    ] {
        group.throughput(throughput);
        group.bench_function(format!("{name}/{unit}"), |b| b.iter(&mut f));
    }
}

fn nvfp4_codec(c: &mut Criterion) {
    let x = kv_values(VALUES, 1.0, 1);
    let mut packed = vec![0u8; VALUES / 2];
    let mut scales = vec![0u8; VALUES / nvfp4::BLOCK];
    let encoded = packed.len() + scales.len();
    let mut y = vec![0.0f32; VALUES];

    let mut group = c.benchmark_group("nvfp4");
    both_units(&mut group, "quantize", encoded, || {
        nvfp4::quantize_unchecked(black_box(&x), G, &mut packed, &mut scales);
        black_box((&packed, &scales));
    });
    both_units(&mut group, "quantize-mse", encoded, || {
        nvfp4::quantize_unchecked_with(
            black_box(&x),
            G,
            nibble_kvfmt::ScaleRule::Mse,
            &mut packed,
            &mut scales,
        );
        black_box((&packed, &scales));
    });
    nvfp4::quantize_unchecked(&x, G, &mut packed, &mut scales);
    both_units(&mut group, "dequantize", encoded, || {
        nvfp4::dequantize_unchecked(black_box(&packed), black_box(&scales), G, &mut y);
        black_box(&y);
    });
    group.finish();
}

fn fp8_codec(c: &mut Criterion) {
    let x = kv_values(VALUES, 1.0, 2);
    let mut q = vec![0u8; VALUES];
    let mut y = vec![0.0f32; VALUES];

    let mut group = c.benchmark_group("fp8");
    both_units(&mut group, "quantize", VALUES, || {
        fp8::quantize_unchecked(black_box(&x), G, &mut q);
        black_box(&q);
    });
    fp8::quantize_unchecked(&x, G, &mut q);
    both_units(&mut group, "dequantize", VALUES, || {
        fp8::dequantize_unchecked(black_box(&q), G, &mut y);
        black_box(&y);
    });
    group.finish();
}

criterion_group!(benches, nvfp4_codec, fp8_codec);
criterion_main!(benches);
