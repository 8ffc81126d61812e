// Read-bandwidth microbenchmark: does the access pattern of the MoE GEMMs (kernels/moe_int4.cu, tiled
// layout) cap DRAM throughput? Each warp streams two 16-row tiles' 1 KB chunk pieces plus 128 B of scales
// through a 4-stage cp.async ring in shared memory, 8 warps a block and two blocks an SM, as the GEMMs do,
// with an optional chain of FMAs per piece standing in for the math. Compared with cudaMemcpy (read +
// write) and a plain coalesced read. Standalone, for the GPU machine
// (notes/benchmarks-history-2026-11.md, session 12):
//   nvcc -arch=sm_90 -O3 -std=c++17 read_pattern.cu -o read_pattern && ./read_pattern
#include <cstdint>

#include "../../kernels/common.cuh"  // the copy wrappers every kernel uses
#include "microbench.cuh"

using kdt::cp_async16;
using kdt::cp_async_commit;
using kdt::cp_async_wait;

// The kernels keep a checksum of what they read and store it only on an unlikely value, so that the
// reads cannot be optimized away and nothing is written.
__global__ void plain_read(const uint4* p, size_t n, uint32_t* out) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678) out[0] = acc;
}

constexpr int PIECE = 1024, TILE = 56 * PIECE, STAGES = 4, KS = 4, PER_WARP = 14;
// Each warp streams 2 m-tiles (gate half / up half of the buffer), 14 pieces each, plus 128 B of scales a piece.
// mode 0: warp ks reads pieces ks*14 .. ks*14+13 of its tile; mode 1: pieces ks, ks+4, ...
template <int MODE>
__global__ void __launch_bounds__(256, 2) stream_read(const uint8_t* w, const uint8_t* sc, size_t half, size_t shalf, int work, uint32_t* out) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, rg = warp / KS, ks = warp % KS;
    uint8_t* ring = smem + warp * STAGES * 2 * 1152;
    const size_t tile = (size_t)blockIdx.x * 2 + rg;
    auto piece_of = [&](int p) { return MODE == 0 ? ks * PER_WARP + p : p * KS + ks; };
    auto issue = [&](int p, int st) {
        if (p < PER_WARP) {
            const int q = piece_of(p);
            for (int m = 0; m < 2; ++m) {
                const uint8_t* src = w + m * half + tile * TILE + (size_t)q * PIECE;
                uint8_t* dst = ring + (st * 2 + m) * 1152;
                cp_async16(dst + lane * 16, src + lane * 16, 16);
                cp_async16(dst + 512 + lane * 16, src + 512 + lane * 16, 16);
                if (lane < 8) cp_async16(dst + 1024 + lane * 16, sc + m * shalf + (tile * 56 + q) * 128 + lane * 16, 16);
            }
        }
        cp_async_commit();
    };
    for (int s = 0; s < STAGES; ++s) issue(s, s);
    uint32_t acc = 0; float f0 = lane, f1 = 1.0f, f2 = 2.0f, f3 = 3.0f;
    for (int p = 0; p < PER_WARP; ++p) {
        cp_async_wait<STAGES - 1>(); __syncwarp();
        const int st = p % STAGES;
        for (int m = 0; m < 2; ++m) {
            uint4 v = *reinterpret_cast<uint4*>(ring + (st * 2 + m) * 1152 + lane * 16);
            uint4 u = *reinterpret_cast<uint4*>(ring + (st * 2 + m) * 1152 + 512 + lane * 16);
            acc ^= v.x ^ v.y ^ u.z ^ u.w;
        }
        for (int i = 0; i < work; ++i) { f0 = fmaf(f0, 1.0001f, 0.5f); f1 = fmaf(f1, 1.0001f, 0.5f); f2 = fmaf(f2, 1.0001f, 0.5f); f3 = fmaf(f3, 1.0001f, 0.5f); }
        __syncwarp();
        issue(p + STAGES, st);
    }
    cp_async_wait<0>();
    if (acc == 0x12345678 || f0 + f1 + f2 + f3 == 0.0f) out[0] = acc;
}

int main() {
    const size_t half = (size_t)1 << 30;  // 1 GiB gate half + 1 GiB up half
    const size_t tiles = half / TILE, blocks = tiles / 2;
    const size_t shalf = tiles * 56 * 128;
    uint8_t *w, *sc, *dst; uint32_t* out;
    CK(cudaMalloc(&w, 2 * half)); CK(cudaMalloc(&sc, 2 * shalf)); CK(cudaMalloc(&dst, 2 * half)); CK(cudaMalloc(&out, 4));
    CK(cudaMemset(w, 1, 2 * half)); CK(cudaMemset(sc, 1, 2 * shalf));
    const int smem = 100 * 1024;
    CK(cudaFuncSetAttribute(stream_read<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(stream_read<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    auto time = [&](const char* name, double bytes, auto f) {
        const float ms = time_ms(f);
        printf("%-40s %8.1f us  %7.0f GB/s\n", name, ms * 1000, bytes / (ms * 1e-3) / 1e9);
    };
    time("memcpy d2d 2 GiB (read+write)", 4.0 * half, [&] { CK(cudaMemcpyAsync(dst, w, 2 * half, cudaMemcpyDeviceToDevice)); });
    time("plain read 2 GiB", 2.0 * half, [&] { plain_read<<<132 * 8, 256>>>((const uint4*)w, 2 * half / 16, out); });
    const double sbytes = 2.0 * tiles * TILE + 2.0 * shalf;
    for (int work : {0, 32, 96}) {
        char n0[64], n1[64];
        snprintf(n0, 64, "stream kslice-contiguous work %d", work); snprintf(n1, 64, "stream kslice-interleaved work %d", work);
        time(n0, sbytes, [&] { stream_read<0><<<blocks, 256, smem>>>(w, sc, half, shalf, work, out); });
        time(n1, sbytes, [&] { stream_read<1><<<blocks, 256, smem>>>(w, sc, half, shalf, work, out); });
    }
    return 0;
}
