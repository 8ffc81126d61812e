// The per-row operations of the forward pass (src/cpu/rowops.rs states the contract): embedding gather,
// RMSNorm, SiLU·mul, the MLA query rows and cache rows, residual add, bf16 conversion, row gather and
// argmax. Every product and sum is a single rounded op (__fmul_rn / __fadd_rn, which nvcc never fuses
// into an FMA), so the results are the CPU's bits. Rows are independent: batch invariant by construction.
#include "common.cuh"

namespace kdt {
namespace rowops {

constexpr int WARP = 32;
constexpr int ROWS_PER_BLOCK = 4;  // one warp per row, four warps per block
constexpr int LATENT = 512;
constexpr int ROPE = 64;
constexpr int ROW = LATENT + ROPE;
constexpr int STATUS_BAD_INDEX = 1;
constexpr int NORM_THREADS = 1024;  // threads of an RMSNorm block (src/cuda/rowops.rs launches this many)
constexpr int COPY_THREADS = 512;   // threads of an embedding or gather block (one block per row)
constexpr int STAGE = 8;            // loads a thread keeps in flight in the row-wide kernels

// The contract's sum of squares: lane l takes elements e with (e / 4) % 32 == l, in increasing e; then
// the butterfly s = 16 .. 1, which leaves the same total in every lane (each pair adds the same two
// values).
__device__ __forceinline__ float sum_squares(const float* x, int d) {
    const int lane = threadIdx.x % WARP;
    float acc = 0.0f;
    for (int base = 4 * lane; base < d; base += 4 * WARP)
        for (int c = 0; c < 4 && base + c < d; ++c) acc = __fadd_rn(acc, __fmul_rn(x[base + c], x[base + c]));
    for (int s = WARP / 2; s > 0; s /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, s));
    return acc;
}

// sum_squares of a row in shared memory (16-byte aligned), in the same order: a lane's four values of
// each full stride of 128 come as one 16-byte load, SUM_BATCH strides of loads ahead of their additions
// (a load per addition would put the shared-memory latency into every step of the serial sum).
__device__ __forceinline__ float sum_squares_staged(const float* x, int d) {
    constexpr int SUM_BATCH = 8;
    const int lane = threadIdx.x % WARP, full = d / (4 * WARP);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float acc = 0.0f;
    const auto add4 = [&acc](float4 v) {
        acc = __fadd_rn(acc, __fmul_rn(v.x, v.x));
        acc = __fadd_rn(acc, __fmul_rn(v.y, v.y));
        acc = __fadd_rn(acc, __fmul_rn(v.z, v.z));
        acc = __fadd_rn(acc, __fmul_rn(v.w, v.w));
    };
    int k = 0;
    for (; k + SUM_BATCH <= full; k += SUM_BATCH) {
        float4 v[SUM_BATCH];
#pragma unroll
        for (int u = 0; u < SUM_BATCH; ++u) v[u] = x4[(k + u) * WARP + lane];
#pragma unroll
        for (int u = 0; u < SUM_BATCH; ++u) add4(v[u]);
    }
    for (; k < full; ++k) add4(x4[k * WARP + lane]);
    for (int base = 4 * (k * WARP + lane); base < d; base += 4 * WARP)
        for (int c = 0; c < 4 && base + c < d; ++c) acc = __fadd_rn(acc, __fmul_rn(x[base + c], x[base + c]));
    for (int s = WARP / 2; s > 0; s /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, s));
    return acc;
}

__device__ __forceinline__ float inv_rms(float sum, int d, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum, (float)d), eps)));
}

__device__ __forceinline__ float rms_inv(const float* x, int d, float eps) { return inv_rms(sum_squares(x, d), d, eps); }

// Rotated value `i` (0..63) of a 64-value rotary part with its table row (32 cos, then 32 sin).
__device__ __forceinline__ float rope_value(const float* x, const float* table, bool interleave, int i) {
    const int half = ROPE / 2, p = i % half;
    const float a = interleave ? x[2 * p] : x[p];
    const float b = interleave ? x[2 * p + 1] : x[p + half];
    const float c = table[p], s = table[half + p];
    return i < half ? __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)) : __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

__device__ __forceinline__ float sigmoid(float g) {
    if (g >= 0.0f) return __fdiv_rn(1.0f, __fadd_rn(1.0f, expd(-g)));
    const float e = expd(g);
    return __fdiv_rn(e, __fadd_rn(1.0f, e));
}

__device__ __forceinline__ int warp_row() { return blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP; }

}  // namespace rowops
}  // namespace kdt

namespace ro = kdt::rowops;

