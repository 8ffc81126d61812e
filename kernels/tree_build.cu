// DDTree best-first tree build (DESIGN.md §4.1 step 2-3; exact contract in reference/README.md).
//
// One warp per request, everything in shared memory, no host round trip and no allocation. Each lane
// keeps the best of the frontier slots it owns; each step two warp reductions find the best candidate
// (largest logw, then earliest push), which is appended as the next row, and its next sibling and first
// child are pushed. The visibility row of a new node is its parent's row plus its own bit.
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

// Shared memory of one request. Frontier slots are never reused: slot s holds the s-th push, so the
// push number (the tie-break) is the slot index, and slot s belongs to lane s % 32, the only lane that
// ever reads or writes it. That removes every cross-lane dependency from the pop loop.
struct Layout {
    float* logp;          // [L*K] this request's top_logp
    uint32_t* slot_key;   // [2N] order key of the candidate's logw; 0 once popped
    float* slot_base;     // [2N] logw of the candidate's parent (for its next sibling)
    uint32_t* slot_info;  // [2N] parent / depth / rank
    uint32_t* node_info;  // [N] parent / depth / rank of each row (lane 0)
    int* first_child;     // [N] (lane 0 in the loop)
    int* next_sibling;    // [N] (lane 0)
    int* last_child;      // [N] (lane 0)
    uint32_t* vis;        // [N*W] word w of every row belongs to lane w % 32
};

__device__ Layout carve(char* smem, int lk, int n_rows) {
    Layout s;
    const int slots = 2 * n_rows;
    s.logp = reinterpret_cast<float*>(smem);
    s.slot_key = reinterpret_cast<uint32_t*>(s.logp + lk);
    s.slot_base = reinterpret_cast<float*>(s.slot_key + slots);
    s.slot_info = reinterpret_cast<uint32_t*>(s.slot_base + slots);
    s.node_info = s.slot_info + slots;
    s.first_child = reinterpret_cast<int*>(s.node_info + n_rows);
    s.next_sibling = s.first_child + n_rows;
    s.last_child = s.next_sibling + n_rows;
    s.vis = reinterpret_cast<uint32_t*>(s.last_child + n_rows);
    return s;
}

// A lane's best live candidate among its own slots (key 0: none).
struct LaneBest {
    uint32_t key;
    int slot;
    float base;
    uint32_t info;

    __device__ __forceinline__ void offer(uint32_t k, int sl, float b, uint32_t inf) {
        if (k > key || (k == key && k != 0 && sl < slot)) {
            key = k;
            slot = sl;
            base = b;
            info = inf;
        }
    }

    __device__ void rescan(const Layout& s, int pushed) {
        key = 0;
        slot = 0;
        for (int i = threadIdx.x; i < pushed; i += 32) offer(s.slot_key[i], i, s.slot_base[i], s.slot_info[i]);
    }
};

__device__ __forceinline__ void push(const Layout& s, LaneBest& best, int slot, float logw, float base, uint32_t info) {
    if ((slot & 31) != (int)threadIdx.x) return;
    uint32_t key = order_key(logw);
    s.slot_key[slot] = key;
    s.slot_base[slot] = base;
    s.slot_info[slot] = info;
    best.offer(key, slot, base, info);
}

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
    for (int i = lane; i < n_rows; i += 32) s.first_child[i] = s.next_sibling[i] = s.last_child[i] = -1;
    for (int w = lane; w < words; w += 32) s.vis[w] = w == 0 ? 1u : 0u;
    __syncwarp();

    LaneBest best{0, 0, 0.0f, 0};
    push(s, best, 0, __fadd_rn(0.0f, s.logp[0]), 0.0f, pack_info(0, 1, 0));
    int n = 0, pushed = 1;
    while (n < budget) {
        // The best candidate: largest key, then smallest slot (= earliest push). Its owner is slot % 32.
        const uint32_t top_key = __reduce_max_sync(0xFFFFFFFFu, best.key);
        if (top_key == 0) break;
        const uint32_t top_slot = ~__reduce_max_sync(0xFFFFFFFFu, best.key == top_key ? ~(uint32_t)best.slot : 0u);
        const int owner = top_slot & 31;
        const float logw = key_value(top_key);
        const float base = __shfl_sync(0xFFFFFFFFu, best.base, owner);
        const uint32_t info = __shfl_sync(0xFFFFFFFFu, best.info, owner);
        const int p = info_parent(info), d = info_depth(info), r = info_rank(info);
        const int row = ++n;

        const bool sibling = r + 1 < k, child = d < depth_max;
        if (lane == owner) s.slot_key[top_slot] = 0;
        if (sibling) push(s, best, pushed, __fadd_rn(base, s.logp[(d - 1) * k + r + 1]), base, pack_info(p, d, r + 1));
        if (child) push(s, best, pushed + sibling, __fadd_rn(logw, s.logp[d * k]), logw, pack_info(row, d + 1, 0));
        pushed += (int)sibling + (int)child;
        if (lane == owner) best.rescan(s, pushed);

        for (int w = lane; w < words; w += 32) {
            uint32_t bit = (w == row / 32) ? (1u << (row % 32)) : 0u;
            s.vis[row * words + w] = s.vis[p * words + w] | bit;
        }
        if (lane == 0) {
            s.node_info[row] = info;
            int prev = s.last_child[p];
            if (prev < 0) s.first_child[p] = row;
            else s.next_sibling[prev] = row;
            s.last_child[p] = row;
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

// One CTA of one warp per request; dynamic shared memory as computed by src/cuda/tree_build.rs.
extern "C" __global__ void __launch_bounds__(32)
    tree_build(const int* top_ids, const float* top_logp, const int* root_token, const int* seq_len, int depth_max,
               int k, int budget, int* num_nodes, int* node_token, int* node_depth, int* parent, int* first_child,
               int* next_sibling, int* position, unsigned int* visibility, int* status) {
    const int b = blockIdx.x;
    const int n_rows = budget + 1, words = (n_rows + 31) / 32;
    const size_t lk = (size_t)depth_max * k, rows = (size_t)b * n_rows;
    kdt::tree::build_one(top_ids + b * lk, top_logp + b * lk, root_token[b], seq_len[b], depth_max, k, budget,
                         num_nodes + b, node_token + rows, node_depth + rows, parent + rows, first_child + rows,
                         next_sibling + rows, position + rows, visibility + rows * words, status + b);
}
