// Paged decode attention (one query token per sequence) over NVFP4, FP8 or BF16 pages:
// split-KV flash-decoding on the tensor cores (mma.sync m16n8k16, f32 accumulation).
//
// Grid (split, kv_head, sequence), 4 warps. Each warp walks 16-token tiles of its split; for each
// tile, all query heads of the GQA group (G <= 8, the mma's N) are scored at once, so every K and
// V byte is read exactly once per group:
//
//   S^T[16 tok x 8 heads] = K[16 tok x D] . Q^T[D x 8 heads]     A = K from pages, B = Q
//   O^T[D x 8 heads]     += V^T[D x 16 tok] . P^T[16 tok x 8]     A = V from pages, B = P
//
// Pages are dequantized in registers with integer bit placement, no conversion instructions
// (Hopper has no FP4 conversion, and its E4M3 one proved the bottleneck of the first version):
// an E2M1 nibble S EEM becomes the f16 high byte S000EEM0, exactly value * 2^-14 (the
// subnormal 0.5 included), four nibbles per shift-and-mask and two f16 per byte permute; an
// E4M3 byte S EEEE MMM placed as the f16 S0EEEEMMM0000000 is exactly value * 2^-8. NVFP4
// elements are multiplied by their block scale (as f16, times 2^7) with one f16x2 multiply per
// pair: e2m1 * s * 2^-7 is exact in f16. BF16 pages feed a bf16 mma directly. Global scales,
// the format factors (2^7, 2^8) and the softmax scale are applied to the f32 scores and to the
// final output. Which dims of a head vector each lane holds is free (the sum over k does not
// care), so lanes load contiguous 16-byte pieces and Q is laid out to match.
//
// Output: with one split (a batch that fills the GPU by sequences and heads alone), the
// attention output itself; with several, unnormalized partial results per split (max, sum in
// log2 units, and sum p*V), merged by decode_combine. (Merging in the last block of each
// sequence and KV head to finish, counted on an atomic, was measured and lost: one block's
// serial merge of dozens of splits costs more than a second launch, run 54.) Whichever writes
// the output also writes its BF16 cast when given a buffer for it (out_bf16 not null): the input
// of the output projection's BF16-weight GEMM, which then needs no cast launch of its own.

#define WARPS 4
#define TILE 16

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// w >> k as the high word of a multiply: an IMAD on the FMA pipe, which has room, where a shift
// would take the integer ALU, which the unpacking below saturates.
template <int K>
__device__ __forceinline__ u32 shr_fma(u32 w) {
    return __umulhi(w, 1u << (32 - K));
}

// f16 high bytes (S000EEM0 = e2m1 * 2^-14) of the low nibbles of four bytes, and of the high
// nibbles. The left shifts compile to IMADs as well.
__device__ __forceinline__ u32 fp4_lo_hb(u32 w) {
    return ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
}
__device__ __forceinline__ u32 fp4_hi_hb(u32 w) {
    return (w & 0x80808080u) | (shr_fma<3>(w) & 0x0E0E0E0Eu);
}
// f16x2 from high bytes: (x.b0, x.b1) and (x.b2, x.b3), zero low bytes.
__device__ __forceinline__ u32 hb_01(u32 x) { return __byte_perm(x, 0u, 0x1404); }
__device__ __forceinline__ u32 hb_23(u32 x) { return __byte_perm(x, 0u, 0x3424); }

// NVFP4 block scales are E4M3 with a clear sign bit, so they need only the magnitude half of
// fp8_02 / fp8_13: bytes 0 and 2 of w (or 1 and 3) as f16x2 of s * 2^7, exact for s <= 448.
__device__ __forceinline__ u32 scale_02(u32 w) {
    return hmul2((w << 7) & 0x3F803F80u, 0x78007800u);  // (s * 2^-8) * 2^15
}
__device__ __forceinline__ u32 scale_13(u32 w) {
    return hmul2(shr_fma<1>(w) & 0x3F803F80u, 0x78007800u);
}

template <int N>
__device__ __forceinline__ void load_words(const u8* p, u32* w) {
    if (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
            w[4 * i] = v.x;
            w[4 * i + 1] = v.y;
            w[4 * i + 2] = v.z;
            w[4 * i + 3] = v.w;
        }
    } else if (N == 2) {
        uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x;
        w[1] = v.y;
    } else {
        w[0] = __ldg(reinterpret_cast<const u32*>(p));
    }
}

// Bytes of one head vector and the words each lane loads: K, a quarter of a vector (lane c of a
// token's 4 lanes); V, an eighth (lane g of 8).
template <int FMT, int D>
struct Fmt {
    static const int VB = FMT == NIBBLE_NVFP4 ? D / 2 : (FMT == NIBBLE_FP8 ? D : 2 * D);
    static const int KW = VB / 16;
    static const int VW = VB / 32;
};

