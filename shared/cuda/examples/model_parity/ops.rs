//! Op-level checks of the CUDA backend against the CPU backend on random inputs (run before the
//! whole-model parity, so a mismatch points at one kernel): every dense op, RoPE in both
//! pairings, the contiguous-cache attention, and the paged paths (prefill, extend, batched decode)
//! with their page bytes, for each KV dtype.

use anyhow::Result;
use nibble_cuda::CudaBackend;
use nibble_engine::backend::{
    AttentionArgs, AttnGeometry, Backend, PageEncoding, PagedSeq, RopeArgs,
};
use nibble_engine::kv::StepTokens;
use nibble_engine::paged::WorkDtype;
use nibble_engine::{CpuBackend, RopeStyle};
use nibble_kvcache::{GlobalScales, PagePool, PageTable, PoolPlan};
use nibble_kvfmt::{KvDtype, PageLayout, ScaleRule};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

fn down<B: Backend>(b: &B, t: &B::Tensor) -> Vec<f32> {
    let (rows, _) = b.shape(t);
    let mut out = Vec::new();
    b.download_rows(t, 0..rows, &mut out).expect("download");
    out
}

/// (max |a − b|, max |a|).
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    (d, a.iter().fold(0.0f32, |m, v| m.max(v.abs())))
}

fn report(name: &str, a: &[f32], b: &[f32], tol: f32) -> bool {
    let (d, scale) = diff(a, b);
    let ok = d <= tol * scale.max(1.0) && b.iter().all(|v| v.is_finite());
    println!(
        "{{\"op\":\"{name}\",\"max_abs_diff\":{d:.3e},\"max_abs\":{scale:.3},\"tol_rel\":{tol:.1e},\"ok\":{ok}}}"
    );
    ok
}

/// `matmul_t` of random `[n, k]` inputs and `[m, k]` weights (uploaded as a model's weights are:
/// BF16 on a BF16-weight backend) on both backends, within `tol` of the largest output.
fn check_matmul(
    cpu: &CpuBackend,
    gpu: &CudaBackend,
    rng: &mut StdRng,
    (n, k, m): (usize, usize, usize),
    name: &str,
    tol: f32,
) -> Result<bool> {
    let x = values(rng, n * k);
    let w = values(rng, m * k);
    let (xc, xg) = (cpu.upload(n, k, &x)?, gpu.upload(n, k, &x)?);
    let (wc, wg) = (
        cpu.upload_matrix(m, k, w.clone())?,
        gpu.upload_matrix(m, k, w)?,
    );
    let (mut oc, mut og) = (cpu.zeros(n, m), gpu.zeros(n, m));
    cpu.matmul_t(&xc, &wc, &mut oc)?;
    gpu.matmul_t(&xg, &wg, &mut og)?;
    Ok(report(
        &format!("{name} {n}x{k}x{m}"),
        &down(cpu, &oc),
        &down(gpu, &og),
        tol,
    ))
}

/// Both backends' tensors for the same host data.
struct Pair<'a> {
    cpu: &'a CpuBackend,
    gpu: &'a CudaBackend,
}

impl Pair<'_> {
    fn up(
        &self,
        rows: usize,
        cols: usize,
        d: &[f32],
    ) -> Result<(
        <CpuBackend as Backend>::Tensor,
        <CudaBackend as Backend>::Tensor,
    )> {
        Ok((
            self.cpu.upload(rows, cols, d)?,
            self.gpu.upload(rows, cols, d)?,
        ))
    }
}

