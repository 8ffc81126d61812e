// MoE with INT4 experts (DESIGN.md §4.4): routing + alignment, grouped GEMM 1 (gate/up with SiLU),
// grouped GEMM 2 (down), and the routing-weighted combine. Weights are W4A16, group 32, either in the
// checkpoint's compressed-tensors layout (native) or in the load-time tile order (tiled, see int4_tile).
//
// Both GEMMs run as "swap AB" tensor-core products: a warp's mma.sync m16n8k16 takes 16 weight rows as
// A (dequantized in registers) and up to 8 tokens as B, so one token per expert wastes MMA lanes but no
// memory traffic, and there is a single code path for every token count. Each k16 step covers 16 values
// of one quantization group; its products (128 + nibble) * x are exact and the MMA sums them in f32 onto
// -136 * sum(x) (group_acts), which leaves the group sum of (nibble - 8) * x, and the bf16 scale is
// applied once per group in f32 (acc = fma(scale, group_sum, acc)). A row group's K is split over a fixed
// number of warps (interleaved chunks, or pairs of chunks: NativeLayoutT PAIR_ORDER) whose partials are
// summed in order, so every output element is
// computed by the same operations whatever the batch: results are deterministic and batch invariant. The
// same MMA path serves one token or many (no separate GEMV path): at a few tokens the kernels are bound
// by weight bytes, not by the MMA lanes left idle. A block whose expert has one token leaves out only work
// on columns that are never stored (group_mma's ONE: 11-19% fewer instructions in its chunk loop, T 1-16
// 2-4% faster on the H200), so it too computes every stored element the same way.
#include <type_traits>

#include "common.cuh"

