// KV compaction after acceptance (DESIGN.md §4.2): moves the accepted tree rows of every request to the
// slots right after its prefix, in place, in every layer, in one launch.
//
// One CTA per (layer, request). Sources are staged in shared memory before any destination is written,
// because a destination slot can be the source of a later step (accept_rows [0, 2, 3] reads slot 2 and
// writes slot 1, then reads slot 3 and writes slot 2). Layers are disjoint, and so are requests as long
// as their block tables share no page (the caller's contract).
#include "common.cuh"

namespace kdt {
namespace compact {

constexpr int THREADS = 128;

// Cache element offset of slot `slot` of request `b` in `layer`; -1 when the block table cannot map it.
__device__ __forceinline__ long long slot_offset(int layer, int slot, const int* block_table_row, int pages_per_req,
                                                 int num_pages, int page_size, int row_elems) {
    int page_idx = slot / page_size;
    if (slot < 0 || page_idx >= pages_per_req) return -1;
    int page = block_table_row[page_idx];
    if (page < 0 || page >= num_pages) return -1;
    return (((long long)layer * num_pages + page) * page_size + slot % page_size) * row_elems;
}

__device__ void compact_one(uint16_t* cache, int layer, const int* block_table_row, int pages_per_req,
                            int num_pages, int page_size, int row_elems, int seq_len, int accepted,
                            const int* path, int n_rows, int* status) {
    extern __shared__ __align__(16) uint16_t staged[];
    __shared__ long long src[64], dst[64];
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < accepted; j += blockDim.x) {
        int row = path[j + 1];
        bool row_ok = row > j && row < n_rows;  // rows on a root path grow strictly: row j+1 >= j+1
        src[j] = row_ok ? slot_offset(layer, seq_len + row, block_table_row, pages_per_req, num_pages, page_size,
                                      row_elems)
                        : -1;
        dst[j] = slot_offset(layer, seq_len + j + 1, block_table_row, pages_per_req, num_pages, page_size, row_elems);
        if (src[j] < 0 || dst[j] < 0) bad = 1;
    }
    __syncthreads();
    if (bad) {
        if (threadIdx.x == 0) atomicOr(status, 1);
        return;
    }
    const bool vec = row_elems % 8 == 0 && ((uintptr_t)cache % 16) == 0;
    if (vec) {
        const int vecs = row_elems / 8;
        uint4* st = reinterpret_cast<uint4*>(staged);
        for (int i = threadIdx.x; i < accepted * vecs; i += blockDim.x)
            st[i] = reinterpret_cast<const uint4*>(cache + src[i / vecs])[i % vecs];
        __syncthreads();
        for (int i = threadIdx.x; i < accepted * vecs; i += blockDim.x)
            reinterpret_cast<uint4*>(cache + dst[i / vecs])[i % vecs] = st[i];
    } else {
        for (int i = threadIdx.x; i < accepted * row_elems; i += blockDim.x)
            staged[i] = cache[src[i / row_elems] + i % row_elems];
        __syncthreads();
        for (int i = threadIdx.x; i < accepted * row_elems; i += blockDim.x)
            cache[dst[i / row_elems] + i % row_elems] = staged[i];
    }
}

}  // namespace compact
}  // namespace kdt

// grid (layers, bs); dynamic shared memory: depth_max * row_elems * 2 bytes.
extern "C" __global__ void __launch_bounds__(kdt::compact::THREADS)
    kv_compact(uint16_t* cache, int num_pages, int page_size, int row_elems, const int* block_table,
               int pages_per_req, const int* seq_len, const int* accept_len, const int* accept_rows, int depth_max,
               int n_rows, int* status) {
    const int layer = blockIdx.x, b = blockIdx.y;
    const int accepted = accept_len[b];
    if (accepted <= 0) return;
    if (accepted > depth_max || accepted > 63) {
        if (threadIdx.x == 0) atomicOr(status, 1);
        return;
    }
    kdt::compact::compact_one(cache, layer, block_table + (size_t)b * pages_per_req, pages_per_req, num_pages,
                              page_size, row_elems, seq_len[b], accepted, accept_rows + (size_t)b * (depth_max + 1),
                              n_rows, status);
}
