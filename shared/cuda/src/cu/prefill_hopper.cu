// Prefill and extend attention for Hopper (sm_90a): the function of prefill.cu's kernels (causal
// attention of n queries at positions start + i over the work-dtype workspace, BF16 queries,
// E4M3 or BF16 K/V, f32 out), on warpgroup MMA (wgmma) with warp-specialized pipelining:
//
//   * a block owns 128 query rows of one head and is 3 warpgroups: warpgroup 0 is the producer,
//     1 and 2 the consumers of 64 rows each;
//   * the producer streams the visible keys in tiles of 128 through shared-memory stages (2 for
//     E4M3, which also needs raw staging; 3 for BF16) in the 128-byte-swizzled layout wgmma
//     reads, and marks the stage's K and its V full (an mbarrier each). Over BF16 one thread has
//     the tensor memory accelerator copy them up to 3 tiles ahead, the copies completing the
//     barriers (a.tma; or, as over E4M3, the 128 threads copy a tile ahead with cp.async); over
//     E4M3 the threads turn the copied bytes into f16 by bit placement (value * 2^-8, exact, as
//     prefill.cu and decode.cu) and arrive themselves. K and V tiles have one layout:
//     rows of 64 dims (128 bytes) per key, 8-key groups 1,024 bytes apart, one 16-KB atom per
//     64 dims;
//   * each consumer computes S = Q K^T for its 64 rows by 128 keys (wgmma m64n128k16, Q from
//     registers, K from shared memory, K-major), the online softmax in registers (log2 units, as
//     prefill.cu), and O += P V (wgmma m64n64k16 per 64 dims, P from registers: S's accumulator
//     layout is the A operand's, V from shared memory, MN-major), one tile behind: tile i's
//     QK^T and tile i - 1's PV are in flight together and the softmax of tile i runs while the
//     PV does. A stage's K is released as soon as its scores are in, its V after its PV. Over
//     BF16 the two consumers take turns issuing their MMAs (ping-pong), so one's softmax
//     overlaps the other's MMAs;
//   * blocks run the longest rows first (the last query block is scheduled first), and a
//     consumer whose 64 rows see none of a tile's keys skips its MMAs; the mask is applied only to
//     tiles that reach past the first row's last visible key.
//
// The producer gives up registers for the consumers (setmaxnreg). The scale factors are
// prefill.cu's: score_scale and v_scale fold the 2^8, the global scales, the softmax scale and
// log2(e).

#define H_ROWS 128
#define H_KEYS 128
#define H_THREADS 384
#define H_PRODUCER_REGS 56
#define H_CONSUMER_REGS 224

template <int FMT, int D>
struct Hop {
    static const int STAGES = FMT == NIBBLE_BF16 ? 3 : 2;  // K/V stages in shared memory
    static const int ATOMS = D / 64;                  // 64-dim (128-byte) swizzle atoms per key
    static const int TILE = ATOMS * H_KEYS * 128;     // bytes of one K or V tile of 16-bit values
    static const int STAGE = 2 * TILE;                // K then V
    static const int VB = FMT == NIBBLE_BF16 ? 2 * D : D;  // workspace bytes per key vector
    static const int SRC = VB / 16;                   // 16-byte loads per key vector
    static const int LOADS = H_KEYS * SRC / 128;      // loads per producer thread per K or V tile
    static const int RAW = FMT == NIBBLE_BF16 ? 0 : 2 * H_KEYS * VB;  // E4M3 staging per tile
};

// Dynamic shared memory a block needs: the stages (3 for BF16, 2 for E4M3), two raw staging
// buffers (E4M3), 1,024 bytes of alignment slack, the barriers (full and empty, K and V, per
// stage).
#define H_SMEM(FMT, D)                                                                 \
    ((FMT) == NIBBLE_BF16 ? 3 * 2 * ((D) / 64) * H_KEYS * 128 + 1024 + 96               \
                          : 2 * 2 * ((D) / 64) * H_KEYS * 128 + 4 * H_KEYS * (D) + 1024 + 64)

