// Read-bandwidth microbenchmark of the narrow gate/up GEMM's copies (kernels/moe_int4.cu, one token, Kimi-K2
// shapes) in both INT4 layouts: how fast do the two layouts' access patterns stream without the math? Each
// block is one row group of 4 K-slice warps (16 gate rows and 16 up rows), 4 blocks an SM; each warp walks
// its 14 chunks of 128 inputs through a 3-stage cp.async ring of both tiles' weights and scales plus the
// token's 256 activation bytes, and runs `work` rounds of 4 independent FMAs per chunk in place of the
// dequantization and MMAs. Patterns:
//   native:        16 rows x 64 B per tile and chunk at the checkpoint's row stride, 8 B of scales per row
//                  (NativeLayout); the K slices take interleaved chunks (warp k: chunks k, k + 4, ...)
//   native-slices: the same copies, each K slice a contiguous run of 14 chunks
//   native-pf128 / native-pf256: native with the copies' L2 prefetch size (cp.async .L2::128B / 256B) on
//                  the weights and .L2::128B on the scales, so that L2 fetches a row's next pieces, which the
//                  other K slices read next, in the same DRAM access
//   native-ks8:    native with 8 K-slice warps a block (7 chunks each, 2 blocks an SM): 512 bytes of a row
//                  per round of the block instead of 256
//   tiled:         one 1152-byte chunk image per tile (TiledLayout), interleaved K slices
//   native-pairs:  native-pf128's copies in stages of two neighbouring chunks (narrow_gate_up_pairs)
// (All without the L2 evict-first hint that TiledLayout's copies carry.)
// Each pattern runs over 128 experts (16384 blocks: the start and end of the grid weigh little) and, for
// tiled, native-pf128 and native-pairs, over 8 (1024 blocks in 1.94 waves of 528, as a one-token forward's
// gate/up GEMM; each launch takes the next 8 of the 128, so that none finds its experts in L2).
// Last, the real one-token gate/up kernels (kernels/moe_int4.cu moe_gate_up_direct_*, launched plainly,
// without the down GEMM after them) on the same 8-expert grid and bytes, so that the difference from the
// copies-only rows is what their dequantization, MMAs and epilogue cost there; and their chunk loops alone
// (BlockShape::pass, the partials left in shared memory: no reduction, SiLU, h stores or release).
// GB/s counts packed weights and scales. Standalone, for the GPU machine
// (notes/benchmarks-history-2026-11.md, sessions 20-21):
//   nvcc -arch=sm_90 -O3 -std=c++17 moe_stream.cu -o moe_stream && ./moe_stream
#include <cstdint>

#include "../../kernels/moe_int4.cu"  // the real one-token gate/up kernels, and the copy wrappers
#include "microbench.cuh"

constexpr int H = 7168, I = 2048, ROWS = 2 * I, GROUPS = H / 32, CHUNKS = GROUPS / 4;
constexpr int STAGES = 3;
constexpr size_t ROW_PIECES = H / 32;  // 16-byte pieces of packed weights per row (one per group)
constexpr size_t EXPERT_PIECES = (size_t)ROWS * ROW_PIECES, EXPERT_SCALES = (size_t)ROWS * GROUPS;
constexpr int EXPERTS = 128;     // 2.1 GB: far past L2
constexpr int SMEM = 56 * 1024;  // the real kernel's 14 KB a warp: 4 blocks an SM
enum Pattern { NATIVE, NATIVE_SLICES, NATIVE_PF128, NATIVE_PF256, NATIVE_KS8, TILED };

using kdt::cp_async16;  // the kernels' copy wrappers (kernels/common.cuh)
using kdt::cp_async_commit;
using kdt::cp_async_wait;

// A weight piece's copy with the pattern's L2 prefetch size (none, 128 or 256 bytes).
template <int PF>
__device__ __forceinline__ void copy_piece(void* s, const void* g) {
    if (PF == 128) kdt::cp_async16_line(s, g, 16);
    else if (PF == 256)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(kdt::smem_addr(s)), "l"(g));
    else cp_async16(s, g, 16);
}
// A row's 8 bytes of scales, with the 128-byte prefetch size when the pattern asks for one.
template <int PF>
__device__ __forceinline__ void copy_scales(void* s, const void* g) {
    if (PF) kdt::cp_async8_line(s, g);
    else kdt::cp_async8(s, g);
}

// What a warp does with a staged chunk in place of the real kernels' math: it reads a word of each tile (so
// the chunk's copies must have landed) and runs `work` rounds of 4 independent FMAs. The checksum is stored
// only on an unlikely value, so the reads and FMAs stay and nothing is written.
struct StandIn {
    uint32_t acc = 0;
    float f[4] = {(float)(threadIdx.x % 32), 1.0f, 2.0f, 3.0f};

