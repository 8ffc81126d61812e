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
// Only lane 0 touches the per-row arrays, and each lane only its own bitmask word of every row, so no
// lane reads what another wrote until the output loop (after a __syncwarp).
struct Layout {
    float* logp;           // [L*K] this request's top_logp
    uint32_t* node_info;   // [N] parent / depth / rank of each row
    int* first_child;      // [N] row of the first child, or -1
    int* next_sibling;     // [N] row of the next sibling, or -1
    int* last_child;       // [N] latest child row appended so far
    uint32_t* vis;         // [N*W]
};

__device__ Layout carve(char* smem, int lk, int n_rows) {
    Layout s;
    s.logp = reinterpret_cast<float*>(smem);
    s.node_info = reinterpret_cast<uint32_t*>(s.logp + lk);
    s.first_child = reinterpret_cast<int*>(s.node_info + n_rows);
    s.next_sibling = s.first_child + n_rows;
    s.last_child = s.next_sibling + n_rows;
    s.vis = reinterpret_cast<uint32_t*>(s.last_child + n_rows);
    return s;
}

// A frontier candidate: its score, its parent's score (the base of its next sibling's score) and
// parent / depth / rank. A NaN score marks an empty place (it compares false with everything).
struct Candidate {
    float logw;
    float base;
    uint32_t info;
};

// The frontier as one array sorted best first (larger logw, then earlier push), spread over the warp:
// element j is register j / 32 of lane j % 32. Each step pops element 0 and inserts at most two new
// candidates; both are pushed after every candidate already there, so each goes right after the
// elements whose logw is >= its own, and the earlier push order of equal scores is kept by position
// alone. The array holds at least as many elements as pops remain (pop_all halves it as they shrink), so
// a candidate pushed past that many better ones can never be popped and is dropped. The pops form one
// dependent chain, and a lone warp pays each instruction's latency, so a step is kept to ballots,
// shuffles and selects with no branch.
template <int SPL>
struct SortedFrontier {
    float logw[SPL];
    float base[SPL];
    uint32_t info[SPL];

    __device__ __forceinline__ void init(const Candidate& first) {
#pragma unroll
        for (int j = 0; j < SPL; ++j) {
            logw[j] = base[j] = __int_as_float(0x7FC00000);
            info[j] = 0;
        }
        if (threadIdx.x == 0) {
            logw[0] = first.logw;
            base[0] = first.base;
            info[0] = first.info;
        }
    }

    // The first 32 * SPL / 2 elements: the registers of the lower half.
    __device__ __forceinline__ SortedFrontier<SPL / 2> lower_half() const {
        SortedFrontier<SPL / 2> h;
#pragma unroll
        for (int j = 0; j < SPL / 2; ++j) {
            h.logw[j] = logw[j];
            h.base[j] = base[j];
            h.info[j] = info[j];
        }
        return h;
    }

    // Element i < 32 (register 0 of lane i), in every lane.
    __device__ __forceinline__ Candidate element(int i) const {
        return {__shfl_sync(0xFFFFFFFFu, logw[0], i), __shfl_sync(0xFFFFFFFFu, base[0], i),
                __shfl_sync(0xFFFFFFFFu, info[0], i)};
    }

    // Elements other than the head (element 0) whose logw is >= x: a prefix of the array after the head.
    __device__ __forceinline__ int count_ge_after_head(float x) const {
        int count = 0;
#pragma unroll
        for (int j = 0; j < SPL; ++j)
            count += __popc(__ballot_sync(0xFFFFFFFFu, logw[j] >= x && (j > 0 || threadIdx.x > 0)));
        return count;
    }

    // Element `at + delta` of the array (delta in -1..1, at = 32 j + lane), with NaN past its end. A
    // shift across a register boundary reads the neighbouring register of the wrapped lane, which that
    // lane offers in the same shuffle (lane 0 offers register j + 1, lane 31 register j - 1).
    template <typename T>
    __device__ __forceinline__ T shifted(const T (&v)[SPL], int j, int delta, T none) const {
        const int lane = threadIdx.x;
        const T same = __shfl_sync(0xFFFFFFFFu, v[j], (lane + delta) & 31);
        const T next = j + 1 < SPL ? v[j + 1 < SPL ? j + 1 : j] : none;
        const T prev = j > 0 ? v[j > 0 ? j - 1 : j] : none;
        const T across = __shfl_sync(0xFFFFFFFFu, lane == 0 ? next : prev, lane == 31 ? 0 : 31);
        return (lane == 31 && delta == 1) || (lane == 0 && delta == -1) ? across : same;
    }

