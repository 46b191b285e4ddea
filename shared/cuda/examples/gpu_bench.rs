//! gpu-bench: the numbers of docs/BENCHMARKS.md's CUDA section, one JSON object per line.
//!
//! * `copy`: device-to-device copy bandwidth (bytes read + written), the ceiling;
//! * `decode`: paged decode attention (32 query heads, 8 KV heads, head dim 128, page 16, one
//!   layer's pages) for BF16, FP8 and NVFP4 pages, batch 1/8/32/64/128 x context 4K/32K/128K:
//!   median time per call with 5 calls queued back to back (and, as `isolated_ms`, of a call
//!   timed alone, which adds the host's launch latency) and effective KV bytes read per second
//!   (every K and V byte of the context, scales included, once);
//! * `quantize`, `gather`: quantize-on-write and extend-gather bandwidth;
//! * `prefill`: causal prefill/extend attention over the FP8 and BF16 workspaces (Llama-3-8B's heads),
//!   time and TFLOP/s of a call timed alone (`ms`, with the host's launch latency) and of 5
//!   queued back to back (`queued_ms`), with each prefill kernel the device has (`--prefill`: only this;
//!   `--prefill-tuning`: also the wgmma kernel's BF16 launches with tiles by `cp.async` and by
//!   the tensor memory accelerator, with and without ping-pong, over the key splits it would
//!   choose and over 1 and 3, rows with `tma`, `pingpong` and `splits` set);
//! * `capacity`: KV tokens of Llama-3-8B's shape that fit one byte budget, per dtype, from the
//!   allocator's plan (`PoolPlan::for_budget`).
//!
//! Inputs are random, never zero; small shapes rotate over disjoint page sets so repeated runs do
//! not read from L2; times are CUDA events around each call, after warm-up, median of many.
//! Run: `cargo run --release -p nibble-cuda --example gpu_bench [-- --quick] [--dtypes nvfp4,fp8] [--page 16] [--shapes 8x32768,1x4096]`
//! (`--dtypes` runs only those decode sweeps; `--kv-window 64` has every decode also read its
//! last 64 tokens from a BF16 recent window, without prefill; `--shapes` only those batch x
//! context shapes of them). `--profile` runs a few calls of batch 32 x 32K (or `--shapes`) per
//! dtype (FP8 and NVFP4, or `--dtypes`) and nothing else, for `ncu`. A sequence's pages lie at
//! random places in the pool, as a serving pool's free list hands them out; `--pages-in-order`
//! lays each sequence's pages out one after another instead, to measure what the scatter costs.

use std::sync::Arc;

use anyhow::{Context, Result};
use cudarc::driver::{sys::CUevent_flags, CudaSlice, CudaStream};
use nibble_cuda::{
    CachedPrefix, DecodeBatch, DecodeOut, DecodeWorkspace, Kernels, KvScales, KvWorkspace, NewKv,
    PageGeom, PrefillBatch, PrefillKernel, WgmmaTuning, WindowGeom,
};
use nibble_kvcache::PoolPlan;
use nibble_kvfmt::nvfp4::feedback::KeyFactors;
use nibble_kvfmt::{bf16, layout::kv_bytes, KvDtype, PageLayout, ScaleRule, WindowLayout};
use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};
use serde_json::json;

const KV_HEADS: usize = 8;
const Q_HEADS: usize = 32;
const DIM: usize = 128;
/// Tokens per page: 16, or `--page N`.
fn page() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        std::env::args()
            .skip_while(|a| a != "--page")
            .nth(1)
            .map(|p| p.parse().expect("--page takes a number of tokens"))
            .unwrap_or(16)
    })
}
const BATCHES: [usize; 5] = [1, 8, 32, 64, 128];
const CONTEXTS: [usize; 3] = [4096, 32768, 131072];
/// Decode calls per timed sample, back to back (see `time_calls_rep`).
const DECODE_REPS: usize = 5;
/// Device memory left free for the workspace, tables and the driver.
const HEADROOM: usize = 6 << 30;

/// `--kv-window W`: decode also reads each sequence's last W tokens from a BF16 window (0, the
/// default: none).
fn kv_window() -> usize {
    std::env::args()
        .skip_while(|a| a != "--kv-window")
        .nth(1)
        .map_or(0, |w| {
            w.parse().expect("--kv-window takes a number of tokens")
        })
}

