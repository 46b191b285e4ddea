// The dense kernels of the CUDA backend (src/backend.rs): embedding (f32 or BF16 table), the
// f32 -> BF16 activation cast of the BF16-weight GEMM and that GEMM for decode's few rows,
// RMSNorm (alone and after a residual add), RoPE, SwiGLU, residual and bias
// adds, causal f32 attention for the contiguous cache, the f32 -> work-dtype workspace encoder of
// the paged prefill/extend paths, and a tiled f32 GEMM used only when cuBLAS cannot be loaded.
// Compiled with --fmad=false so products and sums round like the CPU backend's (which never
// fuses).

// out[r][c] = table[tokens[r]][c]
extern "C" __global__ void embed_rows(float* __restrict__ out, const float* __restrict__ table,
                                      const u32* __restrict__ tokens, u32 n, u32 cols) {
    grid_dependency_sync();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n * cols) return;
    const u32 r = (u32)(i / cols), c = (u32)(i % cols);
    out[i] = table[(u64)tokens[r] * cols + c];
}

// embed_rows over a BF16 table (BF16 weights): the widening to f32 is exact.
extern "C" __global__ void embed_rows_bf16(float* __restrict__ out, const u16* __restrict__ table,
                                           const u32* __restrict__ tokens, u32 n, u32 cols) {
    grid_dependency_sync();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n * cols) return;
    const u32 r = (u32)(i / cols), c = (u32)(i % cols);
    out[i] = bf16_decode(table[(u64)tokens[r] * cols + c]);
}

// out[i] = BF16(x[i]), round to nearest even (kvfmt::bf16::encode): the activation operand of the
// BF16-weight cuBLAS GEMM.
extern "C" __global__ void f32_to_bf16(u16* __restrict__ out, const float* __restrict__ x, u64 n) {
    grid_dependency_sync();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (u16)bf16_encode(x[i]);
}

// The BF16-weight GEMM of decode steps of one or two sequences (n <= 2 rows): out[r][o] = sum_k
// x[r][k] * w[o][k] with w BF16 [m][k], x the BF16 cast [n][k], out f32 [n][m]. Weight-bandwidth
// bound, so built for bytes in flight: a block of 4 warps takes 4 weight rows, each warp a quarter
// of k (k a multiple of 32), each lane 8 values of each row per 16-byte load, streamed past L1
// (which keeps x for the other warps); products exact in f32, sums fused (fmaf: explicit under
// --fmad=false) per lane, then across the warp, then across the 4 warps in shared memory. At one
// row it beats cuBLAS on Llama-3-8B's shapes (a 1024 x 4096 matrix in 6.6 us against 13.2, the
// 128256-row head in 240 against 266; run 60); at 8 rows the loads of x make it slower, so 3 to 16
// rows go to the tensor-core kernel below (gemm_bf16_skinny*) and more to cuBLAS.
// 16 bytes of read-only global memory, with the ld's cache qualifier QUAL (".L1::no_allocate":
// streamed past L1).
#define LOAD_V4(NAME, QUAL)                                                                        \
    __device__ __forceinline__ uint4 NAME(const uint4* p) {                                        \
        uint4 v;                                                                                   \
        asm volatile("ld.global.nc" QUAL ".v4.u32 {%0, %1, %2, %3}, [%4];"                         \
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                                  \
                     : "l"(p));                                                                    \
        return v;                                                                                  \
    }
LOAD_V4(load_stream, ".L1::no_allocate")

__device__ __forceinline__ void bf16x8(uint4 v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

#define GEMV_ROWS 4

template <int N>
__device__ __forceinline__ void gemv_bf16_body(const u16* __restrict__ w,
                                               const u16* __restrict__ x,
                                               float* __restrict__ out, u32 n, u32 m, u32 k,
                                               u32 block) {
    __shared__ float partial[4][GEMV_ROWS][N];
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 row0 = block * GEMV_ROWS;
    const u32 quarter = k / 32;  // 16-byte words of a row per warp
    const u32 first = warp * quarter;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
        const u32 row = min(row0 + i, m - 1);  // past m: read a real row, write nothing
        wr[i] = reinterpret_cast<const uint4*>(w + (u64)row * k) + first;
    }
    float acc[GEMV_ROWS][N];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
        for (int r = 0; r < N; ++r) acc[i][r] = 0.f;
#pragma unroll 2
    for (u32 j = lane; j < quarter; j += 32) {
        float a[GEMV_ROWS][8];
#pragma unroll
        for (int i = 0; i < GEMV_ROWS; ++i) bf16x8(load_stream(wr[i] + j), a[i]);
#pragma unroll
        for (int r = 0; r < N; ++r) {
            if (r >= (int)n) break;
            float xv[8];
            bf16x8(__ldg(reinterpret_cast<const uint4*>(x + (u64)r * k) + first + j), xv);
#pragma unroll
            for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[i][r] = fmaf(a[i][e], xv[e], acc[i][r]);
        }
    }
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
#pragma unroll
        for (int r = 0; r < N; ++r) {
            float v = acc[i][r];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) partial[warp][i][r] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < GEMV_ROWS * N) {
        const u32 i = threadIdx.x / N, r = threadIdx.x % N;
        if (r < n && row0 + i < m)
            out[(u64)r * m + row0 + i] =
                ((partial[0][i][r] + partial[1][i][r]) + partial[2][i][r]) + partial[3][i][r];
    }
}

