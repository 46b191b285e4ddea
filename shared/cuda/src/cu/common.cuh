// nibble CUDA prelude: the element codecs of shared/kvfmt (docs/FORMAT.md), bit for bit, and the
// page geometry every kernel addresses pages with. Prepended to every kernel source; no CUDA
// headers are included, so NVRTC needs no include path.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NIBBLE_NVFP4 0
#define NIBBLE_FP8 1
#define NIBBLE_BF16 2

// One page's geometry (kvfmt's PageLayout) plus the layer being addressed. Matches
// `nibble_cuda::PageGeom` (#[repr(C)]).
struct PageGeom {
    u64 page_bytes;   // bytes of one page (every layer's K and V)
    u32 part_bytes;   // bytes of one (layer, K|V) part: kv_heads * page_size * vector bytes
    u32 kv_heads;
    u32 page_size;    // tokens per page, a power of two
    u32 page_shift;   // log2(page_size)
    u32 head_dim;
    u32 data_bytes;   // element bytes of one head vector: nvfp4 D/2, fp8 D, bf16 2D
    u32 scale_bytes;  // block-scale bytes of one head vector: nvfp4 D/16, otherwise 0
    u32 layer;
};

// A sequence's recent window (kvfmt's WindowLayout) at one layer: the BF16 K/V of its last
// `tokens` tokens in a ring over `pages` pages of the pool, one (layer, slot) unit of
// [K|V][kv_head][head_dim] BF16 per `unit_bytes`, `units_per_page` units per page. Matches
// `nibble_cuda::WindowGeom` (#[repr(C)]). tokens == 0: no window.
struct WindowGeom {
    u64 page_bytes;
    u32 tokens;
    u32 units_per_page;
    u32 unit_bytes;
    u32 pages;  // window pages per sequence: a window table's row length
    u32 kv_heads;
    u32 layer;
};

// The BF16 head vector (part 0 = K, 1 = V) of the token at `pos` in the window whose page ids
// are `row`.
__device__ __forceinline__ u8* window_vector(u8* pages, const u32* row, const WindowGeom& w,
                                             u32 part, u32 head, u32 pos, u32 head_dim) {
    const u32 unit = w.layer * w.tokens + pos % w.tokens;
    const u64 page = row[unit / w.units_per_page];
    return pages + page * w.page_bytes + (u64)(unit % w.units_per_page) * w.unit_bytes +
           (part * w.kv_heads + head) * 2u * head_dim;
}

// Programmatic dependent launch (src/launcher.rs; docs/ARCHITECTURE.md). On sm_90 and newer every
// kernel is launched allowed to start while the kernel before it in the stream is finishing, so
// its launch and block scheduling overlap that kernel's tail. Every kernel calls this first,
// before it touches global memory: it waits until the kernel before it has completed and its
// writes are visible, then lets the kernel after it launch (which in turn waits for this one).
// Memory that no kernel writes (weights) may be read before it.
// Before sm_90 launches are serialized and both are nothing.
__device__ __forceinline__ void grid_dependency_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Offset of (layer, part) within a page.
__device__ __forceinline__ u64 part_offset(const PageGeom& g, u32 part) {
    return (u64)(2u * g.layer + part) * g.part_bytes;
}

// Offset of the data of (part, head, token-in-page) within a page.
__device__ __forceinline__ u64 data_offset(const PageGeom& g, u32 part, u32 head, u32 off) {
    return part_offset(g, part) + (u64)(head * g.page_size + off) * g.data_bytes;
}

// Offset of the scales of (part, head, token-in-page) within a page.
__device__ __forceinline__ u64 scale_offset(const PageGeom& g, u32 part, u32 head, u32 off) {
    return part_offset(g, part) + (u64)g.kv_heads * g.page_size * g.data_bytes +
           (u64)(head * g.page_size + off) * g.scale_bytes;
}

// ---- E4M3FN (OCP FP8): kvfmt::e4m3 ----

__device__ __forceinline__ float e4m3_decode(u32 code) {
    u32 e = (code >> 3) & 0xFu, m = code & 7u;
    float mag;
    if (e == 15u && m == 7u) {
        mag = __int_as_float(0x7fc00000);
    } else if (e == 0u) {
        mag = (float)m * 0.001953125f;  // m * 2^-9, exact
    } else {
        mag = __uint_as_float(((e + 120u) << 23) | (m << 20));
    }
    return (code & 0x80u) ? -mag : mag;
}

