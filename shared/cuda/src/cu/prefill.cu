// Prefill and extend attention over the work-dtype workspace: BF16 Q x E4M3 K/V (fp8 and nvfp4
// caches) or BF16 K/V (bf16 caches), causal, flash-style tiling on the tensor cores (mma.sync
// m16n8k16; f16 operands for E4M3, bf16 for BF16; f32 accumulation).
//
// Queries i = 0..n sit at positions start + i and attend to keys 0..=start + i of the workspace
// ([token][kv_head][head_dim], E4M3 bytes with dequantization multipliers gk, gv, or BF16; the extend path
// gathers a cached prefix into it first, kv_gather_work). One warp owns 16 query rows of one
// head, a block 4 warps of one head. Per 16-key tile:
//
//   S[16 q x 16 keys] = Q . K^T     A = Q (registers, loaded once), B = K: two n-tiles of 8 keys
//   online softmax per row (log2 units); P stays in registers: the C fragments of the two
//   n-tiles are exactly P's A fragment
//   O[16 q x D]      += P . V       B = V: k = keys, D/8 n-tiles of 8 dims
//
// E4M3 bytes become f16 by bit placement (value * 2^-8, exact), as in decode.cu; the 2^8, the
// global scales and the softmax scale are applied to the f32 scores and the final output; BF16
// values are mma operands as they are. K
// lanes hold contiguous quarters of a key vector, V lanes contiguous eighths; Q is laid out to
// match (which dims a lane holds is free: the sums do not care).

#define PF_WARPS 4

template <int FMT>
__device__ __forceinline__ u32 pf_pack(float lo, float hi) {
    return FMT == NIBBLE_BF16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
}

template <int N>
__device__ __forceinline__ void pf_load(const u8* p, u32* w) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
        w[4 * i] = v.x;
        w[4 * i + 1] = v.y;
        w[4 * i + 2] = v.z;
        w[4 * i + 3] = v.w;
    }
    if (N % 4 == 2) {
        uint2 v = __ldg(reinterpret_cast<const uint2*>(p) + (N / 2 - 1));
        w[N - 2] = v.x;
        w[N - 1] = v.y;
    }
}

// Bytes per value of the workspace, and the words of a key vector's quarter (K lanes) and
// eighth (V lanes).
template <int FMT, int D>
struct Work {
    static const int VB = FMT == NIBBLE_BF16 ? 2 * D : D;
    static const int KW = VB / 16;
    static const int VW = VB / 32;
};