/// `--shapes BxC,...`: the decode shapes (batch x context) to run, of those the sweep has.
fn shapes() -> Result<Option<Vec<(usize, usize)>>> {
    let Some(list) = std::env::args().skip_while(|a| a != "--shapes").nth(1) else {
        return Ok(None);
    };
    let shape = |s: &str| -> Option<(usize, usize)> {
        let (b, c) = s.split_once('x')?;
        Some((b.parse().ok()?, c.parse().ok()?))
    };
    list.split(',')
        .map(|s| shape(s).with_context(|| format!("--shapes: {s:?} is not BATCHxCONTEXT")))
        .collect::<Result<_>>()
        .map(Some)
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let mut kernels = Kernels::new(0).context("opening the GPU")?;
    let shapes = shapes()?;
    // `--dtypes nvfp4,fp8` limits the decode sweep to those page formats.
    let only = std::env::args().skip_while(|a| a != "--dtypes").nth(1);
    let only_dtypes: Option<Vec<KvDtype>> = only
        .as_ref()
        .map(|list| {
            list.split(',')
                .map(|d| d.parse().map_err(|e| anyhow::anyhow!("--dtypes: {e}")))
                .collect::<Result<_>>()
        })
        .transpose()?;
    if std::env::args().any(|a| a == "--profile") {
        // A few launches of one shape per dtype, for `ncu`.
        let mut rng = StdRng::seed_from_u64(7);
        let shapes = shapes.unwrap_or_else(|| vec![(32, 32768)]);
        for dtype in only_dtypes.unwrap_or_else(|| vec![KvDtype::Fp8, KvDtype::Nvfp4]) {
            decode_sweep(&kernels, dtype, Sweep::Profile, Some(&shapes), &mut rng)?;
        }
        return Ok(());
    }
    let sweep = if quick { Sweep::Quick } else { Sweep::Full };
    let (free, total) = cudarc::driver::result::mem_get_info()?;
    emit(
        json!({"bench": "device", "arch": kernels.arch(), "sms": kernels.multiprocessors(),
                "free_bytes": free, "total_bytes": total}),
    );
    let mut rng = StdRng::seed_from_u64(7);
    if std::env::args().any(|a| a == "--prefill") {
        return prefill(&mut kernels, &mut rng);
    }
    copy_bandwidth(&kernels)?;
    let dtypes = only_dtypes
        .clone()
        .unwrap_or_else(|| vec![KvDtype::Bf16, KvDtype::Fp8, KvDtype::Nvfp4]);
    for dtype in dtypes {
        decode_sweep(&kernels, dtype, sweep, shapes.as_deref(), &mut rng)?;
    }
    if sweep != Sweep::Quick && only.is_none() {
        prefill(&mut kernels, &mut rng)?;
    }
    capacity(free);
    Ok(())
}

/// Prefill of one prompt (start 0) and extend of a chunk after a cached prefix, over an FP8 and
/// a BF16 workspace, with every prefill kernel the device has.
/// With `--prefill-tuning` the wgmma kernel also runs its BF16 launches each way a tuning can
/// force: tiles by `cp.async` and by TMA, consumers with and without turns, 1 and 3 key splits.
fn prefill(kernels: &mut Kernels, rng: &mut StdRng) -> Result<()> {
    let chosen = kernels.prefill_kernel();
    for kernel in kernels.prefill_kernels() {
        kernels.set_prefill_kernel(kernel)?;
        prefill_with(kernels, rng, &[KvDtype::Fp8, KvDtype::Bf16])?;
    }
    if kernels.prefill_kernels().contains(&PrefillKernel::Wgmma)
        && std::env::args().any(|a| a == "--prefill-tuning")
    {
        kernels.set_prefill_kernel(PrefillKernel::Wgmma)?;
        for tma in [false, true] {
            for pingpong in [false, true] {
                let splits: &[Option<u32>] = if pingpong {
                    &[None, Some(1), Some(3)]
                } else {
                    &[None]
                };
                for &splits in splits {
                    kernels.set_wgmma_tuning(WgmmaTuning {
                        pingpong: Some(pingpong),
                        splits,
                        tma: Some(tma),
                    })?;
                    prefill_with(kernels, rng, &[KvDtype::Bf16])?;
                }
            }
        }
        kernels.set_wgmma_tuning(WgmmaTuning::default())?;
    }
    kernels.set_prefill_kernel(chosen)?;
    Ok(())
}