// The mbarrier of `stage`'s K (part 0) or V (part 1): full ones first, then empty ones.
template <int STAGES>
__device__ __forceinline__ u32 hop_bar(u32 bars, bool empty, u32 stage, u32 part) {
    return bars + 8u * (((empty ? STAGES : 0) + stage) * 2u + part);
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Byte offset in a tile of the 16-byte chunk `chunk` (dims 8 chunk .. 8 chunk + 7) of key `key`:
// the chunk's atom, the key's row, the chunk's place in the row XOR the key's row in its group.
__device__ __forceinline__ u32 tile_offset(u32 key, u32 chunk) {
    return (chunk >> 3) * (H_KEYS * 128u) + key * 128u + (((chunk & 7u) ^ (key & 7u)) << 4);
}

// ---- mbarriers ----

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// ---- the tensor memory accelerator (BF16 workspaces) ----

// A CUtensorMap as the driver encodes it (cuTensorMapEncodeTiled); a kernel takes it as a
// __grid_constant__ parameter and hands its address to the copy.
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

// The next phase of `bar` completes with one arrival and `bytes` delivered by the copies.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// The box of `map` at element (x, y) to shared `dst` in the map's swizzle, completing `bytes`
// of `bar`'s phase (rows past the tensor's end arrive as zeros).
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

// ---- wgmma ----

// A shared-memory matrix descriptor of the 128-byte swizzle: start address, leading and stride
// byte offsets (each >> 4), layout type 1.
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// Until at most one committed group is in flight (groups complete in order).
__device__ __forceinline__ void wg_wait_one() {
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
}

// Keeps the compiler from moving accesses to accumulator registers across the asynchronous MMA.
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Keeps the A-operand registers of an MMA in flight alive (unchanged, not reused) until here.
template <int N>
__device__ __forceinline__ void wg_fence_regs(u32* a) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

#define WG_D8(d, i)                                                                          \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])

// d[64] (+)= A (registers: 64 rows x 16) * B (shared: 16 x 128, K-major), f32 accumulators.
template <int FMT>
__device__ __forceinline__ void wgmma_n128(float* d, const u32* a, u64 desc, u32 accumulate) {
#define WG_N128(TYPE)                                                                          \
    asm volatile(                                                                              \
        "{ .reg .pred p; setp.ne.b32 p, %68, 0;\n"                                              \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                        \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
        "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
        "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                              \
        "{%64, %65, %66, %67}, %69, p, 1, 1, 0; }"                                              \
        : WG_D8(d, 0), WG_D8(d, 8), WG_D8(d, 16), WG_D8(d, 24), WG_D8(d, 32), WG_D8(d, 40),     \
          WG_D8(d, 48), WG_D8(d, 56)                                                           \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(accumulate), "l"(desc))
    if (FMT == NIBBLE_BF16) {
        WG_N128("bf16");
    } else {
        WG_N128("f16");
    }
#undef WG_N128
}

// d[32] += A (registers: 64 rows x 16) * B (shared: 16 x 64, MN-major).
template <int FMT>
__device__ __forceinline__ void wgmma_n64_mn(float* d, const u32* a, u64 desc) {
#define WG_N64(TYPE)                                                                           \
    asm volatile(                                                                              \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                         \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                     \
        "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;"                                                 \
        : WG_D8(d, 0), WG_D8(d, 8), WG_D8(d, 16), WG_D8(d, 24)                                  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))
    if (FMT == NIBBLE_BF16) {
        WG_N64("bf16");
    } else {
        WG_N64("f16");
    }
#undef WG_N64
}

// ---- the producer warpgroup ----

// E4M3 bytes b0..b3 of w as f16 pairs (b0, b1) and (b2, b3) of value * 2^-8.
__device__ __forceinline__ void fp8_pairs(u32 w, u32& lo, u32& hi) {
    const u32 e02 = fp8_02(w), e13 = fp8_13(w);
    lo = __byte_perm(e02, e13, 0x5410);
    hi = __byte_perm(e02, e13, 0x7632);
}