template <int FMT, int D>
__device__ __forceinline__ void prefill_body(const float* __restrict__ q, const u8* __restrict__ wk,
                                             const u8* __restrict__ wv, float* __restrict__ out,
                                             PrefillArgs a) {
    const u32 head = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 lg = lane / 4, lc = lane % 4;
    const u32 row0 = blockIdx.x * (PF_WARPS * 16) + warp * 16;
    if (row0 >= a.n) return;  // the whole warp; no block-wide synchronization follows
    const u32 kv_head = head / (a.q_heads / a.kv_heads);
    typedef Work<FMT, D> W;
    const u32 stride = a.kv_heads * W::VB;  // workspace bytes per token
    const u32 rows[2] = {row0 + lg, row0 + lg + 8};

    // Q as A fragments, BF16-rounded (then f16 for E4M3 keys): k-step s holds dims
    // lc*D/4 + 4s + (0,2 | 1,3) for E4M3 keys, + (0,1 | 2,3) for BF16 keys.
    u32 qa[D / 16][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool ok = rows[r] < a.n;
        const float* qr = q + ((u64)(ok ? rows[r] : 0) * a.q_heads + head) * D + lc * (D / 4);
#pragma unroll
        for (int s = 0; s < D / 16; ++s) {
            float x[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) x[j] = ok ? bf16_decode(bf16_encode(qr[4 * s + j])) : 0.f;
            if (FMT == NIBBLE_BF16) {
                qa[s][r] = pack_bf16(x[0], x[1]);
                qa[s][2 + r] = pack_bf16(x[2], x[3]);
            } else {
                qa[s][r] = pack_f16(x[0], x[2]);
                qa[s][2 + r] = pack_f16(x[1], x[3]);
            }
        }
    }

    const float NEG_INF = __int_as_float(0xff800000);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    // keys visible to this warp's last row; rows past n see none of their own
    const u32 last_row = min(row0 + 15u, a.n - 1u);
    const u32 key_end = a.start + last_row + 1u;
    const u8* kbase = wk + kv_head * W::VB + lc * (W::VB / 4);
    const u8* vbase = wv + kv_head * W::VB + lg * (W::VB / 8);

    for (u32 j0 = 0; j0 < key_end; j0 += 16) {
        // ---- loads: K keys j0+g, j0+8+g (this lane's quarter); V keys 2c, 2c+1, 2c+8, 2c+9 ----
        u32 kr[2][W::KW], vr[4][W::VW];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const u32 key = j0 + lg + 8u * t;
            if (key < key_end) {
                pf_load<W::KW>(kbase + (u64)key * stride, kr[t]);
            } else {
#pragma unroll
                for (int i = 0; i < W::KW; ++i) kr[t][i] = 0u;
            }
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const u32 key = j0 + 2u * lc + (t & 1) + 8u * (t >> 1);
            if (key < key_end) {
                pf_load<W::VW>(vbase + (u64)key * stride, vr[t]);
            } else {
#pragma unroll
                for (int i = 0; i < W::VW; ++i) vr[t][i] = 0u;
            }
        }

        // ---- S = Q K^T: n-tile t holds keys j0 + 8t .. + 7 ----
        float s[2][4];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
            for (int st = 0; st < D / 16; ++st) {
                if (FMT == NIBBLE_BF16)
                    mma16816<FMT>(s[t], qa[st], kr[t][2 * st], kr[t][2 * st + 1]);
                else
                    mma16816<FMT>(s[t], qa[st], fp8_02(kr[t][st]), fp8_13(kr[t][st]));
            }
        }

        // ---- causal mask and online softmax for rows g (r = 0) and g + 8 (r = 1) ----
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u32 visible = rows[r] < a.n ? a.start + rows[r] + 1u : 0u;  // keys < visible
            corr[r] = online_softmax_row<2>(&s[0][0], r, j0, lc, visible, true, a.score_scale,
                                            m[r], l[r]);
        }
        if (!__all_sync(0xffffffffu, corr[0] == 1.f && corr[1] == 1.f)) {
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                o[j][0] *= corr[0];
                o[j][1] *= corr[0];
                o[j][2] *= corr[1];
                o[j][3] *= corr[1];
            }
        }

        // ---- O += P V: P's A fragment is S's two C fragments ----
        const u32 pa[4] = {pf_pack<FMT>(s[0][0], s[0][1]), pf_pack<FMT>(s[0][2], s[0][3]),
                           pf_pack<FMT>(s[1][0], s[1][1]), pf_pack<FMT>(s[1][2], s[1][3])};
        if (FMT == NIBBLE_BF16) {
            // word w holds dims 2w, 2w+1: pair the two keys' values of each dim
#pragma unroll
            for (int w = 0; w < W::VW; ++w) {
                mma16816<FMT>(o[2 * w], pa, __byte_perm(vr[0][w], vr[1][w], 0x5410),
                            __byte_perm(vr[2][w], vr[3][w], 0x5410));
                mma16816<FMT>(o[2 * w + 1], pa, __byte_perm(vr[0][w], vr[1][w], 0x7632),
                            __byte_perm(vr[2][w], vr[3][w], 0x7632));
            }
        } else {
#pragma unroll
        for (int w = 0; w < W::VW; ++w) {
            // (key 2c, key 2c+1) and (key 2c+8, key 2c+9) pairs of dims 4w .. 4w+3 of this lane's
            // eighth: n-tile j, column g is dim g * D/8 + j
            const u32 a01 = __byte_perm(vr[0][w], vr[1][w], 0x5410);
            const u32 a23 = __byte_perm(vr[0][w], vr[1][w], 0x7632);
            const u32 b01 = __byte_perm(vr[2][w], vr[3][w], 0x5410);
            const u32 b23 = __byte_perm(vr[2][w], vr[3][w], 0x7632);
            mma16816<FMT>(o[4 * w + 0], pa, fp8_02(a01), fp8_02(b01));
            mma16816<FMT>(o[4 * w + 1], pa, fp8_13(a01), fp8_13(b01));
            mma16816<FMT>(o[4 * w + 2], pa, fp8_02(a23), fp8_02(b23));
            mma16816<FMT>(o[4 * w + 3], pa, fp8_13(a23), fp8_13(b23));
        }
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    // O's C fragment of n-tile j: rows g, g+8; columns 2c, 2c+1 = dims (2c) * D/8 + j, (2c+1) * D/8 + j
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= a.n) continue;
        const float f = l[r] > 0.f ? a.v_scale / l[r] : 0.f;
        float* orow = out + ((u64)rows[r] * a.q_heads + head) * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            orow[(2 * lc) * (D / 8) + j] = o[j][2 * r] * f;
            orow[(2 * lc + 1) * (D / 8) + j] = o[j][2 * r + 1] * f;
        }
    }
}

#define PREFILL_KERNEL(NAME, FMT, D)                                                        \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32)                             \
        NAME(const float* __restrict__ q, const u8* __restrict__ wk,                         \
             const u8* __restrict__ wv, float* __restrict__ out, PrefillArgs a) {            \
        grid_dependency_sync();                                                              \
        prefill_body<FMT, D>(q, wk, wv, out, a);                                            \
    }

PREFILL_KERNEL(prefill_fp8_d64, NIBBLE_FP8, 64)
PREFILL_KERNEL(prefill_fp8_d128, NIBBLE_FP8, 128)
PREFILL_KERNEL(prefill_bf16_d64, NIBBLE_BF16, 64)
PREFILL_KERNEL(prefill_bf16_d128, NIBBLE_BF16, 128)
