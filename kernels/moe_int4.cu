// MoE with INT4 experts (DESIGN.md §4.4): routing + alignment, grouped GEMM 1 (gate/up with SiLU),
// grouped GEMM 2 (down), and the routing-weighted combine. Weights are W4A16, group 32, either in the
// checkpoint's compressed-tensors layout (native) or in the load-time tile order (tiled, see int4_tile).
//
// Both GEMMs run as "swap AB" tensor-core products: a warp's mma.sync m16n8k16 takes 16 weight rows as
// A (dequantized in registers) and up to 8 tokens as B, so one token per expert wastes MMA lanes but no
// memory traffic, and there is a single code path for every token count. Each k16 step covers 16 values
// of one quantization group, so the group's integer dot products are exact in the MMA and the bf16 scale
// is applied once per group in f32 (acc = fma(scale, group_sum, acc)). A block splits K over its 8 warps
// at fixed group boundaries and sums the warps in order, so every output element is computed by the
// same operations whatever the batch: results are deterministic and batch invariant.
#include "common.cuh"

namespace kdt {
namespace moe {

constexpr int GROUP = 32;
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int MT = 2;  // m16 tiles per block (gate + up rows, or 32 down rows)
constexpr int MAX_EXPERTS = 1024;
constexpr int ROUTE_THREADS = 512;
constexpr int ROUTE_ITEMS = MAX_EXPERTS / ROUTE_THREADS;

// Status bits (mirrored in src/cuda/moe_int4.rs).
constexpr int STATUS_BAD_LOGIT = 1;
constexpr int STATUS_BAD_EXPERT = 2;

// ---------------------------------------------------------------------------------------------------
// Routing and alignment: one CTA. Warps route tokens (sigmoid in float64, top-k of score + bias, ties to
// the smaller expert id, weights renormalized in slot order); then the pairs are counted per expert,
// scanned into offsets, and placed in pair order by a single warp so that each expert's pairs stay in
// increasing pair order.

struct Candidate {
    double key;
    double score;
    int id;
};

__device__ __forceinline__ bool better(const Candidate& a, const Candidate& b) {
    return a.key > b.key || (a.key == b.key && a.id < b.id);
}

__device__ __forceinline__ Candidate warp_best(Candidate c) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        Candidate o;
        o.key = __shfl_xor_sync(0xffffffffu, c.key, off);
        o.score = __shfl_xor_sync(0xffffffffu, c.score, off);
        o.id = __shfl_xor_sync(0xffffffffu, c.id, off);
        if (better(o, c)) c = o;
    }
    return c;
}

__device__ void route_token(const float* __restrict__ logits, const float* __restrict__ bias, double scaling,
                            int E, int k, int* __restrict__ ids, float* __restrict__ weights, int* status) {
    const int lane = threadIdx.x & 31;
    bool finite = true;
    for (int e = lane; e < E; e += 32) finite &= isfinite(logits[e]) && isfinite(bias[e]);
    if (!__all_sync(0xffffffffu, finite)) {
        // Keep the outputs valid expert ids, so later kernels stay in range; the host reports the error.
        if (lane < k) {
            ids[lane] = lane;
            weights[lane] = 0.0f;
        }
        if (lane == 0) atomicOr(status, STATUS_BAD_LOGIT);
        return;
    }
    uint32_t chosen = 0;  // bit j: expert lane + 32 j taken
    double my_score = 0.0;
    for (int slot = 0; slot < k; ++slot) {
        Candidate best{-INFINITY, 0.0, 0x7fffffff};
        for (int j = 0, e = lane; e < E; ++j, e += 32) {
            if (chosen >> j & 1u) continue;
            double s = 1.0 / (1.0 + exp(-(double)logits[e]));
            Candidate c{s + (double)bias[e], s, e};
            if (better(c, best)) best = c;
        }
        best = warp_best(best);
        if (lane == (best.id & 31)) chosen |= 1u << (best.id >> 5);
        if (lane == slot) my_score = best.score;
        if (lane == 0) ids[slot] = best.id;
    }
    double sum = 0.0;
    for (int slot = 0; slot < k; ++slot) sum += __shfl_sync(0xffffffffu, my_score, slot);
    if (lane < k) weights[lane] = (float)(my_score / sum * scaling);
}

