// Quantize-on-write and the extend gather, byte-identical to the CPU codecs (kvcache's
// HostPages::write_kv and the engine's extend workspace).

// One 16-value block of a quantize-on-write: its values and where its bytes go.
struct WriteBlock {
    float x[16];
    float gs;          // the (layer, K|V) global scale
    u8* base;          // the page
    u8* data;          // the head vector's data bytes in the page
    u64 scale_index;   // its scale byte's offset in the page
    u32 chunk;         // which 16 values of the head vector
    u32 token, part, head;
};

// Block `idx` of n tokens' K and V ([token][kv_head][head_dim]): false past the last block and
// for a padding slot (0xFFFFFFFF), else its values and place in `b`.
__device__ __forceinline__ bool write_block(u64 idx, u8* pages, const float* k, const float* v,
                                            const u32* slots, u32 n_tokens, const PageGeom& g,
                                            float gk, float gv, WriteBlock* b) {
    const u32 chunks = g.head_dim / 16u;
    const u32 per_part = g.kv_heads * chunks;
    if (idx >= (u64)n_tokens * 2u * per_part) return false;
    const u32 token = (u32)(idx / (2u * per_part));
    u32 rem = (u32)(idx % (2u * per_part));
    const u32 part = rem / per_part;
    rem %= per_part;
    const u32 head = rem / chunks, chunk = rem % chunks;
    const u32 slot = slots[token];
    if (slot == 0xFFFFFFFFu) return false;
    const u32 page = slot >> g.page_shift, off = slot & (g.page_size - 1u);
    const float* src = (part ? v : k) + ((u64)token * g.kv_heads + head) * g.head_dim + chunk * 16u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float4 f = reinterpret_cast<const float4*>(src)[i];
        b->x[4 * i] = f.x;
        b->x[4 * i + 1] = f.y;
        b->x[4 * i + 2] = f.z;
        b->x[4 * i + 3] = f.w;
    }
    b->gs = part ? gv : gk;
    b->base = pages + (u64)page * g.page_bytes;
    b->data = b->base + data_offset(g, part, head, off);
    b->scale_index = scale_offset(g, part, head, off) + chunk;
    b->chunk = chunk;
    b->token = token;
    b->part = part;
    b->head = head;
    return true;
}

// The recent windows a quantize-on-write also fills with its tokens in BF16 (Kernels::
// quantize_unchecked's window; HostPages::write_window on the CPU): token r belongs to sequence
// r / rows_per_seq, whose length after the step is lens[s], and is its token at position
// lens[s] - rows_per_seq + r % rows_per_seq; table is [seq][w.pages] window page ids. Where
// block b's 16 values go in that window: null without a window (w.tokens == 0: table and lens
// are not read) and for a token older than the window's last w.tokens.
__device__ __forceinline__ u32* window_block(u8* pages, const u32* table, const u32* lens,
                                             u32 rows_per_seq, const WindowGeom& w,
                                             const PageGeom& g, const WriteBlock& b) {
    if (w.tokens == 0u) return nullptr;
    const u32 seq = b.token / rows_per_seq, len = lens[seq];
    const u32 pos = len - rows_per_seq + b.token % rows_per_seq;
    if (pos + w.tokens < len) return nullptr;
    u8* vec = window_vector(pages, table + (u64)seq * w.pages, w, b.part, b.head, pos, g.head_dim);
    return reinterpret_cast<u32*>(vec + b.chunk * 32u);
}

// Values 2i and 2i + 1 of a block as one word of BF16 (the lower address first).
__device__ __forceinline__ u32 bf16_pair(const float* x, int i) {
    return bf16_encode(x[2 * i]) | (bf16_encode(x[2 * i + 1]) << 16);
}

