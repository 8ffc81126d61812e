// Streaming microbenchmark of the MLA chunk kernel's memory pipeline (kernels/mla.cu): what read
// bandwidth does its structure allow, apart from its arithmetic? Each CTA of 256 threads takes one chunk
// of 256 cache rows (576 bf16 each) of a paged cache (page 64, pages in random order), builds the chunk's
// row offsets from the block table, and streams the rows through a cp.async ring of STAGES sub-tiles of
// BK rows, with three barriers per sub-tile as the kernel has. A spin of `delay` SM cycles per sub-tile,
// split over the three phases, stands in for the S / softmax / P.V chain. Shared memory is padded to the
// kernel's 86720 bytes (two CTAs an SM) unless a row says otherwise. Compared with cudaMemcpy (read +
// write) of the same run. Standalone, for the GPU machine (BENCHMARKS.md, session 17):
//   nvcc -arch=sm_90 -O3 -std=c++17 mla_stream.cu -o mla_stream && ./mla_stream
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>

#include "microbench.cuh"

constexpr int ROW_BYTES = 576 * 2, SPLIT = 256, PAGE = 64, THREADS = 256;

__device__ __forceinline__ void cp16(void* s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"((uint32_t)__cvta_generic_to_shared(s)), "l"(g));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}

// grid (chunks per request, requests); the checksum is stored only on an unlikely value, so the reads
// stay and nothing is written.
template <int STAGES, int BK>
__global__ void __launch_bounds__(THREADS) stream_chunks(const uint8_t* cache, const int* table, int pages_per_req,
                                                         int delay, uint32_t* out) {
    extern __shared__ __align__(16) uint8_t smem[];
    long long* key_off = reinterpret_cast<long long*>(smem + STAGES * BK * ROW_BYTES);
    const int* pages = table + (size_t)blockIdx.y * pages_per_req;
    for (int i = threadIdx.x; i < SPLIT; i += THREADS) {
        const int slot = blockIdx.x * SPLIT + i;
        key_off[i] = ((long long)pages[slot / PAGE] * PAGE + slot % PAGE) * ROW_BYTES;
    }
    __syncthreads();
    constexpr int LOAD_THREADS = THREADS / BK, PIECES = ROW_BYTES / 16;
    const int k = threadIdx.x / LOAD_THREADS, first = threadIdx.x % LOAD_THREADS;
    auto issue = [&](int sub, int stage) {
        if (sub < SPLIT / BK) {
            const uint8_t* src = cache + key_off[sub * BK + k];
            uint8_t* dst = smem + (stage * BK + k) * ROW_BYTES;
            for (int p = first; p < PIECES; p += LOAD_THREADS) cp16(dst + 16 * p, src + 16 * p);
        }
        commit();
    };
    for (int s = 0; s < STAGES - 1; ++s) issue(s, s);
    uint32_t acc = 0;
    for (int sub = 0; sub < SPLIT / BK; ++sub) {
        wait<STAGES - 2>();
        __syncthreads();
        issue(sub + STAGES - 1, (sub + STAGES - 1) % STAGES);
        const uint32_t* tile = reinterpret_cast<const uint32_t*>(smem + (sub % STAGES) * BK * ROW_BYTES);
        acc ^= tile[threadIdx.x];
        spin(delay / 3);
        __syncthreads();
        acc ^= tile[THREADS + threadIdx.x];
        spin(delay / 3);
        __syncthreads();
        spin(delay / 3);
    }
    wait<0>();
    if (acc == 0x12345678u) out[0] = acc;
}

// `min_smem`: shared memory per CTA at least this (the kernel's 86720 bytes give two CTAs an H200 SM).
template <int STAGES, int BK>
float time_chunks(const uint8_t* cache, const int* table, int reqs, int chunks, int pages_per_req, int delay,
                  size_t min_smem, uint32_t* out, int* ctas_per_sm) {
    const size_t smem = std::max((size_t)STAGES * BK * ROW_BYTES + SPLIT * 8, min_smem);
    auto kernel = stream_chunks<STAGES, BK>;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, THREADS, smem));
    dim3 grid(chunks, reqs);
    kernel<<<grid, THREADS, smem>>>(cache, table, pages_per_req, delay, out);
    CK(cudaGetLastError());
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const int reps = 20;
    CK(cudaEventRecord(a));
    for (int r = 0; r < reps; ++r) kernel<<<grid, THREADS, smem>>>(cache, table, pages_per_req, delay, out);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms / reps;
}