typedef cub::BlockScan<int, ROUTE_THREADS> ScanInt;

extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route_align(const float* __restrict__ logits, const float* __restrict__ bias, double scaling, int T, int E,
                    int k, int* __restrict__ topk_ids, float* __restrict__ topk_weights,
                    int* __restrict__ expert_offsets, int* __restrict__ sorted_pairs,
                    int* __restrict__ active_experts, int* __restrict__ num_active, int* __restrict__ status) {
    __shared__ int count[MAX_EXPERTS];
    __shared__ int next[MAX_EXPERTS];
    __shared__ typename ScanInt::TempStorage scan_tmp;
    __shared__ int bad_id;
    const int tid = threadIdx.x, pairs = T * k;

    if (logits != nullptr) {
        for (int t = tid >> 5; t < T; t += ROUTE_THREADS / 32)
            route_token(logits + (size_t)t * E, bias, scaling, E, k, topk_ids + (size_t)t * k,
                        topk_weights + (size_t)t * k, status);
    }
    if (tid == 0) bad_id = 0;
    for (int e = tid; e < E; e += ROUTE_THREADS) count[e] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += ROUTE_THREADS) {
        int e = topk_ids[p];
        if (e < 0 || e >= E)
            bad_id = 1;
        else
            atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (bad_id) {
        // Nothing is computed for an invalid routing; the host reports it.
        if (tid == 0) {
            atomicOr(status, STATUS_BAD_EXPERT);
            *num_active = 0;
        }
        return;
    }
    // Blocked arrangement: thread tid owns experts tid * ROUTE_ITEMS + i, so the scans run in expert order.
    int c[ROUTE_ITEMS], used[ROUTE_ITEMS], offset[ROUTE_ITEMS], rank[ROUTE_ITEMS], total_active;
#pragma unroll
    for (int i = 0; i < ROUTE_ITEMS; ++i) {
        const int e = tid * ROUTE_ITEMS + i;
        c[i] = e < E ? count[e] : 0;
        used[i] = c[i] > 0 ? 1 : 0;
    }
    ScanInt(scan_tmp).ExclusiveSum(c, offset);
    __syncthreads();
    ScanInt(scan_tmp).ExclusiveSum(used, rank, total_active);
#pragma unroll
    for (int i = 0; i < ROUTE_ITEMS; ++i) {
        const int e = tid * ROUTE_ITEMS + i;
        if (e >= E) continue;
        expert_offsets[e] = offset[i];
        next[e] = offset[i];
        if (used[i]) active_experts[rank[i]] = e;
    }
    if (tid == 0) {
        expert_offsets[E] = pairs;
        *num_active = total_active;
    }
    __syncthreads();
    if (tid < 32) {
        for (int base = 0; base < pairs; base += 32) {
            const int p = base + tid;
            const int e = p < pairs ? topk_ids[p] : -1;
            const uint32_t peers = __match_any_sync(0xffffffffu, e);
            const int before = __popc(peers & ((1u << tid) - 1u));
            const int slot = e >= 0 ? next[e] + before : 0;
            __syncwarp();
            if (e >= 0) {
                sorted_pairs[slot] = p;
                if (before == 0) next[e] += __popc(peers);
            }
            __syncwarp();
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// INT4 weight loading. A warp's m16 tile at group g needs, per lane (r = lane / 4, c = lane % 4), the
// packed word c of group g for rows r and r + 8, and those rows' scales.

struct Frag {
    uint32_t word[2];  // rows r, r + 8
    float scale[2];
};

// Checkpoint layout: packed [rows, cols/8] i32, scale [rows, cols/32] bf16.
struct NativeLayout {
    __device__ __forceinline__ static Frag load(const uint32_t* __restrict__ packed,
                                                const __nv_bfloat16* __restrict__ scale, int row0, int cols,
                                                int g) {
        const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
        const size_t words = cols / 8, groups = cols / GROUP;
        Frag f;
        f.word[0] = __ldg(packed + (size_t)(row0 + r) * words + g * 4 + c);
        f.word[1] = __ldg(packed + (size_t)(row0 + r + 8) * words + g * 4 + c);
        f.scale[0] = __bfloat162float(scale[(size_t)(row0 + r) * groups + g]);
        f.scale[1] = __bfloat162float(scale[(size_t)(row0 + r + 8) * groups + g]);
        return f;
    }
};

// Tiled layout (int4_tile): for each 16-row tile and group, the 32 lanes' (row r, row r + 8) word pairs
// are contiguous (256 bytes), and the tile's scales are stored as 8 (row i, row i + 8) pairs (32 bytes).
struct TiledLayout {
    __device__ __forceinline__ static Frag load(const uint32_t* __restrict__ packed,
                                                const __nv_bfloat16* __restrict__ scale, int row0, int cols,
                                                int g) {
        const int lane = threadIdx.x & 31, groups = cols / GROUP;
        const size_t tile = (size_t)(row0 / 16) * groups + g;
        const uint2 w = __ldg(reinterpret_cast<const uint2*>(packed) + tile * 32 + lane);
        const __nv_bfloat162 s = reinterpret_cast<const __nv_bfloat162*>(scale)[tile * 8 + (lane >> 2)];
        Frag f;
        f.word[0] = w.x;
        f.word[1] = w.y;
        f.scale[0] = __low2float(s);
        f.scale[1] = __high2float(s);
        return f;
    }
};

// bf16 pair (lo, hi) = (nibble at bit `shift`, nibble at bit `shift + 16`) - 8, exact: 0x4300 | n is
// the bf16 128 + n.
__device__ __forceinline__ uint32_t nibble_pair(uint32_t w, int shift) {
    uint32_t biased = ((w >> shift) & 0x000F000Fu) | 0x43004300u;
    __nv_bfloat162 v = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&biased), __floats2bfloat162_rn(136.0f, 136.0f));
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One group of one (m16 tile, n8 tile): the lane's word holds group elements 8c .. 8c + 7, split into the
// pairs (0, 4), (1, 5), (2, 6), (3, 7); the activations are paired the same way, so the k order inside
// the MMA is a permutation of the group that A and B share.
__device__ __forceinline__ void group_mma(float (&acc)[4], const Frag& w, uint4 x) {
    const uint32_t x04 = __byte_perm(x.x, x.z, 0x5410), x15 = __byte_perm(x.x, x.z, 0x7632);
    const uint32_t x26 = __byte_perm(x.y, x.w, 0x5410), x37 = __byte_perm(x.y, x.w, 0x7632);
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const uint32_t a0[4] = {nibble_pair(w.word[0], 0), nibble_pair(w.word[1], 0), nibble_pair(w.word[0], 4),
                            nibble_pair(w.word[1], 4)};
    mma_bf16(part, a0, x04, x15);
    const uint32_t a1[4] = {nibble_pair(w.word[0], 8), nibble_pair(w.word[1], 8), nibble_pair(w.word[0], 12),
                            nibble_pair(w.word[1], 12)};
    mma_bf16(part, a1, x26, x37);
    acc[0] = fmaf(w.scale[0], part[0], acc[0]);
    acc[1] = fmaf(w.scale[0], part[1], acc[1]);
    acc[2] = fmaf(w.scale[1], part[2], acc[2]);
    acc[3] = fmaf(w.scale[1], part[3], acc[3]);
}

// The operands of one expert GEMM: weight matrix [rows, cols] and the activation rows of the expert's
// tokens (a bf16 row of `cols` per token, found through `act_row`).
struct GemmArgs {
    const uint32_t* packed;
    const __nv_bfloat16* scale;
    int cols;
    int row0[MT];  // first weight row of each m16 tile
};

// A warp's partial sums over its share of the groups for NT n8 tiles of tokens. Lanes whose token is
// past `tokens` read zeros. `act[n]` is the lane's activation row in n-tile n (or null).
template <class Layout, int NT, int UNROLL>
__device__ void warp_gemm(float (&acc)[MT][NT][4], const GemmArgs& args, const __nv_bfloat16* const (&act)[NT]) {
    const int warp = threadIdx.x >> 5, c = threadIdx.x & 3;
    const int groups = args.cols / GROUP;
    const int g_begin = warp * groups / WARPS, g_end = (warp + 1) * groups / WARPS;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.0f;
    for (int g0 = g_begin; g0 < g_end; g0 += UNROLL) {
        Frag w[UNROLL][MT];
        uint4 x[UNROLL][NT];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int g = g0 + u;
            const bool in = g < g_end;
#pragma unroll
            for (int m = 0; m < MT; ++m)
                w[u][m] = in ? Layout::load(args.packed, args.scale, args.row0[m], args.cols, g) : Frag{{0, 0}, {0, 0}};
#pragma unroll
            for (int n = 0; n < NT; ++n)
                x[u][n] = in && act[n] ? __ldg(reinterpret_cast<const uint4*>(act[n] + g * GROUP + 8 * c))
                                       : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < NT; ++n) group_mma(acc[m][n], w[u][m], x[u][n]);
    }
}

// The expert this block serves: its pairs are sorted_pairs[begin, begin + count).
struct ExpertSlice {
    int expert, begin, count;
};

__device__ __forceinline__ bool block_expert(const int* active_experts, const int* num_active,
                                             const int* expert_offsets, ExpertSlice& s) {
    if ((int)blockIdx.x >= *num_active) return false;
    s.expert = active_experts[blockIdx.x];
    s.begin = expert_offsets[s.expert];
    s.count = expert_offsets[s.expert + 1] - s.begin;
    return true;
}

// Sums the warps' partials in warp order. Element index: ((m * NT + n) * 32 + lane) * 4 + i.
template <int NT>
struct Partials {
    float v[WARPS][MT * NT * 32 * 4];

    __device__ __forceinline__ void store(const float (&acc)[MT][NT][4]) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<float4*>(&v[warp][((m * NT + n) * 32 + lane) * 4]) =
                    make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
    }

    __device__ __forceinline__ float sum(int idx) const {
        float s = v[0][idx];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) s += v[w][idx];
        return s;
    }
};