#define GEMV_BF16(NAME, N)                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        NAME(const u16* __restrict__ w0, float* __restrict__ o0, u32 m0,                           \
             const u16* __restrict__ x, u32 n, u32 k) {                                            \
        grid_dependency_sync();                                                                    \
        gemv_bf16_body<N>(w0, x, o0, n, m0, k, blockIdx.x);                                        \
    }
GEMV_BF16(gemv_bf16_n1, 1)
GEMV_BF16(gemv_bf16_n2, 2)

// Two or three matrices of one input in one launch (Q, K and V; gate and up): matrix p takes the
// next ceil(m_p / GEMV_ROWS) blocks. Each output is computed exactly as gemv_bf16_n* computes it
// alone, one launch instead of two or three and no tail wave per matrix.
#define GEMV_BLOCKS(M) (((M) + GEMV_ROWS - 1) / GEMV_ROWS)
#define GEMV_BF16_X2(NAME, N)                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        NAME(const u16* __restrict__ w0, const u16* __restrict__ w1, float* __restrict__ o0,       \
             float* __restrict__ o1, u32 m0, u32 m1, const u16* __restrict__ x, u32 n, u32 k) {    \
        grid_dependency_sync();                                                                    \
        const u32 b = blockIdx.x, b0 = GEMV_BLOCKS(m0);                                            \
        if (b < b0) gemv_bf16_body<N>(w0, x, o0, n, m0, k, b);                                     \
        else gemv_bf16_body<N>(w1, x, o1, n, m1, k, b - b0);                                       \
    }
#define GEMV_BF16_X3(NAME, N)                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        NAME(const u16* __restrict__ w0, const u16* __restrict__ w1, const u16* __restrict__ w2,   \
             float* __restrict__ o0, float* __restrict__ o1, float* __restrict__ o2, u32 m0,       \
             u32 m1, u32 m2, const u16* __restrict__ x, u32 n, u32 k) {                            \
        grid_dependency_sync();                                                                    \
        const u32 b = blockIdx.x, b0 = GEMV_BLOCKS(m0), b1 = b0 + GEMV_BLOCKS(m1);                 \
        if (b < b0) gemv_bf16_body<N>(w0, x, o0, n, m0, k, b);                                     \
        else if (b < b1) gemv_bf16_body<N>(w1, x, o1, n, m1, k, b - b0);                           \
        else gemv_bf16_body<N>(w2, x, o2, n, m2, k, b - b1);                                       \
    }
GEMV_BF16_X2(gemv_bf16_n1_x2, 1)
GEMV_BF16_X2(gemv_bf16_n2_x2, 2)
GEMV_BF16_X3(gemv_bf16_n1_x3, 1)
GEMV_BF16_X3(gemv_bf16_n2_x3, 2)

// A SwiGLU FFN's first half for one or two rows in one launch: gate (w0, into o0) and up (w1,
// into o1), both m features, as gemv_bf16_n*_x2 computes them, then o0 = silu(o0) * o1 and its
// BF16 cast into g_bf16 (unless null) exactly as silu_mul_f32 computes them, sparing a decode
// step that launch per layer. Block b < B (B = ceil(m / GEMV_ROWS)) computes gate rows
// GEMV_ROWS * b.., block B + b the same rows of up; the second of the two to finish (counted in
// pairs[b], which it sets back to 0 for the next launch) applies the activation to them.
#define GEMV_BF16_SWIGLU(NAME, N)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        NAME(const u16* __restrict__ w0, const u16* __restrict__ w1, float* __restrict__ o0,       \
             float* __restrict__ o1, u32 m, const u16* __restrict__ x, u32 n, u32 k,               \
             u32* __restrict__ pairs, u16* __restrict__ g_bf16) {                                  \
        grid_dependency_sync();                                                                    \
        const u32 blocks = GEMV_BLOCKS(m), b = blockIdx.x, pair = b < blocks ? b : b - blocks;     \
        if (b < blocks) gemv_bf16_body<N>(w0, x, o0, n, m, k, pair);                               \
        else gemv_bf16_body<N>(w1, x, o1, n, m, k, pair);                                          \
        swiglu_pair<N>(o0, o1, m, n, pairs, pair, g_bf16);                                         \
    }

