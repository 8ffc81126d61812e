// DDTree best-first tree build (DESIGN.md §4.1 step 2-3; exact contract in reference/README.md).
//
// One warp per request, no host round trip and no allocation: the frontier in registers, the rows and
// the bitmask in shared memory. Each step two warp reductions find the best candidate (largest logw, then
// earliest push), which is appended as the next row, and its next sibling and first child are pushed.
// The visibility row of a new node is its parent's row plus its own bit; sibling lists are linked at
// the end.
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
// Sibling lists come from the pushes: a row's next sibling is its rank + 1 candidate and its first child
// its rank-0 child candidate (siblings are pushed, so popped, in rank order), so recording which slot
// each row pushed and which row each slot became links them with stores alone.
struct Layout {
    float* logp;           // [L*K] this request's top_logp
    uint32_t* node_info;   // [N] parent / depth / rank of each row
    int* sibling_slot;     // [N] slot of the row's next-sibling candidate, or -1
    int* child_slot;       // [N] slot of the row's first-child candidate, or -1
    int* row_of_slot;      // [2N] row a slot was appended as, or -1
    uint32_t* vis;         // [N*W] word w of every row belongs to lane w % 32
};

__device__ Layout carve(char* smem, int lk, int n_rows) {
    Layout s;
    s.logp = reinterpret_cast<float*>(smem);
    s.node_info = reinterpret_cast<uint32_t*>(s.logp + lk);
    s.sibling_slot = reinterpret_cast<int*>(s.node_info + n_rows);
    s.child_slot = s.sibling_slot + n_rows;
    s.row_of_slot = s.child_slot + n_rows;
    s.vis = reinterpret_cast<uint32_t*>(s.row_of_slot + 2 * n_rows);
    return s;
}