template <int FMT, int D>
struct Raw {
    u32 k[2][Fmt<FMT, D>::KW];  // tokens g, g + 8
    u32 ks[2];                 // their nvfp4 scale bytes (D/64 each)
    u32 v[4][Fmt<FMT, D>::VW];  // tokens 2c, 2c+1, 2c+8, 2c+9
    u32 vs[4];                 // their nvfp4 scale byte
};

struct DecodeArgs {
    u32 q_heads;
    u32 group;             // query heads per KV head, <= 8
    u32 max_pages;         // row length of page_table
    u32 splits;
    u32 tokens_per_split;  // a multiple of 16
    float score_scale;     // softmax scale * gK * (64 for nvfp4) * log2(e)
    float v_scale;         // with one split: gV * the format factor (2^7 nvfp4, 2^8 fp8, 1 bf16)
    float window_s_mul;    // 1 / (gK * the format factor): BF16 window scores in page units
    float window_p_mul;    // 1 / (gV * the format factor): window probabilities likewise
};

// This lane's byte offsets within a page, for a tile starting at token 0 of the page: K data of
// token g (quarter c), V data of token 2c (eighth g), and their NVFP4 scales. Fixed per block;
// a page is far smaller than 4 GiB.
struct LaneOffsets {
    u32 kd, vd, ks, vs;
};

template <int FMT, int D>
__device__ __forceinline__ LaneOffsets lane_offsets(const PageGeom& g, u32 head, u32 lg, u32 lc) {
    typedef Fmt<FMT, D> F;
    const u32 data = head * g.page_size * F::VB;
    const u32 scales = g.kv_heads * g.page_size * F::VB + head * g.page_size * (D / 16);
    const u32 k_part = (u32)part_offset(g, 0), v_part = (u32)part_offset(g, 1);
    LaneOffsets o;
    o.kd = k_part + data + lg * F::VB + lc * (F::VB / 4);
    o.vd = v_part + data + 2u * lc * F::VB + lg * (F::VB / 8);
    o.ks = k_part + scales + lg * (D / 16) + lc * (D / 64);
    o.vs = v_part + scales + 2u * lc * (D / 16) + lg * D / 128;
    return o;
}

template <int FMT, int D>
__device__ __forceinline__ void load_k(Raw<FMT, D>& r, int t, const u8* kd, const u8* ks) {
    load_words<Fmt<FMT, D>::KW>(kd, r.k[t]);
    if (FMT == NIBBLE_NVFP4)
        r.ks[t] = D / 64 == 2 ? (u32)__ldg(reinterpret_cast<const u16*>(ks)) : (u32)__ldg(ks);
}

template <int FMT, int D>
__device__ __forceinline__ void load_v(Raw<FMT, D>& r, int t, const u8* vd, const u8* vs) {
    load_words<Fmt<FMT, D>::VW>(vd, r.v[t]);
    if (FMT == NIBBLE_NVFP4) r.vs[t] = __ldg(vs);
}

// Loads one 16-token tile of page `page_id`: this lane's K words of tokens g, g+8 and V words of
// tokens 2c, 2c+1, 2c+8, 2c+9 (zeros past `end`). t0 is a multiple of 16 and pages hold at
// least 16 tokens, so the tile lies in one page and every address is the page plus a lane
// offset plus a constant. Whole tiles (all but a split's last) take a branch with no bounds
// checks.
template <int FMT, int D>
__device__ __forceinline__ void load_tile(Raw<FMT, D>& r, const u8* pages, u32 page_id,
                                          const PageGeom& g, const LaneOffsets& lo, u32 t0,
                                          u32 end, u32 lg, u32 lc) {
    typedef Fmt<FMT, D> F;
    const u32 off0 = t0 & (g.page_size - 1u);
    // The page's address in one wide multiply-add (a page is far smaller than 4 GiB), then each
    // part's pointer one 32-bit offset from it: written plainly, the compiler redoes the wide
    // multiply for every part.
    u64 page;
    asm("mad.wide.u32 %0, %1, %2, %3;"
        : "=l"(page)
        : "r"(page_id), "r"((u32)g.page_bytes), "l"(reinterpret_cast<u64>(pages)));
    const u32 data = off0 * F::VB, scales = off0 * (D / 16);
    const u8* kd = reinterpret_cast<const u8*>(page + (lo.kd + data));
    const u8* vd = reinterpret_cast<const u8*>(page + (lo.vd + data));
    const u8* ks = reinterpret_cast<const u8*>(page + (lo.ks + scales));
    const u8* vs = reinterpret_cast<const u8*>(page + (lo.vs + scales));
    if (t0 + TILE <= end) {
#pragma unroll
        for (int t = 0; t < 2; ++t) load_k<FMT, D>(r, t, kd + 8 * t * F::VB, ks + 8 * t * (D / 16));
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int i = (t & 1) + 8 * (t >> 1);  // token 2c + i
            load_v<FMT, D>(r, t, vd + i * F::VB, vs + i * (D / 16));
        }
        return;
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        if (t0 + lg + 8u * t < end) {
            load_k<FMT, D>(r, t, kd + 8 * t * F::VB, ks + 8 * t * (D / 16));
        } else {
#pragma unroll
            for (int j = 0; j < F::KW; ++j) r.k[t][j] = 0u;
            r.ks[t] = 0u;
        }
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const int i = (t & 1) + 8 * (t >> 1);
        if (t0 + 2u * lc + i < end) {
            load_v<FMT, D>(r, t, vd + i * F::VB, vs + i * (D / 16));
        } else {
#pragma unroll
            for (int j = 0; j < F::VW; ++j) r.v[t][j] = 0u;
            r.vs[t] = 0u;
        }
    }
}