pub fn check_ops(cpu: &CpuBackend, gpu: &CudaBackend) -> Result<bool> {
    let mut rng = StdRng::seed_from_u64(7);
    let p = Pair { cpu, gpu };
    let mut ok = true;
    // matmul_t: decode-like (n = 1), prefill-like and odd shapes.
    for (n, k, m) in [(1, 576, 1536), (37, 576, 192), (5, 1536, 576), (3, 17, 33)] {
        ok &= check_matmul(cpu, gpu, &mut rng, (n, k, m), "matmul_t", 1e-5)?;
    }
    let (rows, cols) = (7, 576);
    let x = values(&mut rng, rows * cols);
    let y = values(&mut rng, rows * cols);
    let w = values(&mut rng, cols);
    let (xc, xg) = p.up(rows, cols, &x)?;
    let (yc, yg) = p.up(rows, cols, &y)?;
    let (wc, wg) = p.up(1, cols, &w)?;
    {
        let (mut a, mut b) = (cpu.zeros(rows, cols), gpu.zeros(rows, cols));
        cpu.rms_norm(&xc, &wc, 1e-5, &mut a)?;
        gpu.rms_norm(&xg, &wg, 1e-5, &mut b)?;
        ok &= report("rms_norm", &down(cpu, &a), &down(gpu, &b), 1e-6);
        let (hc, hg) = p.up(1, 64, &w[..64])?;
        cpu.rms_norm(&xc, &hc, 1e-6, &mut a)?;
        gpu.rms_norm(&xg, &hg, 1e-6, &mut b)?;
        ok &= report("rms_norm per head", &down(cpu, &a), &down(gpu, &b), 1e-6);
    }
    {
        let (mut a, mut b) = (p.up(rows, cols, &x)?.0, p.up(rows, cols, &x)?.1);
        cpu.add(&mut a, &yc)?;
        gpu.add(&mut b, &yg)?;
        ok &= report("add", &down(cpu, &a), &down(gpu, &b), 0.0);
        cpu.add_bias(&mut a, &wc)?;
        gpu.add_bias(&mut b, &wg)?;
        ok &= report("add_bias", &down(cpu, &a), &down(gpu, &b), 0.0);
        cpu.mul_cols(&mut a, &wc)?;
        gpu.mul_cols(&mut b, &wg)?;
        ok &= report("mul_cols", &down(cpu, &a), &down(gpu, &b), 0.0);
        // The Hadamard rotation of head vectors, bit-identical to the CPU's.
        for d in [64, 128] {
            let mut original = down(cpu, &a);
            original.truncate(original.len() / d * d);
            let (_, src) = p.up(1, original.len(), &original)?;
            let mut host = original.clone();
            nibble_engine::hadamard::rotate(&mut host, d);
            let mut dst = gpu.zeros(0, 0);
            gpu.rotate_heads(&src, &mut dst, d)?;
            ok &= report(&format!("hadamard {d}"), &host, &down(gpu, &dst), 0.0);
            // H is its own inverse: rotating again (in place) gives the input back.
            gpu.rotate_heads_in_place(&mut dst, d)?;
            ok &= report(
                &format!("hadamard {d} twice"),
                &original,
                &down(gpu, &dst),
                1e-6,
            );
            // Q, K and V of different lengths in one launch.
            let parts = [&original[..], &original[..2 * d], &original[d..3 * d]];
            let mut out = [gpu.zeros(0, 0), gpu.zeros(0, 0), gpu.zeros(0, 0)];
            let ups = parts
                .iter()
                .map(|x| p.up(1, x.len(), x).map(|t| t.1))
                .collect::<Result<Vec<_>>>()?;
            gpu.rotate_qkv([&ups[0], &ups[1], &ups[2]], &mut out, d)?;
            for (i, (x, y)) in parts.iter().zip(&out).enumerate() {
                let mut want = x.to_vec();
                nibble_engine::hadamard::rotate(&mut want, d);
                ok &= report(&format!("hadamard {d} qkv[{i}]"), &want, &down(gpu, y), 0.0);
            }
        }
        cpu.silu_mul(&mut a, &yc)?;
        gpu.silu_mul(&mut b, &yg)?;
        ok &= report("silu_mul", &down(cpu, &a), &down(gpu, &b), 1e-6);
    }
    {
        // add_rms_norm: the CPU's add then rms_norm (the trait's default), and the GPU's fused
        // kernel, which must give the bits of the GPU's own two kernels.
        let (mut a, mut b) = (p.up(rows, cols, &x)?.0, p.up(rows, cols, &x)?.1);
        let (mut na, mut nb) = (cpu.zeros(rows, cols), gpu.zeros(rows, cols));
        cpu.add_rms_norm(&mut a, &yc, &wc, 1e-5, &mut na)?;
        gpu.add_rms_norm(&mut b, &yg, &wg, 1e-5, &mut nb)?;
        ok &= report("add_rms_norm: sum", &down(cpu, &a), &down(gpu, &b), 0.0);
        ok &= report("add_rms_norm: norm", &down(cpu, &na), &down(gpu, &nb), 1e-6);
        let mut two = p.up(rows, cols, &x)?.1;
        let mut n2 = gpu.zeros(rows, cols);
        gpu.add(&mut two, &yg)?;
        gpu.rms_norm(&two, &wg, 1e-5, &mut n2)?;
        ok &= report(
            "add_rms_norm = add, rms_norm (cuda)",
            &down(gpu, &nb),
            &down(gpu, &n2),
            0.0,
        );
    }
    {
        let table = values(&mut rng, 50 * cols);
        let (tc, tg) = p.up(50, cols, &table)?;
        let tokens = [3u32, 49, 0, 7];
        let (mut a, mut b) = (cpu.zeros(4, cols), gpu.zeros(4, cols));
        cpu.embed(&tc, &tokens, &mut a)?;
        gpu.embed(&tg, &tokens, &mut b)?;
        ok &= report("embed", &down(cpu, &a), &down(gpu, &b), 0.0);
    }
    {
        // argmax_rows: random rows of a 49,152-token vocabulary, ties (first wins), a NaN
        // first (0), NaNs elsewhere (ignored), all -inf (0), a row of one value.
        let vocab = 49152;
        let mut rows: Vec<Vec<f32>> = (0..5).map(|_| values(&mut rng, vocab)).collect();
        rows[1][100] = 9.0;
        rows[1][40000] = 9.0;
        rows[2][0] = f32::NAN;
        rows[3][7] = f32::NAN;
        rows[3][vocab - 1] = 5.0;
        rows.push(vec![f32::NEG_INFINITY; vocab]);
        rows.push(vec![1.5; vocab]);
        let flat: Vec<f32> = rows.concat();
        let (tc, tg) = p.up(rows.len(), vocab, &flat)?;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        cpu.argmax_rows(&tc, &mut a)?;
        gpu.argmax_rows(&tg, &mut b)?;
        let same = a == b;
        println!("{{\"op\":\"argmax_rows\",\"cpu\":{a:?},\"cuda\":{b:?},\"ok\":{same}}}");
        ok &= same;
    }
    for style in [RopeStyle::Interleaved, RopeStyle::HalfSplit] {
        let (hd, max_pos) = (64, 100);
        let cos: Vec<f32> = (0..max_pos * hd / 2)
            .map(|i| (i as f32 * 0.01).cos())
            .collect();
        let sin: Vec<f32> = (0..max_pos * hd / 2)
            .map(|i| (i as f32 * 0.01).sin())
            .collect();
        let (cc, cg) = p.up(max_pos, hd / 2, &cos)?;
        let (sc, sg) = p.up(max_pos, hd / 2, &sin)?;
        let (mut a, mut b) = (p.up(rows, cols, &x)?.0, p.up(rows, cols, &x)?.1);
        let positions = [0u32, 5, 6, 7, 50, 98, 99];
        cpu.rope(
            &mut a,
            &positions,
            &RopeArgs {
                cos: &cc,
                sin: &sc,
                style,
                head_dim: hd,
            },
        )?;
        gpu.rope(
            &mut b,
            &positions,
            &RopeArgs {
                cos: &cg,
                sin: &sg,
                style,
                head_dim: hd,
            },
        )?;
        ok &= report(
            &format!("rope {style:?}"),
            &down(cpu, &a),
            &down(gpu, &b),
            1e-6,
        );
        // Queries and keys in one launch: the bits of the two single launches.
        let keys = values(&mut rng, rows * 3 * hd);
        let args = RopeArgs {
            cos: &cg,
            sin: &sg,
            style,
            head_dim: hd,
        };
        let (mut q1, mut k1) = (p.up(rows, cols, &x)?.1, p.up(rows, 3 * hd, &keys)?.1);
        gpu.rope_qk(&mut q1, &mut k1, &positions, &args)?;
        let mut k2 = p.up(rows, 3 * hd, &keys)?.1;
        gpu.rope(&mut k2, &positions, &args)?;
        let same = down(gpu, &q1) == down(gpu, &b) && down(gpu, &k1) == down(gpu, &k2);
        println!("{{\"op\":\"rope_qk {style:?}\",\"bits_equal_rope\":{same},\"ok\":{same}}}");
        ok &= same;
    }
    // Contiguous-cache attention: 9 query heads over 3 KV heads, 6 new rows of a 40-token context.
    let geometry = AttnGeometry {
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        scale: 0.125,
    };
    {
        let (n, ctx) = (6, 40);
        let q = values(&mut rng, (n + 2) * 9 * 64);
        let k = values(&mut rng, ctx * 3 * 64);
        let v = values(&mut rng, ctx * 3 * 64);
        let (qc, qg) = p.up(n + 2, 9 * 64, &q)?;
        let (kc, kg) = p.up(ctx, 3 * 64, &k)?;
        let (vc, vg) = p.up(ctx, 3 * 64, &v)?;
        let (mut a, mut b) = (cpu.zeros(n + 2, 9 * 64), gpu.zeros(n + 2, 9 * 64));
        let args_c = AttentionArgs {
            q: &qc,
            q_rows: 1..1 + n,
            k: &kc,
            v: &vc,
            kv_len: ctx,
            geometry,
        };
        let args_g = AttentionArgs {
            q: &qg,
            q_rows: 1..1 + n,
            k: &kg,
            v: &vg,
            kv_len: ctx,
            geometry,
        };
        cpu.attention(&args_c, &mut a)?;
        gpu.attention(&args_g, &mut b)?;
        ok &= report(
            "attention (contiguous f32)",
            &down(cpu, &a),
            &down(gpu, &b),
            1e-5,
        );
    }
    // Each cache with its served work dtype, then fp8 and nvfp4 with a BF16 prefill workspace.
    for (dtype, work) in [
        (KvDtype::Bf16, WorkDtype::Bf16),
        (KvDtype::Fp8, WorkDtype::Fp8),
        (KvDtype::Nvfp4, WorkDtype::Fp8),
        (KvDtype::Fp8, WorkDtype::Bf16),
        (KvDtype::Nvfp4, WorkDtype::Bf16),
    ] {
        ok &= check_paged(cpu, gpu, dtype, work, geometry, &mut rng)?;
    }
    Ok(ok)
}

