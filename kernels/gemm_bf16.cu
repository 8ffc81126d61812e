// Fixed-order bf16 GEMM for the model's dense projections (DESIGN.md §4.5): y[b][t][n] = Σ_k W[b][n][k] ·
// x[b][t][k], with W bf16 `[batch, N, K]` in the checkpoint's row-major layout and x float32.
//
// Why not cuBLAS: its kernel choice (and so its reduction order) depends on the number of rows, so a
// token's logits would change with the batch. Here every output element is computed by one fixed chain of
// operations whatever T is:
//   * x is split once into bf16 hi = rn(x) and lo = rn(x - hi) (gemm_split_bf16), so W·x is W·hi + W·lo:
//     exact bf16 products summed in f32, within about 2^-17 of the float32 activations (a single bf16
//     rounding of x would cost about 2^-9, a visible share of the model's tolerance);
//   * "swap AB" mma.sync m16n8k16: 16 weight rows are A, 8 tokens are B, so the weight tile is staged once
//     for all the CTA's tokens; each k16 step adds the hi product then the lo product;
//   * K is cut into `ksplit` chunks chosen by the host from (N, K, batch) only, never from T; a chunk's
//     partial is one warp's MMA chain over its k16 steps in order, and gemm_reduce adds the chunk partials
//     in chunk order. The position of a token inside the tile does not matter: an MMA computes each output
//     element from its own row and column.
// Four tile shapes (Narrow, Medium, Wide, Tall; see below) with a
// cp.async ring of (W, x hi, x lo) tiles. Rows past N and tokens past T are zero-filled and never
// written. The token tiles of one weight tile are neighbours in the grid (blockIdx.x), so that when T
// spans several of them they run together and the weight tile comes from HBM once, then from L2.
#include "common.cuh"

namespace kdt {
namespace gemm {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;

// Element strides of an operand: between consecutive tokens (or weight rows) and between batch entries.
struct Operand {
    long long row;
    long long batch;
};

// A CTA's tile: TILE_N weight rows x TILE_T tokens, staged TILE_K values of k at a time in a ring of
// STAGES. The 8 warps split the rows into groups of WARP_ROWS (16 or 32: one or two m16 fragments) and
// the tokens into the remaining factor; every warp runs all k16 steps of the chunk for its (rows,
// tokens) in order. Two fragments per warp halve the shared-memory reads of x per mma, which is what
// limits a many-token tile.
template <int TILE_N_, int TILE_T_, int TILE_K_, int STAGES_, int WARP_ROWS_ = 16>
struct Shape {
    static constexpr int TILE_N = TILE_N_, TILE_T = TILE_T_, TILE_K = TILE_K_, STAGES = STAGES_;
    static constexpr int WARP_ROWS = WARP_ROWS_;
    static constexpr int LD = TILE_K + 8;  // 16 B of padding: the 8 rows of an ldmatrix fall in distinct banks
    static constexpr int PIECES = TILE_K / 8;  // 16-byte pieces per staged row
    static constexpr int ROW_GROUPS = TILE_N / WARP_ROWS;
    static constexpr int M_TILES = WARP_ROWS / 16;
    static constexpr int TOKEN_GROUPS = WARPS / ROW_GROUPS;
    static constexpr int WARP_TOKENS = TILE_T / TOKEN_GROUPS;
    static constexpr int N_TILES = WARP_TOKENS / 8;
    static_assert(ROW_GROUPS * TOKEN_GROUPS == WARPS && N_TILES % 2 == 0 && WARP_ROWS % 16 == 0, "warp grid");