namespace kdt {
namespace moe {

constexpr int GROUP = 32;
// Warps per GEMM block: a narrow kernel (one n8 tile) runs one row group of K-slice warps, so several
// independent blocks share an SM and one block's start-up latency overlaps the others' work; a wide
// kernel stacks row groups up to 8 warps. Narrow blocks fill an SM to NARROW_SM_WARPS warps.
constexpr int WIDE_WARPS = 8;
constexpr int NARROW_SM_WARPS = 16;
__host__ __device__ constexpr int gemm_warps(int n_tiles, int ksplit) { return n_tiles == 1 ? ksplit : WIDE_WARPS; }
__host__ __device__ constexpr int gemm_min_blocks(int n_tiles, int ksplit) {
    return n_tiles == 1 ? NARROW_SM_WARPS / ksplit : 1;
}
constexpr int MAX_EXPERTS = 1024;  // mirrored in src/cuda/moe_int4.rs (the hand-off counts' stride too)
constexpr int ALIGN_THREADS = 512;
constexpr int ALIGN_ITEMS = MAX_EXPERTS / ALIGN_THREADS;
constexpr int ROUTE_THREADS = MAX_EXPERTS;  // one routing CTA per token, one thread per expert
constexpr int MAX_TOP_K = 32;       // mirrored in src/cuda/moe_int4.rs

// Status bits (mirrored in src/cuda/moe_int4.rs).
constexpr int STATUS_BAD_LOGIT = 1;
constexpr int STATUS_BAD_EXPERT = 2;

// ---------------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+; src/cuda/moe_int4.rs launches align, the GEMMs and the combine
// with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION). Such a kernel may start while the kernel
// before it in the stream still runs: `griddepcontrol.wait` (PTX ISA) returns once every prerequisite
// grid has completed and its memory operations are performed and visible to this grid, and
// `griddepcontrol.launch_dependents` lets the next kernel be scheduled once every CTA of this grid has
// issued it or exited (a CTA's first issue counts; it says nothing about memory). Launched without the
// attribute, both return at once. The kernels keep two rules, which together make any chain of them safe
// (the narrow down GEMM keeps them in the weaker form that rule H below states):
// (W) every thread waits before it writes anything and before it exits, so a grid completes only after
//     its predecessor has, and by induction after everything queued before it;
// (T) a CTA triggers only after it has waited (or, in a kernel launched without the attribute, at any
//     time: everything before it completed before it started), so when a kernel starts, the kernel two
//     back and all before it have completed. Two kernels trigger first instead. The pair kernel
//     (moe_pair_acts, launched right before the gate/up GEMMs) writes only after its wait, when the GEMMs
//     of the forward before, which read the previous x, have completed (see the combine below). A gate/up
//     GEMM after it may start while the alignment still runs: before its own wait it reads only the
//     weights and, in direct mode, topk_ids, whose writer (the routing kernel or set_routing's copy, both
//     before the alignment) has completed, since the alignment triggers only after its wait; from the
//     gate/up GEMM on, which triggers after its wait (the pair kernel complete), T holds again. The
//     combine triggers first as well, so the kernels after it (the next forward's pair kernel and gate/up
//     GEMMs, or a plain launch, which waits for the combine to complete) may start while the down GEMM
//     still runs. A gate/up GEMM reads nothing before
//     its wait that a down GEMM or the combine writes (only the weights, and in direct mode topk_ids, which
//     the routing wrote before the alignment), and the down GEMM after it starts only once the gate/up
//     blocks have waited, i.e. once the combine and so the down GEMM before it have completed: for every
//     kernel from that down GEMM on, T holds again. The combine's CTAs have all started when the gate/up
//     blocks launch, so the gate/up blocks that wait on it cannot keep it from running.
// The down GEMMs read the routing before their wait: it was written by the alignment, which precedes the
// narrow gate/up GEMM, and every gate/up CTA triggers only after its wait, so when a down GEMM starts
// the alignment has completed; those reads go through L2 (ld.global.cg) and never see a line an earlier
// kernel left in L1. In direct mode (one token, block_expert) the gate/up GEMM reads topk_ids before its
// wait: the routing kernel (or set_routing's copy) that wrote it is at least two kernels back, so it has
// completed when the gate/up GEMM starts.
// (H) The narrow down GEMM does not wait for the whole narrow gate/up GEMM before it reads h: each narrow
// gate/up block counts itself done in `handoff[slot]` once its h rows are written (a release), and a narrow
// down block of that slot spins until all of the slot's gate/up blocks are done (an acquire load), so the
// down GEMM streams the experts that are done while the gate/up GEMM finishes the others (both grids are
// expert-major: blockIdx.y is the slot). The spin cannot wait forever: the down blocks start only once
// every gate/up block has started (its trigger) or, launched plainly, once the gate/up GEMM completed. The
// last down block of a slot to pass the spin (counted in handoff[MAX_EXPERTS + slot]) zeroes both counts
// for the next forward, whose gate/up blocks count only after their wait, i.e. after this grid completed.
// A narrow down block writes y (and the counts) after its spin, before its wait: y's other writers and
// readers are this forward's down blocks (other pairs) and combine (which waits), and the forward
// before's combine, at least two kernels back and so complete by (T); the narrow gate/up GEMM, the only
// kernel that may still run, touches neither. It triggers after its spin and waits before it exits (W
// holds for completion); the kernels after it (the wide down GEMM, the combine) wait before they read h
// or y.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void add_release(int* p, int v) {
    asm volatile("fence.acq_rel.gpu;\nred.relaxed.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// ---------------------------------------------------------------------------------------------------
// Routing (sigmoid in float64, top-k of score + bias, ties to the smaller expert id, weights renormalized
// in slot order) and alignment by expert.

// Routing of one token per CTA. Each expert's slot is its rank: the number of experts that beat it
// (larger score + bias, then the smaller id), which gives the slots of k sequential arg-max rounds in one
// parallel pass. Ranked against all E experts, that pass took 14.6 µs for Kimi-K2's E 384 on the H200
// (one SM, E^2 float64 comparisons); ranked in two stages, 5.9 µs, and the one-token MoE step (routing,
// alignment, experts) 12% less. An expert first ranks itself among its warp's 32 experts, and only those
// below k there (the candidates, k per warp) rank among the candidates. That is exact: whoever beats a
// chosen expert (rank < k) is beaten by fewer than k experts, so is a candidate, and a candidate that is
// not chosen is beaten by all k chosen ones, which are candidates, so its candidate rank is k or more.
constexpr int RANK_UNROLL = 8;

__device__ __forceinline__ bool beats(double key_a, int a, double key_b, int b) {
    return key_a > key_b || (key_a == key_b && a < b);
}

// How many of the n experts (key[j], id(j)) beat (mine, e); keys compared RANK_UNROLL at a time so that
// their shared-memory loads overlap.
template <class Id>
__device__ __forceinline__ int count_beaters(const double* key, Id id, int n, double mine, int e) {
    int rank = 0;
    for (int j0 = 0; j0 < n; j0 += RANK_UNROLL) {
        double kj[RANK_UNROLL];
#pragma unroll
        for (int u = 0; u < RANK_UNROLL; ++u) kj[u] = j0 + u < n ? key[j0 + u] : -INFINITY;
#pragma unroll
        for (int u = 0; u < RANK_UNROLL; ++u) rank += j0 + u < n && beats(kj[u], id(j0 + u), mine, e) ? 1 : 0;
    }
    return rank;
}

// Grid: one CTA per token; E <= MAX_EXPERTS = ROUTE_THREADS, one expert per thread. The routing is over
// all E experts; `topk_ids` names the chosen experts relative to `first`, the first of the `held` experts
// this plan computes (an expert-parallel share), and -1 for a chosen expert outside them, whose weight
// stays in its slot: the share's output is its pairs' part of the whole sum.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route(const float* __restrict__ logits, const float* __restrict__ bias, double scaling, int E, int k,
              int first, int held, int* __restrict__ topk_ids, float* __restrict__ topk_weights,
              int* __restrict__ status) {
    __shared__ double key[MAX_EXPERTS];
    // Candidates (see above): warp w's in slots w * k .. w * k + k - 1, by their rank in the warp.
    __shared__ double cand_key[MAX_EXPERTS / 32 * MAX_TOP_K];
    __shared__ double cand_score[MAX_EXPERTS / 32 * MAX_TOP_K];
    __shared__ int cand_id[MAX_EXPERTS / 32 * MAX_TOP_K];
    __shared__ double chosen[MAX_TOP_K];
    // Launched after a memset, without the attribute; the alignment may start at once and wait.
    pdl_launch_dependents();
    const int t = blockIdx.x, e = threadIdx.x;
    const bool active = e < E;
    const float* row = logits + (size_t)t * E;
    int* ids = topk_ids + (size_t)t * k;
    float* weights = topk_weights + (size_t)t * k;
    const float logit = active ? row[e] : 0.0f, b = active ? bias[e] : 0.0f;
    if (!__syncthreads_and(isfinite(logit) && isfinite(b))) {
        // Keep the outputs valid expert ids, so later kernels stay in range; the host reports the error.
        if (e < k) {
            ids[e] = e;
            weights[e] = 0.0f;
        }
        if (e == 0) atomicOr(status, STATUS_BAD_LOGIT);
        return;
    }
    const double score = 1.0 / (1.0 + exp(-(double)logit));
    const double mine = score + (double)b;
    if (active) key[e] = mine;
    __syncthreads();
    const int w0 = e & ~31, in_warp = min(32, E - w0);
    if (active) {
        const int warp_rank = count_beaters(key + w0, [&](int j) { return w0 + j; }, in_warp, mine, e);
        if (warp_rank < k) {
            // Slots are dense: warps before the last are full, and an expert's rank in its warp is unique.
            const int slot = (w0 / 32) * k + warp_rank;
            cand_key[slot] = mine;
            cand_score[slot] = score;
            cand_id[slot] = e;
        }
    }
    __syncthreads();
    const int candidates = (E / 32) * k + min(k, E % 32);
    if (e < candidates) {
        const double cm = cand_key[e];
        const int ce = cand_id[e];
        const int rank = count_beaters(cand_key, [&](int j) { return cand_id[j]; }, candidates, cm, ce);
        if (rank < k) {
            ids[rank] = ce >= first && ce < first + held ? ce - first : -1;
            chosen[rank] = cand_score[e];
        }
    }
    __syncthreads();
    // Renormalized in slot order, as the reference sums them.
    if (e < k) {
        double sum = 0.0;
        for (int slot = 0; slot < k; ++slot) sum += chosen[slot];
        weights[e] = (float)(chosen[e] / sum * scaling);
    }
}

typedef cub::BlockScan<int, ALIGN_THREADS> ScanInt;

// Alignment of topk_ids [T, k]: one CTA. Pairs are counted per expert, scanned into offsets, and placed in
// pair order by a single warp so that each expert's pairs stay in increasing pair order; the experts with
// pairs are listed in increasing id as `active_slices` (expert, begin, count, token of the first pair), so
// that a GEMM block finds its expert in one load, and a gate/up block of a one-token expert (most of them
// at a few tokens) its activation row without a second, dependent load of sorted_pairs.
extern "C" __global__ void __launch_bounds__(ALIGN_THREADS, 1)
    moe_align(const int* __restrict__ topk_ids, int T, int E, int k, int skip_others,
              int* __restrict__ expert_offsets, int* __restrict__ sorted_pairs, int4* __restrict__ active_slices,
              int* __restrict__ num_active, int* __restrict__ status) {
    __shared__ int count[MAX_EXPERTS];
    __shared__ int next[MAX_EXPERTS];
    __shared__ typename ScanInt::TempStorage scan_tmp;
    __shared__ int bad_id, active;
    const int tid = threadIdx.x, pairs = T * k;

    pdl_wait();  // topk_ids come from the routing kernel
    pdl_launch_dependents();
    if (tid == 0) bad_id = 0;
    for (int e = tid; e < E; e += ALIGN_THREADS) count[e] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += ALIGN_THREADS) {
        int e = topk_ids[p];
        if (e == -1 && skip_others) continue;  // another share's expert (moe_route)
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
    // Blocked arrangement: thread tid owns experts tid * ALIGN_ITEMS + i, so the scans run in expert order.
    int c[ALIGN_ITEMS], used[ALIGN_ITEMS], offset[ALIGN_ITEMS], rank[ALIGN_ITEMS], total_active;
#pragma unroll
    for (int i = 0; i < ALIGN_ITEMS; ++i) {
        const int e = tid * ALIGN_ITEMS + i;
        c[i] = e < E ? count[e] : 0;
        used[i] = c[i] > 0 ? 1 : 0;
    }
    ScanInt(scan_tmp).ExclusiveSum(c, offset);
    __syncthreads();
    ScanInt(scan_tmp).ExclusiveSum(used, rank, total_active);
#pragma unroll
    for (int i = 0; i < ALIGN_ITEMS; ++i) {
        const int e = tid * ALIGN_ITEMS + i;
        if (e >= E) continue;
        expert_offsets[e] = offset[i];
        next[e] = offset[i];
        if (used[i]) active_slices[rank[i]] = make_int4(e, offset[i], c[i], 0);
    }
    if (tid == 0) {
        expert_offsets[E] = pairs;
        *num_active = active = total_active;
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
        // The warp's sorted_pairs are visible to the warp after __syncwarp, the slices (written before the
        // barrier above) to every thread.
        for (int i = tid; i < active; i += 32)
            reinterpret_cast<int*>(active_slices + i)[3] = sorted_pairs[active_slices[i].y] / k;
    }
}

// ---------------------------------------------------------------------------------------------------
// Grouped GEMMs. A warp computes MT m16 tiles (16 weight rows each) against NT n8 tiles (8 tokens each)
// over its share of K, walked in chunks of 4 groups (128 inputs). Each chunk of an m16 tile goes through
// a per-warp ring of shared-memory stages filled by cp.async, so several chunks are in flight per warp.
// Each layout has its own stage format and reads from it, for lane l (r = l / 4, c = l % 4), the packed
// word c of the chunk's 4 groups for rows r and r + 8, and those rows' 4 scales.

constexpr int CHUNK_GROUPS = 4;

// The tiled layout's stage: `word[h][l]` holds lane l's 4 words for row r + 8h, and the 16 rows' scales
// are 8 (row i, row i + 8) quads. The tiled global layout stores exactly this image per chunk.
struct StageTile {
    uint4 word[2][32];             // [row half][lane]: 4 words, one per group of the chunk
    __nv_bfloat16 scale[8][2][4];  // [row i][half][group]: row i + 8 * half
};

// The native layout's stage: the chunk's 16 rows in checkpoint order, 64 bytes each and unpadded, and
// their 4 scales each, arranged as the tiled stage's. Row r keeps its group g at g ^ native_swizzle(r), so
// that the 16-byte pieces of one group over rows 0..7 (an 8x8 matrix of ldmatrix, which hands lane l word
// l % 4 of row l / 4) fall in distinct banks, while each row's copy lands on its own 64 bytes.
// (Rows padded to 80 bytes instead give the copies destinations that straddle 32-byte sectors, and L2
// then serves sectors twice: 22.6M sector reads against 17.8M for the gate/up GEMM at T 4 on the H200,
// and 3-6% more time.) A layout whose scales come in quads (below) stages the rows only.
struct NativeRows {
    uint32_t word[16][16];  // [row][swizzled group * 4 + word]
};
struct NativeStage : NativeRows {
    __nv_bfloat16 scale[8][2][4];  // [row i][half][group]: row i + 8 * half
};
__device__ __forceinline__ int native_swizzle(int row) { return (row >> 1) & 3; }

// A two-chunk stage (NativeLayoutT with PAIRS): the 16 rows' 128 bytes of two consecutive chunks, a whole
// L2 line of each row when its 8 groups start one, so that a copy instruction covers 4 lines instead of
// 8 half lines. Row r keeps its 16-byte piece p at p ^ (r mod 8): the 8 rows of an ldmatrix matrix (the
// same piece) fall in distinct banks.
struct NativePairRows {
    uint32_t word[16][32];  // [row][swizzled piece * 4 + word]
};
// A two-chunk stage with its scales (a layout without quads): row r's 8 scales of the two chunks, in
// group order, one 16-byte piece per row.
struct NativePairStage : NativePairRows {
    __nv_bfloat16 scale[16][8];  // [row][group of the two chunks]
};

// The scales of 8 consecutive chunks of a 16-row tile, two quads: a quad's 16 groups of a row are one
// 32-byte sector of the row's scales. Chunk c keeps its 4 groups of each row in slot c % 8, arranged as a
// stage's scales (see NativeLayoutT).
struct ScaleQuads {
    __nv_bfloat16 scale[8][8][2][4];  // [chunk % 8][row i][half][group]: row i + 8 * half
};

// A layout's cursor walks one m16 tile's chunks: `stage(dst, ahead)` copies the chunk `ahead` staged
// chunks past the cursor's into a stage, `read(stage, ahead)` gives a lane that chunk's operands, and
// `advance` moves the cursor. The chunk loop is unrolled by its stages, so `ahead` is a constant there
// and every copy's address an immediate offset from the cursor's pointers, which move once per round of
// stages.

// Checkpoint layout: packed [rows, cols/8] i32, scale [rows, cols/32] bf16. A row's chunk is 64
// contiguous bytes: lane l copies the 16-byte group l % 4 of rows l / 4 and l / 4 + 8, and lanes 0..15 the
// 8 bytes of their row's scales (4-byte-aligned groups only, i.e. a group count divisible by 4; other
// shapes, small ones, load the scales with plain loads). The copies ask L2 for whole 128-byte lines: the
// next chunk of a row, which another K slice (or this warp) reads next, then comes in the same DRAM
// access. On the H200 this access pattern streams at 4359 GB/s with the hint against 3959 without (the
// tiled layout's at 4554; benches/microbench/moe_stream.cu), and the forward is 4-7% faster at T 1-64.
// The tiled layout's evict-first policy on top of it made T 4-64 4-5% slower: the line's other half
// leaves L2 before the next K slice reads it.
// QUADS (a warp that walks consecutive chunks: the down GEMM) copies a row's scales a sector at a time,
// the 16 groups of 4 chunks, into one of two ScaleQuads when it stages the quad's first chunk, instead of
// 8 bytes per row and chunk: each of those copies touched 16 sectors and L1 wavefronts for 128 bytes, 31%
// of the native down GEMM's wavefronts at T 1 on the H200, and its top stall was the memory-instruction
// queue (with the epilogue from registers, BlockShape, the native forward is 2.3-3.2% faster at T 1-64
// on the H200). Quad q's slots are used by chunks 4q .. 4q + 3 and rewritten when chunk 4q + 8 is staged,
// at most STAGES chunks ahead, i.e. after chunk 4q + 3 has been used. Chunks of a K not in whole chunks
// write their own slot with plain loads. (The copy engine instead, one 2-D TMA box of both m16 tiles' 32
// rows per chunk completing on an mbarrier, whose 64-byte swizzle mode is native_swizzle, passed the
// tests but moved the forward by under 1.1% either way at T 1-64 and made the one-token down kernel 8%
// slower alone: the loop grew from 689 to 741 instructions per round of 3 chunks; session 25, H200.)
//
// PAIR_ORDER: K slices take pairs of neighbouring chunks (with KSPLIT slices, slice s takes chunks 2s,
// 2s + 1, 2s + 2 KSPLIT, 2s + 2 KSPLIT + 1, ...), so that one warp reads both halves of a row's 128-byte
// line; with one K slice (QUADS) that is the plain chunk order. A warp's chunk sequence then steps by 1
// and 2 KSPLIT - 1 in turn, so the chunk loop unrolls by an even number of chunks (warp_gemm) and the
// cursor always stands at the first chunk of a pair. Every native gate/up kernel takes this order (a
// token's h must not depend on which kernel serves it).
// PAIRS (implies PAIR_ORDER) stages both chunks of a pair at once, in a NativePairRows (with QUADS) or a
// NativePairStage: lane l copies piece l % 8 of rows l / 8 + 4i, whole 128-byte lines (no line hint
// needed), lanes 0..15 the 16 bytes of their row's scales, and `read` takes the chunk's half of the stage.
// The chunks and their arithmetic are those of one-chunk stages in the same order, so are the bits.
template <bool QUADS, bool PAIRS = false, bool PAIR_ORDER = PAIRS>
struct NativeLayoutT {
    static_assert(PAIR_ORDER || !PAIRS, "a two-chunk stage holds a pair of the pair order");
    typedef typename std::conditional<
        PAIRS, typename std::conditional<QUADS, NativePairRows, NativePairStage>::type,
        typename std::conditional<QUADS, NativeRows, NativeStage>::type>::type Stage;
    static constexpr int STAGE_CHUNKS = PAIRS ? 2 : 1;
    static constexpr bool ORDER_BY_PAIRS = PAIR_ORDER;
    static constexpr bool ACTS_PERMUTED = true;  // nibble i of a word is element i (see group_acts)
    static constexpr size_t SCALE_BYTES = QUADS ? sizeof(ScaleQuads) : 0;  // per cursor (m16 tile)
    const uint4* piece;                // the lane's group of row l / 4 in the current chunk
    const uint4* piece_hi;             // and of row l / 4 + 8
    const uint4* base;                 // a valid address for the zero-filling copies past the last group
    const __nv_bfloat16* scale_row;    // row l % 16's scales at the chunk's first group (QUADS: see stage_quad)
    ScaleQuads* quads;                 // QUADS: the cursor's scale slots
    const __nv_bfloat16* scale_hi;     // QUADS: scale_row 8 rows on
    uint32_t quad_copy, quad_read;     // QUADS: shared addresses of the lane's copy slot and read row, slot 0
    int g0, groups, step;              // step: groups from one chunk (PAIR_ORDER: pair) of the warp to the next