// Round to nearest, ties to even, saturating at +-448; NaN keeps its sign as 0x7F/0xFF.
__device__ __forceinline__ u32 e4m3_encode(float x) {
    u32 bits = __float_as_uint(x);
    u32 sign = (bits >> 24) & 0x80u;
    if (x != x) return sign | 0x7Fu;
    float a = fabsf(x);
    u32 mag;
    if (a >= 448.0f) {
        mag = 0x7Eu;
    } else if (a >= 0.015625f) {
        u32 ab = __float_as_uint(a);
        int exp = (int)(ab >> 23) - 127;
        u32 mant = ab & 0x7FFFFFu;
        u32 code = ((u32)(exp + 7) << 3) | (mant >> 20);
        u32 rest = mant & 0xFFFFFu;
        if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) code += 1u;
        mag = code < 0x7Eu ? code : 0x7Eu;
    } else {
        mag = (u32)rintf(a * 512.0f);  // exact scaling; rintf rounds ties to even
    }
    return sign | mag;
}

// ---- E2M1 (FP4): kvfmt::e2m1 ----

__device__ __forceinline__ float e2m1_decode(u32 code) {
    const u32 m = code & 7u;
    // codes 0..3: 0, 0.5, 1, 1.5; codes 4..7: 2, 3, 4, 6
    float mag = m < 4u ? 0.5f * (float)m
                       : (float)(1u << ((m >> 1) - 1u)) * (1.0f + 0.5f * (float)(m & 1u));
    return (code & 8u) ? -mag : mag;
}

__device__ __forceinline__ u32 e2m1_encode(float x) {
    u32 sign = (x != x) ? 0u : ((__float_as_uint(x) >> 28) & 0x8u);
    float a = fabsf(x);
    u32 m;
    if (a <= 0.25f) m = 0;
    else if (a < 0.75f) m = 1;
    else if (a <= 1.25f) m = 2;
    else if (a < 1.75f) m = 3;
    else if (a <= 2.5f) m = 4;
    else if (a < 3.5f) m = 5;
    else if (a <= 5.0f) m = 6;
    else m = 7;  // also NaN, as the CPU codec
    return sign | m;
}

// ---- BF16: kvfmt::bf16 ----

__device__ __forceinline__ u32 bf16_encode(float x) {
    u32 bits = __float_as_uint(x);
    if (x != x) return ((bits >> 16) | 0x40u) & 0xFFFFu;
    return ((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16) & 0xFFFFu;
}

__device__ __forceinline__ float bf16_decode(u32 bits) { return __uint_as_float(bits << 16); }

// ---- NVFP4 block: kvfmt::nvfp4::quantize_block, the f32 operations in the same order ----

// kvfmt::nvfp4::block_error: the squared error of the block under the decoded scale s, summed in
// order, the codes from one reciprocal, every operation rounded on its own (no FMA contraction)
// as the CPU does.
__device__ __forceinline__ float nvfp4_block_error(const float* x, float g, float s) {
    const float r = __fdiv_rn(1.0f, __fmul_rn(s, g));
    float err = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float q = e2m1_decode(e2m1_encode(__fmul_rn(x[i], r)));
        const float d = __fsub_rn(x[i], __fmul_rn(__fmul_rn(q, s), g));
        err = __fadd_rn(err, __fmul_rn(d, d));
    }
    return err;
}

// Packs 16 values under the decoded block scale s (> 0) into 8 bytes (two u32, element 2j in the
// low nibble of byte j), dividing as kvfmt::nvfp4 encodes.
__device__ __forceinline__ void nvfp4_encode_block(const float* x, float g, float s, u32* packed) {
    const float denom = __fmul_rn(s, g);
    packed[0] = 0u;
    packed[1] = 0u;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        u32 q = e2m1_encode(__fdiv_rn(x[i], denom));
        packed[i >> 3] |= q << (4 * (i & 7));
    }
}

// The amax rule's scale byte of 16 values: E4M3(amax / 6g).
__device__ __forceinline__ u32 nvfp4_amax_scale(const float* x, float g) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
    return e4m3_encode(__fdiv_rn(amax, __fmul_rn(6.0f, g)));
}

// The block scale rules of kvfmt::nvfp4::ScaleRule (kv_quantize's `rule` argument).
#define NIBBLE_SCALE_AMAX 0u
#define NIBBLE_SCALE_MSE 1u

// The mse rule's choice for one thread holding the block: every candidate's error first
// (independent chains the scheduler overlaps), then the choice in kvfmt's order (the amax code
// sets the bar whatever its error; an out-of-range code never wins).
__device__ __forceinline__ u32 nvfp4_mse_scale(const float* x, float g, u32 amax_code) {
    const int offsets[5] = {0, -1, 1, -2, -3};
    float errs[5];
#pragma unroll
    for (int c = 0; c < 5; ++c) {
        const int code = (int)amax_code + offsets[c];
        const u32 scored = (code < 1 || code > 0x7E) ? amax_code : (u32)code;
        errs[c] = nvfp4_block_error(x, g, e4m3_decode(scored));
    }
    u32 best = amax_code;
    float best_err = errs[0];
#pragma unroll
    for (int c = 1; c < 5; ++c) {
        const int code = (int)amax_code + offsets[c];
        if (code >= 1 && code <= 0x7E && errs[c] < best_err) {
            best = (u32)code;
            best_err = errs[c];
        }
    }
    return best;
}