// The end of a GEMV_BF16_SWIGLU block: its outputs made visible, then, in the second block of the
// pair to get here, the activation of the pair's rows (read from L2, where the other block's
// writes are).
template <int N>
__device__ __forceinline__ void swiglu_pair(float* __restrict__ o0, const float* __restrict__ o1,
                                            u32 m, u32 n, u32* __restrict__ pairs, u32 pair,
                                            u16* __restrict__ g_bf16) {
    __shared__ u32 second;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        second = atomicAdd(pairs + pair, 1u) == 1u;
        if (second) pairs[pair] = 0u;
    }
    __syncthreads();
    if (!second) return;
    __threadfence();
    if (threadIdx.x < GEMV_ROWS * N) {
        const u32 i = threadIdx.x / N, r = threadIdx.x % N, row = pair * GEMV_ROWS + i;
        if (r < n && row < m) {
            const u64 at = (u64)r * m + row;
            const float g = __ldcg(o0 + at);
            const float v = g / (1.0f + expf(-g)) * __ldcg(o1 + at);
            o0[at] = v;
            if (g_bf16) g_bf16[at] = (u16)bf16_encode(v);
        }
    }
}
GEMV_BF16_SWIGLU(gemv_bf16_n1_swiglu, 1)
GEMV_BF16_SWIGLU(gemv_bf16_n2_swiglu, 2)

// ---- BF16-weight GEMMs of 3 to 16 rows on the tensor cores (decode batches) ----
// out[r][f] = sum_k x[r][k] * w[f][k] (x the BF16 cast of the activations). A block of
// SKINNY_WARPS warps takes 16 output features (the M of m16n8k16) and NT tiles of 8 rows of x
// (N; rows past n read row n - 1 into columns never written); warp j takes the 32-wide k
// chunks j, j + SKINNY_WARPS, ... Per chunk a lane loads 16 bytes of weight rows g and g + 8
// (k = 8c .. 8c + 7 of the chunk, past L1) and 16 bytes of x row g of each tile: two mmas per
// tile, whose k order is permuted the same way in A and B (mma k 2c, 2c + 1 and 2c + 8, 2c + 9
// are the chunk's 8c + 4s .. 8c + 4s + 3 in step s). The warps' sums meet in shared memory and
// are added in warp order. Weight rows past m read row m - 1 likewise. 16 warps per 16 features
// keep enough loads in flight for q/o and down's 256 blocks (8 warps: down 45 us against
// cuBLAS's 34; 16: 34; run 66). Two tiles (9-16 rows) take 2 chunks per round, not 4, which
// keeps them at 60 registers and two blocks per SM (with 4, one block: slower than cuBLAS).
#define SKINNY_WARPS 16

// x's loads (cached in L1: every block reads all of x). Volatile like load_stream and mma16816,
// so a round's loads stay ahead of its mmas in the PTX; ptxas still interleaves loads and mmas
// in the SASS, and what keeps a load from waiting behind an mma is that no mma waits for another
// (each chunk of a round has its own accumulator, below: with one chain the kernel was 2-3x
// slower than cuBLAS, runs 62-63).
LOAD_V4(load_cached, "")

// NT tiles of 8 rows of x (8 rows: 1; 16: 2), DEPTH chunks per round of a warp.
template <int NT, int DEPTH>
__device__ __forceinline__ void skinny_body(const u16* __restrict__ w, const u16* __restrict__ x,
                                            float* __restrict__ out, u32 n, u32 m, u32 k,
                                            u32 tile) {
    __shared__ float part[SKINNY_WARPS][NT][16][8];
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const u32 f0 = tile * 16;
    const uint4* wa = reinterpret_cast<const uint4*>(w + (u64)min(f0 + g, m - 1) * k) + c;
    const uint4* wb = reinterpret_cast<const uint4*>(w + (u64)min(f0 + g + 8, m - 1) * k) + c;
    const uint4* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t)
        xr[t] = reinterpret_cast<const uint4*>(x + (u64)min(8u * t + g, n - 1) * k) + c;
    // One accumulator per chunk of a round: independent mma chains, so no mma waits for the
    // one before it (and the loads behind it in issue order do not wait either).
    float acc[DEPTH][NT][4];
