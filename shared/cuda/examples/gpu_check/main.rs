//! gpu-check: the CUDA kernels against the CPU reference, on a real GPU.
//!
//! * quantize-on-write: page bytes identical to `HostPages::write_kv` (every dtype, two
//!   geometries, non-unit global scales, padding slots, random page order; NVFP4 under each
//!   block-scale rule, with K's codes chosen for the queries and without);
//! * extend gather: workspace bytes identical to the CPU extend path (dequantize, then E4M3 with
//!   the work scale, or BF16);
//! * decode attention over NVFP4, FP8 and BF16 pages: within a relative L2 error of the CPU
//!   reference (`nibble_engine::paged::DecodeScratch`) on the same pages;
//! * the recent window: BF16 bytes identical to `HostPages::write_window`, and decode over NVFP4
//!   pages plus the window within the relative L2 error of the CPU reference ([`window`]);
//! * prefill and extend attention over the FP8 and BF16 workspaces: within a relative L2 error of
//!   the CPU backend's causal attention (`CpuBackend::attention`) on the same decoded workspace.
//!
//! Exits 1 on any mismatch and also when there is no GPU, driver or NVRTC: it never passes
//! without running. Run: `cargo run --release -p nibble-cuda --example gpu_check`.

use std::process::ExitCode;

mod window;

use anyhow::{bail, Context, Result};
use cudarc::driver::CudaSlice;
use nibble_cuda::{
    CachedPrefix, DecodeBatch, DecodeOut, DecodeWorkspace, Kernels, KvScales, KvWorkspace, NewKv,
    PageGeom, PrefillBatch, PrefillKernel, WgmmaTuning, WindowGeom, WindowRows,
};
use nibble_engine::paged::{DecodeArgs, DecodeScratch, SeqPages};
use nibble_engine::{AttentionArgs, AttnGeometry, Backend, CpuBackend, CpuTensor};
use nibble_kvcache::{GlobalScales, HostPages, PageId, PagePool, PoolPlan, SlotId};
use nibble_kvfmt::nvfp4::feedback::KeyFactors;
use nibble_kvfmt::{bf16, e4m3, fp8, KvDtype, KvPart, PageLayout, ScaleRule};
use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};

/// Relative L2 error allowed for decode attention against the CPU. The GPU reads the same
/// dequantized values; it differs in summation order, in rounding the softmax weights to the
/// mma operand type (f16 for nvfp4/fp8, 2^-11 relative; bf16 for bf16 pages, 2^-8) and in
/// ex2.approx.
fn tolerance(dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::Nvfp4 | KvDtype::Fp8 => 2e-3,
        KvDtype::Bf16 => 1e-2,
    }
}

struct Geometry {
    layers: usize,
    kv_heads: usize,
    q_heads: usize,
    head_dim: usize,
}

const GEOMETRIES: [Geometry; 2] = [
    // Llama-3-8B's attention shape
    Geometry {
        layers: 2,
        kv_heads: 8,
        q_heads: 32,
        head_dim: 128,
    },
    // SmolLM2-135M's
    Geometry {
        layers: 2,
        kv_heads: 3,
        q_heads: 9,
        head_dim: 64,
    },
];
const PAGE: usize = 16;
/// The wgmma kernel's ways beyond its own choice: BF16 consumers without and with turns, over
/// one split and over three, and BF16 tiles by the tensor memory accelerator and by `cp.async`.
const WGMMA_TUNINGS: [WgmmaTuning; 5] = [
    WgmmaTuning {
        pingpong: None,
        splits: None,
        tma: None,
    },
    WgmmaTuning {
        pingpong: Some(false),
        splits: Some(3),
        tma: Some(false),
    },
    WgmmaTuning {
        pingpong: Some(true),
        splits: Some(1),
        tma: Some(false),
    },
    WgmmaTuning {
        pingpong: Some(true),
        splits: Some(3),
        tma: Some(true),
    },
    WgmmaTuning {
        pingpong: Some(false),
        splits: None,
        tma: Some(true),
    },
];
const LAYER: usize = 1;