/// Two sequences through one layer: A prefills 20 tokens, then B prefills 9 while A extends by
/// 13, then both decode one token in one step, prefill and extend over a `work` workspace.
/// Outputs and every page's bytes are compared.
fn check_paged(
    cpu: &CpuBackend,
    gpu: &CudaBackend,
    dtype: KvDtype,
    work: WorkDtype,
    geometry: AttnGeometry,
    rng: &mut StdRng,
) -> Result<bool> {
    let (qw, kw) = (geometry.num_heads * 64, geometry.num_kv_heads * 64);
    let layout = PageLayout::new(2, geometry.num_kv_heads, 64, 16, dtype)?;
    let plan = PoolPlan::for_pages(layout, 16)?;
    let scales = GlobalScales {
        k: vec![0.02, 0.03],
        v: vec![0.025, 0.015],
    };
    let mut pool = PagePool::new(plan);
    let encoding = PageEncoding {
        scales,
        hadamard: false,
        scale_rule: ScaleRule::default(),
        k_codes: None,
        window: 0,
        prefill_work: work,
    };
    let mut pc = cpu.new_pages(plan, encoding.clone())?;
    let mut pg = gpu.new_pages(plan, encoding)?;
    let (mut ta, mut tb) = (PageTable::new(), PageTable::new());
    let layer = 1;
    let mut ok = true;
    // (new tokens of A, new tokens of B); 0 = absent.
    for (step_no, (na, nb)) in [(20usize, 0usize), (13, 9), (1, 1)].into_iter().enumerate() {
        let (sa, sb) = (ta.len(), tb.len());
        let slots_a = if na > 0 {
            ta.append(&mut pool, na)?
        } else {
            vec![]
        };
        let slots_b = if nb > 0 {
            tb.append(&mut pool, nb)?
        } else {
            vec![]
        };
        let rows = na + nb;
        let q = values(rng, rows * qw);
        let k: Vec<f32> = values(rng, rows * kw).iter().map(|x| x * 1.5).collect();
        let v = values(rng, rows * kw);
        let mut spans = vec![];
        let mut seqs = vec![];
        if na > 0 {
            spans.push(0..na);
            seqs.push(PagedSeq {
                pages: ta.pages(),
                stored: sa,
                slots: &slots_a,
                window: &[],
            });
        }
        if nb > 0 {
            spans.push(na..rows);
            seqs.push(PagedSeq {
                pages: tb.pages(),
                stored: sb,
                slots: &slots_b,
                window: &[],
            });
        }
        let (qc, kc, vc) = (
            cpu.upload(rows, qw, &q)?,
            cpu.upload(rows, kw, &k)?,
            cpu.upload(rows, kw, &v)?,
        );
        let (qg, kg, vg) = (
            gpu.upload(rows, qw, &q)?,
            gpu.upload(rows, kw, &k)?,
            gpu.upload(rows, kw, &v)?,
        );
        let (mut oc, mut og) = (cpu.zeros(rows, qw), gpu.zeros(rows, qw));
        let step_c = StepTokens {
            q: &qc,
            k: &kc,
            v: &vc,
            spans: &spans,
            geometry,
        };
        let step_g = StepTokens {
            q: &qg,
            k: &kg,
            v: &vg,
            spans: &spans,
            geometry,
        };
        cpu.paged_attention(&mut pc, &pool, layer, &step_c, &seqs, &mut oc)?;
        gpu.paged_attention(&mut pg, &pool, layer, &step_g, &seqs, &mut og)?;
        // Prefill/extend attend over the same work-dtype values as the CPU; decode runs f16
        // products on the tensor cores, hence the looser bound at step 2.
        let tol = if step_no == 2 { 2e-2 } else { 2e-3 };
        ok &= report(
            &format!(
                "paged {dtype:?} ({} work) step {step_no} (A +{na}, B +{nb})",
                work.name()
            ),
            &down(cpu, &oc),
            &down(gpu, &og),
            tol,
        );
        // Commit: tables already hold the new tokens.
    }
    let mut same = true;
    let (mut bc, mut bg) = (Vec::new(), Vec::new());
    for page in ta.pages().iter().chain(tb.pages()) {
        cpu.read_page(&pc, *page, &mut bc)?;
        gpu.read_page(&pg, *page, &mut bg)?;
        same &= bc == bg;
    }
    // write_page round trip: a CPU page into a GPU page.
    let page = ta.pages()[0];
    cpu.read_page(&pc, page, &mut bc)?;
    gpu.write_page(&mut pg, &pool, page, &bc)?;
    gpu.read_page(&pg, page, &mut bg)?;
    same &= bc == bg;
    println!(
        "{{\"op\":\"paged {dtype:?} ({} work) page bytes\",\"identical\":{same}}}",
        work.name()
    );
    Ok(ok && same)
}

