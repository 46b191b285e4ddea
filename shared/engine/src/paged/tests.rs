use nibble_kvcache::{GlobalScales, HostPages, PageTable, PoolPlan};
use nibble_kvfmt::ScaleRule;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::*;

const Q_HEADS: usize = 4;
const KV_HEADS: usize = 2;
const DIM: usize = 32;
const PAGE: usize = 8;
const LAYERS: usize = 2;

/// Amax block scales: the expected pages below are `interchange` encodings, which use amax.
fn pool(dtype: KvDtype) -> (PagePool, HostPages) {
    let layout = PageLayout::new(LAYERS, KV_HEADS, DIM, PAGE, dtype).unwrap();
    let scales = GlobalScales {
        k: vec![0.5, 2.0],
        v: vec![1.0, 0.25],
    };
    let plan = PoolPlan::for_pages(layout, 16).unwrap();
    (
        PagePool::new(plan),
        HostPages::new(plan, scales, ScaleRule::Amax).unwrap(),
    )
}

fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-3.0f32..3.0)).collect()
}

/// Plain causal attention in f32 over explicit K/V: the definition the paths must meet.
fn reference(q: &[f32], k: &[f32], v: &[f32], start: usize) -> Vec<f32> {
    let n = q.len() / (Q_HEADS * DIM);
    let mut out = vec![0.0f32; q.len()];
    for i in 0..n {
        for h in 0..Q_HEADS {
            let kvh = h / (Q_HEADS / KV_HEADS);
            let qi = &q[(i * Q_HEADS + h) * DIM..][..DIM];
            let visible = start + i + 1;
            let scores: Vec<f32> = (0..visible)
                .map(|j| {
                    let kj = &k[(j * KV_HEADS + kvh) * DIM..][..DIM];
                    qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() / (DIM as f32).sqrt()
                })
                .collect();
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, s| m.max(*s));
            let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f32 = weights.iter().sum();
            for (j, w) in weights.iter().enumerate() {
                let vj = &v[(j * KV_HEADS + kvh) * DIM..][..DIM];
                for d in 0..DIM {
                    out[(i * Q_HEADS + h) * DIM + d] += w / total * vj[d];
                }
            }
        }
    }
    out
}

fn cache<'a>(
    pool: &'a PagePool,
    store: &'a mut HostPages,
    ws: &'a mut Workspace,
) -> PagedCache<'a> {
    PagedCache { pool, store, ws }
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| bf16::decode(bf16::encode(*v))).collect()
}

/// The FP8 work scale of a cache: its global scale, times 6 for nvfp4 (see `work_scales`).
fn work_scale(dtype: KvDtype, g: f32) -> f32 {
    match dtype {
        KvDtype::Nvfp4 => g * 6.0,
        _ => g,
    }
}

fn round_fp8(x: &[f32], g: f32) -> Vec<f32> {
    x.iter()
        .map(|v| e4m3::decode(e4m3::encode(v / g)) * g)
        .collect()
}

/// What the pages hold for `tokens` tokens of a sequence, dequantized.
fn cached(
    store: &HostPages,
    layer: usize,
    pages: &[PageId],
    tokens: usize,
    part: KvPart,
) -> Vec<f32> {
    let mut all = Vec::new();
    let mut x = vec![0.0f32; DIM];
    for t in 0..tokens {
        let slot = SlotId::new(pages[t / PAGE], t % PAGE, PAGE);
        for h in 0..KV_HEADS {
            store.read_head(layer, part, slot, h, &mut x).unwrap();
            all.extend_from_slice(&x);
        }
    }
    all
}

fn assert_close(a: &[f32], b: &[f32], tolerance: f32, what: &str) {
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= tolerance, "{what}: max abs difference {worst}");
}

/// How close each dtype's attention output stays to f32 attention on uniform random K/V/Q.
fn min_cosine(dtype: KvDtype) -> f32 {
    match dtype {
        KvDtype::Bf16 => 0.9999,
        KvDtype::Fp8 => 0.995,
        KvDtype::Nvfp4 => 0.98,
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb)
}

/// Every cache dtype with every work dtype it takes (FP8 needs global scales: not bf16).
fn work_cases() -> Vec<(KvDtype, WorkDtype)> {
    let mut cases = Vec::new();
    for dtype in KvDtype::ALL {
        for work in [WorkDtype::Bf16, WorkDtype::Fp8] {
            if dtype != KvDtype::Bf16 || work == WorkDtype::Bf16 {
                cases.push((dtype, work));
            }
        }
    }
    cases
}