    // Chunks from the warp's current chunk to its chunk `ahead` places on, for K slices `chunk_step`
    // chunks apart (pair order: pairs 2 chunk_step apart; `ahead` counts from the first of a pair).
    __host__ __device__ static constexpr int chunk_offset(int ahead, int chunk_step) {
        return PAIR_ORDER ? (ahead >> 1) * 2 * chunk_step + (ahead & 1) : ahead * chunk_step;
    }
    __device__ __forceinline__ int skip(int ahead) const {  // the same in groups
        return PAIR_ORDER ? (ahead >> 1) * step + (ahead & 1) * CHUNK_GROUPS : ahead * step;
    }

    __device__ __forceinline__ NativeLayoutT(const uint32_t* packed, const __nv_bfloat16* scale, int row0,
                                             int groups_, int chunk, int chunk_step, unsigned char* scale_ring) {
        const int lane = threadIdx.x & 31;
        groups = groups_;
        // QUADS: one K slice (BlockShape), so chunk_step is 1.
        step = (PAIR_ORDER ? 2 : 1) * (QUADS ? 1 : chunk_step) * CHUNK_GROUPS;
        g0 = chunk * CHUNK_GROUPS;
        base = reinterpret_cast<const uint4*>(packed);
        if (PAIRS)
            piece = base + (size_t)(row0 + (lane >> 3)) * groups + g0 + (lane & 7);  // rows l / 8 + 4i, see stage
        else
            piece = base + (size_t)(row0 + (lane >> 2)) * groups + g0 + (lane & 3);  // one 16-byte piece per group
        piece_hi = piece + (size_t)8 * groups;
        if constexpr (QUADS) {
            scale_row = scale + (size_t)(row0 + (lane >> 2)) * groups + g0 + CHUNK_GROUPS * (lane & 3);
            scale_hi = scale_row + (size_t)8 * groups;
            quads = reinterpret_cast<ScaleQuads*>(scale_ring);
            quad_copy = smem_addr(quads->scale[lane & 3][lane >> 2]);
            quad_read = smem_addr(quads->scale[0][lane >> 2]);
        } else {
            scale_row = scale + (size_t)(row0 + (lane & 15)) * groups + g0;
        }
    }

    template <bool WHOLE>
    __device__ __forceinline__ void stage(Stage* dst, int ahead) const {
        if constexpr (PAIRS) {
            stage_pair<WHOLE>(dst, ahead);
        } else {
            const int lane = threadIdx.x & 31, row = lane >> 2, j = lane & 3, at_g = skip(ahead), g = g0 + at_g;
            const bool in = WHOLE || g + j < groups;
            const int at = 4 * (j ^ native_swizzle(row));  // the same for row + 8
            cp_async16_line(&dst->word[row][at], in ? piece + at_g : base, in ? 16 : 0);
            cp_async16_line(&dst->word[row + 8][at], in ? piece_hi + at_g : base, in ? 16 : 0);
            if constexpr (QUADS) {
                stage_quad<WHOLE>(at_g);
            } else if (lane < 16) {
                stage_scales<WHOLE>(dst->scale[lane & 7][lane >> 3], scale_row + at_g, g);
            }
        }
    }

    // PAIRS: the chunks `ahead` and `ahead + 1` past the cursor's (`ahead` even), their rows and scales.
    template <bool WHOLE>
    __device__ __forceinline__ void stage_pair(Stage* dst, int ahead) const {
        const int lane = threadIdx.x & 31, row = lane >> 3, p = lane & 7, at_g = skip(ahead), g = g0 + at_g;
        const bool in = WHOLE || g + p < groups;
        const u64 policy = l2_evict_first();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = row + 4 * i;
            cp_async16_hint(&dst->word[r][4 * (p ^ (r & 7))], in ? piece + (size_t)i * 4 * groups + at_g : base,
                            in ? 16 : 0, policy);
        }
        if constexpr (QUADS) {
            stage_quad<WHOLE>(at_g);
            stage_quad<WHOLE>(at_g + CHUNK_GROUPS);
        } else if (lane < 16) {
            if (WHOLE) {
                cp_async16_line(dst->scale[lane], scale_row + at_g, 16);
            } else {
#pragma unroll
                for (int q = 0; q < 2 * CHUNK_GROUPS; ++q)
                    dst->scale[lane][q] = g + q < groups ? scale_row[at_g + q] : __float2bfloat16_rn(0.0f);
            }
        }
    }

    // A chunk's 4 scales of one row from `src` (its first group, g), zeros past the last group.
    template <bool WHOLE>
    __device__ __forceinline__ void stage_scales(__nv_bfloat16* dst, const __nv_bfloat16* src, int g) const {
        if (WHOLE) {
            cp_async8_line(dst, src);
        } else {
#pragma unroll
            for (int q = 0; q < CHUNK_GROUPS; ++q) dst[q] = g + q < groups ? src[q] : __float2bfloat16_rn(0.0f);
        }
    }

    // QUADS: the scales of the chunk `skip` groups past the cursor's. At a quad's first chunk (whole chunks),
    // lane l copies the 8 bytes of chunk l % 4 of the quad for rows l / 4 and l / 4 + 8 (scale_row points at
    // the first), so 4 lanes read each row's sector; otherwise lanes 0..15 fill the chunk's own slot, as a
    // stage's scales. The addresses are a lane's constants plus the quad's parity (slots 4..7: 512 bytes on):
    // computed per chunk, they made the one-token loop 724 instead of 691 sm_90 instructions per round of 3
    // and the forward up to 0.7% slower on the H200.
    template <bool WHOLE>
    __device__ __forceinline__ void stage_quad(int skip) const {
        const int lane = threadIdx.x & 31, g = g0 + skip;
        if (WHOLE) {
            if ((g & (3 * CHUNK_GROUPS)) != 0 || g + CHUNK_GROUPS * (lane & 3) >= groups) return;
            const uint32_t dst = quad_copy + ((g & (4 * CHUNK_GROUPS)) << 5);
            cp_async8_line(dst, scale_row + skip);
            cp_async8_line(dst + 8, scale_hi + skip);
        } else if (lane < 16) {
            // Row l instead of row l / 4, group 0 of the chunk instead of 4 (l % 4).
            const __nv_bfloat16* src = scale_row + skip + (ptrdiff_t)((lane & 15) - (lane >> 2)) * groups -
                                       CHUNK_GROUPS * (lane & 3);
            stage_scales<false>(quads->scale[(g / CHUNK_GROUPS) & 7][lane & 7][lane >> 3], src, g);
        }
    }

    __device__ __forceinline__ void advance(int chunks) {  // pair order: an even number
        const int by = skip(chunks);
        piece += by;
        piece_hi += by;
        scale_row += by;
        if (QUADS) scale_hi += by;
        g0 += by;
    }

    // The lane's words of rows r and r + 8 (one per group) and their scales, as the tiled stage gives them:
    // one ldmatrix per 8 rows, whose matrix j is group j (lanes 8j .. 8j + 7 give its rows' addresses).
    // PAIRS: the chunk's half of the stage, pieces 4 (ahead % 2) + j (the cursor stands at an even chunk).
    __device__ __forceinline__ void read(const Stage& s, int ahead, uint4& lo, uint4& hi, uint4& scales) const {
        const int lane = threadIdx.x & 31, row = lane & 7, j = lane >> 3;
        const uint32_t* piece = PAIRS ? &s.word[row][4 * ((4 * (ahead & 1) + j) ^ row)]
                                      : &s.word[row][4 * (j ^ native_swizzle(row))];  // the same for row + 8
        uint32_t w[4];
        ldmatrix_x4(w, piece);
        lo = make_uint4(w[0], w[1], w[2], w[3]);
        ldmatrix_x4(w, piece + 8 * (sizeof(s.word[0]) / sizeof(uint32_t)));
        hi = make_uint4(w[0], w[1], w[2], w[3]);
        if constexpr (QUADS) {
            const uint32_t at = quad_read + (((g0 / CHUNK_GROUPS + ahead) & 7) << 7);
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(scales.x), "=r"(scales.y), "=r"(scales.z), "=r"(scales.w)
                         : "r"(at));
        } else if constexpr (PAIRS) {
            const int r = lane >> 2, q = CHUNK_GROUPS * (ahead & 1);
            const uint2 lo_row = *reinterpret_cast<const uint2*>(&s.scale[r][q]);
            const uint2 hi_row = *reinterpret_cast<const uint2*>(&s.scale[r + 8][q]);
            scales = make_uint4(lo_row.x, lo_row.y, hi_row.x, hi_row.y);
        } else {
            scales = *reinterpret_cast<const uint4*>(&s.scale[lane >> 2][0][0]);
        }
    }
};
typedef NativeLayoutT<false> NativeLayout;

// Tiled layout (int4_tile, cpu::moe_int4::tile): each (16-row tile, chunk) is a StageTile image in
// global memory, so the copy is two 16-byte pieces per lane plus eight for the scales.
struct TiledLayout {
    typedef StageTile Stage;
    static constexpr bool ACTS_PERMUTED = false;  // int4_tile's nibble order (see group_acts)
    static constexpr int STAGE_CHUNKS = 1;
    static constexpr bool ORDER_BY_PAIRS = false;
    static constexpr size_t SCALE_BYTES = 0;   // the scales travel in the stage
    const uint4* words;   // the lane's first piece of the current chunk
    const uint4* scales;  // the scale piece of lane % 8
    int step;             // chunks from one staged chunk to the next
    u64 policy;           // L2 evict-first: the weights stream past once (T 4-64 1-2% faster on the H200, T 1 the same)

    __device__ __forceinline__ TiledLayout(const uint32_t* packed, const __nv_bfloat16* scale, int row0, int groups,
                                           int chunk, int chunk_step, unsigned char*) {
        step = chunk_step;
        const int lane = threadIdx.x & 31;
        const size_t tile = (size_t)(row0 / 16) * ((groups + CHUNK_GROUPS - 1) / CHUNK_GROUPS) + chunk;
        words = reinterpret_cast<const uint4*>(packed) + tile * 64 + lane;
        scales = reinterpret_cast<const uint4*>(scale) + tile * 8 + (lane & 7);
        policy = l2_evict_first();
    }