// Local dim (within lane c's quarter of the head vector) of mma k-index j of k-step s:
// j = 0, 1 are the B pair (k = 2c, 2c + 1); j = 2, 3 are k = 2c + 8, 2c + 9.
template <int FMT>
__device__ __forceinline__ int k_dim(int s, int j) {
    const int order[4] = {0, 2, 1, 3};
    if (FMT == NIBBLE_NVFP4) {
        const int w = s >> 1, h = s & 1;
        return 8 * w + 4 * h + order[j];
    }
    if (FMT == NIBBLE_FP8) return 4 * s + order[j];
    return 4 * s + j;
}

// The running state of heads 2c, 2c+1 of the group: m, the max score so far in the mma's units
// (score_scale, > 0, not applied); nm, -m * score_scale, the exponent's offset (0 while m is
// -inf); l, this lane's share of the sum of 2^(s * score_scale + nm); o, the unnormalized output.
// WIN: a tile of the recent window (BF16) in a pass over pages of another format: its scores
// are multiplied by s_mul and its probabilities by p_mul before the V product, which puts both
// in the units of the pages' format (score_scale and the final v_scale are that format's).
template <int FMT, int D, bool WIN = false>
__device__ __forceinline__ void attend_tile(const Raw<FMT, D>& r, const u32 (*qb)[2], float* m,
                                            float* nm, float* l, float (*o)[4], u32 t0, u32 end,
                                            float score_scale, u32 lg, u32 lc, float s_mul = 1.f,
                                            float p_mul = 1.f) {
    typedef Fmt<FMT, D> F;
    // ---- scores: S^T = K . Q^T ----
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    if (FMT == NIBBLE_NVFP4) {
        // Each token's one or two scale bytes (b0, b1) as (b0, b1, b0, b1): (s0, s0) and
        // (s1, s1) without extracting the bytes first.
        u32 sc[2][D / 64];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const u32 x = __byte_perm(r.ks[t], 0u, 0x1010);
            sc[t][0] = scale_02(x);
            if (D / 64 == 2) sc[t][D / 64 - 1] = scale_13(x);
        }
#pragma unroll
        for (int w = 0; w < F::KW; ++w) {
            u32 a0[4], a1[4];
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const u32 lo = fp4_lo_hb(r.k[t][w]), hi = fp4_hi_hb(r.k[t][w]);
                const u32 scale = sc[t][w >> 1];
                a0[t] = hmul2(hb_01(lo), scale);      // dims 0, 2
                a0[2 + t] = hmul2(hb_01(hi), scale);  // dims 1, 3
                a1[t] = hmul2(hb_23(lo), scale);      // dims 4, 6
                a1[2 + t] = hmul2(hb_23(hi), scale);  // dims 5, 7
            }
            mma16816<FMT>(s, a0, qb[2 * w][0], qb[2 * w][1]);
            mma16816<FMT>(s, a1, qb[2 * w + 1][0], qb[2 * w + 1][1]);
        }
    } else if (FMT == NIBBLE_FP8) {
#pragma unroll
        for (int w = 0; w < F::KW; ++w) {
            const u32 a[4] = {fp8_02(r.k[0][w]), fp8_02(r.k[1][w]), fp8_13(r.k[0][w]),
                              fp8_13(r.k[1][w])};
            mma16816<FMT>(s, a, qb[w][0], qb[w][1]);
        }
    } else {
#pragma unroll
        for (int st = 0; st < D / 16; ++st) {
            const u32 a[4] = {r.k[0][2 * st], r.k[1][2 * st], r.k[0][2 * st + 1], r.k[1][2 * st + 1]};
            mma16816<FMT>(s, a, qb[st][0], qb[st][1]);
        }
    }

    if (WIN) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i] *= s_mul;
    }

    // ---- online softmax (log2 units once scaled) for heads 2c, 2c+1 over tokens g, g+8; the
    // scale enters only through the exponent's FMA ----
    const float NEG_INF = __int_as_float(0xff800000);
    if (t0 + TILE > end) {  // the last tile of a split: mask tokens past its end
        const bool v0 = t0 + lg < end, v1 = t0 + lg + 8u < end;
        s[0] = v0 ? s[0] : NEG_INF;
        s[1] = v0 ? s[1] : NEG_INF;
        s[2] = v1 ? s[2] : NEG_INF;
        s[3] = v1 ? s[3] : NEG_INF;
    }
    // The running max moves rarely once a few tiles are in: the warp reduces and rescales only
    // when some score exceeds it (otherwise the max is unchanged, exactly).
    const bool grows = s[0] > m[0] || s[2] > m[0] || s[1] > m[1] || s[3] > m[1];
    if (__any_sync(0xffffffffu, grows)) {
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float tmax = fmaxf(s[h], s[2 + h]);
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 8));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
            const float mnew = fmaxf(m[h], tmax);
            corr[h] = m[h] == NEG_INF ? 0.f : fast_exp2((m[h] - mnew) * score_scale);
            l[h] *= corr[h];
            m[h] = mnew;
            nm[h] = mnew == NEG_INF ? 0.f : -mnew * score_scale;
        }