// Writes n tokens' K and V (f32, [token][kv_head][head_dim]) into their slots, quantized to the
// pool's dtype, NVFP4 block scales chosen by `rule` (NIBBLE_SCALE_*), and those the recent
// windows hold into the windows in BF16 (window_block). slots[t] = page * page_size + offset;
// 0xFFFFFFFF is padding and is skipped. One thread per 16 values of one (token, K|V, head): the
// fastest for prompts, while a decode step's few tokens under the mse rule go to
// kv_quantize_nvfp4_mse, whose bytes are the same.
extern "C" __global__ void kv_quantize(u8* __restrict__ pages, const float* __restrict__ k,
                                       const float* __restrict__ v,
                                       const u32* __restrict__ slots, u32 n_tokens,
                                       PageGeom g, u32 dtype, u32 rule, float gk, float gv,
                                       const u32* __restrict__ wtable,
                                       const u32* __restrict__ wlens, u32 rows_per_seq,
                                       WindowGeom w) {
    grid_dependency_sync();
    WriteBlock b;
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (!write_block(idx, pages, k, v, slots, n_tokens, g, gk, gv, &b)) return;
    const float* x = b.x;
    if (u32* win = window_block(pages, wtable, wlens, rows_per_seq, w, g, b)) {
#pragma unroll
        for (int i = 0; i < 8; ++i) win[i] = bf16_pair(x, i);
    }
    const float gs = b.gs;
    const u32 chunk = b.chunk;
    u8* base = b.base;
    u8* data = b.data;
    if (dtype == NIBBLE_NVFP4) {
        u32 packed[2];
        u32 scale = nvfp4_quantize_block(x, gs, rule, packed);
        *reinterpret_cast<uint2*>(data + chunk * 8u) = make_uint2(packed[0], packed[1]);
        base[b.scale_index] = (u8)scale;
    } else if (dtype == NIBBLE_FP8) {
        u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i >> 2] |= e4m3_encode(__fdiv_rn(x[i], gs)) << (8 * (i & 3));
        *reinterpret_cast<uint4*>(data + chunk * 16u) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
        u32 w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = bf16_encode(x[2 * i]) | (bf16_encode(x[2 * i + 1]) << 16);
        uint4* dst = reinterpret_cast<uint4*>(data + chunk * 32u);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
}

// NVFP4 quantize-on-write under the mse block-scale rule (kvfmt::nvfp4::ScaleRule::Mse) for few
// tokens, with kv_quantize's arguments less the dtype and rule. Eight lanes of one warp share 16
// values: lane k < 5 scores the candidate code at MSE_CANDIDATES[k] = {0, -1, +1, -2, -3} from
// amax's (its error summed in order, as the CPU does), lane 0 gathers the five errors, chooses in
// that order and writes; lane k writes values 2k and 2k + 1 into the window (window_block).
// Spreading the candidates over lanes keeps a decode step's write as short as the amax rule's;
// for a prompt's many tokens kv_quantize's one thread per block is faster. Writing the window
// here spares a decode step a launch per layer.
extern "C" __global__ void kv_quantize_nvfp4_mse(u8* __restrict__ pages,
                                                 const float* __restrict__ k,
                                                 const float* __restrict__ v,
                                                 const u32* __restrict__ slots, u32 n_tokens,
                                                 PageGeom g, float gk, float gv,
                                                 const u32* __restrict__ wtable,
                                                 const u32* __restrict__ wlens, u32 rows_per_seq,
                                                 WindowGeom w) {
    grid_dependency_sync();
    const u64 gidx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u32 lane = (u32)(gidx & 7u);
    WriteBlock b;
    // The eight lanes of a group share their block, so they leave together or not at all.
    if (!write_block(gidx >> 3, pages, k, v, slots, n_tokens, g, gk, gv, &b)) return;
    const float* x = b.x;
    const float gs = b.gs;
    if (u32* win = window_block(pages, wtable, wlens, rows_per_seq, w, g, b)) {
        u32 word = 0u;  // x indexed by constants only, so it stays in registers
#pragma unroll
        for (int i = 0; i < 8; ++i) word = lane == (u32)i ? bf16_pair(x, i) : word;
        win[lane] = word;
    }
    const u32 amax_code = nvfp4_amax_scale(x, gs);
    if (e4m3_decode(amax_code) == 0.0f) {
        if (lane == 0u) {
            *reinterpret_cast<uint2*>(b.data + b.chunk * 8u) = make_uint2(0u, 0u);
            b.base[b.scale_index] = (u8)amax_code;
        }
        return;
    }
    const int offsets[5] = {0, -1, 1, -2, -3};
    int offset = 0;  // offsets[lane], indexed by constants so it stays out of local memory
#pragma unroll
    for (int c = 1; c < 5; ++c) offset = lane == (u32)c ? offsets[c] : offset;
    const int code = (int)amax_code + offset;
    const bool valid = lane < 5u && code >= 1 && code <= 0x7E;
    // Lanes past the candidates, and out-of-range codes, score the amax code (never chosen).
    const float err = nvfp4_block_error(x, gs, e4m3_decode(valid ? (u32)code : amax_code));
    const u32 group = (threadIdx.x & 31u) & ~7u;
    const u32 mask = 0xFFu << group;
    const u32 valid_bits = (__ballot_sync(mask, valid) >> group) & 0x1Fu;
    float errs[5];
#pragma unroll
    for (int c = 0; c < 5; ++c) errs[c] = __shfl_sync(mask, err, c, 8);
    // kvfmt's order: the amax code sets the bar whatever its error; a later one must beat it.
    // Every lane makes the same choice from the same errors.
    u32 best = amax_code;
    float best_err = errs[0];
#pragma unroll
    for (int c = 1; c < 5; ++c) {
        if (((valid_bits >> c) & 1u) && errs[c] < best_err) {
            best = (u32)((int)amax_code + offsets[c]);
            best_err = errs[c];
        }
    }
    // Lane k encodes values 2k and 2k + 1 into byte k (as nvfp4_encode_block divides), so no
    // lane waits on sixteen divisions.
    const float denom = __fmul_rn(e4m3_decode(best), gs);
    float pair[2] = {x[0], x[1]};  // x indexed by constants only, so it stays in registers
#pragma unroll
    for (int i = 1; i < 8; ++i) {
        if (lane == (u32)i) {
            pair[0] = x[2 * i];
            pair[1] = x[2 * i + 1];
        }
    }
    const u32 byte = e2m1_encode(__fdiv_rn(pair[0], denom)) |
                     (e2m1_encode(__fdiv_rn(pair[1], denom)) << 4);
    b.data[b.chunk * 8u + lane] = (u8)byte;
    if (lane == 0u) b.base[b.scale_index] = (u8)best;
}