// Quantizes 16 values with global scale g under `rule` (NIBBLE_SCALE_*) into 8 packed bytes and
// returns the scale byte (kvfmt::nvfp4::quantize_block_with).
__device__ __forceinline__ u32 nvfp4_quantize_block(const float* x, float g, u32 rule,
                                                    u32* packed) {
    u32 scale = nvfp4_amax_scale(x, g);
    packed[0] = 0u;
    packed[1] = 0u;
    if (e4m3_decode(scale) == 0.0f) return scale;
    if (rule == NIBBLE_SCALE_MSE) scale = nvfp4_mse_scale(x, g, scale);
    nvfp4_encode_block(x, g, e4m3_decode(scale), packed);
    return scale;
}

// Tensor-core helpers of the attention kernels (decode and prefill): f32 pairs packed as f16x2 or
// bf16x2, E4M3 bytes unpacked to f16x2, exp2, and the m16n8k16 MMA with f32 accumulators.

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// E4M3 bytes 0 and 2 of w as f16x2 of value * 2^-8; and bytes 1 and 3.
__device__ __forceinline__ u32 fp8_02(u32 w) {
    return ((w << 7) & 0x3F803F80u) | ((w << 8) & 0x80008000u);
}
__device__ __forceinline__ u32 fp8_13(u32 w) {
    return ((w >> 1) & 0x3F803F80u) | (w & 0x80008000u);
}

// 2^x, flushing results below 2^-126 to zero: softmax weights that small add nothing next to the
// 1 of the row's maximum, and without .ftz the instruction is wrapped in a range check (a compare
// and two predicated multiplies) on every call.
__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// The 8x8 matrix of 16-bit elements held in the mma fragment layout (lane l: row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1), transposed, in the same layout. A warp-wide register shuffle:
// every lane of the warp must execute it.
__device__ __forceinline__ u32 transpose_b16(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

template <int FMT>
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
    if (FMT == NIBBLE_BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// One step of the online softmax (log2 units) of the prefill kernels for row r of a lane (0: its
// row g, 1: g + 8) over T n-tiles of 8 keys in the mma accumulator layout (s[4t + 2r + e] is key
// key0 + 8t + 2c + e, c = lane % 4): scales the scores, masks keys >= visible (where `mask`),
// updates the row's running max m and the lane's share of its sum l, turns the scores into
// weights, and returns the factor the row's output must be rescaled by. Every lane of the quad
// holding the row must call it.
template <int T>
__device__ __forceinline__ float online_softmax_row(float* s, int r, u32 key0, u32 c, u32 visible,
                                                   bool mask, float score_scale, float& m,
                                                   float& l) {
    const float NEG_INF = __int_as_float(0xff800000);
    float tmax = NEG_INF;
#pragma unroll
    for (int t = 0; t < T; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& x = s[4 * t + 2 * r + e];
            const u32 key = key0 + 8u * t + 2u * c + e;
            x = (!mask || key < visible) ? x * score_scale : NEG_INF;
            tmax = fmaxf(tmax, x);
        }
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
    const float mnew = fmaxf(m, tmax);
    const float mu = mnew == NEG_INF ? 0.f : mnew;
    const float corr = fast_exp2(m - mu);
    float sum = 0.f;
#pragma unroll
    for (int t = 0; t < T; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& x = s[4 * t + 2 * r + e];
            x = fast_exp2(x - mu);
            sum += x;
        }
    }
    l = l * corr + sum;  // this lane's share; the row's lanes are added at the end
    m = mnew;
    return corr;
}

// The arguments of the prefill/extend attention kernels (prefill.cu, and prefill_hopper.cu on
// sm_90a). Matches `PrefillArgs` of launch/mod.rs (#[repr(C)]).
struct PrefillArgs {
    u32 n;          // query rows
    u32 start;      // position of row 0 (the keys before it are a cached prefix)
    u32 q_heads;
    u32 kv_heads;
    float score_scale;  // softmax scale * gk * 2^8 * log2(e) (E4M3); softmax scale * log2(e) (BF16)
    float v_scale;      // gv * 2^8 (E4M3); 1 (BF16)
    u32 pingpong;       // prefill_hopper over BF16: the consumers take turns (0: they do not)
    u32 tma;            // prefill_hopper over BF16: K/V tiles by the tensor memory accelerator
};