fn prefill_with(kernels: &Kernels, rng: &mut StdRng, works: &[KvDtype]) -> Result<()> {
    let stream = kernels.stream();
    let tuning = kernels.wgmma_tuning();
    for &work in works {
        let width = if work == KvDtype::Bf16 { 2 } else { 1 };
        for (start, n) in [
            (0usize, 4096usize),
            (0, 16384),
            (0, 32768),
            (31744, 1024),
            (4096, 256),
            (16128, 256),
            (32512, 256),
        ] {
            let tokens = start + n;
            let layout = PageLayout::new(1, 1, 16, 16, work)?;
            let geom = PageGeom::new(&layout, 0)?;
            let mut k: CudaSlice<u8> = stream.alloc_zeros(tokens * KV_HEADS * DIM * width)?;
            let mut v: CudaSlice<u8> = stream.alloc_zeros(tokens * KV_HEADS * DIM * width)?;
            kernels.fill_random(&mut k, geom, work, 21)?;
            kernels.fill_random(&mut v, geom, work, 22)?;
            let q: Vec<f32> = (0..n * Q_HEADS * DIM)
                .map(|_| rng.gen_range(-2.0f32..2.0))
                .collect();
            let dq = stream.clone_htod(&q)?;
            let mut out: CudaSlice<f32> = stream.alloc_zeros(q.len())?;
            let batch = PrefillBatch {
                q: &dq,
                n,
                start,
                q_heads: Q_HEADS,
                kv_heads: KV_HEADS,
                head_dim: DIM,
                k: &k,
                v: &v,
                work,
                work_scales: KvScales { k: 0.05, v: 0.05 },
                softmax_scale: 1.0 / (DIM as f32).sqrt(),
            };
            let times = time_calls(stream, 2, (5, 50, 300.0), |_| {
                kernels.prefill(&batch, &mut out)?;
                Ok(())
            })?;
            let ms = median(&times);
            // the same, 5 calls queued back to back (as a model's layers queue them), per call
            let queued = time_calls_rep(stream, 1, (3, 20, 200.0), 5, |_| {
                kernels.prefill(&batch, &mut out)?;
                Ok(())
            })?;
            // Q.K and P.V: 2 FLOP per multiply-add each, over every visible (query, key) pair.
            let pairs: usize = (0..n).map(|i| start + i + 1).sum();
            let flops = 4.0 * (Q_HEADS * DIM) as f64 * pairs as f64;
            let host_out = stream.clone_dtoh(&out)?;
            emit(
                json!({"bench": "prefill", "kernel": kernels.prefill_kernel().to_string(),
                        "work": work.to_string(), "start": start, "rows": n,
                        "pingpong": tuning.pingpong, "splits": tuning.splits, "tma": tuning.tma,
                        "ms": ms, "min_ms": times[0], "runs": times.len(),
                        "queued_ms": median(&queued),
                        "tflops": flops / (ms as f64 * 1e9),
                        "finite": host_out.iter().all(|x| x.is_finite())}),
            );
        }
    }
    Ok(())
}

fn emit(value: serde_json::Value) {
    println!("{value}");
}

