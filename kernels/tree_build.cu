// DDTree best-first tree build (DESIGN.md §4.1 step 2-3; exact contract in reference/README.md).
//
// One warp per request, no host round trip and no allocation: the frontier in registers, the rows and
// the bitmask in shared memory. The frontier is kept sorted (see SortedFrontier), so each step's best
// candidate (largest logw, then earliest push) is simply its head: the step appends it as the next row,
// and inserts its next sibling and first child with a few ballots and shuffles. The pops form one
// sequential chain per request, so the kernel's time is that chain's latency; keeping the step free of
// reductions and data-dependent loops is what makes it short. A new row's bitmask is its parent's plus
// its own bit; sibling lists are linked as rows are appended (children come in rank order).
#include "common.cuh"

namespace kdt {
namespace tree {

// Frontier entry info packed in one word: parent row (12 bits), depth (8 bits), rank (12 bits).
__device__ __forceinline__ uint32_t pack_info(int parent, int depth, int rank) {
    return ((uint32_t)parent << 20) | ((uint32_t)depth << 12) | (uint32_t)rank;
}
__device__ __forceinline__ int info_parent(uint32_t v) { return (int)(v >> 20); }
__device__ __forceinline__ int info_depth(uint32_t v) { return (int)((v >> 12) & 0xFF); }
__device__ __forceinline__ int info_rank(uint32_t v) { return (int)(v & 0xFFF); }

// Shared memory of one request: the read-only log-probs, the rows appended so far, and the bitmask.
struct Layout {
    float* logp;           // [L*K] this request's top_logp
    uint32_t* node_info;   // [N] parent / depth / rank of each row
    float* node_logw;      // [N] score of each row (the base of its next sibling's score)
    int* first_child;      // [N] row of the first child, or -1
    int* next_sibling;     // [N] row of the next sibling, or -1
    int* last_child;       // [N] latest child row appended so far
    uint32_t* vis;         // [N*W]
};

__device__ Layout carve(char* smem, int lk, int n_rows) {
    Layout s;
    s.logp = reinterpret_cast<float*>(smem);
    s.node_info = reinterpret_cast<uint32_t*>(s.logp + lk);
    s.node_logw = reinterpret_cast<float*>(s.node_info + n_rows);
    s.first_child = reinterpret_cast<int*>(s.node_logw + n_rows);
    s.next_sibling = s.first_child + n_rows;
    s.last_child = s.next_sibling + n_rows;
    s.vis = reinterpret_cast<uint32_t*>(s.last_child + n_rows);
    return s;
}

// The frontier as one array sorted best first (larger key, then earlier push), spread over the warp:
// element j is register j / 32 of lane j % 32. Each step pops element 0 and inserts at most two new
// candidates; both are pushed after every candidate already there, so each goes right after the
// elements whose key is >= its own, and the earlier push order of equal keys is kept by position alone.
// The array holds the budget's worth of elements: at most `budget` more pops follow, so a candidate
// pushed past that many better ones can never be popped and is dropped. A step is a few ballots and
// shuffles with no data-dependent loop, which keeps the sequential pop chain short.
template <int SPL>
struct SortedFrontier {
    uint32_t key[SPL];   // order key of the candidate's logw; 0 = empty
    uint32_t info[SPL];  // parent / depth / rank

    __device__ __forceinline__ void init(uint32_t first_key, uint32_t first_info) {
#pragma unroll
        for (int j = 0; j < SPL; ++j) key[j] = info[j] = 0;
        if (threadIdx.x == 0) {
            key[0] = first_key;
            info[0] = first_info;
        }
    }

    // Elements other than the head (element 0) whose key is >= x: a prefix of the array after the head.
    __device__ __forceinline__ int count_ge_after_head(uint32_t x) const {
        int count = 0;
#pragma unroll
        for (int j = 0; j < SPL; ++j)
            count += __popc(__ballot_sync(0xFFFFFFFFu, key[j] >= x && (j > 0 || threadIdx.x > 0)));
        return count;
    }