/// BF16 weights: GEMMs of 1 to 16 rows against the CPU; and a GEMM input is cast to BF16 once
/// for the GEMMs that read it in turn (Q, K and V; gate and up), and cast again once it changes. Against the CPU (f32 weights rounded to BF16
/// on upload by the GPU only, so within BF16's error): a GEMM, a second GEMM of the same input
/// (the cast reused), the input changed in place, then the first GEMM again (a stale cast would
/// be off by the whole change).
pub fn check_bf16_cast(cpu: &CpuBackend, gpu: &CudaBackend) -> Result<bool> {
    let mut rng = StdRng::seed_from_u64(11);
    let mut ok = true;
    // The weight-streaming kernel (1 and 2 rows) and cuBLAS (more), with a number of outputs
    // that leaves the last block one row of its four.
    for n in [1, 2, 5, 8, 16] {
        ok &= check_matmul(
            cpu,
            gpu,
            &mut rng,
            (n, 1536, 577),
            "matmul_t bf16 weights",
            1e-2,
        )?;
    }
    let (n, k, m) = (3, 576, 192);
    let x = values(&mut rng, n * k);
    let y = values(&mut rng, n * k);
    let (w1, w2) = (values(&mut rng, m * k), values(&mut rng, m * k));
    let (mut xc, mut xg) = (cpu.upload(n, k, &x)?, gpu.upload(n, k, &x)?);
    let (yc, yg) = (cpu.upload(n, k, &y)?, gpu.upload(n, k, &y)?);
    let (w1c, w1g) = (
        cpu.upload_matrix(m, k, w1.clone())?,
        gpu.upload_matrix(m, k, w1)?,
    );
    let (w2c, w2g) = (
        cpu.upload_matrix(m, k, w2.clone())?,
        gpu.upload_matrix(m, k, w2)?,
    );
    let (mut oc, mut og) = (cpu.zeros(n, m), gpu.zeros(n, m));
    for (name, first) in [("first", true), ("same input", false)] {
        let (wc, wg) = if first { (&w1c, &w1g) } else { (&w2c, &w2g) };
        cpu.matmul_t(&xc, wc, &mut oc)?;
        gpu.matmul_t(&xg, wg, &mut og)?;
        ok &= report(
            &format!("matmul_t bf16 weights, {name}"),
            &down(cpu, &oc),
            &down(gpu, &og),
            1e-2,
        );
    }
    cpu.add(&mut xc, &yc)?;
    gpu.add(&mut xg, &yg)?;
    cpu.matmul_t(&xc, &w1c, &mut oc)?;
    gpu.matmul_t(&xg, &w1g, &mut og)?;
    ok &= report(
        "matmul_t bf16 weights, input changed",
        &down(cpu, &oc),
        &down(gpu, &og),
        1e-2,
    );
    for n in [1, 2, 5, 12] {
        for parts in [2, 3] {
            ok &= check_matmul_many(gpu, &mut rng, n, parts)?;
        }
    }
    ok &= check_fused_casts(gpu, &mut rng)?;
    for n in [1, 2, 5] {
        ok &= check_matmul_swiglu(gpu, &mut rng, n)?;
    }
    Ok(ok)
}