#pragma unroll
    for (int u = 0; u < DEPTH; ++u)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[u][t][i] = 0.f;
    const u32 chunks = k / 32;
    for (u32 ch0 = warp; ch0 < chunks; ch0 += DEPTH * SKINNY_WARPS) {
        uint4 a[DEPTH], b[DEPTH], xv[DEPTH][NT];
#pragma unroll
        for (int u = 0; u < DEPTH; ++u) {
            const u32 ch = min(ch0 + u * SKINNY_WARPS, chunks - 1);
            a[u] = load_stream(wa + 4 * ch);
            b[u] = load_stream(wb + 4 * ch);
#pragma unroll
            for (int t = 0; t < NT; ++t) xv[u][t] = load_cached(xr[t] + 4 * ch);
        }
        // Past the end (a warp's last round when the chunks do not divide evenly) the last
        // chunk is loaded again and multiplied by zeros. Branching instead would let the
        // compiler sink the loads into the branches, one load latency per chunk again.
#pragma unroll
        for (int u = 0; u < DEPTH; ++u)
            if (ch0 + u * SKINNY_WARPS >= chunks)
#pragma unroll
                for (int t = 0; t < NT; ++t) xv[u][t] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < DEPTH; ++u) {
            const u32 s0[4] = {a[u].x, b[u].x, a[u].y, b[u].y};
            const u32 s1[4] = {a[u].z, b[u].z, a[u].w, b[u].w};
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                mma16816<NIBBLE_BF16>(acc[u][t], s0, xv[u][t].x, xv[u][t].y);
                mma16816<NIBBLE_BF16>(acc[u][t], s1, xv[u][t].z, xv[u][t].w);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = acc[0][t][i];
#pragma unroll
            for (int u = 1; u < DEPTH; ++u) v[i] += acc[u][t][i];
        }
        part[warp][t][g][2 * c] = v[0];
        part[warp][t][g][2 * c + 1] = v[1];
        part[warp][t][g + 8][2 * c] = v[2];
        part[warp][t][g + 8][2 * c + 1] = v[3];
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < NT * 128u; i += blockDim.x) {
        const u32 t = i / 128u, f = (i / 8u) % 16u, r = 8u * t + i % 8u;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < SKINNY_WARPS; ++j) sum += part[j][t][f][i % 8u];
        if (r < n && f0 + f < m) out[(u64)r * m + f0 + f] = sum;
    }
}

#define SKINNY_TILES(M) (((M) + 15u) / 16u)
#define SKINNY_X1(NAME, NT, DEPTH)                                                                 \
    extern "C" __global__ void __launch_bounds__(SKINNY_WARPS * 32)                                \
        NAME(const u16* __restrict__ w0, float* __restrict__ o0, u32 m0,                           \
             const u16* __restrict__ x, u32 n, u32 k) {                                            \
        grid_dependency_sync();                                                                    \
        skinny_body<NT, DEPTH>(w0, x, o0, n, m0, k, blockIdx.x);                                   \
    }
#define SKINNY_X2(NAME, NT, DEPTH)                                                                 \
    extern "C" __global__ void __launch_bounds__(SKINNY_WARPS * 32)                                \
        NAME(const u16* __restrict__ w0, const u16* __restrict__ w1, float* __restrict__ o0,       \
             float* __restrict__ o1, u32 m0, u32 m1, const u16* __restrict__ x, u32 n, u32 k) {    \
        grid_dependency_sync();                                                                    \
        const u32 b = blockIdx.x, b0 = SKINNY_TILES(m0);                                           \
        if (b < b0) skinny_body<NT, DEPTH>(w0, x, o0, n, m0, k, b);                                \
        else skinny_body<NT, DEPTH>(w1, x, o1, n, m1, k, b - b0);                                  \
    }