    // Removes the head and inserts a (if has_a) then b (if has_b).
    __device__ __forceinline__ void pop_and_push(bool has_a, const Candidate& a, bool has_b, const Candidate& b) {
        constexpr int CAP = 32 * SPL;
        // Final places: each new candidate follows the kept elements with logw >= its own, and b also
        // follows a when their scores are equal (a was pushed first).
        const int count_a = count_ge_after_head(a.logw), count_b = count_ge_after_head(b.logw);
        const int pos_a = has_a ? count_a + (int)(has_b && b.logw > a.logw) : CAP;
        const int pos_b = has_b ? count_b + (int)(has_a && a.logw >= b.logw) : CAP;
        const float nan = __int_as_float(0x7FC00000);
        float new_logw[SPL], new_base[SPL];
        uint32_t new_info[SPL];
#pragma unroll
        for (int j = 0; j < SPL; ++j) {
            const int at = j * 32 + (int)threadIdx.x;
            // A kept element came from at + 1 (the head left) less the insertions placed before it.
            const int delta = 1 - (int)(pos_a < at) - (int)(pos_b < at);
            const float kept_logw = shifted(logw, j, delta, nan);
            const float kept_base = shifted(base, j, delta, nan);
            const uint32_t kept_info = shifted(info, j, delta, 0u);
            new_logw[j] = at == pos_a ? a.logw : at == pos_b ? b.logw : kept_logw;
            new_base[j] = at == pos_a ? a.base : at == pos_b ? b.base : kept_base;
            new_info[j] = at == pos_a ? a.info : at == pos_b ? b.info : kept_info;
        }
#pragma unroll
        for (int j = 0; j < SPL; ++j) {
            logw[j] = new_logw[j];
            base[j] = new_base[j];
            info[j] = new_info[j];
        }
    }
};

// The two log-probs a popped candidate (depth d, rank r) extends: its next sibling's, top_logp[d-1][r+1],
// and its first child's, top_logp[d][0]. Indices are clamped so that an absent one (or an empty
// candidate, info 0) still reads in bounds.
struct Loaded {
    float sibling;
    float child;
};

__device__ __forceinline__ Loaded load_logp(const Layout& s, uint32_t info, int k, int depth_max) {
    const int d = info_depth(info), r = info_rank(info);
    return {s.logp[max(d - 1, 0) * k + min(r + 1, k - 1)], s.logp[min(d, depth_max - 1) * k]};
}

// The state carried from step to step: the head (popped next), the runner-up (element 1 of the array),
// the head's two log-probs, and the rows appended so far.
struct Walk {
    Candidate top;
    Candidate second;
    Loaded top_lp;
    int n;
};

// One step: appends the head as row n + 1 and replaces it in the frontier by its next sibling and first
// child. The step is pipelined by hand: the next head is found from uniform values (the runner-up and
// the two new candidates) and its log-probs are loaded before the array update, so that the update and
// those loads overlap instead of forming one chain.
template <int SPL>
__device__ __forceinline__ void step(SortedFrontier<SPL>& f, Walk& w, const Layout& s, int k, int depth_max, int words) {
    const int lane = threadIdx.x;
    const Candidate top = w.top;
    const int p = info_parent(top.info), d = info_depth(top.info), r = info_rank(top.info);
    const int row = ++w.n;
    // Used last, so their latency overlaps the step. words <= 17 for budgets up to 512: one bitmask word
    // per lane.
    const uint32_t parent_vis = lane < words ? s.vis[p * words + lane] : 0u;
    const int prev_sibling = lane == 0 && r > 0 ? s.last_child[p] : 0;

    const bool sibling = r + 1 < k, child = d < depth_max;
    const Candidate next{__fadd_rn(top.base, w.top_lp.sibling), top.base, pack_info(p, d, r + 1)};
    const Candidate first{__fadd_rn(top.logw, w.top_lp.child), top.logw, pack_info(row, d + 1, 0)};
    // The next head: the first of (second, next, first) in the array's order (a kept element before an
    // equal new one, the sibling before an equal child).
    const Candidate second = w.second;
    const bool next_leads = sibling && !(second.logw >= next.logw) && !(child && first.logw > next.logw);
    const bool first_leads = child && !(second.logw >= first.logw) && !(sibling && next.logw >= first.logw);
    w.top = next_leads ? next : first_leads ? first : second;
    w.top_lp = load_logp(s, w.top.info, k, depth_max);

    f.pop_and_push(sibling, next, child, first);
    w.second = f.element(1);

    if (lane == 0) {
        s.node_info[row] = top.info;
        // Children are appended in rank order, so the latest child of p is this row's previous sibling.
        *(r == 0 ? &s.first_child[p] : &s.next_sibling[prev_sibling]) = row;
        s.last_child[p] = row;
    }
    if (lane < words) s.vis[row * words + lane] = parent_vis | (lane == row / 32 ? 1u << (row % 32) : 0u);
}