/// `matmul_swiglu` (one launch at 1 and 2 rows) against `matmul_t_many` then `silu_mul`: the
/// same bits in gate and up, and the down projection that reads the activation's cast the same
/// bits too. Twice in a row with other inputs, so a counter left behind by the first launch
/// would show in the second; features that leave the last block one row of its four.
fn check_matmul_swiglu(gpu: &CudaBackend, rng: &mut StdRng, n: usize) -> Result<bool> {
    let (k, m) = (576, 1537);
    let w_gate = gpu.upload_matrix(m, k, values(rng, m * k))?;
    let w_up = gpu.upload_matrix(m, k, values(rng, m * k))?;
    let w_down = gpu.upload_matrix(k, m, values(rng, k * m))?;
    let mut same = true;
    for _ in 0..2 {
        let x = gpu.upload(n, k, &values(rng, n * k))?;
        let (mut gate, mut up) = (gpu.zeros(n, m), gpu.zeros(n, m));
        gpu.matmul_swiglu(&x, &w_gate, &w_up, &mut gate, &mut up)?;
        let mut down_fused = gpu.zeros(n, k);
        gpu.matmul_t(&gate, &w_down, &mut down_fused)?;
        let (mut g2, mut u2) = (gpu.zeros(n, m), gpu.zeros(n, m));
        gpu.matmul_t_many(&x, &[&w_gate, &w_up], &mut [&mut g2, &mut u2])?;
        gpu.silu_mul(&mut g2, &u2)?;
        let mut down_apart = gpu.zeros(n, k);
        gpu.matmul_t(&g2, &w_down, &mut down_apart)?;
        for (a, b) in [(&gate, &g2), (&up, &u2), (&down_fused, &down_apart)] {
            same &= down(gpu, a)
                .iter()
                .zip(down(gpu, b))
                .all(|(p, q)| p.to_bits() == q.to_bits());
        }
    }
    println!(
        "{{\"op\":\"matmul_swiglu bf16 weights\",\"rows\":{n},\"identical_to_matmul_t_many_and_silu_mul\":{same}}}"
    );
    Ok(same)
}

