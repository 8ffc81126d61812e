// Greedy accept (DESIGN.md §4.2): argmax over the vocabulary of every valid tree row, fused with the walk.
//
// One CTA per (chunk of 16384 logits, row, request) reduces its chunk to one composite key (value, then
// smaller index). The last chunk of a row to finish (a per-row arrival counter) reduces the row's chunk
// keys in chunk order; the last row of a request to finish walks the tree. Counters are reset by the
// last arrival, so the kernel is relaunchable without a memset. Padding rows are skipped entirely.
#include "common.cuh"

namespace kdt {
namespace accept {

constexpr int THREADS = 256;
constexpr int CHUNK = 16384;
constexpr int MAX_ROWS = 520;  // budget <= 512 (src/lib.rs MAX_BUDGET)
constexpr u64 NAN_KEY = ~0ull;

typedef cub::BlockReduce<u64, THREADS> ReduceU64;

template <typename T>
__device__ __forceinline__ u64 chunk_argmax_key(const T* __restrict__ row, int base, int len, bool vec_ok) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int BATCH = 8;  // vectors in flight per thread
    u64 best = 0;
    bool nan_seen = false;
    auto take = [&](float v, int e) {
        nan_seen |= isnan(v);
        u64 k = composite_key(order_key(v), (uint32_t)(base + e));
        best = k > best ? k : best;
    };
    if (vec_ok && len == CHUNK) {
#pragma unroll
        for (int b = 0; b < CHUNK / (THREADS * VEC * BATCH); ++b) {
            uint4 raw[BATCH];
#pragma unroll
            for (int i = 0; i < BATCH; ++i) {
                int e = ((b * BATCH + i) * THREADS + (int)threadIdx.x) * VEC;
                raw[i] = __ldcs(reinterpret_cast<const uint4*>(row + base + e));
            }
#pragma unroll
            for (int i = 0; i < BATCH; ++i) {
                const T* x = reinterpret_cast<const T*>(&raw[i]);
                int e = ((b * BATCH + i) * THREADS + (int)threadIdx.x) * VEC;
#pragma unroll
                for (int j = 0; j < VEC; ++j) take(to_f32(x[j]), e + j);
            }
        }
    } else {
        for (int e = threadIdx.x; e < len; e += THREADS) take(to_f32(row[base + e]), e);
    }
    return nan_seen ? NAN_KEY : best;
}

struct WalkSmem {
    int token[MAX_ROWS];
    int first_child[MAX_ROWS];
    int next_sibling[MAX_ROWS];
    int argmax[MAX_ROWS];
};

// Follows the target's argmax from the root. Runs on one thread; the tree is already in shared memory.
__device__ void walk(const WalkSmem& s, int depth_max, int* accept_len, int* accept_rows, int* emitted) {
    int cur = 0, accepted = 0;
    accept_rows[0] = 0;
    while (accepted < depth_max) {
        int want = s.argmax[cur], next = -1;
        // Bounds and a step limit keep a malformed tree from reading out of range or looping.
        int steps = 0;
        for (int c = s.first_child[cur]; c > 0 && c < MAX_ROWS && steps < MAX_ROWS; c = s.next_sibling[c], ++steps)
            if (s.token[c] == want) {
                next = c;
                break;
            }
        if (next < 0) break;
        emitted[accepted] = want;
        cur = next;
        accept_rows[++accepted] = cur;
    }
    emitted[accepted] = s.argmax[cur];
    for (int j = accepted + 1; j <= depth_max; ++j) {
        accept_rows[j] = -1;
        emitted[j] = -1;
    }
    *accept_len = accepted;
}

// Loads one request's tree and argmax (valid rows only; -1 for padding) into shared memory.
__device__ void load_tree(WalkSmem& s, const int* node_token, const int* first_child, const int* next_sibling,
                          const int* argmax, int n_rows, int valid_rows) {
    for (int i = threadIdx.x; i < n_rows; i += blockDim.x) {
        bool valid = i < valid_rows;
        s.token[i] = valid ? node_token[i] : -1;
        s.first_child[i] = valid ? first_child[i] : -1;
        s.next_sibling[i] = valid ? next_sibling[i] : -1;
        s.argmax[i] = valid ? __ldcg(argmax + i) : -1;
    }
    __syncthreads();
}

template <typename T>
__device__ void fused_kernel(const T* __restrict__ logits, int vocab, int n_rows, int depth_max,
                             const int* __restrict__ num_nodes, const int* __restrict__ node_token,
                             const int* __restrict__ first_child, const int* __restrict__ next_sibling,
                             u64* __restrict__ partial, unsigned int* __restrict__ row_arrivals,
                             unsigned int* __restrict__ req_arrivals, int* __restrict__ argmax,
                             int* __restrict__ accept_len, int* __restrict__ accept_rows, int* __restrict__ emitted,
                             int* __restrict__ status) {
    __shared__ typename ReduceU64::TempStorage reduce;
    __shared__ bool row_done, request_done;  // two flags: thread 0 sets the second while others read the first
    __shared__ WalkSmem walk_smem;
    const int chunk = blockIdx.x, row = blockIdx.y, b = blockIdx.z, chunks = gridDim.x;
    const int valid_rows = min(num_nodes[b], n_rows - 1) + 1;
    if (row >= valid_rows) return;
    const size_t grow = (size_t)b * n_rows + row;
    const int base = chunk * CHUNK, len = min(CHUNK, vocab - base);
    const bool vec_ok = (vocab % (16 / (int)sizeof(T))) == 0 && ((uintptr_t)logits % 16) == 0;

    u64 key = chunk_argmax_key<T>(logits + grow * vocab, base, len, vec_ok);
    key = ReduceU64(reduce).Reduce(key, MaxOp());
    if (threadIdx.x == 0) {
        partial[grow * chunks + chunk] = key;
        __threadfence();
        unsigned prev = atomicAdd(&row_arrivals[grow], 1u);
        row_done = prev == (unsigned)chunks - 1;
    }
    __syncthreads();
    if (!row_done) return;

    if (threadIdx.x == 0) {
        row_arrivals[grow] = 0;
        u64 best = 0;
        for (int c = 0; c < chunks; ++c) best = max(best, __ldcg(partial + grow * chunks + c));
        bool nan_row = best == NAN_KEY;
        argmax[grow] = nan_row ? -1 : (int)(~(uint32_t)best);
        if (nan_row) atomicOr(&status[b], STATUS_NAN);
        __threadfence();
        unsigned prev = atomicAdd(&req_arrivals[b], 1u);
        request_done = prev == (unsigned)valid_rows - 1;
    }
    __syncthreads();
    if (!request_done) return;

    const size_t first_row = (size_t)b * n_rows;
    load_tree(walk_smem, node_token + first_row, first_child + first_row, next_sibling + first_row,
              argmax + first_row, n_rows, valid_rows);
    for (int i = valid_rows + threadIdx.x; i < n_rows; i += blockDim.x) argmax[first_row + i] = -1;
    if (threadIdx.x == 0) {
        req_arrivals[b] = 0;
        walk(walk_smem, depth_max, accept_len + b, accept_rows + (size_t)b * (depth_max + 1),
             emitted + (size_t)b * (depth_max + 1));
    }
}

}  // namespace accept
}  // namespace kdt

