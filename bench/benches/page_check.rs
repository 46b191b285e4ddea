//! What checking received pages costs (`nibble_kvfmt::SequencePages::check`, which a decode
//! worker runs on every page it receives before writing it): one 32K-token hand-off of
//! SmolLM2-135M (30 layers, 3 KV heads of 64, 16-token pages) per dtype, every page checked, as
//! the receiver does. nvfp4 moves its 48-token recent window too (11 pages).
//!
//! Pages hold what quantize-on-write writes (N(0, 1) values, the window in BF16): 64 distinct
//! pages, repeated; the checks are branch-free scans, so the values do not change their cost.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nibble_bench::kv_values;
use nibble_kvfmt::{bf16, fp8, nvfp4, KvDtype, KvPart, PageLayout, SequencePages, WindowLayout};

/// Tokens of the hand-off.
const TOKENS: usize = 32 * 1024;
/// Distinct pages the hand-off's pages repeat.
const DISTINCT: usize = 64;

/// `DISTINCT` prompt pages of `layout` as the writer lays them out, part by part.
fn prompt_pages(layout: &PageLayout) -> Vec<u8> {
    let page_bytes = layout.page_bytes();
    let per_part = layout.kv_heads() * layout.page_size() * layout.head_dim();
    let data = layout.kv_heads() * layout.page_size() * layout.data_bytes();
    let mut pages = vec![0u8; DISTINCT * page_bytes];
    for (n, page) in pages.chunks_exact_mut(page_bytes).enumerate() {
        for layer in 0..layout.layers() {
            for part in [KvPart::K, KvPart::V] {
                let x = kv_values(per_part, 1.0, (n * 1000 + 2 * layer) as u64 + part as u64);
                let start = layout.part_offset(layer, part);
                let region = &mut page[start..start + layout.part_bytes()];
                match layout.dtype() {
                    KvDtype::Nvfp4 => {
                        let (packed, scales) = region.split_at_mut(data);
                        nvfp4::quantize_unchecked(&x, 1.0 / 6.0, packed, scales);
                    }
                    KvDtype::Fp8 => fp8::quantize_unchecked(&x, 1.0, region),
                    KvDtype::Bf16 => bf16::encode_le(&x, region),
                }
            }
        }
    }
    pages
}

/// The hand-off's bytes: its prompt pages, then its window pages (BF16 values).
fn handoff(seq: &SequencePages, layout: &PageLayout) -> Vec<u8> {
    let page_bytes = layout.page_bytes();
    let distinct = prompt_pages(layout);
    let mut bytes = Vec::with_capacity(seq.pages() * page_bytes);
    for i in 0..seq.prompt_pages() {
        let n = i % DISTINCT;
        bytes.extend_from_slice(&distinct[n * page_bytes..(n + 1) * page_bytes]);
    }
    let window = seq.pages() - seq.prompt_pages();
    let values = kv_values(window * page_bytes / 2, 1.0, 7);
    let start = bytes.len();
    bytes.resize(start + window * page_bytes, 0);
    bf16::encode_le(&values, &mut bytes[start..]);
    bytes
}

fn page_check(c: &mut Criterion) {
    let mut group = c.benchmark_group("page_check");
    group.sample_size(20);
    for dtype in [KvDtype::Nvfp4, KvDtype::Fp8, KvDtype::Bf16] {
        let layout = PageLayout::new(30, 3, 64, 16, dtype).unwrap();
        let window = match dtype {
            KvDtype::Nvfp4 => 64,
            _ => 0,
        };
        let window = WindowLayout::new(&layout, window).unwrap();
        let seq = SequencePages::new(layout, window, TOKENS);
        let bytes = handoff(&seq, &layout);
        let page_bytes = layout.page_bytes();
        for (i, page) in bytes.chunks_exact(page_bytes).enumerate() {
            seq.check(i, page).expect("what writers write passes");
        }
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(format!("{dtype}/32k-tokens"), |b| {
            b.iter(|| {
                for (i, page) in black_box(&bytes).chunks_exact(page_bytes).enumerate() {
                    black_box(seq.check(i, page)).unwrap();
                }
            })
        });
        // One PushPages message (about 4 MiB of whole pages), just received: in cache.
        let per_message = nibble_worker::transfer::pages_per_message(page_bytes);
        let message = &bytes[..per_message * page_bytes];
        group.throughput(Throughput::Bytes(message.len() as u64));
        group.bench_function(format!("{dtype}/one-message"), |b| {
            b.iter(|| {
                for (i, page) in black_box(message).chunks_exact(page_bytes).enumerate() {
                    black_box(seq.check(i, page)).unwrap();
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, page_check);
criterion_main!(benches);