    struct Stage {
        __nv_bfloat16 w[TILE_N][LD];
        __nv_bfloat16 hi[TILE_T][LD];
        __nv_bfloat16 lo[TILE_T][LD];
    };
};

// Narrow (16 tokens) for decodes, where the weight bytes are the cost: wide rows of k per stage and many
// bytes in flight. Medium (32 tokens, one stage less to fit 99 KB) for up to a few hundred tokens in
// several token tiles side by side. Wide (64 tokens, 32 rows per warp, k 32 in 4 stages) stages a weight
// tile once for two Medium tiles' tokens. Tall (128 tokens, 32 rows per warp) beyond, where each staged
// weight tile should feed more MMAs. (A 64 x 64 tile with k 32 was slower than Medium at 33-130 tokens on the
// H200 on 25 of 27 shapes x counts, and than Tall beyond: notes/2026-12-02-verify-gemm.md.) All run the
// same per-element operations in the same order, so the host may pick any of them for any T.
typedef Shape<128, 16, 64, 4> Narrow;
typedef Shape<128, 32, 64, 3> Medium;
typedef Shape<128, 64, 32, 4, 32> Wide;
typedef Shape<128, 128, 32, 3, 32> Tall;

// Stages the slice at `k0` of the CTA's weight rows and tokens. K, the row strides and the batch strides
// are multiples of 8 elements and chunks of TILE_K (the host checks), so a 16-byte piece is wholly in or
// out of range; pieces past N, T or the chunk's end read nothing (zero fill) from an in-range address.
template <class S>
__device__ __forceinline__ void load_stage(typename S::Stage& s, const __nv_bfloat16* w, const __nv_bfloat16* hi,
                                           const __nv_bfloat16* lo, Operand xs, int N, int T, int K, int k_end,
                                           int n0, int t0, int k0) {
    for (int i = threadIdx.x; i < S::TILE_N * S::PIECES; i += THREADS) {
        const int r = i / S::PIECES, c = (i % S::PIECES) * 8;
        const bool in = k0 + c < k_end && n0 + r < N;
        cp_async16(&s.w[r][c], w + (in ? (long long)(n0 + r) * K + k0 + c : 0), in ? 16 : 0);
    }
    for (int i = threadIdx.x; i < S::TILE_T * S::PIECES; i += THREADS) {
        const int r = i / S::PIECES, c = (i % S::PIECES) * 8;
        const bool in = k0 + c < k_end && t0 + r < T;
        const long long xo = in ? (long long)(t0 + r) * xs.row + k0 + c : 0;
        cp_async16(&s.hi[r][c], hi + xo, in ? 16 : 0);
        cp_async16(&s.lo[r][c], lo + xo, in ? 16 : 0);
    }
}

// One warp's WARP_ROWS rows x WARP_TOKENS over a staged slice: per k16 step the hi then the lo product.
template <class S>
__device__ __forceinline__ void compute_stage(const typename S::Stage& s, int row0, int tok0,
                                              float (&acc)[S::M_TILES][S::N_TILES][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < S::TILE_K; kk += 16) {
        uint32_t a[S::M_TILES][4];
#pragma unroll
        for (int m = 0; m < S::M_TILES; ++m)
            ldmatrix_x4(a[m], &s.w[row0 + m * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
        for (int j = 0; j < S::N_TILES; j += 2) {
            const int tok = tok0 + (j + (lane >> 4)) * 8 + (lane & 7);
            const int col = kk + ((lane >> 3) & 1) * 8;
            uint32_t bh[4], bl[4];
            ldmatrix_x4(bh, &s.hi[tok][col]);
            ldmatrix_x4(bl, &s.lo[tok][col]);
#pragma unroll
            for (int m = 0; m < S::M_TILES; ++m) {
                mma_bf16(acc[m][j], a[m], bh[0], bh[1]);
                mma_bf16(acc[m][j], a[m], bl[0], bl[1]);
                mma_bf16(acc[m][j + 1], a[m], bh[2], bh[3]);
                mma_bf16(acc[m][j + 1], a[m], bl[2], bl[3]);
            }
        }
    }
}

// Grid: (ceil(T / TILE_T), ceil(N / TILE_N), batch * ksplit). z = b * ksplit + chunk. With ksplit 1 the
// CTA writes y; otherwise it writes its chunk's partial to part[b][chunk][T][N] for gemm_reduce.
template <class S>
__device__ void gemm(const __nv_bfloat16* __restrict__ w, long long w_batch, const __nv_bfloat16* __restrict__ hi,
                     const __nv_bfloat16* __restrict__ lo, Operand xs, int N, int T, int K, int ksplit, int chunk,
                     float* __restrict__ y, Operand ys, float* __restrict__ part) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    typedef typename S::Stage Stage;
    Stage* stages = reinterpret_cast<Stage*>(smem_raw);
    const int b = blockIdx.z / ksplit, c = blockIdx.z % ksplit;
    const int n0 = blockIdx.y * S::TILE_N, t0 = blockIdx.x * S::TILE_T;
    const int k_begin = c * chunk, k_end = min(K, k_begin + chunk);
    w += b * w_batch;
    hi += b * xs.batch;
    lo += b * xs.batch;
    const int tiles = (k_end - k_begin + S::TILE_K - 1) / S::TILE_K;

#pragma unroll
    for (int s = 0; s < S::STAGES - 1; ++s) {
        if (s < tiles) load_stage<S>(stages[s], w, hi, lo, xs, N, T, K, k_end, n0, t0, k_begin + s * S::TILE_K);
        cp_async_commit();
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (warp % S::ROW_GROUPS) * S::WARP_ROWS, tok0 = (warp / S::ROW_GROUPS) * S::WARP_TOKENS;
    float acc[S::M_TILES][S::N_TILES][4] = {};
    for (int i = 0; i < tiles; ++i) {
        cp_async_wait<S::STAGES - 2>();
        __syncthreads();
        const int next = i + S::STAGES - 1;
        if (next < tiles)
            load_stage<S>(stages[next % S::STAGES], w, hi, lo, xs, N, T, K, k_end, n0, t0,
                          k_begin + next * S::TILE_K);
        cp_async_commit();
        compute_stage<S>(stages[i % S::STAGES], row0, tok0, acc);
    }
    cp_async_wait<0>();

    // Fragment (row g | g + 8, tokens 2q, 2q + 1) of each 16-row, 8-token tile.
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int m = 0; m < S::M_TILES; ++m)
#pragma unroll
        for (int j = 0; j < S::N_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = n0 + row0 + m * 16 + g + (e >> 1) * 8;
                const int t = t0 + tok0 + j * 8 + 2 * q + (e & 1);
                if (n >= N || t >= T) continue;
                if (ksplit == 1)
                    y[b * ys.batch + (long long)t * ys.row + n] = acc[m][j][e];
                else
                    part[((long long)(b * ksplit + c) * T + t) * N + n] = acc[m][j][e];
            }
}

}  // namespace gemm
}  // namespace kdt

#define KDT_GEMM_KERNEL(NAME, SHAPE)                                                                          \
    extern "C" __global__ void __launch_bounds__(kdt::gemm::THREADS)                                          \
        NAME(const __nv_bfloat16* __restrict__ w, long long w_batch, const __nv_bfloat16* __restrict__ hi,      \
             const __nv_bfloat16* __restrict__ lo, long long x_row, long long x_batch, int N, int T, int K,     \
             int ksplit, int chunk, float* __restrict__ y, long long y_row, long long y_batch,                  \
             float* __restrict__ part) {                                                                        \
        kdt::gemm::gemm<SHAPE>(w, w_batch, hi, lo, {x_row, x_batch}, N, T, K, ksplit, chunk, y, {y_row, y_batch}, \
                               part);                                                                           \
    }
KDT_GEMM_KERNEL(gemm_bf16_narrow, kdt::gemm::Narrow)
KDT_GEMM_KERNEL(gemm_bf16_medium, kdt::gemm::Medium)
KDT_GEMM_KERNEL(gemm_bf16_wide, kdt::gemm::Wide)
KDT_GEMM_KERNEL(gemm_bf16_tall, kdt::gemm::Tall)
#undef KDT_GEMM_KERNEL

// y[b][t][n] = Σ over chunks in order of part[b][chunk][t][n]. One thread per output element.
extern "C" __global__ void __launch_bounds__(256)
    gemm_reduce(const float* __restrict__ part, int batch, int ksplit, int T, int N, float* __restrict__ y,
                long long y_row, long long y_batch) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long per_batch = (long long)T * N;
    if (i >= per_batch * batch) return;
    const int b = (int)(i / per_batch);
    const long long tn = i % per_batch;
    const float* p = part + (long long)b * ksplit * per_batch + tn;
    float sum = p[0];
    for (int c = 1; c < ksplit; ++c) sum += p[c * per_batch];
    y[b * y_batch + (tn / N) * y_row + tn % N] = sum;
}

// hi = rn_bf16(x), lo = rn_bf16(x - hi) elementwise (x - hi is exact in f32).
extern "C" __global__ void __launch_bounds__(256)
    gemm_split_bf16(const float* __restrict__ x, long long n, __nv_bfloat16* __restrict__ hi,
                    __nv_bfloat16* __restrict__ lo) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i];
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    hi[i] = h;
    lo[i] = __float2bfloat16_rn(v - __bfloat162float(h));
}
