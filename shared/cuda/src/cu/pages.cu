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