    template <bool WHOLE>  // the image holds zeros past the last group: no bounds to check
    __device__ __forceinline__ void stage(StageTile* dst, int ahead) const {
        const int lane = threadIdx.x & 31, skip = ahead * step;
        cp_async16_hint(&dst->word[0][lane], words + 64 * skip, 16, policy);
        cp_async16_hint(&dst->word[1][lane], words + 64 * skip + 32, 16, policy);
        if (lane < 8) cp_async16_hint(&dst->scale[lane][0][0], scales + 8 * skip, 16, policy);
    }

    __host__ __device__ static constexpr int chunk_offset(int ahead, int chunk_step) { return ahead * chunk_step; }

    __device__ __forceinline__ void advance(int chunks) {
        words += 64 * chunks * step;
        scales += 8 * chunks * step;
    }

    __device__ __forceinline__ void read(const Stage& s, int, uint4& lo, uint4& hi, uint4& scales) const {
        const int lane = threadIdx.x & 31;
        lo = s.word[0][lane];
        hi = s.word[1][lane];
        scales = *reinterpret_cast<const uint4*>(&s.scale[lane >> 2][0][0]);
    }
};

// (a & b) | c in one LOP3. Written out because ptxas splits `(a & 0x000F000F) | 0x43004300` into two LOP3s
// (one immediate operand each), a quarter of the dequant's instructions.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));  // 0xEA = (a & b) | c
    return r;
}

// bf16 pair (lo, hi) = 128 + (nibble at bit `shift`, nibble at bit `shift + 16`), exact: 0x4300 | n is the
// bf16 128 + n. The 136 = 128 + 8 of the offset and the stored q + 8 is taken off by group_acts, so a
// nibble pair costs one LOP3 (and a shift) instead of a third instruction for a bf16 subtraction.
__device__ __forceinline__ uint32_t offset_pair(uint32_t w, int shift) {
    return and_or(w >> shift, 0x000F000Fu, 0x43004300u);
}

// One n8 tile's activations of one group as the two MMAs' B fragments (b[0], b[1] and b[2], b[3]),
// paired as the weight words are: the lane holds group elements 8c .. 8c + 7 of its token, and the nibble
// pairs (j, 4 + j) of a weight word hold the elements (j, 4 + j) in the checkpoint's order and (2j, 2j + 1)
// in the tiled order (int4_tile interleaves the nibbles). So the tiled layout's GEMMs read activations in
// their order, and the native layout's (ACTS_PERMUTED) read them with each 8 elements in the order
// 0 4 1 5 2 6 3 7: x as moe_pair_acts writes it, h as the gate/up GEMM stores it (act_column). Permuted once
// per forward instead of in every chunk of every warp (4 byte permutes per group), the native gate/up
// GEMM's loop is about 15 sm_90 instructions a chunk shorter (T 4-64 1.4-1.7% faster on the H200).
struct GroupActs {
    uint32_t b[4];
    // C fragment of -136 * (sum of the group's activations) for the lane's tokens 2c and 2c + 1 (rows
    // r and r + 8 alike), the start of every m16 tile's group sum: one tensor-core product shared by the
    // warp's m16 tiles in place of a bf16 subtraction per nibble pair.
    float offset[4];
};

__device__ __forceinline__ GroupActs group_acts(uint4 x, const uint32_t (&minus136)[4]) {
    GroupActs g;
    g.b[0] = x.x, g.b[1] = x.y, g.b[2] = x.z, g.b[3] = x.w;
#pragma unroll
    for (int i = 0; i < 4; ++i) g.offset[i] = 0.0f;
    mma_bf16(g.offset, minus136, g.b[0], g.b[1]);
    mma_bf16(g.offset, minus136, g.b[2], g.b[3]);
    return g;
}

// group_acts' A fragment, the bf16 pair (-136, -136) in each of its four registers. warp_gemm reads it from
// memory, once per register (volatile, so that the four loads stay four): built from an immediate, ptxas
// rebuilt the register quad (a move and its copies) in every chunk. Loaded, the sm_90 chunk loops shrink
// from 311 to 298 instructions (direct gate/up, tiled), 317 to 299 (narrow down) and 421 to 384 (wide
// gate/up); on the H200 the native layout's T 4 and T 8 forwards ran 1.5-2% faster, the others within 1%.
__device__ uint32_t minus136_pair = 0xC308C308u;

// One group of one (m16 tile, n8 tile). The lane's words (rows r, r + 8) hold group elements 8c .. 8c + 7
// in nibble pairs that the activations in `x` match, so the k order inside the MMA is a permutation of
// the group that A and B share. The products (128 + nibble) * x are exact in the MMA, which sums them onto
// -136 * sum(x), so the group sum is that of (nibble - 8) * x up to f32 rounding; the group's scale is
// applied once, in f32. With one token (ONE) only column 0 is ever stored, so the accumulators of the odd
// columns (elements 1 and 3) are left at zero: two FMAs fewer per group and m16 tile.
template <bool ONE>
__device__ __forceinline__ void group_mma(float (&acc)[4], uint32_t w0, uint32_t w1, float s0, float s1,
                                          const GroupActs& x) {
    float part[4] = {x.offset[0], x.offset[1], x.offset[2], x.offset[3]};
    const uint32_t a0[4] = {offset_pair(w0, 0), offset_pair(w1, 0), offset_pair(w0, 4), offset_pair(w1, 4)};
    mma_bf16(part, a0, x.b[0], x.b[1]);
    const uint32_t a1[4] = {offset_pair(w0, 8), offset_pair(w1, 8), offset_pair(w0, 12), offset_pair(w1, 12)};
    mma_bf16(part, a1, x.b[2], x.b[3]);
    acc[0] = fmaf(s0, part[0], acc[0]);
    acc[2] = fmaf(s1, part[2], acc[2]);
    if (!ONE) {
        acc[1] = fmaf(s0, part[1], acc[1]);
        acc[3] = fmaf(s1, part[3], acc[3]);
    }
}