#define SKINNY_X3(NAME, NT, DEPTH)                                                                 \
    extern "C" __global__ void __launch_bounds__(SKINNY_WARPS * 32)                                \
        NAME(const u16* __restrict__ w0, const u16* __restrict__ w1, const u16* __restrict__ w2,   \
             float* __restrict__ o0, float* __restrict__ o1, float* __restrict__ o2, u32 m0,       \
             u32 m1, u32 m2, const u16* __restrict__ x, u32 n, u32 k) {                            \
        grid_dependency_sync();                                                                    \
        const u32 b = blockIdx.x, b0 = SKINNY_TILES(m0), b1 = b0 + SKINNY_TILES(m1);               \
        if (b < b0) skinny_body<NT, DEPTH>(w0, x, o0, n, m0, k, b);                                \
        else if (b < b1) skinny_body<NT, DEPTH>(w1, x, o1, n, m1, k, b - b0);                      \
        else skinny_body<NT, DEPTH>(w2, x, o2, n, m2, k, b - b1);                                  \
    }
SKINNY_X1(gemm_bf16_skinny8, 1, 4)
SKINNY_X2(gemm_bf16_skinny8_x2, 1, 4)
SKINNY_X3(gemm_bf16_skinny8_x3, 1, 4)
SKINNY_X1(gemm_bf16_skinny16, 2, 2)
SKINNY_X2(gemm_bf16_skinny16_x2, 2, 2)
SKINNY_X3(gemm_bf16_skinny16_x3, 2, 2)

extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, u64 n) {
    grid_dependency_sync();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + y[i];
}

extern "C" __global__ void add_bias_f32(float* __restrict__ x, const float* __restrict__ b, u64 n,
                                        u32 cols) {
    grid_dependency_sync();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + b[i % cols];
}

// x[r][c] *= s[c] (K smoothing: per-channel multipliers of Q and K)
extern "C" __global__ void mul_cols_f32(float* __restrict__ x, const float* __restrict__ s, u64 n,
                                        u32 cols) {
    grid_dependency_sync();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s[i % cols];
}

// y = H x / sqrt(dim) for each head vector of `dim` values (64 or 128): the normalized Hadamard
// rotation of nibble_engine::hadamard::rotate, one warp per vector, with the same butterflies in
// the same order (strides 1, 2, 4, ...; low + high, low - high) and the same final multiply by
// `norm`, so the result is bit-identical to the CPU's. Up to three tensors in one launch (Q, K
// and V of a step): tensor t has n_t vectors, read from x_t (null: in place, y_t read) and
// written to y_t; the warps take tensor 0's vectors, then 1's, then 2's.
extern "C" __global__ void hadamard_f32(const float* x0, float* y0, u64 n0, const float* x1,
                                        float* y1, u64 n1, const float* x2, float* y2, u64 n2,
                                        u32 dim, float norm) {
    grid_dependency_sync();
    u64 vector = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x % 32;
    // Which tensor this warp's vector is in (uniform across the warp).
    const float* x = x0;
    float* y = y0;
    if (vector >= n0) {
        vector -= n0;
        x = x1;
        y = y1;
        if (vector >= n1) {
            vector -= n1;
            x = x2;
            y = y2;
            if (vector >= n2) return;
        }
    }
    const u32 per = dim / 32;  // 2 or 4 consecutive values per lane
    float v[4];
    const float* src = (x ? x : y) + vector * dim + lane * per;
#pragma unroll
    for (u32 i = 0; i < 4; ++i)
        if (i < per) v[i] = src[i];
    // Strides within a lane's values.
    for (u32 h = 1; h < per; h *= 2) {
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            if (i < per && (i & h) == 0) {
                const float a = v[i], b = v[i + h];
                v[i] = a + b;
                v[i + h] = a - b;
            }
        }
    }
    // Strides across lanes: the partner of value i is value i of lane ^ (h / per).
    for (u32 h = per; h < dim; h *= 2) {
        const u32 mask = h / per;
        const bool low = (lane & mask) == 0;
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            if (i < per) {
                const float other = __shfl_xor_sync(0xffffffffu, v[i], mask);
                v[i] = low ? v[i] + other : other - v[i];
            }
        }
    }
    float* dst = y + vector * dim + lane * per;
#pragma unroll
    for (u32 i = 0; i < 4; ++i)
        if (i < per) dst[i] = v[i] * norm;
}

// gate = silu(gate) * up
// gate = silu(gate) * up; with g_bf16 (else null) also its BF16 cast, the input of the BF16
// down projection (as f32_to_bf16 would make it, without the launch).
extern "C" __global__ void silu_mul_f32(float* __restrict__ g, const float* __restrict__ u, u64 n,
                                        u16* __restrict__ g_bf16) {
    grid_dependency_sync();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float x = g[i];
    const float v = x / (1.0f + expf(-x)) * u[i];
    g[i] = v;
    if (g_bf16) g_bf16[i] = (u16)bf16_encode(v);
}