// The frontier lives in registers. Slots are never reused: slot s holds the s-th push, so the push
// number (the tie-break) is the slot index; slot s is register s / 32 of lane s % 32. Each lane keeps the
// best of its own slots, so a step needs two warp reductions and no shared-memory round trip.
template <int SPL>
struct Frontier {
    uint32_t key[SPL];  // order key of the candidate's logw; 0 = empty or popped
    float base[SPL];    // logw of the candidate's parent (for its next sibling)
    uint32_t info[SPL]; // parent / depth / rank
    uint32_t best_key;
    int best_slot;
    float best_base;
    uint32_t best_info;

    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int j = 0; j < SPL; ++j) key[j] = 0;
        best_key = 0;
        best_slot = 0;
    }

    // Register j of this lane is slot j * 32 + lane; the earliest slot wins among equal keys.
    __device__ __forceinline__ void rescan() {
        best_key = 0;
#pragma unroll
        for (int j = 0; j < SPL; ++j)
            if (key[j] > best_key) {
                best_key = key[j];
                best_slot = j * 32 + (int)threadIdx.x;
                best_base = base[j];
                best_info = info[j];
            }
    }

    __device__ __forceinline__ void push(int slot, float logw, float parent_logw, uint32_t packed) {
        if ((slot & 31) != (int)threadIdx.x) return;
        const int reg = slot >> 5;
        const uint32_t k = order_key(logw);
#pragma unroll
        for (int j = 0; j < SPL; ++j)
            if (j == reg) {
                key[j] = k;
                base[j] = parent_logw;
                info[j] = packed;
            }
        if (k > best_key) {  // a later slot never wins a tie against this lane's current best
            best_key = k;
            best_slot = slot;
            best_base = parent_logw;
            best_info = packed;
        }
    }

    __device__ __forceinline__ void pop(int slot) {
        const int reg = slot >> 5;
#pragma unroll
        for (int j = 0; j < SPL; ++j)
            if (j == reg) key[j] = 0;
        rescan();
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
    for (int i = lane; i < 2 * n_rows; i += 32) s.row_of_slot[i] = -1;
    if (lane == 0) {
        s.sibling_slot[0] = -1;
        s.child_slot[0] = 0;
    }
    __syncwarp();

    Frontier<SPL> f;
    f.clear();
    f.push(0, __fadd_rn(0.0f, s.logp[0]), 0.0f, pack_info(0, 1, 0));
    int n = 0, pushed = 1;
    while (n < budget) {
        // The best candidate: largest key, then smallest slot (= earliest push). Its owner is slot % 32.
        const uint32_t top_key = __reduce_max_sync(0xFFFFFFFFu, f.best_key);
        if (top_key == 0) break;
        const uint32_t top_slot = ~__reduce_max_sync(0xFFFFFFFFu, f.best_key == top_key ? ~(uint32_t)f.best_slot : 0u);
        const int owner = top_slot & 31;
        const float logw = key_value(top_key);
        const float base = __shfl_sync(0xFFFFFFFFu, f.best_base, owner);
        const uint32_t info = __shfl_sync(0xFFFFFFFFu, f.best_info, owner);
        const int p = info_parent(info), d = info_depth(info), r = info_rank(info);
        const int row = ++n;

        const bool sibling = r + 1 < k, child = d < depth_max;
        const float sibling_logw = sibling ? __fadd_rn(base, s.logp[(d - 1) * k + r + 1]) : 0.0f;
        const float child_logw = child ? __fadd_rn(logw, s.logp[d * k]) : 0.0f;
        if (lane == owner) f.pop(top_slot);
        if (sibling) f.push(pushed, sibling_logw, base, pack_info(p, d, r + 1));
        if (child) f.push(pushed + sibling, child_logw, logw, pack_info(row, d + 1, 0));
        pushed += (int)sibling + (int)child;

        for (int w = lane; w < words; w += 32) {
            uint32_t bit = (w == row / 32) ? (1u << (row % 32)) : 0u;
            s.vis[row * words + w] = s.vis[p * words + w] | bit;
        }
        if (lane == 0) {
            s.node_info[row] = info;
            s.row_of_slot[top_slot] = row;
            s.sibling_slot[row] = sibling ? pushed - 1 - (int)child : -1;
            s.child_slot[row] = child ? pushed - 1 : -1;
        }
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
        const int sib = s.sibling_slot[i], kid = s.child_slot[i];
        first_child_out[i] = kid >= 0 ? s.row_of_slot[kid] : -1;
        next_sibling_out[i] = sib >= 0 ? s.row_of_slot[sib] : -1;
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
// frontier's registers per lane are a template parameter: at most 2B + 1 slots over 32 lanes.
extern "C" __global__ void __launch_bounds__(32)
    tree_build(const int* top_ids, const float* top_logp, const int* root_token, const int* seq_len, int depth_max,
               int k, int budget, int* num_nodes, int* node_token, int* node_depth, int* parent, int* first_child,
               int* next_sibling, int* position, unsigned int* visibility, int* status) {
    const int b = blockIdx.x;
    const int n_rows = budget + 1, words = (n_rows + 31) / 32;
    const size_t lk = (size_t)depth_max * k, rows = (size_t)b * n_rows;
    const int slots_per_lane = (2 * budget + 1 + 31) / 32;
#define KDT_BUILD(SPL)                                                                                              \
    kdt::tree::build_one<SPL>(top_ids + b * lk, top_logp + b * lk, root_token[b], seq_len[b], depth_max, k, budget, \
                              num_nodes + b, node_token + rows, node_depth + rows, parent + rows, first_child + rows,  \
                              next_sibling + rows, position + rows, visibility + rows * words, status + b)
    if (slots_per_lane <= 4) KDT_BUILD(4);
    else if (slots_per_lane <= 8) KDT_BUILD(8);
    else if (slots_per_lane <= 16) KDT_BUILD(16);
    else KDT_BUILD(33);
#undef KDT_BUILD
}