// y[t] = RMSNorm(x[t]) for rows of d values at row strides x_stride / y_stride. One block per row: the
// whole block stages the row in shared memory, each thread with STAGE independent loads in flight (one
// load at a time would wait a memory latency per element of the thread), then warp 0 sums the squares in
// the contract's lane order (a lane's elements one after another, as the contract's sequential sum
// requires) and the block writes the outputs the same way.
extern "C" __global__ void __launch_bounds__(ro::NORM_THREADS)
    rowops_rmsnorm(const float* __restrict__ x, int x_stride, const float* __restrict__ w, int d, float eps, int rows,
                   float* __restrict__ y, int y_stride) {
    extern __shared__ __align__(16) float staged[];
    __shared__ float inv;
    if ((int)blockIdx.x >= rows) return;
    const float* xr = x + (long long)blockIdx.x * x_stride;
    for (int base = threadIdx.x; base < d; base += ro::STAGE * ro::NORM_THREADS) {
        float v[ro::STAGE];
#pragma unroll
        for (int k = 0; k < ro::STAGE; ++k) {
            const int e = base + k * ro::NORM_THREADS;
            v[k] = e < d ? __ldg(xr + e) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < ro::STAGE; ++k)
            if (base + k * ro::NORM_THREADS < d) staged[base + k * ro::NORM_THREADS] = v[k];
    }
    __syncthreads();
    if (threadIdx.x < ro::WARP) {
        const float v = ro::inv_rms(ro::sum_squares_staged(staged, d), d, eps);
        if (threadIdx.x == 0) inv = v;
    }
    __syncthreads();
    float* yr = y + (long long)blockIdx.x * y_stride;
    for (int base = threadIdx.x; base < d; base += ro::STAGE * ro::NORM_THREADS) {
        float g[ro::STAGE];
#pragma unroll
        for (int k = 0; k < ro::STAGE; ++k) {
            const int e = base + k * ro::NORM_THREADS;
            g[k] = e < d ? __ldg(w + e) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < ro::STAGE; ++k) {
            const int e = base + k * ro::NORM_THREADS;
            if (e < d) yr[e] = __fmul_rn(g[k], __fmul_rn(staged[e], inv));
        }
    }
}

// out[t][j] = SiLU(gu[t][j]) * gu[t][inter + j].
extern "C" __global__ void __launch_bounds__(256) rowops_silu_mul(const float* __restrict__ gu, int inter, long long n, float* __restrict__ out) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / inter, j = i % inter;
        const float g = gu[t * 2 * inter + j], u = gu[t * 2 * inter + inter + j];
        out[i] = __fmul_rn(__fmul_rn(g, ro::sigmoid(g)), u);
    }
}

// out [rows = T * heads, 576] bf16: the latent query, then the rotated rotary part of q [T, heads, nope + 64].
extern "C" __global__ void __launch_bounds__(ro::WARP* ro::ROWS_PER_BLOCK)
    rowops_q_rows(const float* __restrict__ q_latent, const float* __restrict__ q, int heads, int nope,
                  const float* __restrict__ table, int interleave, int rows, __nv_bfloat16* __restrict__ out) {
    const int r = ro::warp_row(), lane = threadIdx.x % ro::WARP;
    if (r >= rows) return;
    const float* lat = q_latent + (long long)r * ro::LATENT;
    __nv_bfloat16* o = out + (long long)r * ro::ROW;
#pragma unroll
    for (int e = lane; e < ro::LATENT; e += ro::WARP) o[e] = __float2bfloat16_rn(lat[e]);
    const float* pe = q + (long long)r * (nope + ro::ROPE) + nope;
    const float* tab = table + (long long)(r / heads) * ro::ROPE;
#pragma unroll
    for (int i = lane; i < ro::ROPE; i += ro::WARP) o[ro::LATENT + i] = __float2bfloat16_rn(ro::rope_value(pe, tab, interleave, i));
}