// The fragment element idx = ((m * NT + n) * 32 + lane) * 4 + i sits at tile row lane / 4 (+ 8 for
// i >= 2) and token column n * 8 + 2 * (lane % 4) + (i & 1).
__device__ __forceinline__ int frag_row(int lane, int i) { return (lane >> 2) + (i >= 2 ? 8 : 0); }
__device__ __forceinline__ int frag_col(int n, int lane, int i) { return n * 8 + 2 * (lane & 3) + (i & 1); }

// GEMM 1: h[pos, j] = bf16(silu(x · gate_j) * (x · up_j)) for the expert's sorted positions `pos`.
// Grid: (active experts, I / 16); tile rows j0 .. j0 + 15 of gate and of up.
template <class Layout, int NT, int UNROLL>
__device__ void gate_up(const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ w13,
                        const __nv_bfloat16* __restrict__ w13_scale, int H, int I, int k,
                        const int* __restrict__ sorted_pairs, const ExpertSlice& ex, __nv_bfloat16* __restrict__ h) {
    __shared__ Partials<NT> part;
    const int lane = threadIdx.x & 31, j0 = blockIdx.y * 16;
    GemmArgs args{w13, w13_scale, H, {ex.expert * 2 * I + j0, ex.expert * 2 * I + I + j0}};
    for (int t0 = 0; t0 < ex.count; t0 += NT * 8) {
        const __nv_bfloat16* act[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int t = t0 + n * 8 + (lane >> 2);
            act[n] = t < ex.count ? x + (size_t)(sorted_pairs[ex.begin + t] / k) * H : nullptr;
        }
        float acc[MT][NT][4];
        warp_gemm<Layout, NT, UNROLL>(acc, args, act);
        part.store(acc);
        __syncthreads();
        for (int idx = threadIdx.x; idx < NT * 32 * 4; idx += THREADS) {
            const int n = idx / 128, l = (idx / 4) & 31, i = idx & 3;
            const int t = t0 + frag_col(n, l, i);
            if (t >= ex.count) continue;
            const float g = part.sum(idx), u = part.sum(NT * 128 + idx);
            const float silu = g / (1.0f + expf(-g));
            h[(size_t)(ex.begin + t) * I + j0 + frag_row(l, i)] = __float2bfloat16_rn(silu * u);
        }
        __syncthreads();
    }
}

