// Streaming microbenchmark of the MLA chunk kernel's memory pipeline (kernels/mla.cu): what read
// bandwidth does its structure allow, apart from its arithmetic? Each CTA of 256 threads takes one chunk
// of 256 cache rows (576 bf16 each) of a paged cache (page 64, pages in random order), builds the chunk's
// row offsets from the block table, and streams the rows through a cp.async ring of STAGES sub-tiles of
// BK rows, with three barriers per sub-tile as the kernel has. A spin of `delay` SM cycles per sub-tile,
// split over the three phases, stands in for the S / softmax / P.V chain. Shared memory is padded to the
// kernel's 88768 bytes (two CTAs an SM; 86720 before session 29, also two) unless a row says otherwise.
// Compared with cudaMemcpy (read + write) of the same run. A second table lets `sharers` neighbouring
// CTAs read the same chunk, as the m-tiles of a tree prefix (33 at N 65, H 8) or of an H 64 decode (4)
// do: one of them brings the rows from DRAM, the others find them in L2, so it measures what the L2
// feeds the SMs in this pattern.
// Standalone, for the GPU machine (notes/benchmarks-history-2026-11.md, sessions 17 and 21):
//   nvcc -arch=sm_90 -O3 -std=c++17 mla_stream.cu -o mla_stream && ./mla_stream [private|shared]
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <cstring>

#include "../../kernels/common.cuh"  // the copy wrappers every kernel uses
#include "microbench.cuh"

constexpr int ROW_BYTES = 576 * 2, SPLIT = 256, PAGE = 64, THREADS = 256;

using kdt::cp_async16;
using kdt::cp_async_commit;
using kdt::cp_async_wait;

__device__ __forceinline__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}

// grid (chunks per request x sharers, requests): CTA x reads chunk x / sharers; the checksum is stored
// only on an unlikely value, so the reads stay and nothing is written.
template <int STAGES, int BK>
__global__ void __launch_bounds__(THREADS) stream_chunks(const uint8_t* cache, const int* table, int pages_per_req,
                                                         int sharers, int delay, uint32_t* out) {
    extern __shared__ __align__(16) uint8_t smem[];
    long long* key_off = reinterpret_cast<long long*>(smem + STAGES * BK * ROW_BYTES);
    const int* pages = table + (size_t)blockIdx.y * pages_per_req;
    for (int i = threadIdx.x; i < SPLIT; i += THREADS) {
        const int slot = blockIdx.x / sharers * SPLIT + i;
        key_off[i] = ((long long)pages[slot / PAGE] * PAGE + slot % PAGE) * ROW_BYTES;
    }
    __syncthreads();
    constexpr int LOAD_THREADS = THREADS / BK, PIECES = ROW_BYTES / 16;
    const int k = threadIdx.x / LOAD_THREADS, first = threadIdx.x % LOAD_THREADS;
    auto issue = [&](int sub, int stage) {
        if (sub < SPLIT / BK) {
            const uint8_t* src = cache + key_off[sub * BK + k];
            uint8_t* dst = smem + (stage * BK + k) * ROW_BYTES;
            for (int p = first; p < PIECES; p += LOAD_THREADS) cp_async16(dst + 16 * p, src + 16 * p, 16);
        }
        cp_async_commit();
    };
    for (int s = 0; s < STAGES - 1; ++s) issue(s, s);
    uint32_t acc = 0;
    for (int sub = 0; sub < SPLIT / BK; ++sub) {
        cp_async_wait<STAGES - 2>();
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
    cp_async_wait<0>();
    if (acc == 0x12345678u) out[0] = acc;
}

// `min_smem`: shared memory per CTA at least this (the kernel's 88768 bytes give two CTAs an H200 SM).
template <int STAGES, int BK>
float time_chunks(const uint8_t* cache, const int* table, int reqs, int chunks, int sharers, int pages_per_req,
                  int delay, size_t min_smem, uint32_t* out, int* ctas_per_sm) {
    const size_t smem = std::max((size_t)STAGES * BK * ROW_BYTES + SPLIT * 8, min_smem);
    auto kernel = stream_chunks<STAGES, BK>;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, THREADS, smem));
    const dim3 grid(chunks * sharers, reqs);
    return time_ms([&] { kernel<<<grid, THREADS, smem>>>(cache, table, pages_per_req, sharers, delay, out); }, 20);
}