    __device__ void use(const uint8_t* tile0, const uint8_t* tile1, int work) {
        const int lane = threadIdx.x % 32;
        const uint4 a = *reinterpret_cast<const uint4*>(tile0 + 16 * lane);
        const uint4 b = *reinterpret_cast<const uint4*>(tile1 + 16 * lane);
        acc ^= a.x ^ a.w ^ b.y ^ b.z;
        for (int k = 0; k < work; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) f[j] = fmaf(f[j], 1.0001f, 0.5f);
    }
    __device__ void finish(uint32_t* out) const {
        if (acc == 0x12345678u || f[0] + f[1] + f[2] + f[3] == 0.0f) out[0] = acc;
    }
};

// A warp's walk over `items` through a cp.async ring of RING stages: `issue(i, stage)` queues item i into
// the stage (nothing past the last item) and commits one group, `use(stage)` reads a stage whose group has
// landed, and the stage is refilled once every lane is done with it.
template <int RING, class Issue, class Use>
__device__ void stream_ring(int items, Issue issue, Use use) {
    for (int s = 0; s < RING; ++s) issue(s, s);
    for (int i = 0; i < items; ++i) {
        cp_async_wait<RING - 1>();
        __syncwarp();
        const int st = i % RING;
        use(st);
        __syncwarp();
        issue(i + RING, st);
    }
    cp_async_wait<0>();
}

// grid (I / 16 row groups, experts), 32 * KS threads.
template <Pattern P, int KS = P == NATIVE_KS8 ? 8 : 4>
__global__ void __launch_bounds__(32 * KS) narrow_gate_up(const uint4* w, const uint16_t* sc, const uint4* x, int work,
                                                      uint32_t* out) {
    extern __shared__ __align__(16) uint8_t smem[];
    constexpr int PER_WARP = CHUNKS / KS, PF = P == NATIVE_PF128 ? 128 : P == NATIVE_PF256 ? 256 : 0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane >> 2, j = lane & 3;
    uint8_t* ring = smem + warp * STAGES * 2560;  // per stage: 2 tiles x 1152 B, then 256 B of activations
    const uint4* ew = w + blockIdx.y * EXPERT_PIECES;
    const uint16_t* es = sc + blockIdx.y * EXPERT_SCALES;
    auto chunk_of = [&](int i) { return P == NATIVE_SLICES ? warp * PER_WARP + i : i * KS + warp; };
    auto issue = [&](int i, int st) {
        if (i < PER_WARP) {
            const int q = chunk_of(i);
            for (int m = 0; m < 2; ++m) {
                const int row0 = m * I + blockIdx.x * 16;
                uint8_t* dst = ring + st * 2560 + m * 1152;
                if (P == TILED) {
                    const uint4* img = ew + ((size_t)(row0 / 16) * CHUNKS + q) * 64;
                    cp_async16(dst + 16 * lane, img + lane, 16);
                    cp_async16(dst + 512 + 16 * lane, img + 32 + lane, 16);
                    const uint4* scales = reinterpret_cast<const uint4*>(es) + ((size_t)(row0 / 16) * CHUNKS + q) * 8;
                    if (lane < 8) cp_async16(dst + 1024 + 16 * lane, scales + lane, 16);
                } else {
                    const uint4* piece = ew + (size_t)(row0 + r) * ROW_PIECES + 4 * q + j;
                    copy_piece<PF>(dst + 64 * r + 16 * j, piece);
                    copy_piece<PF>(dst + 64 * (r + 8) + 16 * j, piece + 8 * ROW_PIECES);
                    if (lane < 16) copy_scales<PF>(dst + 1024 + 8 * lane, es + (size_t)(row0 + lane) * GROUPS + 4 * q);
                }
            }
            if (r == 0) {
                for (int g = 0; g < 4; ++g)
                    cp_async16(ring + st * 2560 + 2304 + 64 * g + 16 * j, x + (4 * q + g) * 4 + j, 16);
            }
        }
        cp_async_commit();
    };
    StandIn stand_in;
    stream_ring<STAGES>(PER_WARP, issue,
                        [&](int st) { stand_in.use(ring + st * 2560, ring + st * 2560 + 1152, work); });
    stand_in.finish(out);
}