// RMSNorm over rows of `width` values, one block of NORM_THREADS threads per row. Thread t sums
// the squares of values t, t + NORM_THREADS, ... in that order; the block adds its threads' sums
// pairwise (thread t + s into thread t for s = NORM_THREADS / 2 .. 1); out = x / sqrt(mean + eps)
// * w, and with out_bf16 (else null) its BF16 cast too, the input of the BF16 GEMMs that follow
// (as f32_to_bf16 would make it, without the launch).
//
// A decode step of one sequence norms a single row, so one block's latency is the kernel's time:
// rows of up to NORM_THREADS * NORM_HELD values are held in registers with every load issued
// before the first is used (a loop of dependent loads, reading the row twice, took 15-17 us per
// 4,096-wide row on an H100: 65 norms a step of Llama-3-8B's shape), with the same sums in the
// same order.
#define NORM_THREADS 256
#define NORM_HELD 16

// The block's sum of its threads' `acc` in the pairwise order above, returned to every thread.
// After the steps s = 128, 64, 32 thread t < 32 holds the 8-term sum below; the steps s = 16 .. 1
// pair lanes of one warp, which shuffles do in the same order with two barriers instead of eight.
__device__ __forceinline__ float norm_block_sum(float acc) {
    __shared__ float all[NORM_THREADS];
    __shared__ float total;
    const u32 t = threadIdx.x;
    all[t] = acc;
    __syncthreads();
    if (t < 32) {
        float r = ((all[t] + all[t + 128]) + (all[t + 64] + all[t + 192])) +
                  ((all[t + 32] + all[t + 160]) + (all[t + 96] + all[t + 224]));
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) r += __shfl_down_sync(0xffffffffu, r, s);
        if (t == 0) total = r;
    }
    __syncthreads();
    return total;
}

// This thread's weights of a held row (rms_norm_row), loaded before the kernel waits on the one
// before it: weights are written by no kernel, so the load overlaps that kernel's tail instead
// of following the block's sum.
struct NormWeights {
    float w[NORM_HELD];
};

__device__ __forceinline__ NormWeights norm_weights(const float* __restrict__ w, u32 width) {
    NormWeights held;
    const u32 t = threadIdx.x;
#pragma unroll
    for (int j = 0; j < NORM_HELD; ++j) {
        const u32 i = t + j * NORM_THREADS;
        held.w[j] = width <= NORM_THREADS * NORM_HELD && i < width ? w[i] : 0.0f;
    }
    return held;
}

// Norms one row, x (and y: then x += y first, written back to x, as add_f32 would); a held row
// takes its weights from `held` (norm_weights), a wider one from w.
__device__ __forceinline__ void rms_norm_row(float* __restrict__ x, const float* __restrict__ y,
                                             const float* __restrict__ w, const NormWeights& held,
                                             float* __restrict__ out, u16* __restrict__ out_bf16,
                                             u32 width, float eps) {
    const u32 t = threadIdx.x;
    if (width <= NORM_THREADS * NORM_HELD) {
        float v[NORM_HELD];
#pragma unroll
        for (int j = 0; j < NORM_HELD; ++j) {
            const u32 i = t + j * NORM_THREADS;
            v[j] = i < width ? (y ? x[i] + y[i] : x[i]) : 0.0f;
        }
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < NORM_HELD; ++j) {
            const u32 i = t + j * NORM_THREADS;
            if (i < width) {
                if (y) x[i] = v[j];
                acc += v[j] * v[j];
            }
        }
        const float inv = 1.0f / sqrtf(norm_block_sum(acc) / (float)width + eps);
#pragma unroll
        for (int j = 0; j < NORM_HELD; ++j) {
            const u32 i = t + j * NORM_THREADS;
            if (i < width) {
                const float o = v[j] * inv * held.w[j];
                out[i] = o;
                if (out_bf16) out_bf16[i] = (u16)bf16_encode(o);
            }
        }
        return;
    }
    float acc = 0.0f;
    for (u32 i = t; i < width; i += NORM_THREADS) {
        const float v = y ? x[i] + y[i] : x[i];
        if (y) x[i] = v;
        acc += v * v;
    }
    const float inv = 1.0f / sqrtf(norm_block_sum(acc) / (float)width + eps);
    for (u32 i = t; i < width; i += NORM_THREADS) {
        const float o = x[i] * inv * w[i];
        out[i] = o;
        if (out_bf16) out_bf16[i] = (u16)bf16_encode(o);
    }
}