extern "C" __global__ void __launch_bounds__(kdt::accept::THREADS)
    greedy_accept_f32(const float* logits, int vocab, int n_rows, int depth_max, const int* num_nodes,
                      const int* node_token, const int* first_child, const int* next_sibling, kdt::u64* partial,
                      unsigned int* row_arrivals, unsigned int* req_arrivals, int* argmax, int* accept_len,
                      int* accept_rows, int* emitted, int* status) {
    kdt::accept::fused_kernel<float>(logits, vocab, n_rows, depth_max, num_nodes, node_token, first_child,
                                     next_sibling, partial, row_arrivals, req_arrivals, argmax, accept_len,
                                     accept_rows, emitted, status);
}

extern "C" __global__ void __launch_bounds__(kdt::accept::THREADS)
    greedy_accept_bf16(const __nv_bfloat16* logits, int vocab, int n_rows, int depth_max, const int* num_nodes,
                       const int* node_token, const int* first_child, const int* next_sibling, kdt::u64* partial,
                       unsigned int* row_arrivals, unsigned int* req_arrivals, int* argmax, int* accept_len,
                       int* accept_rows, int* emitted, int* status) {
    kdt::accept::fused_kernel<__nv_bfloat16>(logits, vocab, n_rows, depth_max, num_nodes, node_token, first_child,
                                             next_sibling, partial, row_arrivals, req_arrivals, argmax, accept_len,
                                             accept_rows, emitted, status);
}

// The walk alone, for callers that already have the target's argmax: one CTA per request.
extern "C" __global__ void __launch_bounds__(128)
    greedy_accept_argmax(const int* target_argmax, int n_rows, int depth_max, const int* num_nodes,
                         const int* node_token, const int* first_child, const int* next_sibling, int* accept_len,
                         int* accept_rows, int* emitted) {
    __shared__ kdt::accept::WalkSmem s;
    const int b = blockIdx.x;
    const size_t first_row = (size_t)b * n_rows;
    const int valid_rows = min(num_nodes[b], n_rows - 1) + 1;
    kdt::accept::load_tree(s, node_token + first_row, first_child + first_row, next_sibling + first_row,
                           target_argmax + first_row, n_rows, valid_rows);
    if (threadIdx.x == 0)
        kdt::accept::walk(s, depth_max, accept_len + b, accept_rows + (size_t)b * (depth_max + 1),
                          emitted + (size_t)b * (depth_max + 1));
}