#pragma unroll
        for (int rt = 0; rt < D / 16; ++rt) {
            o[rt][0] *= corr[0];
            o[rt][1] *= corr[1];
            o[rt][2] *= corr[0];
            o[rt][3] *= corr[1];
        }
    }
    float p[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        p[h] = fast_exp2(fmaf(s[h], score_scale, nm[h]));
        p[2 + h] = fast_exp2(fmaf(s[2 + h], score_scale, nm[h]));
        // this lane's share of the sum; the lanes of a head are added once, at the end
        l[h] += p[h] + p[2 + h];
    }

    // ---- P^T as the B operand: this lane holds P[token g or g+8][heads 2c, 2c+1], the fragment
    // layout of the two 8x8 blocks of P; their transposes are P^T[head g][tokens 2c, 2c+1] and
    // [tokens 2c+8, 2c+9], which is what the mma's B wants ----
    if (WIN) {
#pragma unroll
        for (int i = 0; i < 4; ++i) p[i] *= p_mul;
    }
    const u32 pk0 = FMT == NIBBLE_BF16 ? pack_bf16(p[0], p[1]) : pack_f16(p[0], p[1]);
    const u32 pk1 = FMT == NIBBLE_BF16 ? pack_bf16(p[2], p[3]) : pack_f16(p[2], p[3]);
    const u32 pb0 = transpose_b16(pk0);
    const u32 pb1 = transpose_b16(pk1);

    // ---- O^T += V^T . P^T: lane g holds dims [g*D/8, (g+1)*D/8) of tokens (2c, 2c+1) and
    // (2c+8, 2c+9), paired across tokens ----
    const int VD = D / 8;
    u32 hv[2][VD];
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
        const u32* ve = r.v[2 * pr];
        const u32* vo = r.v[2 * pr + 1];
        if (FMT == NIBBLE_NVFP4) {
            const u32 sl = scale_02(__byte_perm(r.vs[2 * pr], r.vs[2 * pr + 1], 0x0400));
#pragma unroll
            for (int w = 0; w < F::VW; ++w) {
                // (even, odd) token pairs of raw bytes 0, 1 and 2, 3, then their f16 high bytes:
                // x01 = [e.b0, o.b0, e.b1, o.b1] gives dims 0, 2 (low nibbles), 1, 3 (high)
                const u32 x01 = __byte_perm(ve[w], vo[w], 0x5140);
                const u32 x23 = __byte_perm(ve[w], vo[w], 0x7362);
                const u32 l02 = fp4_lo_hb(x01), h13 = fp4_hi_hb(x01);
                const u32 l46 = fp4_lo_hb(x23), h57 = fp4_hi_hb(x23);
                hv[pr][8 * w + 0] = hmul2(hb_01(l02), sl);
                hv[pr][8 * w + 2] = hmul2(hb_23(l02), sl);
                hv[pr][8 * w + 4] = hmul2(hb_01(l46), sl);
                hv[pr][8 * w + 6] = hmul2(hb_23(l46), sl);
                hv[pr][8 * w + 1] = hmul2(hb_01(h13), sl);
                hv[pr][8 * w + 3] = hmul2(hb_23(h13), sl);
                hv[pr][8 * w + 5] = hmul2(hb_01(h57), sl);
                hv[pr][8 * w + 7] = hmul2(hb_23(h57), sl);
            }
        } else if (FMT == NIBBLE_FP8) {
#pragma unroll
            for (int w = 0; w < F::VW; ++w) {
                const u32 x01 = __byte_perm(ve[w], vo[w], 0x5410);  // e0 e1 o0 o1
                const u32 x23 = __byte_perm(ve[w], vo[w], 0x7632);  // e2 e3 o2 o3
                hv[pr][4 * w] = fp8_02(x01);
                hv[pr][4 * w + 1] = fp8_13(x01);
                hv[pr][4 * w + 2] = fp8_02(x23);
                hv[pr][4 * w + 3] = fp8_13(x23);
            }
        } else {
#pragma unroll
            for (int w = 0; w < F::VW; ++w) {
                hv[pr][2 * w] = __byte_perm(ve[w], vo[w], 0x5410);
                hv[pr][2 * w + 1] = __byte_perm(ve[w], vo[w], 0x7632);
            }
        }
    }