/// `x` rounded to the `work` dtype of a `dtype` cache whose global scale is `g`.
fn round_work(dtype: KvDtype, work: WorkDtype, x: &[f32], g: f32) -> Vec<f32> {
    match work {
        WorkDtype::Bf16 => round_bf16(x),
        WorkDtype::Fp8 => round_fp8(x, work_scale(dtype, g)),
    }
}

#[test]
fn the_default_work_dtype_is_bf16() {
    for dtype in KvDtype::ALL {
        let kv = crate::KvConfig::new(dtype);
        assert_eq!(kv.work(), WorkDtype::Bf16, "{dtype}");
    }
}

#[test]
fn prefill_attends_over_work_dtype_kv_and_writes_pages() {
    for (dtype, work) in work_cases() {
        let mut rng = StdRng::seed_from_u64(1);
        let (mut pool, mut store) = pool(dtype);
        let mut ws = Workspace::with_dtype(work);
        let n = 19;
        let (q, k, v) = (
            random(&mut rng, n * Q_HEADS * DIM),
            random(&mut rng, n * KV_HEADS * DIM),
            random(&mut rng, n * KV_HEADS * DIM),
        );
        let mut table = PageTable::new();
        let slots: Vec<_> = table
            .append(&mut pool, n)
            .unwrap()
            .into_iter()
            .map(Some)
            .collect();
        let mut out = vec![0.0f32; q.len()];
        let step = Step {
            layer: 1,
            q_heads: Q_HEADS,
            q: &q,
            k: &k,
            v: &v,
        };
        cache(&pool, &mut store, &mut ws)
            .prefill(step, &slots, &[], &mut out)
            .unwrap();
        let (kw, vw) = (
            round_work(dtype, work, &k, 2.0),
            round_work(dtype, work, &v, 0.25),
        );
        let expected = reference(&round_bf16(&q), &kw, &vw, 0);
        assert_close(
            &out,
            &expected,
            1e-5,
            &format!("{dtype}, {} work", work.name()),
        );
        // The pages hold the f32 K quantized directly (not the work-dtype copy).
        let stored = cached(&store, 1, table.pages(), n, KvPart::K);
        let direct: Vec<f32> = k
            .chunks_exact(DIM)
            .flat_map(|x| {
                let bytes = nibble_kvfmt::interchange::encode(dtype, DIM, 2.0, x).unwrap();
                nibble_kvfmt::interchange::decode(dtype, DIM, 2.0, &bytes).unwrap()
            })
            .collect();
        assert_eq!(stored, direct, "{dtype}");
        table.release(&mut pool).unwrap();
        assert_eq!(pool.free_pages(), pool.total_pages());
    }
}

#[test]
fn extend_gathers_the_prefix_into_the_workspace() {
    for (dtype, work_dtype) in work_cases() {
        let mut rng = StdRng::seed_from_u64(2);
        let (mut pool, mut store) = pool(dtype);
        let mut ws = Workspace::with_dtype(work_dtype);
        let (p, n) = (21, 11);
        let total = p + n;
        // Queries of moderate size, so the softmax is not a near one-hot that amplifies rounding.
        let q: Vec<f32> = random(&mut rng, total * Q_HEADS * DIM)
            .iter()
            .map(|x| x / 3.0)
            .collect();
        let k = random(&mut rng, total * KV_HEADS * DIM);
        let v = random(&mut rng, total * KV_HEADS * DIM);
        let (qs, ks) = (Q_HEADS * DIM, KV_HEADS * DIM);
        let mut table = PageTable::new();
        let first: Vec<_> = table
            .append(&mut pool, p)
            .unwrap()
            .into_iter()
            .map(Some)
            .collect();
        let mut out = vec![0.0f32; p * qs];
        let step = Step {
            layer: 0,
            q_heads: Q_HEADS,
            q: &q[..p * qs],
            k: &k[..p * ks],
            v: &v[..p * ks],
        };
        cache(&pool, &mut store, &mut ws)
            .prefill(step, &first, &[], &mut out)
            .unwrap();
        let chunk: Vec<_> = table
            .append(&mut pool, n)
            .unwrap()
            .into_iter()
            .map(Some)
            .collect();
        let mut out = vec![0.0f32; n * qs];
        let step = Step {
            layer: 0,
            q_heads: Q_HEADS,
            q: &q[p * qs..],
            k: &k[p * ks..],
            v: &v[p * ks..],
        };
        cache(&pool, &mut store, &mut ws)
            .extend(
                step,
                SeqPages {
                    pages: table.pages(),
                    window: &[],
                },
                p,
                &chunk,
                &mut out,
            )
            .unwrap();
        // Expected: prefix from the pages rounded to the work dtype, chunk rounded directly.
        let work = |x: &[f32], g: f32| round_work(dtype, work_dtype, x, g);
        let mut kw = work(&cached(&store, 0, table.pages(), p, KvPart::K), 0.5);
        kw.extend(work(&k[p * ks..], 0.5));
        let mut vw = work(&cached(&store, 0, table.pages(), p, KvPart::V), 1.0);
        vw.extend(work(&v[p * ks..], 1.0));
        let expected = reference(&round_bf16(&q[p * qs..]), &kw, &vw, p);
        let what = format!("{dtype}, {} work", work_dtype.name());
        assert_close(&out, &expected, 1e-5, &what);
        // And it stays close to exact attention.
        let exact = reference(&q[p * qs..], &k, &v, p);
        let c = cosine(&out, &exact);
        assert!(c > min_cosine(dtype), "{what}: cosine to f32 attention {c}");
        table.release(&mut pool).unwrap();
    }
}