// Pops until the budget is spent or the frontier is empty. The array only has to hold as many elements
// as pops remain, so once those fit in half of it the walk goes on with the lower half, whose steps are
// cheaper (fewer registers to count and shuffle).
template <int SPL>
__device__ void pop_all(SortedFrontier<SPL>& f, Walk& w, const Layout& s, int k, int depth_max, int budget,
                        int words) {
    const int end = budget - 16 * SPL;  // from here on, at most 32 * SPL / 2 pops remain
    while (w.n < end && !isnan(w.top.logw)) step(f, w, s, k, depth_max, words);
    if constexpr (SPL > 1) {
        SortedFrontier<SPL / 2> half = f.lower_half();
        pop_all(half, w, s, k, depth_max, budget, words);
    } else {
        while (w.n < budget && !isnan(w.top.logw)) step(f, w, s, k, depth_max, words);
    }
}

// Registers per lane of the frontier's array at the start: room for the largest budget (512).
constexpr int MAX_SPL = 16;

__device__ void build_one(const int* __restrict__ top_ids, const float* __restrict__ top_logp, int root_token,
                          int seq_len, int depth_max, int k, int budget, int* num_nodes, int* node_token,
                          int* node_depth, int* parent_out, int* first_child_out, int* next_sibling_out,
                          int* position_out, uint32_t* vis_out, int* status) {
    extern __shared__ __align__(16) char smem[];
    const int lane = threadIdx.x;
    const int n_rows = budget + 1, words = (n_rows + 31) / 32, lk = depth_max * k;
    Layout s = carve(smem, lk, n_rows);

    // The copy is latency-bound: every lane keeps PRELOAD loads in flight (one round up to 1024 values).
    constexpr int PRELOAD = 32;
    int flags = 0;
    for (int chunk = 0; chunk < lk; chunk += 32 * PRELOAD) {
        float v[PRELOAD];
#pragma unroll
        for (int j = 0; j < PRELOAD; ++j) {
            const int i = chunk + 32 * j + lane;
            v[j] = i < lk ? __ldg(top_logp + i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < PRELOAD; ++j) {
            const int i = chunk + 32 * j + lane;
            if (i >= lk) break;
            flags |= isnan(v[j]) ? STATUS_NAN : 0;
            s.logp[i] = v[j];
        }
    }
    for (int w = lane; w < words; w += 32) s.vis[w] = w == 0 ? 1u : 0u;
    for (int i = lane; i < n_rows; i += 32) s.first_child[i] = s.next_sibling[i] = -1;
    __syncwarp();

    const Candidate root_child{__fadd_rn(0.0f, s.logp[0]), 0.0f, pack_info(0, 1, 0)};
    // Every walk starts with the largest array; a smaller budget skips the phases it does not need at
    // once (pop_all halves the array while the remaining pops fit in half), so one code path serves all.
    SortedFrontier<MAX_SPL> f;
    f.init(root_child);
    Walk w{root_child, {__int_as_float(0x7FC00000), 0.0f, 0u}, load_logp(s, root_child.info, k, depth_max), 0};
    pop_all(f, w, s, k, depth_max, budget, words);
    const int n = w.n;
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