#pragma unroll
    for (int rt = 0; rt < D / 16; ++rt) {
        const u32 a[4] = {hv[0][rt], hv[0][rt + D / 16], hv[1][rt], hv[1][rt + D / 16]};
        mma16816<FMT>(o[rt], a, pb0, pb1);
    }
}

// Loads one 16-token tile of the recent window starting at position t0 (any position: the ring
// is addressed token by token) in the BF16 tile layout of load_tile: K words of tokens g, g+8
// (quarter c) and V words of tokens 2c, 2c+1, 2c+8, 2c+9 (eighth g); zeros past `end`.
template <int D>
__device__ __forceinline__ void load_window_tile(Raw<NIBBLE_BF16, D>& r, const u8* pages,
                                                 const u32* row, const WindowGeom& w, u32 head,
                                                 u32 t0, u32 end, u32 lg, u32 lc) {
    typedef Fmt<NIBBLE_BF16, D> F;
    u8* base = const_cast<u8*>(pages);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const u32 pos = t0 + lg + 8u * t;
        if (pos < end) {
            load_words<F::KW>(window_vector(base, row, w, 0, head, pos, D) + lc * (F::VB / 4), r.k[t]);
        } else {
#pragma unroll
            for (int j = 0; j < F::KW; ++j) r.k[t][j] = 0u;
        }
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const u32 pos = t0 + 2u * lc + (t & 1) + 8 * (t >> 1);
        if (pos < end) {
            load_words<F::VW>(window_vector(base, row, w, 1, head, pos, D) + lg * (F::VB / 8), r.v[t]);
        } else {
#pragma unroll
            for (int j = 0; j < F::VW; ++j) r.v[t][j] = 0u;
        }
    }
}

// Q^T as the B operand of the score mma for FMT's K layout: head g of the group, this lane's
// dims, BF16-rounded (the precision decode takes Q in), then f16 (exact for |q| in
// [2^-14, 65504]) or bf16.
template <int FMT, int D>
__device__ __forceinline__ void load_q(const float* __restrict__ q, u32 seq, u32 kv_head,
                                       const DecodeArgs& args, u32 lg, u32 lc, u32 (*qb)[2]) {
    const bool has = lg < args.group;
    const float* qh =
        q + ((u64)seq * args.q_heads + kv_head * args.group + (has ? lg : 0)) * D + lc * (D / 4);
#pragma unroll
    for (int st = 0; st < D / 16; ++st) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float x0 = has ? bf16_decode(bf16_encode(qh[k_dim<FMT>(st, 2 * j)])) : 0.f;
            float x1 = has ? bf16_decode(bf16_encode(qh[k_dim<FMT>(st, 2 * j + 1)])) : 0.f;
            qb[st][j] = FMT == NIBBLE_BF16 ? pack_bf16(x0, x1) : pack_f16(x0, x1);
        }
    }
}

