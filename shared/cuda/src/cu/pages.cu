// Whole-page copies between a page pool and a contiguous staging buffer, for page transfers
// (NCCL sends one staging buffer per request). A page is one contiguous range of the pool:
// page p is bytes [p * page_bytes, (p + 1) * page_bytes), data and scales of every layer's K and
// V (docs/FORMAT.md), so a copy of those bytes moves everything the page holds.
//
// Grid: y strides over the listed pages, x over a page's 16-byte words (pools are allocated
// 256-byte aligned and the host checks page_bytes % 16 == 0, so every word is aligned).

// staging[i] = pool[page_ids[i]], for i < n.
extern "C" __global__ void pages_gather(u8* __restrict__ staging, const u8* __restrict__ pool,
                                        const u32* __restrict__ page_ids, u32 n, u64 page_bytes) {
    grid_dependency_sync();
    u64 words = page_bytes / 16;
    for (u32 i = blockIdx.y; i < n; i += gridDim.y) {
        const uint4* src = (const uint4*)(pool + (u64)page_ids[i] * page_bytes);
        uint4* dst = (uint4*)(staging + (u64)i * page_bytes);
        for (u64 w = (u64)blockIdx.x * blockDim.x + threadIdx.x; w < words;
             w += (u64)gridDim.x * blockDim.x) {
            dst[w] = src[w];
        }
    }
}

// pool[page_ids[i]] = staging[i], for i < n.
extern "C" __global__ void pages_scatter(u8* __restrict__ pool, const u8* __restrict__ staging,
                                         const u32* __restrict__ page_ids, u32 n, u64 page_bytes) {
    grid_dependency_sync();
    u64 words = page_bytes / 16;
    for (u32 i = blockIdx.y; i < n; i += gridDim.y) {
        const uint4* src = (const uint4*)(staging + (u64)i * page_bytes);
        uint4* dst = (uint4*)(pool + (u64)page_ids[i] * page_bytes);
        for (u64 w = (u64)blockIdx.x * blockDim.x + threadIdx.x; w < words;
             w += (u64)gridDim.x * blockDim.x) {
            dst[w] = src[w];
        }
    }
}

// Writes BF16 K and V of `rows` new tokens into their sequences' recent windows (WindowGeom in
// common.cuh): row r belongs to sequence r / rows_per_seq, whose length after the step is
// lens[s], and is its token at position lens[s] - rows_per_seq + r % rows_per_seq; tokens the
// window does not hold (older than its last w.tokens) are skipped. k and v are
// [row][kv_head][head_dim] f32; table is [seq][w.pages] page ids. One thread per value.
extern "C" __global__ void window_store(u8* __restrict__ pages, const u32* __restrict__ table,
                                        const float* __restrict__ k, const float* __restrict__ v,
                                        const u32* __restrict__ lens, u32 rows, u32 rows_per_seq,
                                        u32 head_dim, WindowGeom w) {
    grid_dependency_sync();
    const u32 row_values = w.kv_heads * head_dim;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)rows * 2 * row_values) return;
    const u32 row = (u32)(i / (2 * row_values)), rem = (u32)(i % (2 * row_values));
    const u32 part = rem / row_values, hd = rem % row_values;
    const u32 seq = row / rows_per_seq, len = lens[seq];
    const u32 pos = len - rows_per_seq + row % rows_per_seq;
    if (pos + w.tokens < len) return;
    const float x = (part ? v : k)[(u64)row * row_values + hd];
    u8* dst = window_vector(pages, table + (u64)seq * w.pages, w, part, hd / head_dim,
                            pos, head_dim);
    reinterpret_cast<u16*>(dst)[hd % head_dim] = (u16)bf16_encode(x);
}