/// Times `f` with CUDA events: `warmup` untimed calls, then calls until `budget_ms` or `max`
/// (at least `min`), each timed on its own. Returns the sorted times in ms.
fn time_calls(
    stream: &Arc<CudaStream>,
    warmup: usize,
    runs: (usize, usize, f32),
    f: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<f32>> {
    time_calls_rep(stream, warmup, runs, 1, f)
}

/// `time_calls`, each sample `reps` calls back to back between one pair of events, divided by
/// `reps`: the device time of a call when calls are queued ahead of the device, as a model's
/// layers are, without the host's launch latency of an isolated call.
fn time_calls_rep(
    stream: &Arc<CudaStream>,
    warmup: usize,
    (min, max, budget_ms): (usize, usize, f32),
    reps: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<f32>> {
    let ctx = stream.context();
    for i in 0..warmup {
        f(i)?;
    }
    stream.synchronize()?;
    let mut times = Vec::new();
    let mut spent = 0.0;
    while times.len() < min || (times.len() < max && spent < budget_ms) {
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(stream)?;
        for r in 0..reps {
            f(warmup + times.len() * reps + r)?;
        }
        end.record(stream)?;
        let ms = start.elapsed_ms(&end)? / reps as f32;
        spent += ms;
        times.push(ms);
    }
    times.sort_by(f32::total_cmp);
    Ok(times)
}

fn median(sorted: &[f32]) -> f32 {
    sorted[sorted.len() / 2]
}

fn copy_bandwidth(kernels: &Kernels) -> Result<()> {
    let stream = kernels.stream();
    let bytes = 4usize << 30;
    let mut src: CudaSlice<u8> = stream.alloc_zeros(bytes)?;
    let mut dst: CudaSlice<u8> = stream.alloc_zeros(bytes)?;
    let layout = PageLayout::new(1, 1, 16, 16, KvDtype::Fp8)?;
    kernels.fill_random(&mut src, PageGeom::new(&layout, 0)?, KvDtype::Fp8, 1)?;
    let times = time_calls(stream, 3, (20, 20, 0.0), |_| {
        stream.memcpy_dtod(&src, &mut dst)?;
        Ok(())
    })?;
    let ms = median(&times);
    emit(
        json!({"bench": "copy", "bytes_each_way": bytes, "ms": ms, "min_ms": times[0],
                "gbps": 2.0 * bytes as f64 / (ms as f64 * 1e6)}),
    );
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Sweep {
    Full,
    Quick,
    Profile,
}

fn decode_sweep(
    kernels: &Kernels,
    dtype: KvDtype,
    sweep: Sweep,
    shapes: Option<&[(usize, usize)]>,
    rng: &mut StdRng,
) -> Result<()> {
    let stream = kernels.stream();
    let layout = PageLayout::new(1, KV_HEADS, DIM, page(), dtype)?;
    let geom = PageGeom::new(&layout, 0)?;
    // Freed pools return to the driver at a synchronization point.
    stream.synchronize()?;
    let (free, _) = cudarc::driver::result::mem_get_info()?;
    let largest = BATCHES[BATCHES.len() - 1] * CONTEXTS[CONTEXTS.len() - 1];
    // The pool the allocator would carve from this budget: the largest shape, four times over
    // when it fits (for rotation), never more than the free memory allows.
    let mut want = 4 * largest / page() * layout.page_bytes();
    if sweep == Sweep::Profile {
        want = want.min(8 << 30); // ncu saves and restores device memory between passes
    }
    let plan = PoolPlan::for_budget(layout, want.min(free.saturating_sub(HEADROOM)))?;
    let mut pages: CudaSlice<u8> = stream.alloc_zeros(plan.bytes)?;
    kernels.fill_random(&mut pages, geom, dtype, 11 + dtype as u32)?;
    let mut order: Vec<u32> = (0..plan.pages as u32).collect();
    if !std::env::args().any(|a| a == "--pages-in-order") {
        order.shuffle(rng);
    }
    emit(
        json!({"bench": "pool", "dtype": dtype.to_string(), "pages": plan.pages,
                "page_bytes": layout.page_bytes(), "page_tokens": page(), "bytes": plan.bytes}),
    );
    // `--kv-window W`: every sequence also reads its last W tokens from a BF16 window. The
    // windows take the last pages of `order` (filled with BF16 values), out of the rotation.
    let window = WindowLayout::new(&layout, kv_window())?;
    let wgeom = match window.is_none() {
        true => WindowGeom::none(),
        false => WindowGeom::new(&window, &layout, 0),
    };
    let reserved = BATCHES[BATCHES.len() - 1] * window.pages();
    let usable = plan.pages - reserved;
    if reserved > 0 {
        let values: Vec<u8> = (0..layout.page_bytes() / 2)
            .flat_map(|_| bf16::encode(rng.gen_range(-2.0f32..2.0)).to_le_bytes())
            .collect();
        for &p in &order[usable..] {
            let at = p as usize * layout.page_bytes();
            stream.memcpy_htod(&values, &mut pages.slice_mut(at..at + values.len()))?;
        }
    }
    let mut ws = DecodeWorkspace::new(kernels)?;
    let per_token = kv_bytes(1, KV_HEADS, DIM, 1, dtype).per_token;
    for &ctx in &CONTEXTS {
        for &batch in &BATCHES {
            let skip = match (shapes, sweep) {
                (Some(list), _) => !list.contains(&(batch, ctx)),
                (None, Sweep::Full | Sweep::Profile) => false,
                (None, Sweep::Quick) => batch > 8 || ctx > 32768,
            };
            if skip {
                continue;
            }
            let pps = ctx / page();
            let need = batch * pps;
            if need > usable {
                emit(
                    json!({"bench": "decode", "dtype": dtype.to_string(), "batch": batch,
                            "context": ctx, "skipped": format!(
                                "needs {need} pages, the pool holds {}", plan.pages)}),
                );
                continue;
            }
            let sets = (usable / need).min(4);
            let wtable = stream.clone_htod(&order[usable..usable + batch * window.pages()])?;
            let tables: Vec<CudaSlice<u32>> = (0..sets)
                .map(|s| stream.clone_htod(&order[s * need..(s + 1) * need]))
                .collect::<std::result::Result<_, _>>()?;
            let q: Vec<f32> = (0..batch * Q_HEADS * DIM)
                .map(|_| rng.gen_range(-2.0f32..2.0))
                .collect();
            let dq = stream.clone_htod(&q)?;
            let dctx = stream.clone_htod(&vec![ctx as u32; batch])?;
            let mut out: CudaSlice<f32> = stream.alloc_zeros(q.len())?;
            let runs = if sweep == Sweep::Profile {
                (3, 3, 0.0)
            } else {
                (10, 200, 400.0)
            };
            let mut call = |i: usize| {
                let batch_args = DecodeBatch {
                    q: dq.as_view(),
                    q_heads: Q_HEADS,
                    page_table: tables[i % sets].as_view(),
                    max_pages: pps,
                    context: dctx.as_view(),
                    max_context: ctx,
                    scales: KvScales { k: 0.8, v: 1.3 },
                    softmax_scale: 1.0 / (DIM as f32).sqrt(),
                    window: wgeom,
                    window_table: Some(wtable.as_view()),
                };
                let out = DecodeOut {
                    values: out.as_view_mut(),
                    bf16: None,
                };
                kernels.decode(&pages, geom, dtype, &batch_args, &mut ws, out)?;
                Ok(())
            };
            let times = time_calls_rep(stream, 3, runs, DECODE_REPS, &mut call)?;
            let isolated = time_calls(stream, 0, (5, 50, 100.0), &mut call)?;
            let ms = median(&times);
            let bytes = batch * ctx * per_token;
            let host_out = stream.clone_dtoh(&out)?;
            emit(
                json!({"bench": "decode", "dtype": dtype.to_string(), "batch": batch,
                        "context": ctx, "kv_window": window.tokens(), "ms": ms, "min_ms": times[0],
                        "max_ms": times[times.len() - 1], "runs": times.len(),
                        "reps": DECODE_REPS, "isolated_ms": median(&isolated),
                        "rotation_sets": sets, "kv_bytes": bytes,
                        "gbps": bytes as f64 / (ms as f64 * 1e6),
                        "finite": host_out.iter().all(|x| x.is_finite())}),
            );
        }
    }
    if sweep != Sweep::Profile {
        quantize_and_gather(kernels, dtype, geom, &mut pages, &order, rng)?;
    }
    Ok(())
}

/// Quantize-on-write of 64Ki tokens (one layer, page-contiguous slots on shuffled pages), and
/// the extend gather of a 128Ki-token prefix into the work-dtype workspace.
fn quantize_and_gather(
    kernels: &Kernels,
    dtype: KvDtype,
    geom: PageGeom,
    pages: &mut CudaSlice<u8>,
    order: &[u32],
    rng: &mut StdRng,
) -> Result<()> {
    let stream = kernels.stream();
    let tokens = 65536;
    let values = tokens * KV_HEADS * DIM;
    let k: Vec<f32> = (0..values).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
    let v: Vec<f32> = (0..values).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
    let (dk, dv) = (stream.clone_htod(&k)?, stream.clone_htod(&v)?);
    let slots: Vec<u32> = (0..tokens)
        .map(|t| order[t / page()] * page() as u32 + (t % page()) as u32)
        .collect();
    let dslots = stream.clone_htod(&slots)?;
    // Every NVFP4 block scale rule, and the default one with K's codes chosen for the queries
    // (the plain default last, so the pages hold its bytes); other dtypes have none.
    let rules: &[(ScaleRule, bool)] = match dtype {
        KvDtype::Nvfp4 => &[
            (ScaleRule::Amax, false),
            (ScaleRule::Mse, true),
            (ScaleRule::Mse, false),
        ],
        _ => &[(ScaleRule::Mse, false)],
    };
    // One layer's factors.
    let factors = KeyFactors::mixing(1, KV_HEADS, DIM, 2);
    let uppers: Vec<f32> = factors.uppers().flatten().copied().collect();
    let du = stream.clone_htod(&uppers)?;
    for &(rule, codes) in rules {
        let kv = NewKv {
            k: dk.as_view(),
            v: dv.as_view(),
            scales: KvScales { k: 0.9, v: 1.1 },
            rule,
            k_codes: codes.then(|| du.as_view()),
        };
        // The slots once through the checked launch; the timed ones are the kernel alone.
        kernels.quantize(pages, geom, dtype, &kv, &slots)?;
        let times = time_calls(stream, 3, (20, 100, 300.0), |_| {
            // SAFETY: the same slots passed the checks of the launch above.
            unsafe {
                kernels.quantize_unchecked(pages, geom, dtype, &kv, &dslots.as_view(), None)
            }?;
            Ok(())
        })?;
        let ms = median(&times);
        let written = tokens * kv_bytes(1, KV_HEADS, DIM, 1, dtype).per_token;
        let read = 2 * values * 4;
        emit(
            json!({"bench": "quantize", "dtype": dtype.to_string(), "scale_rule": rule.name(),
                    "k_codes": codes,
                    "tokens": tokens, "ms": ms, "f32_bytes_read": read,
                    "kv_bytes_written": written,
                    "gbps": (read + written) as f64 / (ms as f64 * 1e6),
                    "tokens_per_s": tokens as f64 / (ms as f64 * 1e-3)}),
        );
    }

    let prefix = 131072;
    let table = stream.clone_htod(&order[..prefix / page()])?;
    let width = if dtype == KvDtype::Bf16 { 2 } else { 1 };
    let ws_bytes = prefix * KV_HEADS * DIM * width;
    let mut wk: CudaSlice<u8> = stream.alloc_zeros(ws_bytes)?;
    let mut wv: CudaSlice<u8> = stream.alloc_zeros(ws_bytes)?;
    // The work scales the engine gives the workspace: an nvfp4 cache's global scales times 6,
    // an fp8 cache's own (then the gather is a copy).
    let scales = KvScales { k: 0.9, v: 1.1 };
    let cached = CachedPrefix {
        page_table: &table,
        tokens: prefix,
        scales,
        work: match dtype {
            KvDtype::Bf16 => KvDtype::Bf16,
            KvDtype::Fp8 | KvDtype::Nvfp4 => KvDtype::Fp8,
        },
        work_scales: scales.work(dtype),
    };
    let times = time_calls(stream, 3, (20, 100, 300.0), |_| {
        let ws = KvWorkspace {
            k: &mut wk,
            v: &mut wv,
        };
        kernels.gather_work(ws, pages, geom, dtype, &cached)?;
        Ok(())
    })?;
    let ms = median(&times);
    let read = prefix * kv_bytes(1, KV_HEADS, DIM, 1, dtype).per_token;
    emit(
        json!({"bench": "gather", "dtype": dtype.to_string(), "tokens": prefix, "ms": ms,
                "kv_bytes_read": read, "workspace_bytes_written": 2 * ws_bytes,
                "gbps": (read + 2 * ws_bytes) as f64 / (ms as f64 * 1e6)}),
    );
    Ok(())
}

fn capacity(free: usize) {
    let budget = free.saturating_sub(HEADROOM);
    for dtype in [KvDtype::Bf16, KvDtype::Fp8, KvDtype::Nvfp4] {
        let layout = PageLayout::new(32, KV_HEADS, DIM, page(), dtype).expect("valid geometry");
        if let Ok(plan) = PoolPlan::for_budget(layout, budget) {
            emit(
                json!({"bench": "capacity", "model": "Llama-3-8B shape (32 layers, 8 KV heads, head dim 128)",
                        "dtype": dtype.to_string(), "budget_bytes": budget, "pages": plan.pages,
                        "tokens": plan.tokens(), "bytes": plan.bytes}),
            );
        }
    }
}