// GEMM 2: y[pair, r] = h[pos] · down_r for rows r0 .. r0 + 31 of the expert's down projection.
template <class Layout, int NT, int UNROLL>
__device__ void down(const __nv_bfloat16* __restrict__ h, const uint32_t* __restrict__ w2,
                     const __nv_bfloat16* __restrict__ w2_scale, int H, int I, const int* __restrict__ sorted_pairs,
                     const ExpertSlice& ex, float* __restrict__ y) {
    __shared__ Partials<NT> part;
    const int lane = threadIdx.x & 31, r0 = blockIdx.y * 32;
    GemmArgs args{w2, w2_scale, I, {ex.expert * H + r0, ex.expert * H + r0 + 16}};
    for (int t0 = 0; t0 < ex.count; t0 += NT * 8) {
        const __nv_bfloat16* act[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int t = t0 + n * 8 + (lane >> 2);
            act[n] = t < ex.count ? h + (size_t)(ex.begin + t) * I : nullptr;
        }
        float acc[MT][NT][4];
        warp_gemm<Layout, NT, UNROLL>(acc, args, act);
        part.store(acc);
        __syncthreads();
        for (int idx = threadIdx.x; idx < MT * NT * 32 * 4; idx += THREADS) {
            const int m = idx / (NT * 128), n = (idx / 128) % NT, l = (idx / 4) & 31, i = idx & 3;
            const int t = t0 + frag_col(n, l, i);
            if (t >= ex.count) continue;
            const int pair = sorted_pairs[ex.begin + t];
            y[(size_t)pair * H + r0 + m * 16 + frag_row(l, i)] = part.sum(idx);
        }
        __syncthreads();
    }
}