// Word j of a uint4 (j a compile-time constant after unrolling).
__device__ __forceinline__ uint32_t word(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The f32 values of a word's two bf16 halves (exact: a bf16 is the upper half of its f32).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// The lane's activations of group g: elements 8c .. 8c + 7 of its row (`x` points at element 8c of
// group 0); zeros past the last group, which only chunks of a partly filled last chunk reach.
template <bool WHOLE>
__device__ __forceinline__ uint4 load_act(const uint4* x, int g, int groups) {
    return WHOLE || g < groups ? __ldg(x + g * (GROUP / 8)) : make_uint4(0, 0, 0, 0);
}

// Multiplies one staged chunk (groups g0 .. g0 + 3, `ahead` chunks past the cursors') of MT m16 tiles with
// NT n8 tiles. With one n8 tile the activations come from their stage in `xp`; with more they are loaded
// here, one group at a time, so they do not all occupy registers at once.
template <class Layout, int MT, int NT, bool ONE, bool WHOLE>
__device__ __forceinline__ void chunk_mma(float (&acc)[MT][NT][4], const Layout (&cursor)[MT],
                                          const typename Layout::Stage* tiles, int ahead,
                                          const uint4 (&xp)[CHUNK_GROUPS], const uint4* const (&act)[NT], int g0,
                                          int groups, const uint32_t (&minus136)[4]) {
    uint4 lo[MT], hi[MT], sv[MT];  // word j of rows r and r + 8 per group j; sv: the scales (read)
#pragma unroll
    for (int m = 0; m < MT; ++m) cursor[m].read(tiles[m], ahead, lo[m], hi[m], sv[m]);
#pragma unroll
    for (int j = 0; j < CHUNK_GROUPS; ++j) {
        GroupActs x[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n)
            x[n] = group_acts(NT == 1 ? xp[j] : load_act<WHOLE>(act[n], g0 + j, groups), minus136);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            // sv: the scales of groups (0, 1) and (2, 3) of row r, then of row r + 8
            const uint32_t s_lo = j < 2 ? sv[m].x : sv[m].y, s_hi = j < 2 ? sv[m].z : sv[m].w;
            const float scale_lo = j % 2 ? bf16_hi(s_lo) : bf16_lo(s_lo);
            const float scale_hi = j % 2 ? bf16_hi(s_hi) : bf16_lo(s_hi);
#pragma unroll
            for (int n = 0; n < NT; ++n)
                group_mma<ONE>(acc[m][n], word(lo[m], j), word(hi[m], j), scale_lo, scale_hi, x[n]);
        }
    }
}

// The operands of one expert GEMM: weight matrix [rows, cols] and the first row of each of the warp's
// m16 tiles.
template <int MT>
struct GemmArgs {
    const uint32_t* packed;
    const __nv_bfloat16* scale;
    int cols;
    int row0[MT];
};

// The activations of one chunk for one n8 tile, staged next to its weights: x[j][slot][c] holds
// elements 8c .. 8c + 7 of group j of the chunk for token slot `slot`, the 16 bytes lane (slot, c) reads.
// A kernel whose blocks all have one token (the direct down GEMM) stages slot 0 only, and the lanes of
// the other slots read a ring of zeros of the same shape that follows the warp's ring (so that every read
// keeps its immediate offset).
template <int SLOTS>
struct ActStageT {
    uint4 x[CHUNK_GROUPS][SLOTS][4];
};
typedef ActStageT<8> ActStage;

// A warp's partial sums over the chunks first, first + step, ... (`count` of them) for NT n8 tiles of
// tokens; `act[n]` is the lane's activation row in n-tile n, advanced to element 8c (lanes past the
// expert's tokens point at its last token: their columns are never stored). `ring` holds STAGES * MT
// weight stages. The weights do not depend on any earlier kernel, so the first STAGES chunks' weights are
// copied before `wait_inputs` (griddepcontrol.wait, or the narrow down GEMM's spin, rule H), and the
// activations, which may be an earlier kernel's output, after it.
//
// With one n8 tile (the few-token case) the activations go through the cp.async pipeline as well, in
// `acts` (STAGES ActStages): lane (r, c) copies its row's 64 bytes of a chunk when r < `tokens`, so they
// arrive STAGES chunks ahead like the weights; the slots of absent tokens are zeroed once, so those MMA
// columns (never stored) multiply zeros, which draws less power than copies of a real token's
// activations would (the board runs these kernels at its power cap). cp.async groups:
// W0 .. W(S-1) (weights of chunks 0 .. S-1), then A0 .. A(S-1) (their activations), then one group per
// later chunk (its weights and activations). Chunk i < S needs W_i and A_i, chunk i >= S its own group,
// and either way exactly S - 1 newer groups have been committed when chunk i is used, so every wait
// below is the same constant (no branch on the chunk index in the loop). With more n8 tiles the
// activations are loaded by each lane inside chunk_mma, and the groups are W0 .. W(S-1) then one per
// later chunk, again S - 1 newer ones. With one token (ONE: NT 1, `tokens` 1) lanes (g, c), g < 4, copy
// piece c of group g, so a chunk's 64 bytes take one copy instruction instead of four.
template <class Layout, int MT, int NT, int STAGES, bool ONE, bool WHOLE, int SLOTS, class WaitInputs>
__device__ void warp_gemm(float (&acc)[MT][NT][4], const GemmArgs<MT>& args, const uint4* const (&act)[NT],
                          int tokens, int first, int count, int step, typename Layout::Stage* ring,
                          ActStageT<SLOTS>* acts, unsigned char* scale_ring, WaitInputs wait_inputs) {
    static_assert(SLOTS == 8 || ONE, "a stage of fewer token slots serves one token");
    static_assert(SLOTS == 8 || SLOTS == 1, "one token slot staged, or all 8");
    static_assert(!ONE || NT == 1, "one token fills one n8 tile");
    // Chunks per stage (Layout::STAGE_CHUNKS, 1 or 2) and in the ring: a stage is one cp.async group and
    // is refilled once all its chunks are used; below, "chunk" counts chunks and "stage" stages.
    constexpr int CPS = Layout::STAGE_CHUNKS, RING = STAGES * CPS;
    // The loop below unrolls by rings, so that the cursors stand at the first chunk of a pair in pair order
    // (NativeLayoutT), where a chunk's offset from them then is a constant.
    static_assert(!Layout::ORDER_BY_PAIRS || RING % 2 == 0, "pair order: an even number of chunks in the ring");
    static_assert(Layout::SCALE_BYTES == 0 || RING <= 4, "a scale quad is rewritten 8 chunks on (NativeLayoutT)");
    const int groups = args.cols / GROUP;
    const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.0f;
    Layout cursor[MT] = {Layout(args.packed, args.scale, args.row0[0], groups, first, step, scale_ring),
                         Layout(args.packed, args.scale, args.row0[1], groups, first, step,
                                scale_ring + Layout::SCALE_BYTES)};
    static_assert(MT == 2, "the cursors above list two m16 tiles");
    // Copies of the chunk `ahead` chunks past the cursors' into stage `stage` (see the layouts' cursors).
    auto stage_weights = [&](int stage, int ahead) {
#pragma unroll
        for (int m = 0; m < MT; ++m) cursor[m].template stage<WHOLE>(ring + stage * MT + m, ahead);
    };
    // The lane's 64 bytes of each staged chunk, from a cursor that walks the chunks with the weights'.
    const uint4* act_chunk = act[0] + first * CHUNK_GROUPS * (GROUP / 8);
    int act_group = first * CHUNK_GROUPS;
    auto stage_acts = [&](int stage, int ahead) {
        const int skip = Layout::chunk_offset(ahead, step) * CHUNK_GROUPS, g = act_group + skip;  // in groups
        const uint4* src = act_chunk + skip * (GROUP / 8);
        if (ONE) {
            if (r < CHUNK_GROUPS) {
                const bool in = WHOLE || g + r < groups;
                cp_async16(&acts[stage].x[r][0][c], in ? src + r * (GROUP / 8) : act[0], in ? 16 : 0);
            }
        } else if (r < tokens) {
#pragma unroll
            for (int j = 0; j < CHUNK_GROUPS; ++j) {
                const bool in = WHOLE || g + j < groups;
                cp_async16(&acts[stage].x[j][r][c], in ? src + j * (GROUP / 8) : act[0], in ? 16 : 0);
            }
        }
    };
    auto advance = [&](int chunks) {
#pragma unroll
        for (int m = 0; m < MT; ++m) cursor[m].advance(chunks);
        act_chunk += Layout::chunk_offset(chunks, step) * CHUNK_GROUPS * (GROUP / 8);
        act_group += Layout::chunk_offset(chunks, step) * CHUNK_GROUPS;
    };
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
        if (s * CPS < count) stage_weights(s, s * CPS);
        cp_async_commit();  // also when empty, so the group count stays one per stage
    }
    if (NT == 1 && r >= tokens && SLOTS == 8) {
#pragma unroll
        for (int s = 0; s < RING; ++s)
#pragma unroll
            for (int j = 0; j < CHUNK_GROUPS; ++j) acts[s].x[j][r][c] = make_uint4(0, 0, 0, 0);
    }
    const ActStageT<SLOTS>* reads = acts;  // the lane's activation ring (see ActStageT)
    if (SLOTS < 8) {
        uint4* zeros = acts[RING].x[0][0];
        for (int i = lane; i < RING * (int)(sizeof(ActStageT<SLOTS>) / sizeof(uint4)); i += 32)
            zeros[i] = make_uint4(0, 0, 0, 0);
        if (r >= SLOTS) reads = acts + RING;
    }
    wait_inputs();
    pdl_launch_dependents();
    if (NT == 1) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
#pragma unroll
            for (int half = 0; half < CPS; ++half)
                if (s * CPS + half < count) stage_acts(s * CPS + half, s * CPS + half);
            cp_async_commit();
        }
    }
    uint32_t minus136[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) minus136[i] = *static_cast<volatile const uint32_t*>(&minus136_pair);
    // Rounds of RING chunks, unrolled, so that each chunk's stage, slot and offset are constants; the
    // cursors stand at chunk i (the round's first) throughout a round.
    for (int i = 0; i < count; i += RING) {
#pragma unroll
        for (int first_of_stage = 0; first_of_stage < RING; first_of_stage += CPS) {
            const int stage = first_of_stage / CPS;  // chunks i + first_of_stage .., in stage `stage`
            if (i + first_of_stage >= count) break;
            cp_async_wait<STAGES - 1>();  // the stage's weights (and activations) have landed for this lane ...
            __syncwarp();                 // ... and for every lane
#pragma unroll
            for (int half = 0; half < CPS; ++half) {
                const int ahead = first_of_stage + half;  // the chunk's place in the round
                if (CPS > 1 && i + ahead >= count) break;
                uint4 x[CHUNK_GROUPS];
                if (NT == 1) {
#pragma unroll
                    for (int j = 0; j < CHUNK_GROUPS; ++j) x[j] = reads[ahead].x[j][SLOTS == 8 ? r : 0][c];
                }
                const int g0 = (first + Layout::chunk_offset(i + ahead, step)) * CHUNK_GROUPS;
                chunk_mma<Layout, MT, NT, ONE, WHOLE>(acc, cursor, ring + stage * MT, ahead, x, act, g0, groups,
                                                      minus136);
            }
            __syncwarp();  // every lane is done with the stage before it is refilled
            if (i + first_of_stage + RING < count) {
                stage_weights(stage, first_of_stage + RING);
                if (NT == 1) {
#pragma unroll
                    for (int half = 0; half < CPS; ++half) {
                        const int ahead = first_of_stage + half + RING;
                        if (i + ahead < count) stage_acts(ahead - RING, ahead);
                    }
                }
            }
            cp_async_commit();
        }
        advance(RING);
    }
    cp_async_wait<0>();
}

// The expert this block serves: its pairs are sorted_pairs[begin, begin + count), the first of them
// from token first_token.
struct ExpertSlice {
    int expert, begin, count, first_token;
};

// Where a GEMM block finds its expert. After the alignment, blockIdx.y is the rank of an active expert:
// the grid has at most E blocks in y, so active_slices[blockIdx.y] is in bounds, and it is loaded
// together with num_active, so one load latency precedes the block's first weight copy (an entry past
// num_active is stale and unused). With one token ("direct"), the k routing slots are the experts, each
// with its one pair: the block of slot y serves expert topk_ids[y] with pair y as its h and y row, the
// aligned path's arithmetic on other rows, so the bits are the same. The routing is complete when the
// gate/up GEMM starts while the alignment may not be (rule T), so the direct gate/up kernel stages its
// first weights before its wait. An id out of range (which the alignment reports) leaves its slot idle in
// both GEMMs. The loads go through L2 only (ld.global.cg): they precede griddepcontrol.wait.
struct BlockRouting {
    const int4* active_slices;
    const int* num_active;
    const int* topk_ids;
    int experts, direct;
};

__device__ __forceinline__ bool aligned_expert(const int4* active_slices, const int* num_active, ExpertSlice& s) {
    const int active = __ldcg(num_active);
    const int4 slice = __ldcg(active_slices + blockIdx.y);
    s = ExpertSlice{slice.x, slice.y, slice.z, slice.w};
    return (int)blockIdx.y < active;
}

__device__ __forceinline__ bool direct_expert(const int* topk_ids, int experts, ExpertSlice& s) {
    const int e = __ldcg(topk_ids + blockIdx.y);
    s = ExpertSlice{e, (int)blockIdx.y, 1, 0};
    return e >= 0 && e < experts;
}

__device__ __forceinline__ bool block_expert(const BlockRouting& r, ExpertSlice& s) {
    return r.direct ? direct_expert(r.topk_ids, r.experts, s) : aligned_expert(r.active_slices, r.num_active, s);
}

// The fragment element idx = ((m * NT + n) * 32 + lane) * 4 + i sits at tile row lane / 4 (+ 8 for
// i >= 2) and token column n * 8 + 2 * (lane % 4) + (i & 1).
__device__ __forceinline__ int frag_row(int lane, int i) { return (lane >> 2) + (i >= 2 ? 8 : 0); }
__device__ __forceinline__ int frag_col(int n, int lane, int i) { return n * 8 + 2 * (lane & 3) + (i & 1); }

// A block's geometry: WARPS = KSPLIT warps splitting K by interleaved chunks (or pairs) x RGROUPS row groups of
// MT m16 tiles. Shared memory: the warps' weight stage rings, activation stage rings (one n8 tile) and
// scale rings (layouts that stage scales apart, NativeLayoutT), then, with K split over several warps, the
// partial sums [KSPLIT][RGROUPS][frag]. With one K slice each warp's accumulators are its row group's
// results, which the kernel stores from registers. SLOTS: token slots of an activation stage (ActStageT).
template <class Layout, int MT, int NT, int KSPLIT, int STAGES, int SLOTS = 8>
struct BlockShape {
    typedef typename Layout::Stage Stage;
    static constexpr int WARPS = gemm_warps(NT, KSPLIT), THREADS = WARPS * 32;
    static constexpr int RGROUPS = WARPS / KSPLIT;
    static constexpr int FRAG = MT * NT * 128;  // accumulators of one warp
    static constexpr bool PARTIALS = KSPLIT > 1;
    static constexpr size_t WEIGHT_RING_BYTES = (size_t)WARPS * STAGES * MT * sizeof(Stage);
    static constexpr int RING = STAGES * Layout::STAGE_CHUNKS;  // activation stages: one per chunk
    static constexpr size_t ACT_RING_BYTES =  // SLOTS < 8: the ring, then its zeros (ActStageT)
        NT == 1 ? (size_t)WARPS * RING * sizeof(ActStageT<SLOTS>) * (SLOTS < 8 ? 2 : 1) : 0;
    static constexpr size_t SCALE_RING_BYTES = (size_t)WARPS * MT * Layout::SCALE_BYTES;
    static constexpr size_t RING_BYTES = WEIGHT_RING_BYTES + ACT_RING_BYTES + SCALE_RING_BYTES;
    static constexpr size_t SHARED_BYTES = RING_BYTES + (PARTIALS ? (size_t)WARPS * FRAG * sizeof(float) : 0);
    static_assert(Layout::SCALE_BYTES == 0 || KSPLIT == 1, "scale quads need a warp's chunks to be consecutive");