__device__ __forceinline__ void st_shared16(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ uint4 ld_shared16(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// 16 bytes from global to shared without registers; zeros where `bytes` is 0.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Starts the copies of tile t's keys (zeros past key_end) for this thread: its 16-byte pieces
// tid, tid + 128, ... of the K and of the V tile (a key's pieces are consecutive: a warp reads
// whole rows). E4M3 pieces go to the raw staging buffer `raw` at their index, to be converted by
// this same thread; BF16 pieces go straight to their swizzled place in the stage `tile`.
template <int FMT, int D>
__device__ __forceinline__ void hop_fetch(const u8* __restrict__ wk, const u8* __restrict__ wv,
                                          u32 stride, u32 key0, u32 key_end, u32 raw, u32 tile,
                                          u32 tid) {
    typedef Hop<FMT, D> H;
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        const u8* src = part ? wv : wk;
#pragma unroll 8
        for (int i = 0; i < H::LOADS; ++i) {
            const u32 idx = (u32)i * 128u + tid;
            const u32 key = idx / H::SRC, piece = idx % H::SRC;
            const bool in = key0 + key < key_end;
            const u8* from = src + (u64)(in ? key0 + key : 0u) * stride + piece * 16u;
            const u32 to = FMT == NIBBLE_BF16 ? tile + part * H::TILE + tile_offset(key, piece)
                                              : raw + (part * H_KEYS * H::SRC + idx) * 16u;
            cp_async16(to, from, in ? 16u : 0u);
        }
    }
    cp_async_commit();
}

// This thread's E4M3 pieces of the K (part 0) or V (part 1) of a fetched tile, as f16 in the
// stage's swizzled layout: 16 bytes are dims 16 piece .. + 15, the tile's chunks 2 piece and
// 2 piece + 1.
template <int D>
__device__ __forceinline__ void hop_convert(u32 raw, u32 tile, u32 tid, u32 part) {
    typedef Hop<NIBBLE_FP8, D> H;
#pragma unroll
    for (int i = 0; i < H::LOADS; ++i) {
        const u32 idx = (u32)i * 128u + tid;
        const u32 key = idx / H::SRC, piece = idx % H::SRC;
        const uint4 w = ld_shared16(raw + (part * H_KEYS * H::SRC + idx) * 16u);
        uint4 c0, c1;
        fp8_pairs(w.x, c0.x, c0.y);
        fp8_pairs(w.y, c0.z, c0.w);
        fp8_pairs(w.z, c1.x, c1.y);
        fp8_pairs(w.w, c1.z, c1.w);
        const u32 t = tile + part * H::TILE;
        st_shared16(t + tile_offset(key, 2u * piece), c0);
        st_shared16(t + tile_offset(key, 2u * piece + 1u), c1);
    }
}

// The BF16 tiles by the tensor memory accelerator: one thread waits for each stage's K (then
// V) to be released, announces the tile's bytes on its full barrier and issues one copy per
// 64-dim atom, up to STAGES tiles ahead; the copies complete the barriers themselves. Keys past
// the workspace's end arrive as zeros, those before it (past the block's last row) are masked.
template <int D>
__device__ __forceinline__ void hop_produce_tma(const TensorMap* tk, const TensorMap* tv,
                                                u32 kv_head, u32 first, u32 count, u32 stages,
                                                u32 bars) {
    typedef Hop<NIBBLE_BF16, D> H;
    const u32 S = H::STAGES;
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(tk)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(tv)) : "memory");
    for (u32 i = 0; i < count; ++i) {
        const u32 tile = stages + (i % S) * H::STAGE;
        const int key0 = (int)((first + i) * H_KEYS);
#pragma unroll
        for (u32 part = 0; part < 2; ++part) {
            if (i >= S) mbar_wait(hop_bar<H::STAGES>(bars, true, i % S, part), (i / S - 1u) & 1u);
            const u32 full = hop_bar<H::STAGES>(bars, false, i % S, part);
            mbar_expect(full, (u32)H::TILE);
#pragma unroll
            for (int a = 0; a < H::ATOMS; ++a) {
                tma_load_2d(tile + part * H::TILE + a * (H_KEYS * 128), part ? tv : tk,
                            (int)(kv_head * D) + 64 * a, key0, full);
            }
        }
    }
}

