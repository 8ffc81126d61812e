// DDTree best-first tree build (DESIGN.md §4.1 step 2-3; exact contract in reference/README.md).
//
// One warp per request, everything in shared memory, no host round trip and no allocation. Each step the
// warp finds the best frontier candidate (largest logw, then smallest push number) with two warp
// reductions, appends it as the next row, and pushes its next sibling and first child. The visibility row
// of a new node is its parent's row plus its own bit, built as the node is appended.
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

struct Layout {
    float* logp;          // [L*K] this request's top_logp
    float* front_logw;    // [N] frontier
    uint32_t* front_seq;  // [N]
    uint32_t* front_info; // [N]
    float* node_logw;     // [N]
    uint32_t* node_info;  // [N] parent / depth / rank of each row
    int* first_child;     // [N]
    int* next_sibling;    // [N]
    int* last_child;      // [N]
    uint32_t* vis;        // [N*W]
};

__device__ Layout carve(char* smem, int lk, int n_rows, int words) {
    Layout s;
    s.logp = reinterpret_cast<float*>(smem);
    s.front_logw = s.logp + lk;
    s.front_seq = reinterpret_cast<uint32_t*>(s.front_logw + n_rows);
    s.front_info = s.front_seq + n_rows;
    s.node_logw = reinterpret_cast<float*>(s.front_info + n_rows);
    s.node_info = reinterpret_cast<uint32_t*>(s.node_logw + n_rows);
    s.first_child = reinterpret_cast<int*>(s.node_info + n_rows);
    s.next_sibling = s.first_child + n_rows;
    s.last_child = s.next_sibling + n_rows;
    s.vis = reinterpret_cast<uint32_t*>(s.last_child + n_rows);
    return s;
}

// Warp-wide: the frontier slot holding the largest (logw, -seq). All lanes get the same answer.
__device__ __forceinline__ int best_slot(const Layout& s, int frontier) {
    const int lane = threadIdx.x;
    uint32_t best_hi = 0, best_lo = 0;
    int best = -1;
    for (int i = lane; i < frontier; i += 32) {
        uint32_t hi = order_key(s.front_logw[i]), lo = ~s.front_seq[i];
        if (best < 0 || hi > best_hi || (hi == best_hi && lo > best_lo)) {
            best_hi = hi;
            best_lo = lo;
            best = i;
        }
    }
    uint32_t top_hi = __reduce_max_sync(0xFFFFFFFFu, best >= 0 ? best_hi : 0u);
    uint32_t top_lo = __reduce_max_sync(0xFFFFFFFFu, (best >= 0 && best_hi == top_hi) ? best_lo : 0u);
    unsigned winners = __ballot_sync(0xFFFFFFFFu, best >= 0 && best_hi == top_hi && best_lo == top_lo);
    return __shfl_sync(0xFFFFFFFFu, best, __ffs(winners) - 1);
}

__device__ void build_one(const int* __restrict__ top_ids, const float* __restrict__ top_logp, int root_token,
                          int seq_len, int depth_max, int k, int budget, int* num_nodes, int* node_token,
                          int* node_depth, int* parent_out, int* first_child_out, int* next_sibling_out,
                          int* position_out, uint32_t* vis_out, int* status) {
    extern __shared__ __align__(16) char smem[];
    const int lane = threadIdx.x;
    const int n_rows = budget + 1, words = (n_rows + 31) / 32, lk = depth_max * k;
    Layout s = carve(smem, lk, n_rows, words);

    int flags = 0;
    for (int i = lane; i < lk; i += 32) {
        float v = top_logp[i];
        flags |= isnan(v) ? STATUS_NAN : 0;
        s.logp[i] = v;
    }
    for (int i = lane; i < n_rows; i += 32) {
        s.first_child[i] = -1;
        s.next_sibling[i] = -1;
        s.last_child[i] = -1;
    }
    for (int w = lane; w < words; w += 32) s.vis[w] = w == 0 ? 1u : 0u;
    if (lane == 0) {
        s.node_logw[0] = 0.0f;
        s.node_info[0] = 0;
        s.front_logw[0] = __fadd_rn(0.0f, s.logp[0]);
        s.front_seq[0] = 0;
        s.front_info[0] = pack_info(0, 1, 0);
    }
    __syncwarp();

    int n = 0, frontier = 1;
    uint32_t next_seq = 1;
    while (n < budget && frontier > 0) {
        const int slot = best_slot(s, frontier);
        const float logw = s.front_logw[slot];
        const uint32_t info = s.front_info[slot];
        const int p = info_parent(info), d = info_depth(info), r = info_rank(info);
        const int row = ++n;
        const int last = frontier - 1;
        const float last_logw = s.front_logw[last];
        const uint32_t last_seq = s.front_seq[last], last_info = s.front_info[last];
        const float parent_logw = s.node_logw[p];
        const int prev_child = s.last_child[p];
        __syncwarp();
        for (int w = lane; w < words; w += 32) {
            uint32_t bit = (w == row / 32) ? (1u << (row % 32)) : 0u;
            s.vis[row * words + w] = s.vis[p * words + w] | bit;
        }
        if (lane == 0) {
            s.node_logw[row] = logw;
            s.node_info[row] = info;
            if (prev_child < 0) s.first_child[p] = row;
            else s.next_sibling[prev_child] = row;
            s.last_child[p] = row;
            // Fill the hole with the last entry, then push sibling and child in that order.
            s.front_logw[slot] = last_logw;
            s.front_seq[slot] = last_seq;
            s.front_info[slot] = last_info;
            int f = last;
            if (r + 1 < k) {
                s.front_logw[f] = __fadd_rn(parent_logw, s.logp[(d - 1) * k + r + 1]);
                s.front_seq[f] = next_seq++;
                s.front_info[f] = pack_info(p, d, r + 1);
                ++f;
            }
            if (d < depth_max) {
                s.front_logw[f] = __fadd_rn(logw, s.logp[d * k]);
                s.front_seq[f] = next_seq++;
                s.front_info[f] = pack_info(row, d + 1, 0);
                ++f;
            }
        }
        // Every lane tracks the frontier size and push counter the same way lane 0 does.
        frontier = last + (r + 1 < k ? 1 : 0) + (d < depth_max ? 1 : 0);
        next_seq += lane == 0 ? 0 : (r + 1 < k ? 1 : 0) + (d < depth_max ? 1 : 0);
        __syncwarp();
    }

    for (int i = lane; i < n_rows; i += 32) {
        if (i > n) {  // padding row: its node_info was never written
            node_token[i] = node_depth[i] = parent_out[i] = -1;
            first_child_out[i] = next_sibling_out[i] = position_out[i] = -1;
            continue;
        }
        uint32_t info = s.node_info[i];
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