/// What a test prefills into.
struct Cache<'a> {
    pool: &'a mut PagePool,
    store: &'a mut HostPages,
    ws: &'a mut Workspace,
}

/// Random Q, K and V for `p + extra` tokens, the first `p` prefilled at `layer` into a new page
/// table (and the window `window`, when the store has one).
fn prefill_random(
    rng: &mut StdRng,
    c: Cache<'_>,
    layer: usize,
    p: usize,
    extra: usize,
    window: &[PageId],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, PageTable) {
    let (qs, ks) = (Q_HEADS * DIM, KV_HEADS * DIM);
    let k = random(rng, (p + extra) * ks);
    let v = random(rng, (p + extra) * ks);
    let q: Vec<f32> = random(rng, (p + extra) * qs)
        .iter()
        .map(|x| x / 3.0)
        .collect();
    let mut table = PageTable::new();
    let first: Vec<_> = table
        .append(c.pool, p)
        .unwrap()
        .into_iter()
        .map(Some)
        .collect();
    let mut out = vec![0.0f32; p * qs];
    let step = Step {
        layer,
        q_heads: Q_HEADS,
        q: &q[..p * qs],
        k: &k[..p * ks],
        v: &v[..p * ks],
    };
    cache(c.pool, c.store, c.ws)
        .prefill(step, &first, window, &mut out)
        .unwrap();
    (q, k, v, table)
}

#[test]
fn decode_reads_pages_directly() {
    for dtype in KvDtype::ALL {
        let mut rng = StdRng::seed_from_u64(3);
        let (mut pool, mut store) = pool(dtype);
        let mut ws = Workspace::default();
        let p = 23;
        let (qs, ks) = (Q_HEADS * DIM, KV_HEADS * DIM);
        let cache_of = Cache {
            pool: &mut pool,
            store: &mut store,
            ws: &mut ws,
        };
        let (q, k, v, mut table) = prefill_random(&mut rng, cache_of, 1, p, 3, &[]);
        for t in p..p + 3 {
            let slot = table.append(&mut pool, 1).unwrap()[0];
            let mut out = vec![0.0f32; qs];
            let step = Step {
                layer: 1,
                q_heads: Q_HEADS,
                q: &q[t * qs..(t + 1) * qs],
                k: &k[t * ks..(t + 1) * ks],
                v: &v[t * ks..(t + 1) * ks],
            };
            cache(&pool, &mut store, &mut ws)
                .decode(
                    step,
                    SeqPages {
                        pages: table.pages(),
                        window: &[],
                    },
                    t + 1,
                    slot,
                    &mut out,
                )
                .unwrap();
            let kc = cached(&store, 1, table.pages(), t + 1, KvPart::K);
            let vc = cached(&store, 1, table.pages(), t + 1, KvPart::V);
            let expected = reference(&round_bf16(&q[t * qs..(t + 1) * qs]), &kc, &vc, t);
            assert_close(&out, &expected, 1e-5, dtype.name());
            let exact = reference(
                &q[t * qs..(t + 1) * qs],
                &k[..(t + 1) * ks],
                &v[..(t + 1) * ks],
                t,
            );
            let c = cosine(&out, &exact);
            assert!(
                c > min_cosine(dtype),
                "{dtype}: cosine to f32 attention {c}"
            );
        }
        table.release(&mut pool).unwrap();
        assert_eq!(pool.free_pages(), pool.total_pages());
    }
}