// The real kernels' chunk loop for one token without their epilogue, taking their arguments (H and I are
// this file's constants): grid (I / 16, 8 slots). Nothing is stored but a flag on an unlikely value, so
// that the loop stays.
template <class Layout>
__global__ void __launch_bounds__(128, 4)
    gate_up_loop_only(const __nv_bfloat16* x, const uint32_t* w13, const __nv_bfloat16* w13_scale, int, int,
                      const int* ids, int, __nv_bfloat16*, int* flag) {
    using namespace kdt::moe;
    typedef BlockShape<Layout, 2, 1, GATE_UP_KSPLIT, NARROW_STAGES> Shape;
    extern __shared__ __align__(16) unsigned char smem[];
    const int e = ids[blockIdx.y], j0 = blockIdx.x * 16;
    const GemmArgs<2> args{w13, w13_scale, H, {e * 2 * I + j0, e * 2 * I + I + j0}};
    const uint4* act[1] = {reinterpret_cast<const uint4*>(x) + (threadIdx.x & 3)};
    // The one-token loop of whole chunks (H splits into them), as the real kernels run it.
    float acc[2][1][4];
    Shape::template pass<true, H % 128 == 0>(smem, args, act, 1, true, [] {}, acc);
    if (reinterpret_cast<const float*>(smem + Shape::RING_BYTES)[threadIdx.x] == 12345.0f) flag[0] = 1;
}

// native-pairs: the native copies with the L2 prefetch size of native-pf128, but each warp stages two
// neighbouring chunks at a time (128 bytes of each row, a whole line, and 16 bytes of its scales) in a
// 2-stage ring of such pairs (4 chunks in flight against the others' 3), and the K slices interleave by
// pair (warp k: pairs k, k + 4, ...): the copies a native GEMM would make with two-chunk stages.
constexpr int PAIR_STAGES = 2, PAIR_STAGE_BYTES = 2 * 2304 + 512;  // 2 tiles x (16 rows x 144 B), activations
template <int KS = 4>
__global__ void __launch_bounds__(32 * KS) narrow_gate_up_pairs(const uint4* w, const uint16_t* sc, const uint4* x,
                                                             int work, uint32_t* out) {
    extern __shared__ __align__(16) uint8_t smem[];
    constexpr int PER_WARP = CHUNKS / 2 / KS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint8_t* ring = smem + warp * PAIR_STAGES * PAIR_STAGE_BYTES;
    const uint4* ew = w + blockIdx.y * EXPERT_PIECES;
    const uint16_t* es = sc + blockIdx.y * EXPERT_SCALES;
    auto issue = [&](int i, int st) {
        if (i < PER_WARP) {
            const int q = 2 * (i * KS + warp);  // the pair's first chunk
            for (int m = 0; m < 2; ++m) {
                const int row0 = m * I + blockIdx.x * 16;
                uint8_t* dst = ring + st * PAIR_STAGE_BYTES + m * 2304;
                for (int k = 0; k < 4; ++k) {  // 8 lanes a row: one 128-byte line each
                    const int t = 32 * k + lane, row = t >> 3, piece = t & 7;
                    const uint4* src = ew + (size_t)(row0 + row) * ROW_PIECES + 4 * q + piece;
                    copy_piece<128>(dst + 128 * row + 16 * piece, src);
                }
                if (lane < 16)
                    kdt::cp_async16_line(dst + 2048 + 16 * lane, es + (size_t)(row0 + lane) * GROUPS + 4 * q, 16);
            }
            if (lane < 8) {
                for (int g = 0; g < 4; ++g)
                    cp_async16(ring + st * PAIR_STAGE_BYTES + 4608 + 64 * g + 16 * (lane & 3) + 256 * (lane >> 2),
                               x + (4 * (q + (lane >> 2)) + g) * 4 + (lane & 3), 16);
            }
        }
        cp_async_commit();
    };
    StandIn stand_in;
    stream_ring<PAIR_STAGES>(PER_WARP, issue, [&](int st) {
        for (int c = 0; c < 2; ++c)
            stand_in.use(ring + st * PAIR_STAGE_BYTES + 1024 * c, ring + st * PAIR_STAGE_BYTES + 2304 + 1024 * c, work);
    });
    stand_in.finish(out);
}