    // Removes the head and inserts (k1, i1) then (k2, i2); a zero key is no candidate.
    __device__ __forceinline__ void pop_and_push(uint32_t k1, uint32_t i1, uint32_t k2, uint32_t i2) {
        constexpr int CAP = 32 * SPL;
        // Final positions: each new candidate follows the kept elements with keys >= its own, and the
        // second follows the first when their keys are equal (the first was pushed first).
        const int c1 = k1 ? count_ge_after_head(k1) : CAP, c2 = k2 ? count_ge_after_head(k2) : CAP;
        const int pos1 = k1 ? c1 + (int)(k2 > k1) : CAP;
        const int pos2 = k2 ? c2 + (int)(k1 != 0 && k1 >= k2) : CAP;
        const int lane = threadIdx.x;
        uint32_t new_key[SPL], new_info[SPL];
#pragma unroll
        for (int j = 0; j < SPL; ++j) {
            const int at = j * 32 + lane;
            // Source of a kept element: its old index is at + 1 (the head left) less the insertions before it.
            const int delta = 1 - (int)(pos1 < at) - (int)(pos2 < at);
            const int src_lane = (lane + delta) & 31;
            uint32_t sk = __shfl_sync(0xFFFFFFFFu, key[j], src_lane);
            uint32_t si = __shfl_sync(0xFFFFFFFFu, info[j], src_lane);
            const uint32_t next_k = j + 1 < SPL ? __shfl_sync(0xFFFFFFFFu, key[j + 1 < SPL ? j + 1 : j], 0) : 0u;
            const uint32_t next_i = j + 1 < SPL ? __shfl_sync(0xFFFFFFFFu, info[j + 1 < SPL ? j + 1 : j], 0) : 0u;
            const uint32_t prev_k = j > 0 ? __shfl_sync(0xFFFFFFFFu, key[j > 0 ? j - 1 : 0], 31) : 0u;
            const uint32_t prev_i = j > 0 ? __shfl_sync(0xFFFFFFFFu, info[j > 0 ? j - 1 : 0], 31) : 0u;
            if (lane == 31 && delta == 1) {
                sk = next_k;
                si = next_i;
            } else if (lane == 0 && delta == -1) {
                sk = prev_k;
                si = prev_i;
            }
            new_key[j] = at == pos1 ? k1 : at == pos2 ? k2 : sk;
            new_info[j] = at == pos1 ? i1 : at == pos2 ? i2 : si;
        }
#pragma unroll
        for (int j = 0; j < SPL; ++j) {
            key[j] = new_key[j];
            info[j] = new_info[j];
        }
    }
};

template <int SPL>
__device__ void build_one(const int* __restrict__ top_ids, const float* __restrict__ top_logp, int root_token,
                          int seq_len, int depth_max, int k, int budget, int* num_nodes, int* node_token,
                          int* node_depth, int* parent_out, int* first_child_out, int* next_sibling_out,
                          int* position_out, uint32_t* vis_out, int* status) {
    extern __shared__ __align__(16) char smem[];
    const int lane = threadIdx.x;
    const int n_rows = budget + 1, words = (n_rows + 31) / 32, lk = depth_max * k;
    Layout s = carve(smem, lk, n_rows);

    // Eight loads in flight per lane: this copy is latency-bound, not bandwidth-bound.
    int flags = 0;
#pragma unroll 8
    for (int i = lane; i < lk; i += 32) {
        float v = __ldg(top_logp + i);
        flags |= isnan(v) ? STATUS_NAN : 0;
        s.logp[i] = v;
    }
    for (int w = lane; w < words; w += 32) s.vis[w] = w == 0 ? 1u : 0u;
    for (int i = lane; i < n_rows; i += 32) s.first_child[i] = s.next_sibling[i] = -1;
    if (lane == 0) s.node_logw[0] = 0.0f;
    __syncwarp();

    SortedFrontier<SPL> f;
    f.init(order_key(__fadd_rn(0.0f, s.logp[0])), pack_info(0, 1, 0));
    int n = 0;
    while (n < budget) {
        const uint32_t top_key = __shfl_sync(0xFFFFFFFFu, f.key[0], 0);
        if (top_key == 0) break;
        const uint32_t info = __shfl_sync(0xFFFFFFFFu, f.info[0], 0);
        const int p = info_parent(info), d = info_depth(info), r = info_rank(info);
        const int row = ++n;
        // The parent's bitmask word is loaded now and stored last, so its latency overlaps the step.
        // words <= 17 for budgets up to 512: one word per lane.
        const uint32_t parent_vis = lane < words ? s.vis[p * words + lane] : 0u;
        const float logw = key_value(top_key);

        const bool sibling = r + 1 < k, child = d < depth_max;
        const float sibling_logw = sibling ? __fadd_rn(s.node_logw[p], s.logp[(d - 1) * k + r + 1]) : 0.0f;
        const float child_logw = child ? __fadd_rn(logw, s.logp[d * k]) : 0.0f;
        f.pop_and_push(sibling ? order_key(sibling_logw) : 0u, pack_info(p, d, r + 1),
                       child ? order_key(child_logw) : 0u, pack_info(row, d + 1, 0));

        if (lane == 0) {
            s.node_info[row] = info;
            s.node_logw[row] = logw;
            // Children are appended in rank order, so the latest child of p is this row's previous sibling.
            if (r == 0) s.first_child[p] = row;
            else s.next_sibling[s.last_child[p]] = row;
            s.last_child[p] = row;
        }
        if (lane < words) s.vis[row * words + lane] = parent_vis | (lane == row / 32 ? 1u << (row % 32) : 0u);
    }
    __syncwarp();

#pragma unroll 4
    for (int i = lane; i < n_rows; i += 32) {
        if (i > n) {  // padding row: its node_info was never written
            node_token[i] = node_depth[i] = parent_out[i] = -1;
            first_child_out[i] = next_sibling_out[i] = position_out[i] = -1;
            continue;
        }
        uint32_t info = i == 0 ? 0u : s.node_info[i];
        int d = i == 0 ? 0 : info_depth(info);
        node_token[i] = i == 0 ? root_token : top_ids[(d - 1) * k + info_rank(info)];
        node_depth[i] = d;
        parent_out[i] = i == 0 ? -1 : info_parent(info);
        first_child_out[i] = s.first_child[i];
        next_sibling_out[i] = s.next_sibling[i];
        position_out[i] = seq_len + d;
    }
    for (int i = lane; i < n_rows * words; i += 32) vis_out[i] = (i / words) <= n ? s.vis[i] : 0u;
    flags = __reduce_or_sync(0xFFFFFFFFu, flags);
    if (lane == 0) {
        *num_nodes = n;
        *status = flags;
    }
}

}  // namespace tree
}  // namespace kdt