#[test]
fn shape_errors_name_the_buffer() {
    let (mut pool, mut store) = pool(KvDtype::Nvfp4);
    let mut ws = Workspace::default();
    let q = vec![0.0f32; Q_HEADS * DIM];
    let kv = vec![0.0f32; KV_HEADS * DIM];
    let mut out = vec![0.0f32; Q_HEADS * DIM];
    let slot = pool.alloc(1).unwrap()[0];
    let slots = [Some(SlotId::new(slot, 0, PAGE))];
    let step = Step {
        layer: 0,
        q_heads: Q_HEADS,
        q: &q,
        k: &kv[1..],
        v: &kv,
    };
    let err = cache(&pool, &mut store, &mut ws)
        .prefill(step, &slots, &[], &mut out)
        .unwrap_err();
    assert_eq!(err.to_string(), "k: expected 64 values, got 63");
    let step = Step {
        layer: 0,
        q_heads: 3,
        q: &q,
        k: &kv,
        v: &kv,
    };
    let err = cache(&pool, &mut store, &mut ws)
        .prefill(step, &slots, &[], &mut out)
        .unwrap_err();
    assert!(matches!(err, AttentionError::Heads { .. }));
}

/// With a recent window, decode reads the last `W` tokens as BF16 of what was written and older
/// ones from their NVFP4 pages; prefill and decode both keep the window filled.
#[test]
fn decode_reads_the_recent_window_in_bf16_and_older_tokens_from_pages() {
    const W: usize = 16;
    let mut rng = StdRng::seed_from_u64(11);
    let layout = PageLayout::new(LAYERS, KV_HEADS, DIM, PAGE, KvDtype::Nvfp4).unwrap();
    let plan = PoolPlan::for_pages(layout, 16).unwrap();
    let mut pool = PagePool::new(plan);
    let mut store = HostPages::new(plan, GlobalScales::ones(LAYERS), ScaleRule::Mse)
        .unwrap()
        .with_window(W)
        .unwrap();
    let window = pool.alloc(store.window().pages()).unwrap();
    let mut ws = Workspace::default();
    let p = 21;
    let (qs, ks) = (Q_HEADS * DIM, KV_HEADS * DIM);
    let cache_of = Cache {
        pool: &mut pool,
        store: &mut store,
        ws: &mut ws,
    };
    let (q, k, v, mut table) = prefill_random(&mut rng, cache_of, 0, p, 4, &window);
    for t in p..p + 4 {
        let slot = table.append(&mut pool, 1).unwrap()[0];
        let mut out = vec![0.0f32; qs];
        let step = Step {
            layer: 0,
            q_heads: Q_HEADS,
            q: &q[t * qs..(t + 1) * qs],
            k: &k[t * ks..(t + 1) * ks],
            v: &v[t * ks..(t + 1) * ks],
        };
        let seq = SeqPages {
            pages: table.pages(),
            window: &window,
        };
        cache(&pool, &mut store, &mut ws)
            .decode(step, seq, t + 1, slot, &mut out)
            .unwrap();
        // What decode must have read: pages for positions before t + 1 - W, BF16 after.
        let mut kc = cached(&store, 0, table.pages(), t + 1, KvPart::K);
        let mut vc = cached(&store, 0, table.pages(), t + 1, KvPart::V);
        for j in t + 1 - W..=t {
            for (c, x) in [(&mut kc, &k), (&mut vc, &v)] {
                for i in j * ks..(j + 1) * ks {
                    c[i] = bf16::round(x[i]);
                }
            }
        }
        let expected = reference(&round_bf16(&q[t * qs..(t + 1) * qs]), &kc, &vc, t);
        assert_close(&out, &expected, 1e-5, "nvfp4 with a window");
        // Closer to f32 attention than without the window.
        let exact = reference(
            &q[t * qs..(t + 1) * qs],
            &k[..(t + 1) * ks],
            &v[..(t + 1) * ks],
            t,
        );
        let pages_only = reference(
            &round_bf16(&q[t * qs..(t + 1) * qs]),
            &cached(&store, 0, table.pages(), t + 1, KvPart::K),
            &cached(&store, 0, table.pages(), t + 1, KvPart::V),
            t,
        );
        assert!(
            cosine(&out, &exact) > cosine(&pages_only, &exact),
            "token {t}"
        );
    }
}