// The block's tiles i = 0 .. count - 1 (keys from (first + i) * H_KEYS): tile i + 1's copies are
// in flight while tile i is converted (E4M3) or completes (BF16). A stage's K or V is written
// once the consumers released the tile STAGES before it; each is then marked full.
template <int FMT, int D>
__device__ __forceinline__ void hop_produce(const u8* __restrict__ wk, const u8* __restrict__ wv,
                                            u32 stride, u32 key_end, u32 first, u32 count,
                                            u32 stages, u32 raw, u32 bars, u32 tid) {
    typedef Hop<FMT, D> H;
    const u32 S = H::STAGES;
    auto free = [&](u32 i, u32 part) {
        if (i >= S) mbar_wait(hop_bar<H::STAGES>(bars, true, i % S, part), (i / S - 1u) & 1u);
    };
    auto fetch = [&](u32 i) {
        if (FMT == NIBBLE_BF16) {
            free(i, 0);
            free(i, 1);
        }
        hop_fetch<FMT, D>(wk, wv, stride, (first + i) * H_KEYS, key_end, raw + (i & 1u) * H::RAW,
                          stages + (i % S) * H::STAGE, tid);
    };
    if (count > 0) fetch(0);
    for (u32 i = 0; i < count; ++i) {
        if (i + 1u < count) {
            fetch(i + 1u);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        const u32 tile = stages + (i % S) * H::STAGE;
#pragma unroll
        for (u32 part = 0; part < 2; ++part) {
            if (FMT != NIBBLE_BF16) {
                free(i, part);
                hop_convert<D>(raw + (i & 1u) * H::RAW, tile, tid, part);
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            mbar_arrive(hop_bar<H::STAGES>(bars, false, i % S, part));
        }
    }
}

// ---- the consumer warpgroups ----

template <int FMT, int D>
__device__ __forceinline__ void hop_consume(const float* __restrict__ q, float* __restrict__ out,
                                            float* __restrict__ part, PrefillArgs a, u32 head,
                                            u32 row_base, u32 first, u32 count, u32 stages,
                                            u32 bars, u32 tid) {
    typedef Hop<FMT, D> H;
    const u32 warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const u32 rows[2] = {row_base + 16u * warp + g, row_base + 16u * warp + g + 8u};

    // Q as A fragments, BF16-rounded (then f16 for E4M3 keys): k-step s, register 2h + r holds
    // row r's dims 16s + 8h + 2c, + 1.
    u32 qa[D / 16][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool ok = rows[r] < a.n;
        const float* qr = q + ((u64)(ok ? rows[r] : 0u) * a.q_heads + head) * D + 2u * c;
#pragma unroll
        for (int s = 0; s < D / 16; ++s) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 x = *reinterpret_cast<const float2*>(qr + 16 * s + 8 * h);
                const float lo = ok ? bf16_decode(bf16_encode(x.x)) : 0.f;
                const float hi = ok ? bf16_decode(bf16_encode(x.y)) : 0.f;
                qa[s][2 * h + r] = FMT == NIBBLE_BF16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
            }
        }
    }

    const float NEG_INF = __int_as_float(0xff800000);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[H::ATOMS][32];
#pragma unroll
    for (int h = 0; h < H::ATOMS; ++h)
#pragma unroll
        for (int i = 0; i < 32; ++i) o[h][i] = 0.f;

    // this warpgroup's rows see keys < its_end; every row sees keys < all_see
    auto end_of = [&](u32 base) {
        return base < a.n ? a.start + min(base + 63u, a.n - 1u) + 1u : 0u;
    };
    const u32 its_end = end_of(row_base);
    const u32 all_see = a.start + row_base + 1u;

    // The tiles this warpgroup's rows see are a prefix of the block's: `seen` of them. The
    // others are waited for and released without MMAs (the producer fills every stage).
    const u32 S = H::STAGES;
    auto seen_of = [&](u32 end) {
        return end > first * H_KEYS ? min(count, (end + H_KEYS - 1u) / H_KEYS - first) : 0u;
    };
    const u32 seen = seen_of(its_end);
    // Over BF16 the two consumers take turns issuing their MMAs (FA3's ping-pong, on named
    // barriers 1 and 2), so one's softmax runs while the other's MMAs do: the first consumer
    // goes first, and the one with fewer tiles (they differ by at most one, fewer than the
    // stages, so no stage waits on a consumer that waits for its turn) takes empty turns until
    // both have taken as many. Over E4M3 the producer's conversion sets the pace and turns
    // gained nothing (KERNEL-LAB.md). The launch chooses (`a.pingpong`, the same for the block).
    const bool pingpong = FMT == NIBBLE_BF16 && a.pingpong != 0u;
    const u32 which = (row_base / 64u) & 1u;
    const u32 turns = max(seen, seen_of(end_of(which ? row_base - 64u : row_base + 64u)));
    auto turn_wait = [&]() {
        if (pingpong) asm volatile("bar.sync %0, 256;" ::"r"(1u + which) : "memory");
    };
    auto turn_pass = [&]() {
        if (pingpong) asm volatile("bar.arrive %0, 256;" ::"r"(2u - which) : "memory");
    };
    if (which == 1u) turn_pass();
    auto bar = [&](bool empty, u32 i, u32 part) {
        return hop_bar<H::STAGES>(bars, empty, i % S, part);
    };
    auto phase = [&](u32 i) { return (i / S) & 1u; };
    // S = Q K^T of tile i, issued and committed.
    auto issue_s = [&](u32 i, float* sc) {
        const u32 k_tile = stages + (i % S) * H::STAGE;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const u32 at = k_tile + (ks / 4) * (H_KEYS * 128) + (ks % 4) * 32;
            wgmma_n128<FMT>(sc, qa[ks], sw128_desc(at, 16, 1024), ks > 0 ? 1u : 0u);
        }
        wg_commit();
    };
    // O += P V of tile i (P in `pa`), issued and committed.
    auto issue_pv = [&](u32 i, u32 (*pa)[4]) {
        const u32 v_tile = stages + (i % S) * H::STAGE + H::TILE;
#pragma unroll
        for (int kt = 0; kt < 8; ++kt) {
#pragma unroll
            for (int h = 0; h < H::ATOMS; ++h) {
                const u32 at = v_tile + h * (H_KEYS * 128) + kt * 2048;
                wgmma_n64_mn<FMT>(o[h], pa[kt], sw128_desc(at, 1024, 1024));
            }
        }
        wg_commit();
    };
    // After the PV of tile i completed: its accumulators and A registers settled, its V free.
    auto settle_pv = [&](u32 i, u32 (*pa)[4]) {
#pragma unroll
        for (int h = 0; h < H::ATOMS; ++h) wg_fence_regs<32>(o[h]);
#pragma unroll
        for (int kt = 0; kt < 8; ++kt) wg_fence_regs<4>(pa[kt]);
        mbar_arrive(bar(true, i, 1));
    };
    // The online softmax of tile i's scores, O rescaled, and P packed into `pa`.
    auto softmax = [&](u32 i, float* sc, u32 (*pa)[4], bool pv_in_flight) {
        const u32 key0 = (first + i) * H_KEYS;
        // scores (log2 units), masked where the tile reaches past a row's last key
        const bool mask = key0 + H_KEYS > all_see || row_base + 64u > a.n;
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u32 visible = rows[r] < a.n ? a.start + rows[r] + 1u : 0u;
            corr[r] = online_softmax_row<16>(sc, r, key0, c, visible, mask, a.score_scale, m[r],
                                             l[r]);
        }
        if (pv_in_flight) {
            wg_wait_all();
            settle_pv(i - 1u, pa);
        }