struct Shape {
    int reqs, len;
};
constexpr size_t KERNEL_SMEM = 88768;

// Each CTA reads a chunk of its own (the decode's pattern) through the four rings.
void private_chunks(const uint8_t* cache, const int* table, int pages_per_req, double copy_gbs, uint32_t* out) {
    const Shape shapes[] = {{1, 65536 / 4}, {8, 16384}, {32, 4096}, {64, 1024}, {64, 16384}};
    const int delays[] = {0, 1500, 3000, 4500};
    printf("| ring | CTAs/SM | bs x rows | CTAs | delay (cycles) | GB/s | %% of copy |\n"
           "|---|---:|---|---:|---:|---:|---:|\n");
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
            // One CTA per chunk (sharers 1).
            row("2 x 32 rows",
                time_chunks<2, 32>(cache, table, reqs, chunks, 1, pages_per_req, delay, KERNEL_SMEM, out, &occ));
            row("2 x 32 rows, unpadded",
                time_chunks<2, 32>(cache, table, reqs, chunks, 1, pages_per_req, delay, 0, out, &occ));
            row("3 x 32 rows", time_chunks<3, 32>(cache, table, reqs, chunks, 1, pages_per_req, delay, 0, out, &occ));
            row("4 x 16 rows",
                time_chunks<4, 16>(cache, table, reqs, chunks, 1, pages_per_req, delay, KERNEL_SMEM, out, &occ));
        }
    }
}

// `sharers` neighbouring CTAs read each chunk through the kernel's ring: the bytes the SMs receive
// (every CTA's chunk) against the bytes of the distinct chunks, which DRAM supplies.
void shared_chunks(const uint8_t* cache, const int* table, int pages_per_req, double copy_gbs, uint32_t* out) {
    struct Case {
        const char* like;
        Shape shape;
        int sharers;
    };
    const Case cases[] = {{"tree prefix N 65 H 8 bs 1", {1, 4096}, 33},  {"tree prefix N 65 H 8 bs 8", {8, 4096}, 33},
                          {"decode H 64 bs 8 p4096", {8, 4096}, 4},      {"decode H 64 bs 64 p16384", {64, 16384}, 4},
                          {"decode H 32 bs 64 p16384", {64, 16384}, 2}, {"decode H 8 bs 64 p16384", {64, 16384}, 1}};
    const int delays[] = {0, 1500, 2200, 3000};
    printf("\n| pattern | sharers | CTAs | delay (cycles) | GB/s to the SMs | distinct GB/s | %% of copy (distinct) |\n"
           "|---|---:|---:|---:|---:|---:|---:|\n");
    for (const Case& c : cases) {
        const int chunks = c.shape.len / SPLIT;
        const double distinct = (double)c.shape.reqs * c.shape.len * ROW_BYTES;
        for (int delay : delays) {
            int occ;
            const float ms = time_chunks<2, 32>(cache, table, c.shape.reqs, chunks, c.sharers, pages_per_req, delay,
                                                KERNEL_SMEM, out, &occ);
            const double gbs = distinct / (ms * 1e-3) / 1e9;
            printf("| %s | %d | %d | %d | %.0f | %.0f | %.0f%% |\n", c.like, c.sharers,
                   c.shape.reqs * chunks * c.sharers, delay, gbs * c.sharers, gbs, 100 * gbs / copy_gbs);
        }
    }
}

int main(int argc, char** argv) {
    const char* only = argc > 1 ? argv[1] : "";
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
    const float copy_ms = time_ms([&] { CK(cudaMemcpy(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); });
    const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
    printf("cudaMemcpy D2D: %.0f GB/s (read + write)\n", copy_gbs);
    if (strcmp(only, "shared") != 0) private_chunks(cache, table, pages_per_req, copy_gbs, out);
    if (strcmp(only, "private") != 0) shared_chunks(cache, table, pages_per_req, copy_gbs, out);
    return 0;
}