// The kernels' one-token gate/up GEMMs, and their chunk loops alone, over 8 experts a launch (the next 8
// at every launch), reading the same buffers as their own layout: any nibbles and scales do for timing.
template <class Time>
void real_gate_up(const uint4* w, const uint16_t* sc, const uint4* x, Time time) {
    using namespace kdt::moe;
    constexpr int SLOTS = 8;
    int* ids;
    __nv_bfloat16* h;
    int* handoff;  // counted up by the blocks and never reset: no down GEMM waits on it here
    CK(cudaMalloc(&ids, EXPERTS * sizeof(int)));
    CK(cudaMalloc(&h, SLOTS * I * sizeof(__nv_bfloat16)));
    CK(cudaMalloc(&handoff, 2 * MAX_EXPERTS * sizeof(int)));
    CK(cudaMemset(handoff, 0, 2 * MAX_EXPERTS * sizeof(int)));
    int host_ids[EXPERTS];
    for (int e = 0; e < EXPERTS; ++e) host_ids[e] = e;
    CK(cudaMemcpy(ids, host_ids, sizeof host_ids, cudaMemcpyHostToDevice));
    const int smem = (int)BlockShape<TiledLayout, 2, 1, GATE_UP_KSPLIT, NARROW_STAGES>::SHARED_BYTES;
    static_assert(sizeof(StageTile) == sizeof(NativeStage), "both layouts stage the same bytes");
    const double bytes = (double)SLOTS * (EXPERT_PIECES * 16 + EXPERT_SCALES * 2);
    auto run = [&](const char* name, auto kernel) {
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int first = 0;
        time(name, bytes, [&] {
            kernel<<<dim3(I / 16, SLOTS), 128, smem>>>(reinterpret_cast<const __nv_bfloat16*>(x),
                                                       reinterpret_cast<const uint32_t*>(w),
                                                       reinterpret_cast<const __nv_bfloat16*>(sc), H, I, ids + first,
                                                       EXPERTS, h, handoff);
            first = (first + SLOTS) % EXPERTS;
        });
    };
    run("real gate/up, native, 8 experts", moe_gate_up_direct_native);
    run("real gate/up, tiled, 8 experts", moe_gate_up_direct_tiled);
    run("chunk loop only, native, 8 experts", gate_up_loop_only<NativeLayout>);
    run("chunk loop only, tiled, 8 experts", gate_up_loop_only<TiledLayout>);
}

int main() {
    uint4 *w, *x;
    uint16_t* sc;
    uint8_t* dst;
    uint32_t* out;
    const size_t wbytes = EXPERTS * EXPERT_PIECES * 16, sbytes = EXPERTS * EXPERT_SCALES * 2;
    CK(cudaMalloc(&w, wbytes));
    CK(cudaMalloc(&sc, sbytes));
    CK(cudaMalloc(&x, H * 2));
    CK(cudaMalloc(&dst, wbytes));
    CK(cudaMalloc(&out, 4));
    CK(cudaMemset(w, 1, wbytes));
    CK(cudaMemset(sc, 1, sbytes));
    CK(cudaMemset(x, 1, H * 2));
    auto time = [&](const char* name, double bytes, auto f) {
        const float ms = time_ms(f);
        printf("%-34s %9.1f us %7.0f GB/s\n", name, ms * 1000, bytes / (ms * 1e-3) / 1e9);
    };
    time("memcpy d2d (read+write)", 2.0 * wbytes,
         [&] { CK(cudaMemcpyAsync(dst, w, wbytes, cudaMemcpyDeviceToDevice)); });
    // `n` experts a launch, from expert `first` on, the next n at every launch.
    auto run = [&](const char* name, auto kernel, int threads = 128, int n = EXPERTS) {
        const int smem = SMEM * threads / 128;
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const dim3 grid(I / 16, n);
        for (int work : {0, 32, 64}) {
            char label[64];
            if (n == EXPERTS) snprintf(label, sizeof label, "%s work %d", name, work);
            else snprintf(label, sizeof label, "%s, %d experts work %d", name, n, work);
            int first = 0;
            time(label, (double)(wbytes + sbytes) * n / EXPERTS, [&] {
                kernel<<<grid, threads, smem>>>(w + first * EXPERT_PIECES, sc + first * EXPERT_SCALES, x, work, out);
                first = (first + n) % EXPERTS;
            });
        }
    };
    run("native", narrow_gate_up<NATIVE>);
    run("native-slices", narrow_gate_up<NATIVE_SLICES>);
    run("native-pf128", narrow_gate_up<NATIVE_PF128>);
    run("native-pf256", narrow_gate_up<NATIVE_PF256>);
    run("native-ks8", narrow_gate_up<NATIVE_KS8>, 256);
    run("tiled", narrow_gate_up<TILED>);
    run("native-pairs", narrow_gate_up_pairs<>);
    run("native-pf128", narrow_gate_up<NATIVE_PF128>, 128, 8);
    run("native-pairs", narrow_gate_up_pairs<>, 128, 8);
    run("tiled", narrow_gate_up<TILED>, 128, 8);
    real_gate_up(w, sc, x, time);
    return 0;
}