#pragma unroll
        for (int h = 0; h < H::ATOMS; ++h) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                o[h][4 * j + 0] *= corr[0];
                o[h][4 * j + 1] *= corr[0];
                o[h][4 * j + 2] *= corr[1];
                o[h][4 * j + 3] *= corr[1];
            }
        }
#pragma unroll
        for (int kt = 0; kt < 8; ++kt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float* f = sc + 4 * (2 * kt + h);
                pa[kt][2 * h] = FMT == NIBBLE_BF16 ? pack_bf16(f[0], f[1]) : pack_f16(f[0], f[1]);
                pa[kt][2 * h + 1] = FMT == NIBBLE_BF16 ? pack_bf16(f[2], f[3]) : pack_f16(f[2], f[3]);
            }
        }
    };

    // P of the tile before, as A fragments: k-step kt (keys 16 kt ..) is S's n-tiles 2 kt and
    // 2 kt + 1.
    u32 pa[8][4];
    if (seen > 0) {
        float sc[64];
        mbar_wait(bar(false, 0, 0), 0);
        wg_fence();
        issue_s(0, sc);
        wg_wait_all();
        wg_fence_regs<64>(sc);
        mbar_arrive(bar(true, 0, 0));
        softmax(0, sc, pa, false);
    }
    for (u32 i = 1; i < seen; ++i) {
        float sc[64];
        mbar_wait(bar(false, i, 0), phase(i));
        mbar_wait(bar(false, i - 1u, 1), phase(i - 1u));
#pragma unroll
        for (int h = 0; h < H::ATOMS; ++h) wg_fence_regs<32>(o[h]);
        turn_wait();
        wg_fence();
        issue_s(i, sc);
        issue_pv(i - 1u, pa);
        turn_pass();
        wg_wait_one();  // the scores; the PV may still run
        wg_fence_regs<64>(sc);
        mbar_arrive(bar(true, i, 0));
        softmax(i, sc, pa, true);
    }
    for (u32 i = max(seen, 1u); i < turns; ++i) {
        turn_wait();
        turn_pass();
    }
    // The second consumer's last pass (or its first, with no turns) is the first's last wait,
    // so no barrier is left half-arrived when the block ends.
    if (which == 0u) turn_wait();
    if (seen > 0) {
        mbar_wait(bar(false, seen - 1u, 1), phase(seen - 1u));
#pragma unroll
        for (int h = 0; h < H::ATOMS; ++h) wg_fence_regs<32>(o[h]);
        wg_fence();
        issue_pv(seen - 1u, pa);
        wg_wait_all();
        settle_pv(seen - 1u, pa);
    }
    for (u32 i = seen; i < count; ++i) {
#pragma unroll
        for (u32 part = 0; part < 2; ++part) {
            mbar_wait(bar(false, i, part), phase(i));
            mbar_arrive(bar(true, i, part));
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    // o[h][4j + 2r + e]: row r, dim 64h + 8j + 2c + e. One split: the output. Several: this
    // split's unnormalized O and its rows' (m, l), merged by prefill_combine.
    const u32 split = blockIdx.z, splits = gridDim.z;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= a.n) continue;
        const u64 at = (u64)split * a.n * a.q_heads + (u64)rows[r] * a.q_heads + head;
        const float f = splits > 1 ? 1.f : (l[r] > 0.f ? a.v_scale / l[r] : 0.f);
        float* orow = (splits > 1 ? part : out) + at * D + 2u * c;
#pragma unroll
        for (int h = 0; h < H::ATOMS; ++h) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                *reinterpret_cast<float2*>(orow + 64 * h + 8 * j) =
                    make_float2(o[h][4 * j + 2 * r] * f, o[h][4 * j + 2 * r + 1] * f);
            }
        }
        if (splits > 1 && c == 0) {
            float* ml = part + (u64)splits * a.n * a.q_heads * D + 2u * at;
            *reinterpret_cast<float2*>(ml) = make_float2(m[r], l[r]);
        }
    }
}