// K's NVFP4 codes chosen for the queries (kvfmt::nvfp4::feedback::quantize_for_queries), after
// kv_quantize (or kv_quantize_nvfp4_mse) wrote the same tokens: one warp per (token, KV head)
// rewrites the head vector's K codes; its block scales are the ones already written, recomputed
// here by lanes b < d/16 as kv_quantize chose them. u holds the layer's factors, [kv_head][d][d]
// row-major (U upper triangular). d is a multiple of 32 of at most 256. The arithmetic is the
// CPU's: f32, each operation rounded on its own, value i ascending, then j ascending.
extern "C" __global__ void kv_k_codes(u8* __restrict__ pages, const float* __restrict__ k,
                                      const u32* __restrict__ slots, u32 n_tokens, PageGeom g,
                                      u32 rule, float gk, const float* __restrict__ u) {
    grid_dependency_sync();
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31u;
    // Whole warps leave together: blockDim is a multiple of 32.
    if (warp >= (u64)n_tokens * g.kv_heads) return;
    const u32 token = (u32)(warp / g.kv_heads), head = (u32)(warp % g.kv_heads);
    const u32 slot = slots[token];
    if (slot == 0xFFFFFFFFu) return;
    const u32 d = g.head_dim, per = d / 32u;
    const u32 page = slot >> g.page_shift, off = slot & (g.page_size - 1u);
    u8* data = pages + (u64)page * g.page_bytes + data_offset(g, 0u, head, off);
    const float* x = k + ((u64)token * g.kv_heads + head) * d;
    float scale = 0.0f;
    if (lane < d / 16u) {
        float xb[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) xb[i] = x[lane * 16u + i];
        u32 unused[2];
        scale = e4m3_decode(nvfp4_quantize_block(xb, gk, rule, unused));
    }
    float w[8];
#pragma unroll
    for (u32 t = 0; t < 8u; ++t) w[t] = t < per ? x[lane + 32u * t] : 0.0f;
    u32 codes = 0u;  // nibble t: the code of value lane + 32 t
    const float* uh = u + (u64)head * d * d;
    for (u32 i = 0; i < d; ++i) {
        const u32 owner = i & 31u, ti = i >> 5;
        const float s = __shfl_sync(0xFFFFFFFFu, scale, i / 16u);
        float mine = 0.0f;
#pragma unroll
        for (u32 t = 0; t < 8u; ++t) mine = t == ti ? w[t] : mine;
        const float wi = __shfl_sync(0xFFFFFFFFu, mine, owner);
        u32 code = 0u;
        float q = 0.0f;
        if (s != 0.0f) {
            code = e2m1_encode(__fdiv_rn(wi, __fmul_rn(s, gk)));
            q = __fmul_rn(__fmul_rn(e2m1_decode(code), s), gk);
        }
        if (lane == owner) codes |= code << (4u * ti);
        const float* row = uh + (u64)i * d;
        const float err = __fdiv_rn(__fsub_rn(wi, q), row[i]);
#pragma unroll
        for (u32 t = 0; t < 8u; ++t) {
            const u32 j = lane + 32u * t;
            if (t < per && j > i) w[t] = __fsub_rn(w[t], __fmul_rn(err, row[j]));
        }
    }
    // Byte b holds value 2b in its low nibble and 2b + 1 in its high one: an even lane and the
    // next, at the same t.
#pragma unroll
    for (u32 t = 0; t < 8u; ++t) {
        if (t >= per) break;
        const u32 c = (codes >> (4u * t)) & 0xFu;
        const u32 next = __shfl_down_sync(0xFFFFFFFFu, c, 1);
        if ((lane & 1u) == 0u) data[(lane + 32u * t) >> 1] = (u8)(c | (next << 4));
    }
}