    __device__ static Stage* ring(unsigned char* smem) {
        return reinterpret_cast<Stage*>(smem) + (threadIdx.x >> 5) * STAGES * MT;
    }
    __device__ static ActStageT<SLOTS>* act_ring(unsigned char* smem) {
        return reinterpret_cast<ActStageT<SLOTS>*>(smem + WEIGHT_RING_BYTES) +
               (threadIdx.x >> 5) * RING * (SLOTS < 8 ? 2 : 1);
    }
    __device__ static unsigned char* scale_ring(unsigned char* smem) {
        return smem + WEIGHT_RING_BYTES + ACT_RING_BYTES + (size_t)(threadIdx.x >> 5) * MT * Layout::SCALE_BYTES;
    }

    // How many of the `chunks` chunks the K slice whose first chunk is `first` takes.
    __device__ static int slice_chunks(int chunks, int first) {
        if (!Layout::ORDER_BY_PAIRS) return (chunks - first + KSPLIT - 1) / KSPLIT;
        const int whole = chunks / 2, pair = first / 2;  // whole pairs, and the slice's first pair
        const int pairs = (whole - pair + KSPLIT - 1) / KSPLIT;
        return 2 * max(pairs, 0) + (chunks % 2 != 0 && whole % KSPLIT == pair ? 1 : 0);
    }

    // Runs the warp's share of a pass into `acc` and, with several K slices, leaves it in the partials.
    // A row group past the matrix (`rows_valid` false) computes nothing but still reaches the barriers.
    template <bool ONE, bool WHOLE, class WaitInputs>
    __device__ static void pass(unsigned char* smem, const GemmArgs<MT>& args, const uint4* const (&act)[NT],
                                int tokens, bool rows_valid, WaitInputs wait_inputs, float (&acc)[MT][NT][4]) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kslice = warp % KSPLIT;
        const int chunks = (args.cols / GROUP + CHUNK_GROUPS - 1) / CHUNK_GROUPS;
        // The K slices interleave by chunk (slice s takes chunks s, s + KSPLIT, ...) or by pairs of chunks
        // (Layout::ORDER_BY_PAIRS), so a block's warps read neighbouring chunks at about the same time.
        const int first = Layout::ORDER_BY_PAIRS ? 2 * kslice : kslice;
        const int count = rows_valid ? slice_chunks(chunks, first) : 0;
        warp_gemm<Layout, MT, NT, STAGES, ONE, WHOLE>(acc, args, act, tokens, first, count, KSPLIT, ring(smem),
                                                      act_ring(smem), scale_ring(smem), wait_inputs);
        if (!PARTIALS) return;
        float* out = reinterpret_cast<float*>(smem + RING_BYTES) + (size_t)warp * FRAG;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<float4*>(&out[((m * NT + n) * 32 + lane) * 4]) =
                    make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
    }

    // Row group `rg`'s element idx summed over the K slices in order (warp w = rg * KSPLIT + kslice).
    __device__ static float sum(const unsigned char* smem, int rg, int idx) {
        static_assert(PARTIALS, "one K slice keeps its results in registers");
        const float* p = reinterpret_cast<const float*>(smem + RING_BYTES) + (size_t)rg * KSPLIT * FRAG + idx;
        float s = p[0];
#pragma unroll
        for (int k = 1; k < KSPLIT; ++k) s += p[(size_t)k * FRAG];
        return s;
    }
};

// Where an activation row keeps its element j (see GroupActs): as is for the tiled layout; for the native
// one, each 8 elements in the order 0 4 1 5 2 6 3 7.
template <class Layout>
__device__ __forceinline__ int act_column(int j) {
    if (!Layout::ACTS_PERMUTED) return j;
    const int e = j & 7;
    return (j & ~7) | (e < 4 ? 2 * e : 2 * e - 7);
}

// The down GEMM's view of a layout: its one K slice walks consecutive chunks, so the native layout stages
// the scales by quads.
template <class Layout>
struct DownView {
    typedef Layout type;
};
template <>
struct DownView<NativeLayout> {
    typedef NativeLayoutT<true> type;
};
// The one-token down GEMM's view: the native layout stages two chunks at a time as well (NativePairRows).
template <class Layout>
struct DirectDownView {
    typedef typename DownView<Layout>::type type;
};
template <>
struct DirectDownView<NativeLayout> {
    typedef NativeLayoutT<true, true> type;
};

// GEMM 1: h[pos, act_column(j)] = bf16(silu(x · gate_j) * (x · up_j)) for the expert's sorted positions
// `pos`, x's elements in act_column order as well. A row group covers 16 rows j of gate (m tile 0) and of up (m tile 1). Grid: (I / (16 RGROUPS),
// active experts).
// The narrow kernel counts each block done in handoff[slot] (rule H).
// Layout: a gate/up view (GateUp, DirectGateUp); STAGES counts its stages.
template <class Layout, int NT, int KSPLIT, int STAGES, bool ONE, bool WHOLE, int SLOTS = 8>
__device__ void gate_up(const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ w13,
                        const __nv_bfloat16* __restrict__ w13_scale, int H, int I, int k,
                        const int* __restrict__ sorted_pairs, const ExpertSlice& ex, __nv_bfloat16* __restrict__ h,
                        int* __restrict__ handoff) {
    typedef BlockShape<Layout, 2, NT, KSPLIT, STAGES, SLOTS> Shape;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, rg = (threadIdx.x >> 5) / KSPLIT;
    const int j0 = (blockIdx.x * Shape::RGROUPS + rg) * 16;
    const GemmArgs<2> args{w13, w13_scale, H, {ex.expert * 2 * I + j0, ex.expert * 2 * I + I + j0}};
    for (int t0 = 0; t0 < ex.count; t0 += NT * 8) {
        const uint4* act[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int t = min(t0 + n * 8 + (lane >> 2), ex.count - 1);
            const int token = t == 0 ? ex.first_token : sorted_pairs[ex.begin + t] / k;
            act[n] = reinterpret_cast<const uint4*>(x + (size_t)token * H) + (lane & 3);
        }
        float acc[2][NT][4];
        Shape::template pass<ONE, WHOLE>(smem, args, act, min(ex.count - t0, NT * 8), true, [] { pdl_wait(); }, acc);
        __syncthreads();
        for (int idx = threadIdx.x; idx < Shape::RGROUPS * NT * 128; idx += Shape::THREADS) {
            const int g = idx / (NT * 128), e = idx % (NT * 128);
            const int n = e / 128, l = (e / 4) & 31, i = e & 3;
            const int t = t0 + frag_col(n, l, i);
            if (t >= ex.count) continue;
            const float gate = Shape::sum(smem, g, e), up = Shape::sum(smem, g, NT * 128 + e);
            const float silu = gate / (1.0f + expf(-gate));
            const int row = (blockIdx.x * Shape::RGROUPS + g) * 16 + frag_row(l, i);
            h[(size_t)(ex.begin + t) * I + act_column<Layout>(row)] = __float2bfloat16_rn(silu * up);
        }
        __syncthreads();
    }
    // The barrier above orders every thread's h stores before thread 0's release (fence + relaxed add,
    // cumulative over what the barrier ordered), so one thread publishes the whole block's rows.
    if (NT == 1 && threadIdx.x == 0) add_release(handoff + blockIdx.y, 1);
}

// The narrow down GEMM's wait for its expert's h (rule H): every lane spins on the count of the slot's
// gate/up blocks done; the last block of the slot to get past it zeroes both counts. The warp barrier
// keeps lane 0 from counting its block past the wait before every lane of it has left the loop, so no
// lane can read the zeroed count and spin forever.
__device__ __forceinline__ void wait_for_expert(int* handoff, int gate_up_blocks) {
    const int slot = blockIdx.y;
    while (load_acquire(handoff + slot) < gate_up_blocks) __nanosleep(64);
    __syncwarp();
    if ((threadIdx.x & 31) == 0 && atomicAdd(handoff + MAX_EXPERTS + slot, 1) == (int)gridDim.x - 1) {
        handoff[slot] = 0;
        handoff[MAX_EXPERTS + slot] = 0;
    }
}

// GEMM 2: y[pair, r] = h[pos] · down_r; a row group covers 32 rows (two m16 tiles).
// Grid: (ceil(H / (32 RGROUPS)), active experts). ONE: the expert has one token (see group_mma). View: the
// layout's DownView (or DirectDownView); STAGES counts its stages.
template <class View, int NT, int KSPLIT, int STAGES, bool ONE, bool WHOLE, int SLOTS = 8>
__device__ void down(const __nv_bfloat16* __restrict__ h, const uint32_t* __restrict__ w2,
                     const __nv_bfloat16* __restrict__ w2_scale, int H, int I, const int* __restrict__ sorted_pairs,
                     bool direct, const ExpertSlice& ex, float* __restrict__ y, int* __restrict__ handoff) {
    typedef BlockShape<View, 2, NT, KSPLIT, STAGES, SLOTS> Shape;
    static_assert(!Shape::PARTIALS, "each warp is a row group: its results are stored from its registers");
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, rg = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * Shape::RGROUPS + rg) * 32;
    const GemmArgs<2> args{w2, w2_scale, I, {ex.expert * H + r0, ex.expert * H + r0 + 16}};
    for (int t0 = 0; t0 < ex.count; t0 += NT * 8) {
        const uint4* act[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int t = min(t0 + n * 8 + (lane >> 2), ex.count - 1);
            act[n] = reinterpret_cast<const uint4*>(h + (size_t)(ex.begin + t) * I) + (lane & 3);
        }
        const int gate_up_blocks = (I + 15) / 16;  // the narrow gate/up grid's rows (asserted below)
        float acc[2][NT][4];
        Shape::template pass<ONE, WHOLE>(
            smem, args, act, min(ex.count - t0, NT * 8), r0 < H,
            [&] {
                if constexpr (NT == 1) {
                    static_assert(KSPLIT == 1 && Shape::WARPS == 1, "one warp per narrow down block: each counts once");
                    wait_for_expert(handoff, gate_up_blocks);
                } else {
                    pdl_wait();
                }
            },
            acc);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = t0 + frag_col(n, lane, i), row = r0 + m * 16 + frag_row(lane, i);
                    if (t >= ex.count || row >= H) continue;
                    const int pair = direct ? ex.begin + t : sorted_pairs[ex.begin + t];
                    y[(size_t)pair * H + row] = acc[m][n][i];
                }
    }
}

// Launch geometry shared with src/cuda/moe_int4.rs: K slices per row group and pipeline depths. Gate/up
// splits K = H over 4 warps (14 chunks each at Kimi-K2 sizes) for a row group of 16 h rows; down gives
// each warp a whole row group of 32 output rows and all of K = I (16 chunks), so a narrow down block is
// one warp and needs no partial sums. Small blocks balance the SMs: at one token (8 experts) the narrow
// down GEMM has 1792 one-warp blocks, 13-14 per SM, where 256-row blocks of 8 K-split warps gave 224
// blocks, 1 or 2 per SM (18% over the mean; Nsight Compute: 46% of DRAM bandwidth). Against 4 K slices
// for down, one slice took T 16 from 784 to 765 us and T 256 from 3.79 to 3.43 ms and left T <= 8 within
// 1% (session 12, tiled). Two gate/up K slices instead of four (every gate/up kernel alike, as batch
// invariance needs; at one token one wave of 2-warp blocks instead of 1.94 of 4-warp ones) made the
// native forward 2-12% slower at T 1-64, the tiled one 2.3% slower at T 1 and 2.6-3.0% faster at
// T 16-64 (session 25, H200). The narrow kernels stage 3 chunks of weights and activations per warp (the
// native gate/up GEMM 2, see GateUp): four 4-warp gate/up blocks (55 KB; the native launch 48 KB) or 15-16
// one-warp down blocks (13 KB, the native ones 14 KB with their scale quads) fit an SM's 228 KB, as many
// as the 128 registers of their threads allow.
constexpr int GATE_UP_KSPLIT = 4;
constexpr int DOWN_KSPLIT = 1;
constexpr int NARROW_STAGES = 3;
constexpr int WIDE_STAGES = 2;
// The native down GEMM of one token (moe_down_direct_native) stages one token slot of activations (256
// bytes a chunk instead of 2 KB), which leaves room for a fourth chunk in flight at 16 one-warp blocks an
// SM (see down_direct_kernel); it counts chunks, staged two at a time (DirectDownView).
constexpr int DIRECT_DOWN_STAGES = 4;