template <int FMT, int D>
__device__ __forceinline__ void hopper_prefill_body(const float* __restrict__ q,
                                                    const u8* __restrict__ wk,
                                                    const u8* __restrict__ wv,
                                                    float* __restrict__ out,
                                                    float* __restrict__ part, PrefillArgs a,
                                                    const TensorMap* tk, const TensorMap* tv) {
    typedef Hop<FMT, D> H;
    // BF16 tiles by the tensor memory accelerator (a.tma) or by the producer's 128 threads
    const bool tma = FMT == NIBBLE_BF16 && a.tma != 0u;
    extern __shared__ u8 hop_smem[];
    const u32 stages = (smem_addr(hop_smem) + 1023u) & ~1023u;
    const u32 raw = stages + H::STAGES * H::STAGE;   // two E4M3 staging buffers
    const u32 bars = raw + 2u * H::RAW;              // hop_bar
    const u32 tid = threadIdx.x, wg = tid / 128;
    const u32 head = blockIdx.y;
    const u32 row0 = (gridDim.x - 1u - blockIdx.x) * H_ROWS;  // the longest rows first
    const u32 key_end = a.start + min(row0 + H_ROWS - 1u, a.n - 1u) + 1u;
    // split z of gridDim.z takes an equal share of the block's tiles (possibly none)
    const u32 tiles = (key_end + H_KEYS - 1u) / H_KEYS;
    const u32 share = (tiles + gridDim.z - 1u) / gridDim.z;
    const u32 first = min(blockIdx.z * share, tiles);
    const u32 count = min(first + share, tiles) - first;
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < H::STAGES; ++s) {
#pragma unroll
            for (int part = 0; part < 2; ++part) {
                mbar_init(hop_bar<H::STAGES>(bars, false, s, part), tma ? 1u : 128u);
                mbar_init(hop_bar<H::STAGES>(bars, true, s, part), 256u);
            }
        }
        // the initialized barriers visible to the tensor memory accelerator's completions
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const u32 kv_head = head / (a.q_heads / a.kv_heads);
    const u32 stride = a.kv_heads * H::VB;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(H_PRODUCER_REGS));
        if (tma) {
            if (tid == 0) hop_produce_tma<D>(tk, tv, kv_head, first, count, stages, bars);
        } else {
            hop_produce<FMT, D>(wk + kv_head * H::VB, wv + kv_head * H::VB, stride, key_end,
                                first, count, stages, raw, bars, tid);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(H_CONSUMER_REGS));
        hop_consume<FMT, D>(q, out, part, a, head, row0 + 64u * (wg - 1u), first, count, stages,
                            bars, tid & 127u);
    }
}