// One block (NORM_THREADS threads) per row of `width` values: out = x / sqrt(mean(x^2) + eps) * w.
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ out, u32 width, float eps,
                                        u16* __restrict__ out_bf16) {
    const NormWeights held = norm_weights(w, width);
    grid_dependency_sync();
    const u64 base = (u64)blockIdx.x * width;
    // x is only read (y is null).
    rms_norm_row(const_cast<float*>(x) + base, nullptr, w, held, out + base,
                 out_bf16 ? out_bf16 + base : nullptr, width, eps);
}

// x += y, then out = rms_norm(x) * w over each row of `width` values (w is [width]): the
// residual add and the next norm in one launch, with the arithmetic of add_f32 followed by
// rms_norm_f32 (the same sums in the same order), so the results are the same bits.
extern "C" __global__ void add_rms_norm_f32(float* __restrict__ x, const float* __restrict__ y,
                                            const float* __restrict__ w,
                                            float* __restrict__ out, u32 width, float eps,
                                            u16* __restrict__ out_bf16) {
    const NormWeights held = norm_weights(w, width);
    grid_dependency_sync();
    const u64 base = (u64)blockIdx.x * width;
    rms_norm_row(x + base, y + base, w, held, out + base, out_bf16 ? out_bf16 + base : nullptr,
                 width, eps);
}

// One thread per rotated pair: row r, pair p of the row (cols / 2 pairs). half_split != 0 pairs
// (x_i, x_{i + d/2}) of each head; otherwise (x_{2i}, x_{2i+1}). The pairs of x's rows come
// first, then those of y's (the keys of the same rows: queries and keys in one launch), if
// y_cols > 0.
extern "C" __global__ void rope_f32(float* __restrict__ x, float* __restrict__ y,
                                    const u32* __restrict__ pos, const float* __restrict__ cos_t,
                                    const float* __restrict__ sin_t, u32 rows, u32 x_cols,
                                    u32 y_cols, u32 head_dim, u32 half_split) {
    grid_dependency_sync();
    const u32 half = head_dim / 2u;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 x_pairs = (u64)rows * (x_cols / 2u);
    u32 cols = x_cols;
    float* t = x;
    if (i >= x_pairs) {
        i -= x_pairs;
        cols = y_cols;
        t = y;
        if (i >= (u64)rows * (y_cols / 2u)) return;
    }
    const u32 r = (u32)(i / (cols / 2u)), p = (u32)(i % (cols / 2u));
    const u32 head = p / half, j = p % half;
    float* h = t + (u64)r * cols + (u64)head * head_dim;
    const u32 ia = half_split ? j : 2u * j, ib = half_split ? j + half : 2u * j + 1u;
    const float c = cos_t[(u64)pos[r] * half + j], s = sin_t[(u64)pos[r] * half + j];
    const float a = h[ia], b = h[ib];
    h[ia] = a * c - b * s;
    h[ib] = a * s + b * c;
}

// Causal GQA attention in f32 over a contiguous cache. One block per (query row, head); the
// row's scores live in dynamic shared memory (kv_len floats). Query row i (0-based within the
// sequence's n rows) sits at position kv_len - n + i.
extern "C" __global__ void attention_f32(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float* __restrict__ out,
                                         u32 q_row0, u32 n, u32 kv_len, u32 q_heads,
                                         u32 kv_heads, u32 head_dim, float scale) {
    grid_dependency_sync();
    extern __shared__ float scores[];
    __shared__ float red[256];
    const u32 i = blockIdx.x, h = blockIdx.y;
    const u32 kvh = h / (q_heads / kv_heads);
    const u32 last = kv_len - n + i;  // attends to 0..=last
    const float* qv = q + ((u64)(q_row0 + i) * q_heads + h) * head_dim;
    const u64 kv_row = (u64)kv_heads * head_dim;
    float m = __int_as_float(0xff800000u);
    for (u32 j = threadIdx.x; j <= last; j += blockDim.x) {
        const float* kr = k + j * kv_row + (u64)kvh * head_dim;
        float dot = 0.0f;
        for (u32 d = 0; d < head_dim; ++d) dot += qv[d] * kr[d];
        const float s = dot * scale;
        scores[j] = s;
        m = fmaxf(m, s);
    }
    red[threadIdx.x] = m;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float sum = 0.0f;
    for (u32 j = threadIdx.x; j <= last; j += blockDim.x) {
        const float e = expf(scores[j] - m);
        scores[j] = e;
        sum += e;
    }
    red[threadIdx.x] = sum;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    const float inv = 1.0f / red[0];
    float* o = out + ((u64)(q_row0 + i) * q_heads + h) * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (u32 j = 0; j <= last; ++j) acc += scores[j] * v[j * kv_row + (u64)kvh * head_dim + d];
        o[d] = acc * inv;
    }
}