// Cache row slot[t] of cache [cache_rows, 576] = bf16(RMSNorm(kv[t][..512]) | rotated kv[t][512..]). A slot
// outside the cache is skipped and sets status bit 1.
extern "C" __global__ void __launch_bounds__(ro::WARP* ro::ROWS_PER_BLOCK)
    rowops_kv_rows(const float* __restrict__ kv, const float* __restrict__ norm_w, float eps,
                   const float* __restrict__ table, int interleave, const int* __restrict__ slot, int rows,
                   __nv_bfloat16* __restrict__ cache, long long cache_rows, int* status) {
    const int t = ro::warp_row(), lane = threadIdx.x % ro::WARP;
    if (t >= rows) return;
    const int s = slot[t];
    if (s < 0 || s >= cache_rows) {
        if (lane == 0) atomicOr(status, ro::STATUS_BAD_INDEX);
        return;
    }
    const float* src = kv + (long long)t * ro::ROW;
    const float inv = ro::rms_inv(src, ro::LATENT, eps);
    __nv_bfloat16* dst = cache + (long long)s * ro::ROW;
#pragma unroll
    for (int e = lane; e < ro::LATENT; e += ro::WARP) dst[e] = __float2bfloat16_rn(__fmul_rn(norm_w[e], __fmul_rn(src[e], inv)));
    const float* tab = table + (long long)t * ro::ROPE;
#pragma unroll
    for (int i = lane; i < ro::ROPE; i += ro::WARP)
        dst[ro::LATENT + i] = __float2bfloat16_rn(ro::rope_value(src + ro::LATENT, tab, interleave, i));
}

// out[t] = table[ids[t]] widened to f32; an id outside the vocabulary gives a zero row and status bit 1.
extern "C" __global__ void __launch_bounds__(ro::COPY_THREADS)
    rowops_embed(const __nv_bfloat16* __restrict__ table, int hidden, int vocab, const int* __restrict__ ids,
                 float* __restrict__ out, int* status) {
    const int t = blockIdx.x, id = ids[t];
    const bool ok = id >= 0 && id < vocab;
    if (!ok && threadIdx.x == 0) atomicOr(status, ro::STATUS_BAD_INDEX);
    const __nv_bfloat16* src = table + (long long)(ok ? id : 0) * hidden;
#pragma unroll ro::STAGE
    for (int e = threadIdx.x; e < hidden; e += blockDim.x)
        out[(long long)t * hidden + e] = ok ? __bfloat162float(src[e]) : 0.0f;
}

// x += y.
extern "C" __global__ void __launch_bounds__(256) rowops_add(float* __restrict__ x, const float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = __fadd_rn(x[i], y[i]);
}

// out = bf16(x), round to nearest even.
extern "C" __global__ void __launch_bounds__(256) rowops_to_bf16(const float* __restrict__ x, long long n, __nv_bfloat16* __restrict__ out) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(x[i]);
}

// out[r] = x[idx[r]] for rows of d values; an index outside 0..rows gives a zero row and status bit 1.
extern "C" __global__ void __launch_bounds__(ro::COPY_THREADS)
    rowops_gather(const float* __restrict__ x, int d, int rows, const int* __restrict__ idx, float* __restrict__ out,
                  int* status) {
    const int r = blockIdx.x, i = idx[r];
    const bool ok = i >= 0 && i < rows;
    if (!ok && threadIdx.x == 0) atomicOr(status, ro::STATUS_BAD_INDEX);
    const float* src = x + (long long)(ok ? i : 0) * d;
#pragma unroll ro::STAGE
    for (int e = threadIdx.x; e < d; e += blockDim.x) out[(long long)r * d + e] = ok ? src[e] : 0.0f;
}

// The argmax of row r of x [rows, vocab] as the largest composite key (order key, NaN above +inf, -0 read
// as +0; then the inverted index, so the lowest index wins among equals): block (c, r) reduces chunk c of
// the row and folds its best key into keys[r] with atomicMax, which is order independent. keys must
// start at 0; rowops_argmax_finish turns them into indices and sets them back to 0.
extern "C" __global__ void __launch_bounds__(256) rowops_argmax_chunk(const float* x, int vocab, int chunk, kdt::u64* keys) {
    using Reduce = cub::BlockReduce<kdt::u64, 256>;
    __shared__ typename Reduce::TempStorage tmp;
    const float* row = x + (long long)blockIdx.y * vocab;
    const int start = blockIdx.x * chunk, end = min(vocab, start + chunk);
    kdt::u64 best = 0;
    for (int i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float v = row[i];
        const uint32_t key = isnan(v) ? 0xFFFFFFFFu : kdt::order_key(v);
        const kdt::u64 k = kdt::composite_key(key, (uint32_t)i);
        best = k > best ? k : best;
    }
    const kdt::u64 top = Reduce(tmp).Reduce(best, [](kdt::u64 a, kdt::u64 b) { return a > b ? a : b; });
    if (threadIdx.x == 0) atomicMax(keys + blockIdx.y, top);
}

extern "C" __global__ void __launch_bounds__(256) rowops_argmax_finish(kdt::u64* keys, int rows, int* out) {
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
        out[r] = (int)~(uint32_t)(keys[r] & 0xFFFFFFFFu);
        keys[r] = 0;
    }
}
