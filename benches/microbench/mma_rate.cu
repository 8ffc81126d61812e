// Tensor-core rate microbenchmark: how many bf16 FLOP/s does mma.sync m16n8k16 (f32 accumulate) reach on
// this GPU, the instruction every kernel here uses (no wgmma, so that sm_120 runs them too)? The MLA
// roofline (benches/mla.rs) divides FLOPs by a cuBLAS GEMM's rate, which on sm_90 uses wgmma; this gives
// the ceiling a kernel built on mma.sync can reach instead. Each warp runs CHAINS independent accumulator
// chains over operands held in registers (no memory traffic), 1 to 4 blocks of 8 warps per SM. Standalone,
// for the GPU machine (notes/benchmarks-history-2026-11.md, session 14):
//   nvcc -arch=sm_90 -O3 -std=c++17 mma_rate.cu -o mma_rate && ./mma_rate   (from benches/microbench)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "../../kernels/common.cuh"  // kdt::mma_bf16, the wrapper every kernel uses
#include "microbench.cuh"

// The operands come from the thread index, so nothing is constant-folded; the accumulators are stored
// only on an unlikely value, so the mmas cannot be removed and nothing is written.
template <int CHAINS>
__global__ void __launch_bounds__(256) mma_loop(int iters, float* out) {
    const uint32_t seed = threadIdx.x * 0x9E3779B9u;
    const uint32_t a[4] = {seed & 0x3F803F80u, (seed >> 1) & 0x3F803F80u, (seed >> 2) & 0x3F803F80u,
                           (seed >> 3) & 0x3F803F80u};
    const uint32_t b0 = (seed >> 4) & 0x3F803F80u, b1 = (seed >> 5) & 0x3F803F80u;
    float acc[CHAINS][4] = {};
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) kdt::mma_bf16(acc[c], a, b0, b1);
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    if (sum == 1234.5f) out[0] = sum;
}

template <int CHAINS>
void run(int sms, int blocks_per_sm, float* out) {
    const int iters = 4096;
    const int blocks = sms * blocks_per_sm;
    mma_loop<CHAINS><<<blocks, 256>>>(iters, out);  // warm-up (clocks)
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    cudaEvent_t t0, t1;
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    const int reps = 5;
    CK(cudaEventRecord(t0));
    for (int r = 0; r < reps; ++r) mma_loop<CHAINS><<<blocks, 256>>>(iters, out);
    CK(cudaGetLastError());
    CK(cudaEventRecord(t1));
    CK(cudaEventSynchronize(t1));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, t0, t1));
    const double flops = 2.0 * 16 * 8 * 16 * CHAINS * (double)iters * (blocks * 8.0) * reps;
    printf("chains %d, blocks/SM %d: %.1f TFLOP/s\n", CHAINS, blocks_per_sm, flops / (ms * 1e-3) / 1e12);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    float* out;
    CK(cudaMalloc(&out, sizeof(float)));
    for (int bps = 1; bps <= 4; bps *= 2) {
        run<4>(prop.multiProcessorCount, bps, out);
        run<8>(prop.multiProcessorCount, bps, out);
    }
    CK(cudaFree(out));
    return 0;
}