// The gate/up GEMMs of a layout, narrow (NT 1) or wide: their view and stages. The native
// layout's K slices take pairs of chunks (NativeLayoutT PAIR_ORDER), and its rings hold an even number of
// chunks (warp_gemm): the narrow one 2 (38 KB a block). On the H200 (session 28, against 3 chunks in the
// chunk order) that made the native forward 1.0-1.8% faster at T 4-16; 3 chunks in pair order, whose
// loop then unrolls by 6 (1278 sm_90 instructions, against 645 by 3), were 1.0-1.9% slower, and 2
// two-chunk stages (72 KB, three blocks an SM) within 0.7% of the chunk order. A narrow block whose
// expert has one token runs the one-token kernel's stages instead (DirectGateUp, 48 KB, so the narrow
// native launch asks for 48 KB and still fits four blocks an SM): 0-0.9% faster at T 4-16.
template <class Layout, int NT>
struct GateUp {
    typedef Layout View;
    static constexpr int STAGES = NT == 1 ? NARROW_STAGES : WIDE_STAGES;
};
template <int NT>
struct GateUp<NativeLayout, NT> {
    typedef NativeLayoutT<false, false, true> View;
    static constexpr int STAGES = NT == 1 ? 2 : WIDE_STAGES;
};

// The gate/up GEMM of one token: the tiled layout runs the narrow kernel's ring; the native one stages
// both chunks of a pair at once (NativeLayoutT PAIRS: each copy instruction 4 whole 128-byte lines instead
// of 8 half lines) in a ring of 2, 4 chunks in flight, with one-slot activation stages, so that four
// 4-warp blocks still fit an SM (48 KB each).
template <class Layout>
struct DirectGateUp {
    typedef Layout View;
    static constexpr int STAGES = NARROW_STAGES, SLOTS = 8;
};
template <>
struct DirectGateUp<NativeLayout> {
    typedef NativeLayoutT<false, true> View;
    static constexpr int STAGES = 2, SLOTS = 1;
};

// Calls f(std::true_type) when K = `cols` splits into whole stages of STAGE_CHUNKS chunks (every Kimi-K2
// matrix), else f(std::false_type): the chunk loops of the first kind check no bounds (the native layout's
// copies and the activations' would otherwise select addresses and sizes per copy), the others zero what
// lies past K.
template <int STAGE_CHUNKS = 1, class F>
__device__ __forceinline__ void with_whole_chunks(int cols, F f) {
    if (cols % (GROUP * CHUNK_GROUPS * STAGE_CHUNKS) == 0)
        f(std::true_type{});
    else
        f(std::false_type{});
}

// Calls f(one_path, whole) with both as std::bool_constant: one_path when `one` (an expert with one token,
// see group_mma) and MAY_BE_ONE, so that kernels of several n8 tiles never instantiate it; whole as in
// with_whole_chunks<STAGE_CHUNKS>(cols).
template <bool MAY_BE_ONE, int STAGE_CHUNKS, class F>
__device__ __forceinline__ void with_paths(bool one, int cols, F f) {
    with_whole_chunks<STAGE_CHUNKS>(cols, [&](auto whole) {
        if (MAY_BE_ONE && one)
            f(std::bool_constant<MAY_BE_ONE>{}, whole);
        else
            f(std::false_type{}, whole);
    });
}

// Experts with at most 8 tokens take the narrow kernels (one n8 tile, a deep pipeline), the others the
// wide ones (2 n8 tiles per pass), so the common few-token case keeps its registers and occupancy. Both
// compute every element with the same operations, so which one serves an expert changes no result.
template <class Layout, int NT>
__device__ __forceinline__ void gate_up_kernel(const __nv_bfloat16* x, const uint32_t* w13,
                                               const __nv_bfloat16* w13_scale, int H, int I, int k,
                                               const int4* slices, const int* num_active, const int* pairs,
                                               __nv_bfloat16* h, int* handoff) {
    // The alignment and x may come from the kernels just before: wait for them first (there is nothing
    // to prefetch before knowing the expert).
    pdl_wait();
    pdl_launch_dependents();
    ExpertSlice ex;
    if (!aligned_expert(slices, num_active, ex) || (ex.count > 8) != (NT > 1)) return;
    // Most experts of a few-token routing have one token (at T 16, 90 of about 109 on Kimi-K2's 384).
    const bool one = NT == 1 && ex.count == 1;
    // An expert with one token takes the one-token kernel's stages (DirectGateUp; the launch gives the
    // block the larger shared memory of the two), the others the narrow ring; the same chunks in the same
    // order, so the same bits either way.
    typedef GateUp<Layout, NT> G;
    typedef DirectGateUp<Layout> D;
    constexpr int WHOLE_CHUNKS = NT == 1 && D::View::STAGE_CHUNKS > G::View::STAGE_CHUNKS ? D::View::STAGE_CHUNKS
                                                                                        : G::View::STAGE_CHUNKS;
    with_paths<NT == 1, WHOLE_CHUNKS>(one, H, [&](auto one_path, auto whole) {
        if constexpr (decltype(one_path)::value)
            gate_up<typename D::View, 1, GATE_UP_KSPLIT, D::STAGES, true, decltype(whole)::value, D::SLOTS>(
                x, w13, w13_scale, H, I, k, pairs, ex, h, handoff);
        else
            gate_up<typename G::View, NT, GATE_UP_KSPLIT, G::STAGES, false, decltype(whole)::value>(
                x, w13, w13_scale, H, I, k, pairs, ex, h, handoff);
    });
}

// The gate/up GEMM of one token (direct_expert): the expert is known before the wait, so warp_gemm
// issues the first weight stages while the kernels before finish.
template <class Layout>
__device__ __forceinline__ void gate_up_direct_kernel(const __nv_bfloat16* x, const uint32_t* w13,
                                                      const __nv_bfloat16* w13_scale, int H, int I,
                                                      const int* topk_ids, int experts, __nv_bfloat16* h,
                                                      int* handoff) {
    typedef DirectGateUp<Layout> D;
    ExpertSlice ex;
    if (direct_expert(topk_ids, experts, ex))
        with_whole_chunks<D::View::STAGE_CHUNKS>(H, [&](auto whole) {
            gate_up<typename D::View, 1, GATE_UP_KSPLIT, D::STAGES, true, decltype(whole)::value, D::SLOTS>(
                x, w13, w13_scale, H, I, 1, nullptr, ex, h, handoff);
        });
    pdl_wait();  // rule W on every path (a block that ran has waited in warp_gemm already)
}

template <class Layout, int NT, int STAGES>
__device__ __forceinline__ void down_kernel(const __nv_bfloat16* h, const uint32_t* w2,
                                            const __nv_bfloat16* w2_scale, int H, int I, const BlockRouting& routing,
                                            const int* pairs, float* y, int* handoff) {
    // The routing is complete before this kernel starts (rule T above), so the expert is known before
    // the wait, and warp_gemm issues the block's first weight stages while the gate/up GEMM finishes.
    ExpertSlice ex;
    if (block_expert(routing, ex) && (ex.count > 8) == (NT > 1)) {
        const bool direct = routing.direct, one = NT == 1 && ex.count == 1;  // always one for a direct routing
        typedef typename DownView<Layout>::type View;
        with_paths<NT == 1, View::STAGE_CHUNKS>(one, I, [&](auto one_path, auto whole) {
            down<View, NT, DOWN_KSPLIT, STAGES, decltype(one_path)::value, decltype(whole)::value>(
                h, w2, w2_scale, H, I, pairs, direct, ex, y, handoff);
        });
    }
    pdl_wait();  // rule W on every path (a wide block has waited in warp_gemm already; a narrow one only spun)
}

// The down GEMM of one token (direct_expert): every block has one token, so activation stages of one
// slot (ActStageT<1>) and a deeper ring than the narrow kernel's, with the same arithmetic in the same
// order (so the same bits). On the H200 the native one-token forward is 2.2% faster with it than with the
// narrow kernel (its loop 219.5 instead of 229.7 sm_90 instructions a chunk, and no spill), the tiled one
// not faster (`experts` +0.1%, `step` +1.1%; session 25), so only the native layout has one. One m16 tile
// a warp instead (3584 blocks of 16 rows, 28 an SM, same bits) was 5.6% slower: about 195 instructions a
// chunk per 16 rows, since the activations' conversion and the copies' bookkeeping are then not shared
// by two tiles (session 26, branch wip/moe-down-direct-mt1). Its two-chunk stages (DirectDownView) made the
// native `experts` T 1 0.5-0.7% faster (session 27, branch wip/moe-down-pairs). The direct gate/up GEMM
// with these one-slot stages and 4 one-chunk stages in flight gained nothing (`experts` T 1 -0.3%) and
// made the one-token step 2.7-5.1% slower in both layouts (session 26, branch
// wip/moe-gate-up-direct-slots); with two-chunk stages (DirectGateUp) the native one-token forward is
// 5-6% faster (session 28, with the down GEMM's pairs).
template <class Layout>
__device__ __forceinline__ void down_direct_kernel(const __nv_bfloat16* h, const uint32_t* w2,
                                                   const __nv_bfloat16* w2_scale, int H, int I, const int* topk_ids,
                                                   int experts, float* y, int* handoff) {
    typedef typename DirectDownView<Layout>::type View;
    ExpertSlice ex;
    if (direct_expert(topk_ids, experts, ex))
        with_whole_chunks<View::STAGE_CHUNKS>(I, [&](auto whole) {
            down<View, 1, DOWN_KSPLIT, DIRECT_DOWN_STAGES / View::STAGE_CHUNKS, true, decltype(whole)::value, 1>(
                h, w2, w2_scale, H, I, nullptr, true, ex, y, handoff);
        });
    pdl_wait();  // rule W on every path
}