template <int FMT, int D>
__device__ __forceinline__ void decode_body(const u8* __restrict__ pages,
                                            const float* __restrict__ q,
                                            const u32* __restrict__ page_table,
                                            const u32* __restrict__ context,
                                            float* __restrict__ part_o,
                                            float* __restrict__ part_ml,
                                            float* __restrict__ out,
                                            u16* __restrict__ out_bf16, PageGeom geom,
                                            DecodeArgs args,
                                            const u32* __restrict__ window_table,
                                            WindowGeom wgeom) {
    __shared__ float sm_m[WARPS][8], sm_l[WARPS][8];
    __shared__ float sm_o[WARPS][8][D];

    const u32 split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 lg = lane / 4, lc = lane % 4;
    const u32 ctx = context[seq];
    const u32 begin = split * args.tokens_per_split;
    const u32 end_all = min(ctx, begin + args.tokens_per_split);
    // Tokens from wstart on are read from the recent window, the others from their pages.
    const u32 wstart = wgeom.tokens == 0 ? ctx : (ctx > wgeom.tokens ? ctx - wgeom.tokens : 0u);
    const u32 end = min(end_all, wstart);
    const u32* table = page_table + (u64)seq * args.max_pages;

    u32 qb[D / 16][2];  // Q^T in the pages' operand layout
    load_q<FMT, D>(q, seq, kv_head, args, lg, lc, qb);

    float m[2] = {__int_as_float(0xff800000), __int_as_float(0xff800000)};
    float nm[2] = {0.f, 0.f};
    float l[2] = {0.f, 0.f};
    float o[D / 16][4];
#pragma unroll
    for (int rt = 0; rt < D / 16; ++rt) o[rt][0] = o[rt][1] = o[rt][2] = o[rt][3] = 0.f;

    const u32 stride = WARPS * TILE;
    const LaneOffsets lanes = lane_offsets<FMT, D>(geom, kv_head, lg, lc);
    // The page id of a tile is read a tile ahead of its data: the data loads then never wait
    // for a page-table read (two dependent trips to memory).
    auto page_of = [&](u32 t) { return t < end ? __ldg(table + (t >> geom.page_shift)) : 0u; };
    u32 t0 = begin + warp * TILE;
    if (t0 < end) {
        Raw<FMT, D> cur;
        load_tile<FMT, D>(cur, pages, page_of(t0), geom, lanes, t0, end, lg, lc);
        u32 next_page = page_of(t0 + stride);
        if (FMT == NIBBLE_BF16) {
            // 256 B per lane in flight already; double-buffering would not fit in registers.
            while (true) {
                attend_tile<FMT, D>(cur, qb, m, nm, l, o, t0, end, args.score_scale, lg, lc);
                t0 += stride;
                if (t0 >= end) break;
                const u32 page = next_page;
                next_page = page_of(t0 + stride);
                load_tile<FMT, D>(cur, pages, page, geom, lanes, t0, end, lg, lc);
            }
        } else {
            // Two buffers in turn: the next tile loads while this one is computed.
            Raw<FMT, D> other;
            while (true) {
                bool more = t0 + stride < end;
                if (more) {
                    const u32 page = next_page;
                    next_page = page_of(t0 + 2 * stride);
                    load_tile<FMT, D>(other, pages, page, geom, lanes, t0 + stride, end, lg, lc);
                }
                attend_tile<FMT, D>(cur, qb, m, nm, l, o, t0, end, args.score_scale, lg, lc);
                if (!more) break;
                t0 += stride;
                more = t0 + stride < end;
                if (more) {
                    const u32 page = next_page;
                    next_page = page_of(t0 + 2 * stride);
                    load_tile<FMT, D>(cur, pages, page, geom, lanes, t0 + stride, end, lg, lc);
                }
                attend_tile<FMT, D>(other, qb, m, nm, l, o, t0, end, args.score_scale, lg, lc);
                if (!more) break;
                t0 += stride;
            }
        }
    }

    // ---- the recent window's tokens of this split, in BF16 ----
    const u32 wbegin = max(begin, wstart);
    if (wbegin < end_all) {
        u32 qw[D / 16][2];  // Q^T in the BF16 operand layout
        load_q<NIBBLE_BF16, D>(q, seq, kv_head, args, lg, lc, qw);
        const u32* wrow = window_table + (u64)seq * wgeom.pages;
        for (u32 w0 = wbegin + warp * TILE; w0 < end_all; w0 += stride) {
            Raw<NIBBLE_BF16, D> win;
            load_window_tile<D>(win, pages, wrow, wgeom, kv_head, w0, end_all, lg, lc);
            attend_tile<NIBBLE_BF16, D, true>(win, qw, m, nm, l, o, w0, end_all, args.score_scale,
                                              lg, lc, args.window_s_mul, args.window_p_mul);
        }
    }

    // ---- merge the warps, write this split's partial result (or, alone, the output) ----
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
    }
    if (lg == 0) {  // the max in log2 units, as the partial results carry it
        sm_m[warp][2 * lc] = m[0] * args.score_scale;
        sm_m[warp][2 * lc + 1] = m[1] * args.score_scale;
        sm_l[warp][2 * lc] = l[0];
        sm_l[warp][2 * lc + 1] = l[1];
    }