// grid (query blocks, query heads, splits); tk and tv map a BF16 workspace's K and V for the
// tensor memory accelerator (2D: kv_heads * D elements a key, the keys; 64 x 128 boxes in the
// 128-byte swizzle), unused over E4M3 and without a.tma; with one split `part` is not touched, with several
// each split writes its share to `part` ([split][row][head][D] f32, then [split][row][head]
// (m, l)) and prefill_combine writes `out`.
#define HOPPER_PREFILL_KERNEL(NAME, FMT, D)                                                 \
    extern "C" __global__ void __launch_bounds__(H_THREADS, 1)                              \
        NAME(const float* __restrict__ q, const u8* __restrict__ wk,                         \
             const u8* __restrict__ wv, float* __restrict__ out, float* __restrict__ part,   \
             PrefillArgs a, const __grid_constant__ TensorMap tk,                           \
             const __grid_constant__ TensorMap tv) {                                        \
        grid_dependency_sync();                                                              \
        hopper_prefill_body<FMT, D>(q, wk, wv, out, part, a, &tk, &tv);                     \
    }

HOPPER_PREFILL_KERNEL(prefill_hopper_fp8_d64, NIBBLE_FP8, 64)
HOPPER_PREFILL_KERNEL(prefill_hopper_fp8_d128, NIBBLE_FP8, 128)
HOPPER_PREFILL_KERNEL(prefill_hopper_bf16_d64, NIBBLE_BF16, 64)
HOPPER_PREFILL_KERNEL(prefill_hopper_bf16_d128, NIBBLE_BF16, 128)

// The splits of a prefill_hopper_* launch merged: one warp per (row, head), grid (rows, heads /
// 4) of 128 threads. The splits' maxima are log2-unit scores, as the kernels keep them; a split
// that saw no key has m = -inf, l = 0 and adds nothing.
extern "C" __global__ void __launch_bounds__(128)
    prefill_combine(const float* __restrict__ part, float* __restrict__ out, u32 n, u32 q_heads,
                    u32 head_dim, u32 splits, float v_scale) {
    grid_dependency_sync();
    const u32 row = blockIdx.x, head = blockIdx.y * 4u + threadIdx.x / 32u, lane = threadIdx.x % 32u;
    if (head >= q_heads) return;
    const float NEG_INF = __int_as_float(0xff800000);
    const float* ml = part + (u64)splits * n * q_heads * head_dim;
    float mx = NEG_INF;
    for (u32 s = 0; s < splits; ++s) mx = fmaxf(mx, ml[2u * (((u64)s * n + row) * q_heads + head)]);
    const float mu = mx == NEG_INF ? 0.f : mx;
    float l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (u32 s = 0; s < splits; ++s) {
        const u64 at = ((u64)s * n + row) * q_heads + head;
        const float w = fast_exp2(ml[2u * at] - mu);
        l += w * ml[2u * at + 1u];
        const float* o = part + at * head_dim;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 d = lane + 32u * i;
            if (d < head_dim) acc[i] += w * o[d];
        }
    }
    const float f = l > 0.f ? v_scale / l : 0.f;
    float* orow = out + ((u64)row * q_heads + head) * head_dim;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 d = lane + 32u * i;
        if (d < head_dim) orow[d] = acc[i] * f;
    }
}