fn main() -> ExitCode {
    match run() {
        Ok(0) => {
            println!("gpu-check: PASS");
            ExitCode::SUCCESS
        }
        Ok(failures) => {
            println!("gpu-check: FAIL ({failures} checks failed)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("gpu-check: FAIL, could not run: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<usize> {
    let mut kernels = Kernels::new(0).context("opening the GPU")?;
    println!(
        "device 0: {} multiprocessors, kernels compiled for {}, launches {}",
        kernels.multiprocessors(),
        kernels.arch(),
        if kernels.programmatic_launch() {
            "programmatic (PDL)"
        } else {
            "serialized"
        }
    );
    let cpu = CpuBackend::new(2)?;
    let mut failures = 0;
    for geometry in &GEOMETRIES {
        for dtype in [KvDtype::Nvfp4, KvDtype::Fp8, KvDtype::Bf16] {
            failures += check_dtype(&kernels, geometry, dtype)?;
        }
        failures += window::check_window(&kernels, geometry)?;
        for kernel in kernels.prefill_kernels() {
            kernels.set_prefill_kernel(kernel)?;
            // the wgmma kernel's launches as it chooses them, then its consumers with and
            // without turns over BF16 (with forced key splits, so every variant meets a split)
            let tunings: &[WgmmaTuning] = match kernel {
                PrefillKernel::Mma => &[WgmmaTuning::default()],
                PrefillKernel::Wgmma => &WGMMA_TUNINGS,
            };
            for &tuning in tunings {
                kernels.set_wgmma_tuning(tuning)?;
                for work in [KvDtype::Fp8, KvDtype::Bf16] {
                    if tuning != WgmmaTuning::default() && work != KvDtype::Bf16 {
                        continue;
                    }
                    for (start, n) in [
                        (0, 1),
                        (0, 300),
                        (700, 100),
                        (33, 17),
                        (129, 1000),
                        (4000, 256),
                    ] {
                        failures +=
                            check_prefill(&kernels, &cpu, geometry, work, start, n, tuning)?;
                    }
                }
            }
            kernels.set_wgmma_tuning(WgmmaTuning::default())?;
        }
    }
    Ok(failures)
}

/// Values with a wide spread of magnitudes, exact E2M1/E4M3 ties and all-zero blocks.
fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let ties = [0.25f32, 0.75, 1.25, 2.5, 5.0, 432.0, 0.0, -0.0];
    let mut x: Vec<f32> = (0..n)
        .map(|_| {
            if rng.gen_bool(0.05) {
                ties[rng.gen_range(0..ties.len())]
            } else {
                rng.gen_range(-3.0f32..3.0) * 10f32.powf(rng.gen_range(-2.0f32..1.0))
            }
        })
        .collect();
    for block in x.chunks_mut(16) {
        if rng.gen_bool(0.02) {
            block.fill(0.0);
        }
    }
    x
}

/// Every page's bytes of `store`, in page order: the pool as the GPU holds it.
fn pool_bytes(store: &HostPages, pages: usize) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    for p in 0..pages {
        bytes.extend_from_slice(store.page(PageId(p as u32))?);
    }
    Ok(bytes)
}

/// Bytes that differ between two buffers of the same length.
fn differing(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

/// ", ping-pong off, 3 splits" for a tuning that overrides the launch's choices, "" otherwise.
fn tuning_label(tuning: WgmmaTuning) -> String {
    let mut label = String::new();
    if let Some(on) = tuning.pingpong {
        label += if on {
            ", ping-pong on"
        } else {
            ", ping-pong off"
        };
    }
    if let Some(splits) = tuning.splits {
        label += &format!(", {splits} splits");
    }
    if let Some(tma) = tuning.tma {
        label += if tma { ", TMA" } else { ", cp.async" };
    }
    label
}

/// Relative L2 error of `gpu` against `cpu`, its largest absolute error, and whether `gpu` is
/// finite.
fn compare(cpu: &[f32], gpu: &[f32]) -> (f64, f64, bool) {
    let (mut err, mut norm, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
    for (a, b) in cpu.iter().zip(gpu) {
        let d = (*a as f64) - (*b as f64);
        err += d * d;
        norm += (*a as f64) * (*a as f64);
        max_abs = max_abs.max(d.abs());
    }
    let finite = gpu.iter().all(|x| x.is_finite());
    ((err / norm.max(1e-30)).sqrt(), max_abs, finite)
}

/// Prefill (start = 0) or extend (start > 0) of `n` queries over a work-dtype workspace (`work`:
/// FP8 or BF16) of `start + n` tokens, against the CPU backend's causal attention on the decoded
/// workspace (what the engine's prefill and extend paths hand it).
fn check_prefill(
    kernels: &Kernels,
    cpu: &CpuBackend,
    geo: &Geometry,
    work_dtype: KvDtype,
    start: usize,
    n: usize,
    tuning: WgmmaTuning,
) -> Result<usize> {
    let stream = kernels.stream();
    let mut rng = StdRng::seed_from_u64(0xfeed ^ (start * 1000 + n) as u64);
    let (d, kvh, qh) = (geo.head_dim, geo.kv_heads, geo.q_heads);
    let tokens = start + n;
    let work = (0.37f32 * 6.0, 1.9f32 * 6.0);
    let k = values(&mut rng, tokens * kvh * d);
    let v = values(&mut rng, tokens * kvh * d);
    let width = if work_dtype == KvDtype::Bf16 { 2 } else { 1 };
    let (mut wk, mut wv) = (vec![0u8; k.len() * width], vec![0u8; v.len() * width]);
    if work_dtype == KvDtype::Bf16 {
        bf16::encode_le(&k, &mut wk);
        bf16::encode_le(&v, &mut wv);
    } else {
        fp8::quantize_unchecked(&k, work.0, &mut wk);
        fp8::quantize_unchecked(&v, work.1, &mut wv);
    }
    let q: Vec<f32> = (0..n * qh * d)
        .map(|_| rng.gen_range(-3.0f32..3.0))
        .collect();
    // The CPU side: BF16 Q, the workspace decoded to f32, CpuBackend::attention.
    let decode = |bytes: &[u8], g: f32| -> Vec<f32> {
        if work_dtype == KvDtype::Bf16 {
            let mut out = vec![0.0f32; bytes.len() / 2];
            bf16::decode_le(bytes, &mut out);
            out
        } else {
            bytes.iter().map(|b| e4m3::decode(*b) * g).collect()
        }
    };
    let qt = CpuTensor::new(n, qh * d, q.iter().map(|x| bf16::round(*x)).collect())?;
    let kt = CpuTensor::new(tokens, kvh * d, decode(&wk, work.0))?;
    let vt = CpuTensor::new(tokens, kvh * d, decode(&wv, work.1))?;
    let mut ct = CpuTensor::new(n, qh * d, vec![0.0; n * qh * d])?;
    let args = AttentionArgs {
        q: &qt,
        q_rows: 0..n,
        k: &kt,
        v: &vt,
        kv_len: tokens,
        geometry: AttnGeometry {
            num_heads: qh,
            num_kv_heads: kvh,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
        },
    };
    cpu.attention(&args, &mut ct)?;
    let (dq, dk, dv) = (
        stream.clone_htod(&q)?,
        stream.clone_htod(&wk)?,
        stream.clone_htod(&wv)?,
    );
    let mut dout = stream.clone_htod(&vec![f32::NAN; q.len()])?;
    let batch = PrefillBatch {
        q: &dq,
        n,
        start,
        q_heads: qh,
        kv_heads: kvh,
        head_dim: d,
        k: &dk,
        v: &dv,
        work: work_dtype,
        work_scales: KvScales {
            k: work.0,
            v: work.1,
        },
        softmax_scale: 1.0 / (d as f32).sqrt(),
    };
    kernels.prefill(&batch, &mut dout)?;
    let gpu = stream.clone_dtoh(&dout)?;
    let (rel, max_abs, finite) = compare(ct.as_slice(), &gpu);
    let limit = tolerance(work_dtype);
    let what = if start == 0 { "prefill" } else { "extend" };
    Ok(report(
        &format!(
            "{what} ({}{}) {work_dtype} D={d} H={kvh} start {start} rows {n}",
            kernels.prefill_kernel(),
            tuning_label(tuning)
        ),
        finite && rel <= limit,
        &format!(
            "relative L2 error {rel:.2e} (limit {limit:.0e}), max abs error {max_abs:.2e}{}",
            if finite { "" } else { ", NON-FINITE OUTPUT" }
        ),
    ))
}

fn report(name: &str, ok: bool, detail: &str) -> usize {
    println!("{} {name}: {detail}", if ok { "ok  " } else { "FAIL" });
    usize::from(!ok)
}

fn check_dtype(kernels: &Kernels, geo: &Geometry, dtype: KvDtype) -> Result<usize> {
    let stream = kernels.stream();
    let mut rng = StdRng::seed_from_u64(0x5eed ^ geo.head_dim as u64 ^ dtype as u64);
    let layout = PageLayout::new(geo.layers, geo.kv_heads, geo.head_dim, PAGE, dtype)?;
    let contexts = [1usize, 15, 16, 333, 2100, 12_000];
    let total_tokens: usize = contexts.iter().map(|c| c.next_multiple_of(PAGE)).sum();
    let plan = PoolPlan::for_pages(layout, total_tokens / PAGE + 8)?;
    let mut pool = PagePool::new(plan);
    let scales = GlobalScales {
        k: vec![1.0, 0.37],
        v: vec![1.0, 1.9],
    };
    // The default rule here, with poisoned pages; the other NVFP4 rule below, from zeroed ones.
    let mut store = HostPages::new(plan, scales.clone(), ScaleRule::default())?;
    let geom = PageGeom::new(&layout, LAYER)?;
    let name = format!("{dtype} D={} H={}", geo.head_dim, geo.kv_heads);
    let mut failures = 0;

    // Poison every page identically on both sides, so unwritten and stray bytes show.
    let all = pool.alloc(plan.pages)?;
    for page in &all {
        let bytes = store.page_mut(&pool, *page)?;
        rng.fill(bytes);
    }
    pool.release_all(&all)?;
    let mut host_bytes = Vec::with_capacity(plan.bytes);
    for p in 0..plan.pages {
        host_bytes.extend_from_slice(store.page(PageId(p as u32))?);
    }
    let mut dev_pages = stream.clone_htod(&host_bytes)?;

    // Sequences on shuffled pages; every context token written, plus padding slots.
    let mut seq_pages: Vec<Vec<PageId>> = Vec::new();
    for ctx in contexts {
        let mut pages = pool.alloc(ctx.div_ceil(PAGE))?;
        pages.shuffle(&mut rng);
        seq_pages.push(pages);
    }
    let mut slots: Vec<Option<SlotId>> = Vec::new();
    for (ctx, pages) in contexts.iter().zip(&seq_pages) {
        for t in 0..*ctx {
            slots.push(Some(SlotId::new(pages[t / PAGE], t % PAGE, PAGE)));
            if rng.gen_bool(0.01) {
                slots.push(None);
            }
        }
    }
    slots.shuffle(&mut rng);
    let per_token = geo.kv_heads * geo.head_dim;
    let k = values(&mut rng, slots.len() * per_token);
    let v = values(&mut rng, slots.len() * per_token);
    store.write_kv(&pool, LAYER, &k, &v, &slots)?;
    let slot_ids: Vec<u32> = slots.iter().map(|s| s.map_or(u32::MAX, |s| s.0)).collect();
    let (dk, dv) = (stream.clone_htod(&k)?, stream.clone_htod(&v)?);
    let g = KvScales::of_layer(&scales, LAYER);
    let kv = NewKv {
        k: dk.as_view(),
        v: dv.as_view(),
        scales: g,
        rule: store.scale_rule(),
        k_codes: None,
    };
    kernels.quantize(&mut dev_pages, geom, dtype, &kv, &slot_ids)?;
    let gpu_bytes = stream.clone_dtoh(&dev_pages)?;
    if dtype == KvDtype::Nvfp4 {
        // Each rule over every token and over a decode step's few tokens (the mse rule then
        // runs its eight-lane kernel), with K's codes chosen for the queries (kv_k_codes after
        // either kernel) and without, each from zeroed pages; all but the case checked above.
        let few = 5;
        let (layers, heads, d) = (layout.layers(), layout.kv_heads(), layout.head_dim());
        let factors = std::sync::Arc::new(KeyFactors::mixing(layers, heads, d, rng.gen()));
        let mut cases = Vec::new();
        for rule in ScaleRule::ALL {
            for tokens in [slots.len(), few] {
                for codes in [false, true] {
                    if (rule, tokens, codes) != (store.scale_rule(), slots.len(), false) {
                        cases.push((rule, tokens, codes));
                    }
                }
            }
        }
        let uppers: Vec<f32> = factors.uppers().flatten().copied().collect();
        let per_layer = layout.kv_heads() * layout.head_dim() * layout.head_dim();
        let du = stream.clone_htod(&uppers[LAYER * per_layer..(LAYER + 1) * per_layer])?;
        for (rule, tokens, codes) in cases {
            let values = tokens * per_token;
            let (k, v, slots) = (&k[..values], &v[..values], &slots[..tokens]);
            let mut other = HostPages::new(plan, scales.clone(), rule)?
                .with_k_codes(codes.then(|| factors.clone()))?;
            other.write_kv(&pool, LAYER, k, v, slots)?;
            let mut dev = stream.alloc_zeros::<u8>(plan.bytes)?;
            let ids: Vec<u32> = slots.iter().map(|s| s.map_or(u32::MAX, |s| s.0)).collect();
            let (dk, dv) = (stream.clone_htod(k)?, stream.clone_htod(v)?);
            let kv = NewKv {
                k: dk.as_view(),
                v: dv.as_view(),
                scales: g,
                rule,
                k_codes: codes.then(|| du.as_view()),
            };
            kernels.quantize(&mut dev, geom, dtype, &kv, &ids)?;
            let gpu = stream.clone_dtoh(&dev)?;
            let cpu = pool_bytes(&other, plan.pages)?;
            let diff = differing(&cpu, &gpu);
            let codes = if codes {
                ", K codes for the queries"
            } else {
                ""
            };
            failures += report(
                &format!("quantize {name} scale rule {rule}, {tokens} tokens{codes}"),
                diff == 0,
                &format!("{diff} of {} page bytes differ", cpu.len()),
            );
        }
    }
    let cpu_bytes = pool_bytes(&store, plan.pages)?;
    let diff = differing(&cpu_bytes, &gpu_bytes);
    failures += report(
        &format!("quantize {name}"),
        diff == 0,
        &format!(
            "{} tokens, {diff} of {} page bytes differ",
            slots.len(),
            cpu_bytes.len()
        ),
    );

    // Extend gather of the longest sequence into the work-dtype workspace: FP8 at the work
    // scales the engine uses (an nvfp4 cache's global scale times 6; an fp8 cache's own, where
    // the kernel copies the bytes) and, for fp8, at another (where it re-encodes them); BF16 for
    // every cache (`--prefill-work bf16`).
    let long = contexts.len() - 1;
    let prefix = contexts[long];
    let cases: &[(KvDtype, f32)] = match dtype {
        KvDtype::Nvfp4 => &[(KvDtype::Fp8, 6.0), (KvDtype::Bf16, 1.0)],
        KvDtype::Fp8 => &[
            (KvDtype::Fp8, 1.0),
            (KvDtype::Fp8, 2.5),
            (KvDtype::Bf16, 1.0),
        ],
        KvDtype::Bf16 => &[(KvDtype::Bf16, 1.0)],
    };
    let table: Vec<u32> = seq_pages[long].iter().map(|p| p.0).collect();
    let dtable = stream.clone_htod(&table)?;
    for &(work, factor) in cases {
        let work_scale = |part| scales.get(LAYER, part) * factor;
        let width = if work == KvDtype::Bf16 { 2 } else { 1 };
        let mut expected = [Vec::new(), Vec::new()];
        let mut head = vec![0.0f32; geo.head_dim];
        let mut enc = vec![0u8; geo.head_dim * width];
        for t in 0..prefix {
            let slot = SlotId::new(seq_pages[long][t / PAGE], t % PAGE, PAGE);
            for (i, part) in [KvPart::K, KvPart::V].into_iter().enumerate() {
                for h in 0..geo.kv_heads {
                    store.read_head(LAYER, part, slot, h, &mut head)?;
                    match work {
                        KvDtype::Bf16 => bf16::encode_le(&head, &mut enc),
                        _ => fp8::quantize_unchecked(&head, work_scale(part), &mut enc),
                    }
                    expected[i].extend_from_slice(&enc);
                }
            }
        }
        let mut wk: CudaSlice<u8> = stream.alloc_zeros(expected[0].len())?;
        let mut wv: CudaSlice<u8> = stream.alloc_zeros(expected[1].len())?;
        let cached = CachedPrefix {
            page_table: &dtable,
            tokens: prefix,
            scales: g,
            work,
            work_scales: KvScales {
                k: work_scale(KvPart::K),
                v: work_scale(KvPart::V),
            },
        };
        let ws = KvWorkspace {
            k: &mut wk,
            v: &mut wv,
        };
        kernels.gather_work(ws, &dev_pages, geom, dtype, &cached)?;
        let (gk, gv) = (stream.clone_dtoh(&wk)?, stream.clone_dtoh(&wv)?);
        let diff = (expected[0].iter().zip(&gk).filter(|(a, b)| a != b).count())
            + (expected[1].iter().zip(&gv).filter(|(a, b)| a != b).count());
        failures += report(
            &format!("extend gather {name} into {work}, work scale x{factor}"),
            diff == 0,
            &format!(
                "{prefix} tokens, {diff} of {} workspace bytes differ",
                2 * expected[0].len()
            ),
        );
    }

    // Decode attention of every sequence, one launch, against the CPU on the same pages.
    let max_pages = seq_pages.iter().map(Vec::len).max().unwrap_or(1) + 1;
    let mut table = vec![0u32; contexts.len() * max_pages];
    for (i, pages) in seq_pages.iter().enumerate() {
        for (j, p) in pages.iter().enumerate() {
            table[i * max_pages + j] = p.0;
        }
    }
    let qn = geo.q_heads * geo.head_dim;
    let q: Vec<f32> = (0..contexts.len() * qn)
        .map(|_| rng.gen_range(-3.0f32..3.0))
        .collect();
    let mut cpu_out = vec![0.0f32; q.len()];
    let mut scratch = DecodeScratch::default();
    for (i, (ctx, pages)) in contexts.iter().zip(&seq_pages).enumerate() {
        let args = DecodeArgs {
            layer: LAYER,
            q_heads: geo.q_heads,
            q: &q[i * qn..(i + 1) * qn],
            seq: SeqPages { pages, window: &[] },
            context: *ctx,
        };
        scratch.decode(&store, args, &mut cpu_out[i * qn..(i + 1) * qn])?;
    }
    // Four batches: every sequence (several splits, merged by decode_combine in one thread group
    // for 8 KV heads, in four for 3), the first three alone (at most 16 tokens: one split, whose
    // blocks write the output themselves), the 2,100 tokens alone (17 splits: four groups, one
    // round of loads) and the 12,000 alone (63 splits for 8 KV heads; 94 for 3, more than the 80
    // four groups load in one round). Each runs twice on the same workspace, and the second
    // output must equal the first bit for bit: nothing left in the workspace changes a launch.
    let mut ws = DecodeWorkspace::new(kernels)?;
    let n = contexts.len();
    for batch_seqs in [0..n, 0..3, n - 2..n - 1, n - 1..n] {
        let seqs = batch_seqs.len();
        let first = batch_seqs.start;
        let ctx32: Vec<u32> = contexts[batch_seqs.clone()]
            .iter()
            .map(|c| *c as u32)
            .collect();
        let (dq, dtable, dctx) = (
            stream.clone_htod(&q[first * qn..batch_seqs.end * qn])?,
            stream.clone_htod(&table[first * max_pages..batch_seqs.end * max_pages])?,
            stream.clone_htod(&ctx32)?,
        );
        let batch = DecodeBatch {
            q: dq.as_view(),
            q_heads: geo.q_heads,
            page_table: dtable.as_view(),
            max_pages,
            context: dctx.as_view(),
            max_context: *contexts[batch_seqs.clone()].iter().max().unwrap_or(&1),
            scales: g,
            softmax_scale: 1.0 / (geo.head_dim as f32).sqrt(),
            window: WindowGeom::none(),
            window_table: None,
        };
        // Launched twice, the second time also writing the output's BF16 cast.
        let mut outputs = Vec::new();
        let mut cast = stream.clone_htod(&vec![0xFFFFu16; seqs * qn])?;
        for with_cast in [false, true] {
            let mut dout = stream.clone_htod(&vec![f32::NAN; seqs * qn])?;
            let out = DecodeOut {
                values: dout.as_view_mut(),
                bf16: with_cast.then_some(&mut cast),
            };
            kernels.decode(&dev_pages, geom, dtype, &batch, &mut ws, out)?;
            outputs.push(stream.clone_dtoh(&dout)?);
        }
        let gpu_out = &outputs[0];
        let repeat_same = outputs[0]
            .iter()
            .zip(&outputs[1])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        failures += report(
            &format!("decode {name} {seqs} sequences, launched again"),
            repeat_same,
            if repeat_same {
                "the same output bits"
            } else {
                "the second launch differs: state left in the workspace"
            },
        );
        let cast = stream.clone_dtoh(&cast)?;
        let cast_same = cast
            .iter()
            .zip(gpu_out)
            .all(|(c, x)| *c == bf16::encode(*x));
        failures += report(
            &format!("decode {name} {seqs} sequences, BF16 cast of the output"),
            cast_same,
            if cast_same {
                "bf16::encode of every output"
            } else {
                "differs from bf16::encode of the output"
            },
        );
        for (i, ctx) in contexts[batch_seqs.clone()].iter().enumerate() {
            let (c, gpu) = (
                &cpu_out[(first + i) * qn..(first + i + 1) * qn],
                &gpu_out[i * qn..(i + 1) * qn],
            );
            let (mut err, mut norm, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
            for (a, b) in c.iter().zip(gpu) {
                let d = (*a as f64) - (*b as f64);
                err += d * d;
                norm += (*a as f64) * (*a as f64);
                max_abs = max_abs.max(d.abs());
            }
            let rel = (err / norm.max(1e-30)).sqrt();
            let finite = gpu.iter().all(|x| x.is_finite());
            failures += report(
                &format!("decode {name} of {seqs}: context {ctx}"),
                finite && rel <= tolerance(dtype),
                &format!(
                    "relative L2 error {rel:.2e} (limit {:.0e}), max abs error {max_abs:.2e}{}",
                    tolerance(dtype),
                    if finite { "" } else { ", NON-FINITE OUTPUT" }
                ),
            );
        }
    }
    if !(0..contexts.len()).all(|i| cpu_out[i * qn..(i + 1) * qn].iter().any(|x| *x != 0.0)) {
        bail!("CPU reference produced an all-zero output: the check itself is broken");
    }
    Ok(failures)
}