// The new tokens' f32 K/V into the work-dtype workspace at value offset `at`: E4M3 of x / g (the
// engine's fp8::quantize_unchecked) or little-endian BF16 (bf16 != 0).
extern "C" __global__ void encode_work(u8* __restrict__ ws_k, u8* __restrict__ ws_v,
                                       const float* __restrict__ k, const float* __restrict__ v,
                                       u64 n, u64 at, u32 bf16, float gk, float gv) {
    grid_dependency_sync();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2u * n) return;
    const bool is_v = i >= n;
    const u64 e = is_v ? i - n : i;
    const float x = is_v ? v[e] : k[e];
    u8* ws = is_v ? ws_v : ws_k;
    if (bf16) {
        const u32 b = bf16_encode(x);
        ws[2u * (at + e)] = (u8)(b & 0xFFu);
        ws[2u * (at + e) + 1u] = (u8)(b >> 8);
    } else {
        ws[at + e] = (u8)e4m3_encode(__fdiv_rn(x, is_v ? gv : gk));
    }
}

// out[n][m] = x[n][k] . w[m][k]^T, 16x16 tiles (fallback when cuBLAS is absent).
extern "C" __global__ void gemm_nt_f32(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ out, u32 n, u32 m, u32 k) {
    grid_dependency_sync();
    __shared__ float xs[16][17];
    __shared__ float ws[16][17];
    const u32 tx = threadIdx.x, ty = threadIdx.y;
    const u32 row = blockIdx.y * 16u + ty, col = blockIdx.x * 16u + tx;
    const u32 wrow = blockIdx.x * 16u + ty;
    float acc = 0.0f;
    for (u32 t = 0; t < k; t += 16u) {
        xs[ty][tx] = (row < n && t + tx < k) ? x[(u64)row * k + t + tx] : 0.0f;
        ws[ty][tx] = (wrow < m && t + tx < k) ? w[(u64)wrow * k + t + tx] : 0.0f;
        __syncthreads();
#pragma unroll
        for (u32 e = 0; e < 16u; ++e) acc += xs[ty][e] * ws[tx][e];
        __syncthreads();
    }
    if (row < n && col < m) out[(u64)row * m + col] = acc;
}

// out[r] = the first column of row r holding the row's largest value, NaNs ignored, and 0 when
// the row starts with a NaN: exactly what nibble_engine's host argmax returns (a running best
// that only a strictly larger value replaces, starting from column 0). One block per row.
extern "C" __global__ void argmax_rows_f32(const float* __restrict__ x, u32* __restrict__ out,
                                           u32 cols) {
    grid_dependency_sync();
    const float* row = x + (u64)blockIdx.x * cols;
    float best = __int_as_float(0xff800000);
    u32 at = 0xFFFFFFFFu;
    // A thread visits columns t, t + blockDim.x, ... in order, eight loads in flight (a
    // 128,256-wide row of one sequence is one block's work; a loop of one load at a time took
    // 54 us on an H100).
    for (u32 c0 = threadIdx.x; c0 < cols; c0 += 8 * blockDim.x) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 c = c0 + j * blockDim.x;
            v[j] = c < cols ? row[c] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 c = c0 + j * blockDim.x;
            if (c < cols && (v[j] > best || (v[j] == best && c < at))) {
                best = v[j];
                at = c;
            }
        }
    }
    __shared__ float sb[32];
    __shared__ u32 sa[32];
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const u32 oa = __shfl_xor_sync(0xffffffffu, at, o);
        if (ob > best || (ob == best && oa < at)) {
            best = ob;
            at = oa;
        }
    }
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        sb[warp] = best;
        sa[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 w = 1; w < blockDim.x / 32; ++w) {
            if (sb[w] > best || (sb[w] == best && sa[w] < at)) {
                best = sb[w];
                at = sa[w];
            }
        }
        out[blockIdx.x] = (cols == 0 || row[0] != row[0] || at == 0xFFFFFFFFu) ? 0u : at;
    }
}