// Extend: gathers tokens [0, n_tokens) of one sequence (its pages in page_table) from the pool
// into the work-dtype workspace, [token][kv_head][head_dim]: E4M3 with the work scales (wk, wv),
// or BF16 bytes when work_bf16 is set (always so for a bf16 cache). Each value is first
// dequantized to f32 exactly as the CPU reads a head vector (e2m1 * s * g, or e4m3 * g), then
// encoded.
extern "C" __global__ void kv_gather_work(u8* __restrict__ ws_k, u8* __restrict__ ws_v,
                                          const u8* __restrict__ pages,
                                          const u32* __restrict__ page_table, u32 n_tokens,
                                          PageGeom g, u32 dtype, u32 work_bf16, float gk,
                                          float gv, float wk, float wv) {
    grid_dependency_sync();
    const u32 chunks = g.head_dim / 16u;
    const u32 per_part = g.kv_heads * chunks;
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)n_tokens * 2u * per_part) return;
    const u32 token = (u32)(idx / (2u * per_part));
    u32 rem = (u32)(idx % (2u * per_part));
    const u32 part = rem / per_part;
    rem %= per_part;
    const u32 head = rem / chunks, chunk = rem % chunks;
    const u32 page = page_table[token >> g.page_shift], off = token & (g.page_size - 1u);
    const u8* base = pages + (u64)page * g.page_bytes;
    const u8* data = base + data_offset(g, part, head, off);
    const float gs = part ? gv : gk, ws = part ? wv : wk;
    const u64 out_index = ((u64)token * g.kv_heads + head) * g.head_dim + chunk * 16u;
    u8* out = part ? ws_v : ws_k;
    if (dtype == NIBBLE_BF16) {
        const uint4* src = reinterpret_cast<const uint4*>(data + chunk * 32u);
        uint4* dst = reinterpret_cast<uint4*>(out + 2u * out_index);
        dst[0] = src[0];
        dst[1] = src[1];
        return;
    }
    if (!work_bf16 && dtype == NIBBLE_FP8 && gs == ws && gs >= 0x1p-100f && gs <= 0x1p100f) {
        // The work scale is the cache's own (always so for an fp8 cache): re-encoding gives
        // every byte back. e4m3 * g / g is within 2^-23 of the E4M3 value, far inside its
        // rounding interval, as long as e4m3 * g stays a normal float, which this range of g
        // guarantees (|e4m3| is 0 or in [2^-9, 448]); 448 stays 448 and NaN codes stay as
        // written, as the CPU's decode and encode leave them.
        *reinterpret_cast<uint4*>(out + out_index) =
            *reinterpret_cast<const uint4*>(data + chunk * 16u);
        return;
    }
    float x[16];
    if (dtype == NIBBLE_NVFP4) {
        uint2 packed = *reinterpret_cast<const uint2*>(data + chunk * 8u);
        const u32 scale_code = base[scale_offset(g, part, head, off) + chunk];
        float s = e4m3_decode(scale_code);
        if (!work_bf16 && (scale_code & 0x7Fu) != 0x7Fu) {
            // A block's 16 codes take only 8 magnitudes: each magnitude's E4M3 byte is computed
            // once, exactly as below, and a code's byte is its magnitude's with the sign bit
            // flipped for a negative code (every step, the products, the division and the
            // encoding, is symmetric in the sign). A NaN scale (never written by nibble, but a
            // page can hold anything) takes the path below, whose NaN signs are the GPU's own.
            u32 lut[2] = {0u, 0u};
#pragma unroll
            for (u32 m = 0; m < 8u; ++m) {
                const float xm = __fmul_rn(__fmul_rn(e2m1_decode(m), s), gs);
                lut[m >> 2] |= e4m3_encode(__fdiv_rn(xm, ws)) << (8u * (m & 3u));
            }
            u32 w[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // four codes (16 bits) per output word
                const u32 codes = ((q < 2 ? packed.x : packed.y) >> (16 * (q & 1))) & 0xFFFFu;
                const u32 mag = __byte_perm(lut[0], lut[1], codes & 0x7777u);
                // prmt's sign-replicating mode: a selector nibble with its top bit set (a
                // negative code) gives 0xFF from a 0x80 byte, a clear one gives 0x80.
                u32 rep;
                asm("prmt.b32 %0, %1, %1, %2;" : "=r"(rep) : "r"(0x80808080u), "r"(codes));
                w[q] = mag ^ ((rep & 0x40404040u) << 1);
            }
            *reinterpret_cast<uint4*>(out + out_index) = make_uint4(w[0], w[1], w[2], w[3]);
            return;
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            u32 word = i < 8 ? packed.x : packed.y;
            u32 code = (word >> (4 * (i & 7))) & 0xFu;
            x[i] = __fmul_rn(__fmul_rn(e2m1_decode(code), s), gs);
        }
    } else {
        uint4 q = *reinterpret_cast<const uint4*>(data + chunk * 16u);
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = __fmul_rn(e4m3_decode((w[i >> 2] >> (8 * (i & 3))) & 0xFFu), gs);
    }
    if (work_bf16) {
        u32 w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = bf16_encode(x[2 * i]) | (bf16_encode(x[2 * i + 1]) << 16);
        uint4* dst = reinterpret_cast<uint4*>(out + 2u * out_index);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
        return;
    }
    u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i >> 2] |= e4m3_encode(__fdiv_rn(x[i], ws)) << (8 * (i & 3));
    *reinterpret_cast<uint4*>(out + out_index) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Fills n bytes with valid random codes of `dtype` from a counter hash (benchmark and test
// inputs, never zeros): any byte for nvfp4 data, scale bytes in [0x28, 0x3F] (0.125 .. 0.9375,
// never NaN); fp8 bytes with the NaN codes mapped away; bf16 values of magnitude in [2^-5, 2^5).
extern "C" __global__ void fill_random_pages(u8* __restrict__ pages, u64 n, u32 dtype, u32 seed,
                                             PageGeom g) {
    grid_dependency_sync();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u32 h = (u32)i * 0x9E3779B1u ^ (u32)(i >> 32) * 0x85EBCA77u ^ seed;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    u8 b = (u8)h;
    if (dtype == NIBBLE_NVFP4) {
        u64 in_page = i % g.page_bytes;
        u64 in_part = in_page % g.part_bytes;
        if (in_part >= (u64)g.kv_heads * g.page_size * g.data_bytes) b = (u8)(0x28u + (h >> 8) % 24u);
    } else if (dtype == NIBBLE_FP8) {
        if ((b & 0x7Fu) == 0x7Fu) b &= 0xF7u;
    } else if ((i & 1u) == 1u) {
        // high byte of a bf16: the sign and the top 7 exponent bits (61..65); the low byte is
        // random, so values are finite with magnitude in [2^-5, 2^5).
        b = (u8)(((h >> 12) & 0x80u) | (61u + (h >> 8) % 5u));
    }
    pages[i] = b;
}
