//! The recent window on the GPU: quantize-on-write with a window writes the bytes
//! `HostPages::write_kv` and `HostPages::write_window` write together (a prefill's many rows and
//! a decode step's one row per sequence, under either block-scale rule: the mse rule's eight
//! lanes per block and one thread per block), and decode over NVFP4 pages
//! plus a BF16 window matches the CPU reference within the decode tolerance, for contexts
//! shorter than the window, equal to it, and longer (the window's first token anywhere in a
//! 16-token tile), at the default window (48 tokens) and at 64.

use super::*;

const WINDOWS: [usize; 2] = [48, 64];

pub(crate) fn check_window(kernels: &Kernels, geo: &Geometry) -> Result<usize> {
    let mut failures = 0;
    for window in WINDOWS {
        failures += check_one_window(kernels, geo, window)?;
    }
    Ok(failures)
}

fn check_one_window(kernels: &Kernels, geo: &Geometry, window_tokens: usize) -> Result<usize> {
    let stream = kernels.stream();
    let dtype = KvDtype::Nvfp4;
    let mut rng = StdRng::seed_from_u64(0x3d0 ^ geo.head_dim as u64 ^ window_tokens as u64);
    let layout = PageLayout::new(geo.layers, geo.kv_heads, geo.head_dim, PAGE, dtype)?;
    let w = window_tokens;
    let contexts = [1usize, 40, w, w + 1, w + 13, 333, 2100];
    let scales = GlobalScales {
        k: vec![1.0, 0.37],
        v: vec![1.0, 1.9],
    };
    let probe = HostPages::new(
        PoolPlan::for_pages(layout, 1)?,
        scales.clone(),
        ScaleRule::Mse,
    )?
    .with_window(window_tokens)?;
    let wp = probe.window().pages();
    let token_pages: usize = contexts.iter().map(|c| c.div_ceil(PAGE)).sum();
    let plan = PoolPlan::for_pages(layout, token_pages + contexts.len() * wp)?;
    let mut pool = PagePool::new(plan);
    let geom = PageGeom::new(&layout, LAYER)?;
    let wgeom = WindowGeom::new(probe.window(), &layout, LAYER);
    let name = format!("D={} H={} W={w}", geo.head_dim, geo.kv_heads);
    let mut failures = 0;
    let per_token = geo.kv_heads * geo.head_dim;

    // Every sequence: its pages (in random order), its window's pages, its K and V.
    let mut seqs = Vec::new();
    for &ctx in &contexts {
        let mut pages = pool.alloc(ctx.div_ceil(PAGE))?;
        pages.shuffle(&mut rng);
        let window = pool.alloc(wp)?;
        let (k, v) = (
            values(&mut rng, ctx * per_token),
            values(&mut rng, ctx * per_token),
        );
        seqs.push((ctx, pages, window, k, v));
    }
    let slots_of = |pages: &[PageId], tokens: std::ops::Range<usize>| -> Vec<Option<SlotId>> {
        tokens
            .map(|t| Some(SlotId::new(pages[t / PAGE], t % PAGE, PAGE)))
            .collect()
    };
    let mut tables = Vec::new();
    for (_, _, window, _, _) in &seqs {
        tables.extend(window.iter().map(|p| p.0));
    }

    // Quantize-on-write with the window, into a zeroed pool on the GPU: each sequence as a
    // prefill (all rows but the last three) and then decode steps (one row each), against the
    // CPU writing every token into its page and the window. The mse rule takes the eight-lane
    // kernel, the amax rule the one-thread-per-block kernel.
    let mut store = None;
    for rule in [ScaleRule::Mse, ScaleRule::Amax] {
        let mut cpu = HostPages::new(plan, scales.clone(), rule)?.with_window(window_tokens)?;
        for (ctx, pages, window, k, v) in &seqs {
            cpu.write_kv(&pool, LAYER, k, v, &slots_of(pages, 0..*ctx))?;
            cpu.write_window(&pool, window, LAYER, k, v, 0..*ctx, *ctx)?;
        }
        let cpu_bytes = pool_bytes(&cpu, plan.pages)?;
        let mut dev = stream.clone_htod(&vec![0u8; cpu_bytes.len()])?;
        for (ctx, pages, window, k, v) in &seqs {
            let table: Vec<u32> = window.iter().map(|p| p.0).collect();
            let dt = stream.clone_htod(&table)?;
            let prefill = ctx.saturating_sub(3).max(1);
            let mut write = |rows: std::ops::Range<usize>| -> Result<()> {
                let values = rows.start * per_token..rows.end * per_token;
                let (dk, dv) = (
                    stream.clone_htod(&k[values.clone()])?,
                    stream.clone_htod(&v[values])?,
                );
                let slots: Vec<u32> = slots_of(pages, rows.clone())
                    .iter()
                    .map(|s| s.map_or(u32::MAX, |s| s.0))
                    .collect();
                let (ds, dl) = (
                    stream.clone_htod(&slots)?,
                    stream.clone_htod(&[rows.end as u32])?,
                );
                let kv = NewKv {
                    k: dk.as_view(),
                    v: dv.as_view(),
                    scales: KvScales::of_layer(&scales, LAYER),
                    rule,
                    k_codes: None,
                };
                let window = WindowRows {
                    geom: wgeom,
                    table: dt.as_view(),
                    lens: dl.as_view(),
                    rows_per_seq: rows.len(),
                };
                // SAFETY: the slots and the window's pages are this pool's, the geometries its
                // layout's, and the length covers the rows.
                unsafe {
                    kernels.quantize_unchecked(
                        &mut dev,
                        geom,
                        dtype,
                        &kv,
                        &ds.as_view(),
                        Some(&window),
                    )
                }?;
                Ok(())
            };
            write(0..prefill)?;
            for t in prefill..*ctx {
                write(t..t + 1)?;
            }
        }
        let diff = differing(&cpu_bytes, &stream.clone_dtoh(&dev)?);
        failures += report(
            &format!("quantize-on-write with a window {name}, {rule:?} scales"),
            diff == 0,
            &format!("{diff} of {} pool bytes differ", cpu_bytes.len()),
        );
        if rule == ScaleRule::Mse {
            store = Some((cpu, cpu_bytes));
        }
    }
    let (store, cpu_bytes) = store.expect("the mse rule ran");

    // Decode of every sequence in one launch, and of the longest alone (several splits).
    let qn = geo.q_heads * geo.head_dim;
    let q: Vec<f32> = (0..contexts.len() * qn)
        .map(|_| rng.gen_range(-3.0f32..3.0))
        .collect();
    let mut cpu_out = vec![0.0f32; q.len()];
    let mut scratch = DecodeScratch::default();
    for (i, (ctx, pages, window, _, _)) in seqs.iter().enumerate() {
        let args = DecodeArgs {
            layer: LAYER,
            q_heads: geo.q_heads,
            q: &q[i * qn..(i + 1) * qn],
            seq: SeqPages { pages, window },
            context: *ctx,
        };
        scratch.decode(&store, args, &mut cpu_out[i * qn..(i + 1) * qn])?;
    }
    let dev_pages = stream.clone_htod(&cpu_bytes)?;
    let max_pages = seqs.iter().map(|s| s.1.len()).max().unwrap_or(1);
    let mut table = vec![0u32; seqs.len() * max_pages];
    for (i, (_, pages, _, _, _)) in seqs.iter().enumerate() {
        for (j, p) in pages.iter().enumerate() {
            table[i * max_pages + j] = p.0;
        }
    }
    let mut ws = DecodeWorkspace::new(kernels)?;
    let n = seqs.len();
    for batch_seqs in [0..n, n - 1..n] {
        let first = batch_seqs.start;
        let ctx32: Vec<u32> = contexts[batch_seqs.clone()]
            .iter()
            .map(|c| *c as u32)
            .collect();
        let (dq, dtable, dctx, dwin) = (
            stream.clone_htod(&q[first * qn..batch_seqs.end * qn])?,
            stream.clone_htod(&table[first * max_pages..batch_seqs.end * max_pages])?,
            stream.clone_htod(&ctx32)?,
            stream.clone_htod(&tables[first * wp..batch_seqs.end * wp])?,
        );
        let batch = DecodeBatch {
            q: dq.as_view(),
            q_heads: geo.q_heads,
            page_table: dtable.as_view(),
            max_pages,
            context: dctx.as_view(),
            max_context: *contexts[batch_seqs.clone()].iter().max().unwrap_or(&1),
            scales: KvScales::of_layer(&scales, LAYER),
            softmax_scale: 1.0 / (geo.head_dim as f32).sqrt(),
            window: wgeom,
            window_table: Some(dwin.as_view()),
        };
        let mut dout = stream.clone_htod(&vec![f32::NAN; batch_seqs.len() * qn])?;
        let out = DecodeOut {
            values: dout.as_view_mut(),
            bf16: None,
        };
        kernels.decode(&dev_pages, geom, dtype, &batch, &mut ws, out)?;
        let gpu_out = stream.clone_dtoh(&dout)?;
        for (i, ctx) in contexts[batch_seqs.clone()].iter().enumerate() {
            let c = &cpu_out[(first + i) * qn..(first + i + 1) * qn];
            let (rel, max_abs, finite) = compare(c, &gpu_out[i * qn..(i + 1) * qn]);
            failures += report(
                &format!(
                    "decode with a window {name} of {}: context {ctx}",
                    batch_seqs.len()
                ),
                finite && rel <= tolerance(KvDtype::Bf16),
                &format!(
                    "relative L2 error {rel:.2e} (limit {:.0e}), max abs error {max_abs:.2e}",
                    tolerance(KvDtype::Bf16)
                ),
            );
        }
    }
    Ok(failures)
}