int main() {
    // The largest shape (bs 64 x 16384 rows) sets the cache size: 1.2 GB, far beyond L2.
    const int max_reqs = 64, max_len = 16384, pages_per_req = max_len / PAGE, pages = max_reqs * pages_per_req;
    const size_t bytes = (size_t)pages * PAGE * ROW_BYTES;
    uint8_t* cache;
    int* table;
    uint32_t* out;
    CK(cudaMalloc(&cache, bytes));
    CK(cudaMemset(cache, 1, bytes));
    CK(cudaMalloc(&table, pages * sizeof(int)));
    CK(cudaMalloc(&out, 4));
    std::vector<int> perm(pages);
    for (int i = 0; i < pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
    CK(cudaMemcpy(table, perm.data(), pages * sizeof(int), cudaMemcpyHostToDevice));

    const size_t copy_bytes = 1ull << 30;
    uint8_t *src, *dst;
    CK(cudaMalloc(&src, copy_bytes));
    CK(cudaMalloc(&dst, copy_bytes));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaMemcpy(dst, src, copy_bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(a));
    for (int r = 0; r < 10; ++r) CK(cudaMemcpy(dst, src, copy_bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float copy_ms;
    CK(cudaEventElapsedTime(&copy_ms, a, b));
    const double copy_gbs = 2.0 * copy_bytes * 10 / (copy_ms * 1e-3) / 1e9;
    printf("cudaMemcpy D2D: %.0f GB/s (read + write)\n", copy_gbs);

    struct Shape { int reqs, len; };
    const Shape shapes[] = {{1, 65536 / 4}, {8, 16384}, {32, 4096}, {64, 1024}, {64, 16384}};
    const int delays[] = {0, 1500, 3000, 4500};
    printf("| ring | CTAs/SM | bs x rows | CTAs | delay (cycles) | GB/s | %% of copy |\n|---|---:|---|---:|---:|---:|---:|\n");
    for (const Shape& s : shapes) {
        // bs 1 x 65536 is modelled as 4 requests of 16384 rows: the same 256 chunks in one launch.
        const int reqs = s.reqs == 1 ? 4 : s.reqs, chunks = s.len / SPLIT;
        const double read = (double)reqs * s.len * ROW_BYTES;
        for (int delay : delays) {
            int occ;
            auto row = [&](const char* ring, float ms) {
                const double gbs = read / (ms * 1e-3) / 1e9;
                printf("| %s | %d | %d x %d | %d | %d | %.0f | %.0f%% |\n", ring, occ, s.reqs,
                       s.reqs == 1 ? 65536 : s.len, reqs * chunks, delay, gbs, 100 * gbs / copy_gbs);
            };
            const size_t kernel_smem = 86720;
            row("2 x 32 rows", time_chunks<2, 32>(cache, table, reqs, chunks, pages_per_req, delay, kernel_smem, out, &occ));
            row("2 x 32 rows, unpadded", time_chunks<2, 32>(cache, table, reqs, chunks, pages_per_req, delay, 0, out, &occ));
            row("3 x 32 rows", time_chunks<3, 32>(cache, table, reqs, chunks, pages_per_req, delay, 0, out, &occ));
            row("4 x 16 rows", time_chunks<4, 16>(cache, table, reqs, chunks, pages_per_req, delay, kernel_smem, out, &occ));
        }
    }
    return 0;
}