// Experts with at most 8 tokens take the narrow kernels (one n8 tile, a deep load pipeline), the others
// the wide ones (4 n8 tiles per pass), so the common few-token case keeps its registers and occupancy.
// Both compute every element with the same operations, so which one serves an expert changes no result.
template <class Layout, int NT, int UNROLL>
__device__ __forceinline__ void gate_up_kernel(const __nv_bfloat16* x, const uint32_t* w13,
                                               const __nv_bfloat16* w13_scale, int H, int I, int k,
                                               const int* active, const int* num_active, const int* offsets,
                                               const int* pairs, __nv_bfloat16* h) {
    ExpertSlice ex;
    if (!block_expert(active, num_active, offsets, ex) || (ex.count > 8) != (NT > 1)) return;
    gate_up<Layout, NT, UNROLL>(x, w13, w13_scale, H, I, k, pairs, ex, h);
}

template <class Layout, int NT, int UNROLL>
__device__ __forceinline__ void down_kernel(const __nv_bfloat16* h, const uint32_t* w2,
                                            const __nv_bfloat16* w2_scale, int H, int I, const int* active,
                                            const int* num_active, const int* offsets, const int* pairs,
                                            float* y) {
    ExpertSlice ex;
    if (!block_expert(active, num_active, offsets, ex) || (ex.count > 8) != (NT > 1)) return;
    down<Layout, NT, UNROLL>(h, w2, w2_scale, H, I, pairs, ex, y);
}

#define KDT_MOE_GEMMS(LAYOUT, NT, UNROLL, SUFFIX)                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) moe_gate_up_##SUFFIX(                                \
        const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ w13,                                 \
        const __nv_bfloat16* __restrict__ w13_scale, int H, int I, int k, const int* __restrict__ active,      \
        const int* __restrict__ num_active, const int* __restrict__ offsets, const int* __restrict__ pairs,    \
        __nv_bfloat16* __restrict__ h) {                                                                       \
        gate_up_kernel<LAYOUT, NT, UNROLL>(x, w13, w13_scale, H, I, k, active, num_active, offsets, pairs, h); \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) moe_down_##SUFFIX(                                   \
        const __nv_bfloat16* __restrict__ h, const uint32_t* __restrict__ w2,                                  \
        const __nv_bfloat16* __restrict__ w2_scale, int H, int I, const int* __restrict__ active,              \
        const int* __restrict__ num_active, const int* __restrict__ offsets, const int* __restrict__ pairs,    \
        float* __restrict__ y) {                                                                               \
        down_kernel<LAYOUT, NT, UNROLL>(h, w2, w2_scale, H, I, active, num_active, offsets, pairs, y);         \
    }