/// RMSNorm, the fused add + RMSNorm and SwiGLU write their output's BF16 cast as they go, and
/// the GEMM that reads the output uses it without casting: the product must be the same bits
/// as after a cast made from the output itself (an add of zeros makes the output a new state
/// with the same values, so the GEMM casts it afresh).
fn check_fused_casts(gpu: &CudaBackend, rng: &mut StdRng) -> Result<bool> {
    let (n, k, m) = (3, 576, 64);
    let w = gpu.upload_matrix(m, k, values(rng, m * k))?;
    let norm_w = gpu.upload(1, k, &values(rng, k))?;
    let zeros = gpu.zeros(n, k);
    let mut x = gpu.upload(n, k, &values(rng, n * k))?;
    let y = gpu.upload(n, k, &values(rng, n * k))?;
    let up = gpu.upload(n, k, &values(rng, n * k))?;
    let mut out = gpu.zeros(n, k);
    let mut ok = true;
    for op in ["rms_norm", "add_rms_norm", "silu_mul"] {
        match op {
            "rms_norm" => gpu.rms_norm(&x, &norm_w, 1e-5, &mut out),
            "add_rms_norm" => gpu.add_rms_norm(&mut x, &y, &norm_w, 1e-5, &mut out),
            _ => gpu.silu_mul(&mut out, &up),
        }?;
        let (mut fused, mut fresh) = (gpu.zeros(n, m), gpu.zeros(n, m));
        gpu.matmul_t(&out, &w, &mut fused)?;
        gpu.add(&mut out, &zeros)?;
        gpu.matmul_t(&out, &w, &mut fresh)?;
        let same = down(gpu, &fused)
            .iter()
            .zip(down(gpu, &fresh))
            .all(|(a, b)| a.to_bits() == b.to_bits());
        println!(
            "{{\"op\":\"{op} then matmul_t bf16 weights\",\"fused_cast_identical_to_cast\":{same}}}"
        );
        ok &= same;
    }
    Ok(ok)
}