#pragma unroll
    for (int rt = 0; rt < D / 16; ++rt) {
        const u32 d0 = lg * (D / 8) + rt, d1 = d0 + D / 16;
        sm_o[warp][2 * lc][d0] = o[rt][0];
        sm_o[warp][2 * lc + 1][d0] = o[rt][1];
        sm_o[warp][2 * lc][d1] = o[rt][2];
        sm_o[warp][2 * lc + 1][d1] = o[rt][3];
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < args.group * D; i += blockDim.x) {
        const u32 h = i / D, d = i % D;
        float mx = sm_m[0][h];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][h]);
        float acc = 0.f, sum = 0.f;
        if (mx != __int_as_float(0xff800000)) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = fast_exp2(sm_m[w][h] - mx);
                acc += sm_o[w][h][d] * f;
                sum += sm_l[w][h] * f;
            }
        }
        const u64 head_row = (u64)seq * args.q_heads + kv_head * args.group + h;
        if (args.splits == 1) {  // the whole context in this block: the output itself
            const float y = sum > 0.f ? acc / sum * args.v_scale : 0.f;
            out[head_row * D + d] = y;
            if (out_bf16) out_bf16[head_row * D + d] = (u16)bf16_encode(y);
            continue;
        }
        const u64 row = head_row * args.splits + split;
        part_o[row * D + d] = acc;
        if (d == 0) {
            part_ml[2 * row] = mx;
            part_ml[2 * row + 1] = sum;
        }
    }
}

#define DECODE_KERNEL(NAME, FMT, D, MIN_BLOCKS)                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)                           \
        NAME(const u8* __restrict__ pages, const float* __restrict__ q,                          \
             const u32* __restrict__ page_table, const u32* __restrict__ context,                \
             float* __restrict__ part_o, float* __restrict__ part_ml, float* __restrict__ out,  \
             u16* __restrict__ out_bf16, PageGeom geom, DecodeArgs args,                         \
             const u32* __restrict__ window_table, WindowGeom wgeom) {                           \
        grid_dependency_sync();                                                                  \
        decode_body<FMT, D>(pages, q, page_table, context, part_o, part_ml, out, out_bf16, geom, \
                            args, window_table, wgeom);                                          \
    }

// Blocks per SM the register allocation must allow: 4 (16 warps) where it fits without
// meaningful spilling.
DECODE_KERNEL(decode_nvfp4_d64, NIBBLE_NVFP4, 64, 4)
DECODE_KERNEL(decode_nvfp4_d128, NIBBLE_NVFP4, 128, 4)
DECODE_KERNEL(decode_fp8_d64, NIBBLE_FP8, 64, 4)
DECODE_KERNEL(decode_fp8_d128, NIBBLE_FP8, 128, 3)
DECODE_KERNEL(decode_bf16_d64, NIBBLE_BF16, 64, 4)
DECODE_KERNEL(decode_bf16_d128, NIBBLE_BF16, 128, 3)

// Merges the splits of every (sequence, query head): out = sum_s o_s 2^(m_s - M) / L * v_scale,
// and its BF16 cast into out_bf16 unless null (as the decode kernel writes both with one split).
// Grid (q_heads, sequences). The merge is a chain of loads from L2 and little else, so round trips
// are its time: thread d loads dim d of a round of splits, every load of the round issued before
// any is used, and folds the round into its running (max, sum, output) as the decode kernel
// folds tiles. Empty splits (m = -inf, l = 0, o = 0) weigh 0, without a branch.
// * decode_combine, block (head_dim): one thread group, up to 16 splits (batches of 4 and more
//   sequences), in rounds of COMBINE_ROUND (batches of 8 and more: one round).
// * decode_combine_groups, block (head_dim, COMBINE_GROUPS): dozens of splits (small batches,
//   where the merge is a large share of the call). Group g merges splits g, g + 4, ... in rounds
//   of 8 up to 32 splits and of COMBINE_GROUP_ROUND above (up to 80 splits: one round), then
//   group 0 merges the groups' results from shared memory. A batch of one sequence at 32K (66
//   splits) spent ~6 us of a 33 us call in a merge of dependent block-wide reductions before
//   (runs 90-91: 33.2 -> 27.7 us).
// Two kernels, not one with two paths: the groups' 20-split rounds take 84 registers, which would
// also cap how many one-group blocks fit an SM (40 registers with rounds of 8, 12 blocks).
#define COMBINE_GROUPS 4
#define COMBINE_ROUND 8
#define COMBINE_GROUP_ROUND 20

// The weight 2^(m_s - M) of a split whose max is m_s; 0 for an empty split (m_s = -inf).
__device__ __forceinline__ float split_weight(float ms, float mx) {
    return ms == __int_as_float(0xff800000) ? 0.f : fast_exp2(ms - mx);
}