KDT_MOE_GEMMS(NativeLayout, 1, 4, native)
KDT_MOE_GEMMS(NativeLayout, 4, 1, wide_native)
KDT_MOE_GEMMS(TiledLayout, 1, 4, tiled)
KDT_MOE_GEMMS(TiledLayout, 4, 1, wide_tiled)

// out[t, c] = Σ_slot weight[t, slot] · y[t * k + slot, c], in slot order, multiply and add rounded
// separately as in the CPU reference. Grid: (ceil(H / 256), T).
extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const float* __restrict__ y, const float* __restrict__ topk_weights, int H, int k,
                float* __restrict__ out) {
    const int t = blockIdx.y, col = blockIdx.x * 256 + threadIdx.x;
    if (col >= H) return;
    float acc = 0.0f;
    for (int slot = 0; slot < k; ++slot)
        acc = __fadd_rn(acc, __fmul_rn(topk_weights[t * k + slot], y[((size_t)t * k + slot) * H + col]));
    out[(size_t)t * H + col] = acc;
}

// ---------------------------------------------------------------------------------------------------
// Layout and benchmark helpers.

// Native -> tiled repack of a [rows, cols] matrix (rows a multiple of 16). One thread per (tile, group,
// lane) word pair; the lanes with lane % 4 == 0 also write the scale pair of row lane / 4.
extern "C" __global__ void int4_tile(const uint32_t* __restrict__ packed, const __nv_bfloat16* __restrict__ scale,
                                     int rows, int cols, uint32_t* __restrict__ packed_tiled,
                                     __nv_bfloat16* __restrict__ scale_tiled) {
    const int groups = cols / GROUP;
    const size_t total = (size_t)(rows / 16) * groups * 32;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int lane = i % 32, r = lane >> 2, c = lane & 3;
        const size_t tile = i / 32;
        const int g = tile % groups, row0 = (int)(tile / groups) * 16;
        const size_t words = cols / 8;
        packed_tiled[2 * i] = packed[(size_t)(row0 + r) * words + g * 4 + c];
        packed_tiled[2 * i + 1] = packed[(size_t)(row0 + r + 8) * words + g * 4 + c];
        if (c == 0) {
            scale_tiled[(tile * 8 + r) * 2] = scale[(size_t)(row0 + r) * groups + g];
            scale_tiled[(tile * 8 + r) * 2 + 1] = scale[(size_t)(row0 + r + 8) * groups + g];
        }
    }
}

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Random INT4 weights for benchmarks: uniform nibbles, scales uniform in [scale_lo, scale_hi).
extern "C" __global__ void int4_fill_random(uint32_t* __restrict__ packed, size_t words,
                                            __nv_bfloat16* __restrict__ scale, size_t groups, u64 seed,
                                            float scale_lo, float scale_hi) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += stride)
        packed[i] = (uint32_t)splitmix64(seed ^ (i * 2 + 1));
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < groups; i += stride) {
        const float u = (float)(splitmix64(~seed ^ (i * 2)) >> 40) * (1.0f / 16777216.0f);
        scale[i] = __float2bfloat16_rn(scale_lo + u * (scale_hi - scale_lo));
    }
}

// Native INT4 -> bf16 (rounded once), for the cuBLAS baseline: out[r, c] = bf16((nibble - 8) * scale).
extern "C" __global__ void int4_dequant_bf16(const uint32_t* __restrict__ packed,
                                             const __nv_bfloat16* __restrict__ scale, size_t words,
                                             __nv_bfloat16* __restrict__ out) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t w = packed[i];
        const float s = __bfloat162float(scale[i / 4]);
#pragma unroll
        for (int j = 0; j < 8; ++j) out[i * 8 + j] = __float2bfloat16_rn((float)((int)((w >> (4 * j)) & 0xF) - 8) * s);
    }
}

}  // namespace moe
}  // namespace kdt