// One CTA of one warp per request; dynamic shared memory as computed by src/cuda/tree_build.rs. The
// frontier's registers per lane are a template parameter: the budget's worth of elements over 32 lanes.
extern "C" __global__ void __launch_bounds__(32)
    tree_build(const int* top_ids, const float* top_logp, const int* root_token, const int* seq_len, int depth_max,
               int k, int budget, int* num_nodes, int* node_token, int* node_depth, int* parent, int* first_child,
               int* next_sibling, int* position, unsigned int* visibility, int* status) {
    const int b = blockIdx.x;
    const int n_rows = budget + 1, words = (n_rows + 31) / 32;
    const size_t lk = (size_t)depth_max * k, rows = (size_t)b * n_rows;
    const int per_lane = (budget + 31) / 32;
#define KDT_BUILD(SPL)                                                                                              \
    kdt::tree::build_one<SPL>(top_ids + b * lk, top_logp + b * lk, root_token[b], seq_len[b], depth_max, k, budget, \
                              num_nodes + b, node_token + rows, node_depth + rows, parent + rows, first_child + rows,  \
                              next_sibling + rows, position + rows, visibility + rows * words, status + b)
    if (per_lane <= 1) KDT_BUILD(1);
    else if (per_lane <= 2) KDT_BUILD(2);
    else if (per_lane <= 4) KDT_BUILD(4);
    else if (per_lane <= 8) KDT_BUILD(8);
    else KDT_BUILD(16);
#undef KDT_BUILD
}