// Folds dim d of splits first, first + step, ... (< splits) into (mx, sum, acc), ROUND at a time.
template <int ROUND>
__device__ __forceinline__ void merge_splits(const float* __restrict__ part_o,
                                             const float* __restrict__ part_ml, u64 row0,
                                             u32 splits, u32 first, u32 step, u32 head_dim, u32 d,
                                             float& mx, float& sum, float& acc) {
    const float NEG_INF = __int_as_float(0xff800000);
    const float* ml = part_ml + 2 * row0;     // (m, l) of split s at 2s
    const float* o = part_o + row0 * head_dim + d;  // dim d of split s at s * head_dim
    for (; first < splits; first += ROUND * step) {
        float ms[ROUND], ls[ROUND], os[ROUND];
#pragma unroll
        for (int i = 0; i < ROUND; ++i) {
            const u32 s = first + i * step;
            const bool in = s < splits;
            ms[i] = in ? __ldg(ml + 2 * s) : NEG_INF;
            ls[i] = in ? __ldg(ml + 2 * s + 1) : 0.f;
            os[i] = in ? __ldg(o + s * head_dim) : 0.f;
        }
        float m_new = mx;
#pragma unroll
        for (int i = 0; i < ROUND; ++i) m_new = fmaxf(m_new, ms[i]);
        const float c = split_weight(mx, m_new);  // what came before, rescaled (0 while empty)
        acc *= c;
        sum *= c;
#pragma unroll
        for (int i = 0; i < ROUND; ++i) {
            const float f = split_weight(ms[i], m_new);
            acc += os[i] * f;
            sum += ls[i] * f;
        }
        mx = m_new;
    }
}

__device__ __forceinline__ void write_merged(float* __restrict__ out, u16* __restrict__ out_bf16,
                                             u64 at, float sum, float acc, float v_scale) {
    const float y = sum > 0.f ? acc / sum * v_scale : 0.f;
    out[at] = y;
    if (out_bf16) out_bf16[at] = (u16)bf16_encode(y);
}

extern "C" __global__ void __launch_bounds__(128)
    decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                   float* __restrict__ out, u16* __restrict__ out_bf16, u32 q_heads, u32 splits,
                   u32 head_dim, float v_scale) {
    grid_dependency_sync();
    const u32 h = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
    const u64 row0 = ((u64)seq * q_heads + h) * splits;
    float mx = __int_as_float(0xff800000), sum = 0.f, acc = 0.f;
    merge_splits<COMBINE_ROUND>(part_o, part_ml, row0, splits, 0, 1, head_dim, d, mx, sum, acc);
    write_merged(out, out_bf16, ((u64)seq * q_heads + h) * head_dim + d, sum, acc, v_scale);
}

extern "C" __global__ void __launch_bounds__(128 * COMBINE_GROUPS)
    decode_combine_groups(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                          float* __restrict__ out, u16* __restrict__ out_bf16, u32 q_heads,
                          u32 splits, u32 head_dim, float v_scale) {
    grid_dependency_sync();
    __shared__ float m_g[COMBINE_GROUPS], l_g[COMBINE_GROUPS];
    __shared__ float acc_g[COMBINE_GROUPS][128];
    const u32 h = blockIdx.x, seq = blockIdx.y, d = threadIdx.x, g = threadIdx.y;
    const u64 row0 = ((u64)seq * q_heads + h) * splits;
    float mx = __int_as_float(0xff800000), sum = 0.f, acc = 0.f;
    // Rounds of 8 where they cover every split at once (up to 32: a batch of one sequence at
    // 4K), to issue no more loads than there are splits.
    if (splits <= 8 * COMBINE_GROUPS)
        merge_splits<8>(part_o, part_ml, row0, splits, g, COMBINE_GROUPS, head_dim, d, mx, sum, acc);
    else
        merge_splits<COMBINE_GROUP_ROUND>(part_o, part_ml, row0, splits, g, COMBINE_GROUPS,
                                          head_dim, d, mx, sum, acc);
    if (d == 0) {
        m_g[g] = mx;
        l_g[g] = sum;
    }
    acc_g[g][d] = acc;
    __syncthreads();
    if (g != 0) return;
    float m_all = m_g[0];
#pragma unroll
    for (int j = 1; j < COMBINE_GROUPS; ++j) m_all = fmaxf(m_all, m_g[j]);
    acc = 0.f;
    sum = 0.f;
#pragma unroll
    for (int j = 0; j < COMBINE_GROUPS; ++j) {
        const float f = split_weight(m_g[j], m_all);
        acc += acc_g[j][d] * f;
        sum += l_g[j] * f;
    }
    write_merged(out, out_bf16, ((u64)seq * q_heads + h) * head_dim + d, sum, acc, v_scale);
}