/// `matmul_t_many` on the GPU (one launch over 2 or 3 BF16 matrices: the weight-streaming kernel
/// at 1-2 rows, the skinny tensor-core GEMM at 5 and 12) against `matmul_t` per matrix: the same
/// values, bit for bit. Row counts that are
/// not multiples of the kernel's 4 rows per block put block boundaries inside the matrices.
fn check_matmul_many(gpu: &CudaBackend, rng: &mut StdRng, n: usize, parts: usize) -> Result<bool> {
    let k = 576;
    let rows = [192usize, 1538, 63];
    let x = gpu.upload(n, k, &values(rng, n * k))?;
    let mut ws = Vec::new();
    for &m in &rows[..parts] {
        ws.push(gpu.upload_matrix(m, k, values(rng, m * k))?);
    }
    let mut fused: Vec<_> = rows[..parts].iter().map(|&m| gpu.zeros(n, m)).collect();
    let weights: Vec<_> = ws.iter().collect();
    let mut outs: Vec<_> = fused.iter_mut().collect();
    gpu.matmul_t_many(&x, &weights, &mut outs)?;
    let mut same = true;
    for (w, got) in ws.iter().zip(&fused) {
        let mut one = gpu.zeros(n, gpu.shape(w).0);
        gpu.matmul_t(&x, w, &mut one)?;
        same &= down(gpu, &one)
            .iter()
            .zip(down(gpu, got))
            .all(|(a, b)| a.to_bits() == b.to_bits());
    }
    println!(
        "{{\"op\":\"matmul_t_many bf16 weights\",\"rows\":{n},\"matrices\":{parts},\"identical_to_matmul_t\":{same}}}"
    );
    Ok(same)
}