#define KDT_MOE_GEMMS(LAYOUT, NT, STAGES, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(gemm_warps(NT, GATE_UP_KSPLIT) * 32,                         \
                                                 gemm_min_blocks(NT, GATE_UP_KSPLIT))                         \
        moe_gate_up_##SUFFIX(const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ w13,           \
                             const __nv_bfloat16* __restrict__ w13_scale, int H, int I, int k,                \
                             const int4* __restrict__ slices, const int* __restrict__ num_active,             \
                             const int* __restrict__ pairs, __nv_bfloat16* __restrict__ h,                    \
                             int* __restrict__ handoff) {                                                     \
        gate_up_kernel<LAYOUT, NT>(x, w13, w13_scale, H, I, k, slices, num_active, pairs, h, handoff); \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(gemm_warps(NT, DOWN_KSPLIT) * 32,                            \
                                                 gemm_min_blocks(NT, DOWN_KSPLIT))                            \
        moe_down_##SUFFIX(const __nv_bfloat16* __restrict__ h, const uint32_t* __restrict__ w2,               \
                          const __nv_bfloat16* __restrict__ w2_scale, int H, int I,                           \
                          const int4* __restrict__ slices, const int* __restrict__ num_active,                \
                          const int* __restrict__ topk_ids, int E, int direct, const int* __restrict__ pairs,  \
                          float* __restrict__ y, int* __restrict__ handoff) {                                 \
        down_kernel<LAYOUT, NT, STAGES>(h, w2, w2_scale, H, I, BlockRouting{slices, num_active, topk_ids, E,  \
                                        direct}, pairs, y, handoff);                                          \
    }

// The direct gate/up GEMM (one token, so narrow only), with the narrow kernel's block (DirectGateUp).
#define KDT_MOE_GATE_UP_DIRECT(LAYOUT, SUFFIX)                                                               \
    extern "C" __global__ void __launch_bounds__(gemm_warps(1, GATE_UP_KSPLIT) * 32,                          \
                                                 gemm_min_blocks(1, GATE_UP_KSPLIT))                          \
        moe_gate_up_direct_##SUFFIX(const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ w13,    \
                                    const __nv_bfloat16* __restrict__ w13_scale, int H, int I,                \
                                    const int* __restrict__ topk_ids, int E, __nv_bfloat16* __restrict__ h,   \
                                    int* __restrict__ handoff) {                                              \
        gate_up_direct_kernel<LAYOUT>(x, w13, w13_scale, H, I, topk_ids, E, h, handoff);                      \
    }

// Narrow kernels are held to 128 registers so 16 warps share an SM; the wide ones keep their two n8
// tiles' accumulators in registers at one block per SM.
KDT_MOE_GEMMS(NativeLayout, 1, NARROW_STAGES, native)
KDT_MOE_GEMMS(NativeLayout, 2, WIDE_STAGES, wide_native)
KDT_MOE_GEMMS(TiledLayout, 1, NARROW_STAGES, tiled)
KDT_MOE_GEMMS(TiledLayout, 2, WIDE_STAGES, wide_tiled)
KDT_MOE_GATE_UP_DIRECT(NativeLayout, native)
KDT_MOE_GATE_UP_DIRECT(TiledLayout, tiled)

// The native down GEMM of one token (down_direct_kernel), with the narrow down kernel's geometry.
extern "C" __global__ void __launch_bounds__(gemm_warps(1, DOWN_KSPLIT) * 32, gemm_min_blocks(1, DOWN_KSPLIT))
    moe_down_direct_native(const __nv_bfloat16* __restrict__ h, const uint32_t* __restrict__ w2,
                           const __nv_bfloat16* __restrict__ w2_scale, int H, int I, const int* __restrict__ topk_ids,
                           int E, float* __restrict__ y, int* __restrict__ handoff) {
    down_direct_kernel<NativeLayout>(h, w2, w2_scale, H, I, topk_ids, E, y, handoff);
}

// Dynamic shared memory of each GEMM kernel, for the launcher (which must match these sizes).
template <class Layout>
constexpr bool fits_shared() {
    typedef GateUp<Layout, 1> N;
    typedef GateUp<Layout, 2> W;
    typedef DirectGateUp<Layout> D;
    return BlockShape<typename N::View, 2, 1, GATE_UP_KSPLIT, N::STAGES>::SHARED_BYTES <= 99 * 1024 &&
           BlockShape<typename W::View, 2, 2, GATE_UP_KSPLIT, W::STAGES>::SHARED_BYTES <= 99 * 1024 &&
           BlockShape<typename D::View, 2, 1, GATE_UP_KSPLIT, D::STAGES, D::SLOTS>::SHARED_BYTES <= 99 * 1024 &&
           BlockShape<typename DownView<Layout>::type, 2, 1, DOWN_KSPLIT, NARROW_STAGES>::SHARED_BYTES <= 99 * 1024 &&
           BlockShape<typename DownView<Layout>::type, 2, 2, DOWN_KSPLIT, WIDE_STAGES>::SHARED_BYTES <= 99 * 1024 &&
           BlockShape<typename DirectDownView<Layout>::type, 2, 1, DOWN_KSPLIT,
                      DIRECT_DOWN_STAGES / DirectDownView<Layout>::type::STAGE_CHUNKS, 1>::SHARED_BYTES <=
               99 * 1024;  // moe_down_direct_native
}
static_assert(fits_shared<NativeLayout>() && fits_shared<TiledLayout>(), "GEMM shared memory over 99 KB");
static_assert(BlockShape<TiledLayout, 2, 1, GATE_UP_KSPLIT, NARROW_STAGES>::RGROUPS == 1 &&
                  BlockShape<NativeLayout, 2, 1, GATE_UP_KSPLIT, NARROW_STAGES>::RGROUPS == 1,
              "a narrow gate/up block is one 16-row group: the down GEMM waits for ceil(I / 16) of them (rule H)");
// gate_up does not bound its rows by I (its h stores would land in the next row), so a block's rows must
// divide every I the launcher takes: a multiple of GROUP.
static_assert(GROUP % (16 * BlockShape<TiledLayout, 2, 2, GATE_UP_KSPLIT, WIDE_STAGES>::RGROUPS) == 0 &&
                  GROUP % (16 * BlockShape<NativeLayout, 2, 2, GATE_UP_KSPLIT, WIDE_STAGES>::RGROUPS) == 0,
              "a wide gate/up block's rows divide I");
static_assert(sizeof(NativeStage) == 1152 && sizeof(NativeRows) == 1024 && sizeof(ScaleQuads) == 1024 &&
                  sizeof(NativePairRows) == 2 * sizeof(NativeRows) &&
                  sizeof(NativePairStage) == 2 * sizeof(NativeStage),
              "src/cuda/moe_int4.rs sizes the native stages and scale quads");
static_assert(sizeof(StageTile) == 1152, "StageTile is the tiled layout's chunk image");
static_assert(BlockShape<GateUp<NativeLayout, 1>::View, 2, 1, GATE_UP_KSPLIT,
                         GateUp<NativeLayout, 1>::STAGES>::SHARED_BYTES == 38912,
              "mirrored by gemm_shared_bytes_of in src/cuda/moe_int4.rs (which gives the launch the larger "
              "one-token stages below)");
static_assert(BlockShape<DirectGateUp<NativeLayout>::View, 2, 1, GATE_UP_KSPLIT, DirectGateUp<NativeLayout>::STAGES,
                         DirectGateUp<NativeLayout>::SLOTS>::SHARED_BYTES == 49152,
              "mirrored by NATIVE_ONE_TOKEN_GATE_UP_BYTES in src/cuda/moe_int4.rs");
static_assert(sizeof(ActStage) == 2048, "src/cuda/moe_int4.rs sizes the activation stages");

// out[t, c] = Σ_slot weight[t, slot] · y[t * k + slot, c], in slot order, multiply and add rounded
// separately as in the CPU reference, over the slots of this plan's experts (topk_ids >= 0: the others
// are another share's, and their y rows are never written). Grid: (ceil(H / 256), T).
extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const float* __restrict__ y, const float* __restrict__ topk_weights,
                const int* __restrict__ topk_ids, int H, int k, float* __restrict__ out) {
    // The one exception to rule T (see there): the next forward's gate/up blocks may start as soon as every
    // combine CTA has, and stage their first weights during the down GEMM's tail.
    pdl_launch_dependents();
    pdl_wait();  // y and topk_weights come from earlier kernels
    const int t = blockIdx.y, col = blockIdx.x * 256 + threadIdx.x;
    if (col >= H) return;
    float acc = 0.0f;
    for (int slot = 0; slot < k; ++slot)
        if (topk_ids[t * k + slot] >= 0)
            acc = __fadd_rn(acc, __fmul_rn(topk_weights[t * k + slot], y[((size_t)t * k + slot) * H + col]));
    out[(size_t)t * H + col] = acc;
}

// x with each 8 elements in act_column order, for the native layout's gate/up GEMMs (see GroupActs): one
// 16-byte piece per thread. It triggers first (see rule T) and writes after its wait, when the GEMMs that
// read the previous x have completed.
extern "C" __global__ void __launch_bounds__(256)
    moe_pair_acts(const uint4* __restrict__ x, int pieces, uint4* __restrict__ out) {
    pdl_launch_dependents();
    pdl_wait();
    for (int i = blockIdx.x * 256 + threadIdx.x; i < pieces; i += gridDim.x * 256) {
        const uint4 v = x[i];
        out[i] = make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),  // elements (0, 4), (1, 5)
                            __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));  // (2, 6), (3, 7)
    }
}

// ---------------------------------------------------------------------------------------------------
// Layout and benchmark helpers.

// A packed word with element 2j moved to nibble j and element 2j + 1 to nibble 4 + j
// (cpu::moe_int4::interleave_nibbles).
__device__ __forceinline__ uint32_t interleave_nibbles(uint32_t w) {
    uint32_t out = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) out |= ((w >> (4 * i)) & 0xFu) << (4 * (i / 2 + (i % 2) * 4));
    return out;
}

// Native -> tiled repack of a [rows, cols] matrix (rows a multiple of 16): for every (16-row tile, chunk
// of 4 groups) the StageTile image of interleaved words. One thread per (tile, chunk, lane); groups past
// the end are zeros.
extern "C" __global__ void int4_tile(const uint32_t* __restrict__ packed, const __nv_bfloat16* __restrict__ scale,
                                     int rows, int cols, uint32_t* __restrict__ packed_tiled,
                                     __nv_bfloat16* __restrict__ scale_tiled) {
    const int groups = cols / GROUP, chunks = (groups + CHUNK_GROUPS - 1) / CHUNK_GROUPS;
    const size_t total = (size_t)(rows / 16) * chunks * 32;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int lane = i % 32, r = lane >> 2, c = lane & 3;
        const size_t tile = i / 32;
        const int chunk = tile % chunks, row0 = (int)(tile / chunks) * 16;
        for (int half = 0; half < 2; ++half)
            for (int j = 0; j < CHUNK_GROUPS; ++j) {
                const int g = chunk * CHUNK_GROUPS + j;
                packed_tiled[tile * 256 + half * 128 + lane * 4 + j] =
                    g < groups ? interleave_nibbles(packed[(size_t)(row0 + r + 8 * half) * groups * 4 + g * 4 + c])
                               : 0u;
            }
        if (lane < 16) {
            const int row = lane & 7, half = lane >> 3;
            for (int j = 0; j < CHUNK_GROUPS; ++j) {
                const int g = chunk * CHUNK_GROUPS + j;
                scale_tiled[tile * 64 + row * 8 + half * 4 + j] =
                    g < groups ? scale[(size_t)(row0 + row + 8 * half) * groups + g] : __float2bfloat16_rn(0.0f);
            }
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
