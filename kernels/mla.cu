// MLA absorbed attention over a paged latent cache (DESIGN.md §4.3; exact contract in reference/README.md):
// mla_decode and tree_verify.
//
// Decomposition. Every (request, query row, head) walks its logical sequence of visible cache rows in
// chunks of SPLIT rows; consecutive chunks form fold groups of FOLD. A row's result is a fixed two-level
// fold: each group's chunk results (max, sum, unnormalized output) folded in chunk order from the
// initial state (fold_ml / fold_o), then the group states weighted by 2^(group max - row max) and summed
// in group order (FMA chains), then normalized.
//   mla_chunk computes chunks for a tile of BM query rows that share the chunk's key list: a CTA takes a
//   run of consecutive chunks (one, a pair, or a fold group), streamed through shared memory without a
//   break at the chunk borders, and either writes each chunk's result to its scratch slot or (`fold`)
//   writes only the group state, folded with the same fold_ml / fold_o, to the group's first slot.
//   Its three modes differ only in which rows and chunks a CTA takes:
//   decode: the H heads of one request, any run of chunks of its sequence;
//   prefix: all N*H rows of a tree request, the chunks lying wholly inside the prefix (read once per
//           request: the request's m-tiles are the fastest grid dimension, so they run side by side and
//           share the chunk through L2);
//   tail:   the H heads of one tree row, the chunks holding tree rows (never folded), over that row's
//           own key list (the prefix tail, then its visible tree rows in increasing row order).
//   mla_combine does the rest per row: a group's state starts from the folded slot where mla_chunk
//   folded its leading chunks (every chunk of a folded decode, the full prefix chunks of a folded tree
//   prefix), else from the initial state, and continues over the per-chunk slots; the groups are then
//   combined through the row max, taken first, so that no serial chain of (max, exp) steps over the
//   groups remains. For a few rows it splits each row's output dims over several CTAs and stages the
//   partials in shared memory with one burst of loads; for many rows mla_combine_rows runs the same
//   arithmetic as a plain loop, one CTA per row.
// Continuing a left fold from a stored state gives the bits of doing it in one place, and the row max
// is exact in any order, so whether a launch folds, and which combine kernel runs (host choices by
// launch size), never changes the bits. All modes run the same run_chunk, whose per-row arithmetic
// does not depend on the other rows of the tile (mma computes each output element from its own row)
// nor on where the keys come from (a key sits at the same position of the chunk in every mode). So a
// tree row gives the bits of a decode over its compacted sequence, and a request gives the same bits
// alone or in any batch.
//
// Grids are sized from the run's max_seq_len (a host-known bound on every row's sequence), not the
// plan's; a row past it is flagged (STATUS_TOO_LONG) and gets o = 0, lse = -inf.
//
// Inside a chunk, a CTA of 8 warps takes a tile of 16 query rows (one mma M tile; see MT for why not two)
// and streams the chunk's keys through shared memory in sub-tiles of BK = 32 (cp.async, two stages, so
// the next sub-tile lands while this one is used), with an online softmax in base 2 and three barriers
// per sub-tile. (A ring of five 16-key stages with four sub-tiles in flight, commit 51c4176, measured
// 5-15% slower on the H200: the per-sub-tile chain S -> softmax -> P.V, not the loads' latency, bounds
// a CTA, so the work here goes into shortening that chain. Asking L2 for the rows of the sub-tiles 1-3
// ahead of the cp.async stream, prefetch.global.L2 per line, was 7-20% slower on every row, the more
// so the further ahead.) S = Q.K^T uses mma.m16n8k16 bf16 with Q in registers: each warp
// owns one dim quarter (144 dims) of the tile for two key n-tiles, accumulating the even and odd k-steps
// of each separately (four interleaved chains of at most 5 dependent mmas, then added), and the four
// quarter partials are added in a fixed order through shared memory (columns swizzled by s_col, so
// conflict-free). P.V rounds P to bf16 as a hi + lo pair (two mmas), so P keeps about f32 precision. A
// single bf16 P (branch wip/mla-bf16-p, the CPU reference rounding alike) stays inside the fixtures'
// tolerance (3.3-5.9e-4 against 2e-3) and made H 64 decodes and tree_verify 6-7% faster on the H200, but
// it moves the tiny model's "hello" prompt across a routing near-tie (at one layer a token's 8th and 9th
// experts, 6.3e-6 apart, swap), and its CUDA logits then differ from transformers' by 1.2e-2, over issue
// 5's 1e-2 (session 26).
// Each warp owns 64 output dims, so each V fragment it loads feeds 4 * MT mmas. A row's arithmetic is
// the same in every mode and tile position: the sub-tile borders sit at fixed keys of the chunk, a row's
// softmax always runs on 16 threads of 2 keys (each thread keeps its share of the row sum, added once per
// chunk by a fixed butterfly, so that no sum butterfly sits in every sub-tile's softmax), and every
// other step is per row or per (row, key) in a fixed order.
#include "common.cuh"

namespace kdt {
namespace mla {

constexpr int LATENT = 512;
constexpr int ROW = 576;             // elements of a query or cache row: [latent 512 | rope 64]
constexpr int SPLIT = 256;           // visible rows per chunk (reference/README.md)
constexpr int NT = 4;                // mma N tiles (8 keys each) of S per sub-tile
constexpr int BK = 8 * NT;           // keys per shared-memory sub-tile
constexpr int STAGES = 2;            // cp.async ring: the next sub-tile lands while this one is used
constexpr int S_NT = 2;              // S n-tiles per warp
constexpr int KV_STRIDE = ROW;       // unpadded rows, 16-byte pieces swizzled (see swizzle)
constexpr int S_STRIDE = BK;         // S partial rows of 128 B, columns swizzled by s_col
constexpr int P_STRIDE = BK + 8;     // P rows of 80 B: the 8 rows of an ldmatrix hit distinct banks
constexpr int QUARTER = ROW / 4;     // dims per S partial sum
constexpr int QUARTER_STEPS = QUARTER / 16;
constexpr int PIECES = ROW * 2 / 16; // 16-byte cp.async pieces per row
constexpr int ROW_THREADS = 16;      // softmax threads per query row
constexpr int ROW_KEYS = BK / ROW_THREADS;  // keys per softmax thread

// mma M tiles (16 query rows each) per CTA, 8 warps per M tile. Two (512 threads, 32 rows) share
// each staged key between twice the mmas, but at the 128 registers that 512 threads allow a CTA
// holds a whole SM, and on the H200 that was no faster for H 64 decodes (1-4%) and 7-14% slower for
// tree prefixes than two one-tile CTAs per SM (sessions before the swizzled rows). Two tiles in 8 warps
// (each warp two m-tiles in P.V and four n-tiles in S: 225 registers, 97664 bytes, one CTA an SM; branch
// wip/mla-wide) read a quarter fewer shared-memory wavefronts per row, but with 8 warps an SM were 3-5%
// slower at H 64 and 8-38% slower on tree prefixes (session 21). The kernel takes one: load_subtile maps
// 8 threads to a key row and accumulate_pv swizzles from a warp's first dim, both static_asserted
// (src/cuda/mla.rs mirrors the block size, tile rows and shared memory).
constexpr int MT = 1;
constexpr int BM = 16 * MT;                    // query rows per CTA
constexpr int THREADS = 256 * MT;
constexpr int WARPS = THREADS / 32;
constexpr int WARP_DIMS = LATENT / WARPS;      // output dims per warp in P.V
constexpr int PV_NT = WARP_DIMS / 8;           // their n-tiles
static_assert(WARPS == 4 * MT * (NT / S_NT), "S: one warp per (dim quarter, m-tile, S_NT n-tiles)");
static_assert(PV_NT % 2 == 0, "P.V: V fragments come in pairs of n-tiles");
static_assert(WARP_DIMS % 64 == 0, "P.V: a warp's dims start a group of 8 pieces, which swizzle permutes");
static_assert(THREADS == BM * ROW_THREADS, "softmax: ROW_THREADS threads per row");
static_assert(THREADS % BK == 0, "load_subtile: the same number of threads per key row");

constexpr int FOLD = 4;              // chunks per fold group (see the top of the file)

constexpr int MODE_DECODE = 0;
constexpr int MODE_PREFIX = 1;
constexpr int MODE_TAIL = 2;

// Status bits (mirrored in src/cuda/mla.rs).
constexpr int STATUS_BAD_PAGE = 1;  // a slot maps past the block table or to a page id out of range
constexpr int STATUS_TOO_LONG = 2;  // a row's sequence is longer than the run's max_seq_len (or the plan's scratch)

constexpr float LN2 = 0.693147180559945309f;
constexpr float LOG2E = 1.44269504088896341f;

static_assert(QUARTER_STEPS == 9, "the S loop below issues four x4 and one x2 ldmatrix per quarter");
static_assert(BK == 32, "P.V: two k-steps of 16 keys per sub-tile; s_col permutes 8-key quarters");
static_assert(ROW_KEYS == 2 && ROW_THREADS == 16, "softmax: one float2 of keys per thread, 16 threads per row");
static_assert(SPLIT % BK == 0, "a chunk is whole sub-tiles, so sub-tile borders sit at the same keys in every mode");

struct Smem {
    __nv_bfloat16 kv[STAGES][BK][KV_STRIDE];  // key sub-tiles, whole cache rows (at a chunk start, stage 1: Q)
    float s_part[4][BM][S_STRIDE];            // S partial sums of the four dim quarters
    __nv_bfloat16 p_hi[BM][P_STRIDE];         // P rounded to bf16 ...
    __nv_bfloat16 p_lo[BM][P_STRIDE];         // ... and the bf16 rounding of the remainder
    float alpha[BM];                          // per row: rescale of the running output
    float fold_a[BM];                         // per row: fold factors of the group state ...
    float fold_b[BM];                         // ... and of the chunk just computed
    long long key_off[2][SPLIT];              // element offset of each key row in the cache: the chunk being
                                              // computed and the CTA's next one (see NextChunk)
};

// 99 KB is the most a block may take on sm_120; on sm_90 two blocks fit an SM.
static_assert(sizeof(Smem) <= 99 * 1024, "shared memory budget");
static_assert(sizeof(Smem) == 88768, "mirrored by CHUNK_SHARED_BYTES in src/cuda/mla.rs");

// What one CTA computes: query rows [row0, row1) over chunk `chunk` of a sequence of `len` rows whose
// first `prefix` are slots 0..prefix and whose rest are the tree rows set in `vis` (nullptr: none).
struct Task {
    int row0, row1;
    int prefix;
    int len;
    int chunk;
    const uint32_t* vis;
};

// Paged cache geometry of a request.
struct Pages {
    const int* table;  // this request's block-table row
    int pages_per_req, page_size, num_pages;
};

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One step of the chunk-order fold: merges a chunk's (mc, lc) into the state (m, l) and returns the
// factors that rescale the state's output (a) and the chunk's output (b). mla_chunk (fold groups) and
// mla_combine both fold through these two functions, so the same inputs give the same bits in both.
__device__ __forceinline__ void fold_ml(float& m, float& l, float mc, float lc, float& a, float& b) {
    const float m_new = fmaxf(m, mc);
    a = ex2(__fsub_rn(m, m_new));
    b = ex2(__fsub_rn(mc, m_new));
    l = __fadd_rn(__fmul_rn(l, a), __fmul_rn(lc, b));
    m = m_new;
}
__device__ __forceinline__ float fold_o(float acc, float a, float oc, float b) {
    return __fadd_rn(__fmul_rn(acc, a), __fmul_rn(oc, b));
}

// Tree rows visible to a row: the bits below n_rows of its bitmask.
__device__ __forceinline__ int tree_count(const uint32_t* vis, int n_rows) {
    int count = 0;
    for (int w = 0; w * 32 < n_rows; ++w) {
        const int bits = n_rows - w * 32;
        const uint32_t mask = bits >= 32 ? 0xFFFFFFFFu : ((1u << bits) - 1u);
        count += __popc(vis[w] & mask);
    }
    return count;
}

// Element offset of a slot's cache row; a slot outside the block table or a bad page id flags the
// status and reads row 0 instead (never out of bounds).
__device__ __forceinline__ long long slot_offset(const Pages& pg, int slot, int* status) {
    const int idx = slot / pg.page_size;
    const int page = idx < pg.pages_per_req ? pg.table[idx] : -1;
    if (page < 0 || page >= pg.num_pages) {
        atomicOr(status, STATUS_BAD_PAGE);
        return 0;
    }
    return ((long long)page * pg.page_size + slot % pg.page_size) * ROW;
}

// Fills `key_off` with the chunk's keys in sequence order: prefix slots, then the visible tree rows.
__device__ void build_key_list(long long* key_off, const Task& t, const Pages& pg, int n_rows, int nkeys,
                               int* status) {
    const int begin = t.chunk * SPLIT;
    for (int i = threadIdx.x; i < min(t.prefix - begin, nkeys); i += THREADS)
        key_off[i] = slot_offset(pg, begin + i, status);
    if (t.vis == nullptr) return;
    for (int j = threadIdx.x; j < n_rows; j += THREADS) {
        const uint32_t word = t.vis[j >> 5];
        if (((word >> (j & 31)) & 1u) == 0) continue;
        int rank = __popc(word & ((1u << (j & 31)) - 1u));
        for (int w = 0; w < (j >> 5); ++w) rank += __popc(t.vis[w]);
        const int pos = t.prefix + rank - begin;
        if (pos >= 0 && pos < nkeys) key_off[pos] = slot_offset(pg, t.prefix + j, status);
    }
}

// Sub-tile rows are unpadded, and row r keeps its 16-byte piece p at p ^ (r mod 8): an ldmatrix reads
// the same logical piece of 8 consecutive rows, which so fall in distinct banks, and each 128-byte line
// of a cache row lands on a 128-byte line of shared memory. (With 16 bytes of padding per row instead,
// the copies' unaligned destinations made L2 serve every sector about 1.5 times: 7.2M sector reads
// against 4.8M for an H 8 decode at bs 8, prefix 16384, on the H200, and 5-13% more time.) The XOR
// touches the low three bits only, so piece p + 8m sits at (p ^ (r mod 8)) + 8m: the users below take
// one swizzled base per lane and add plain offsets.
__device__ __forceinline__ int swizzle(int piece, int row) { return piece ^ (row & 7); }

// Queues the cache rows of sub-tile `sub` of the chunk whose key list is `key_off` into `stage`; keys
// past the chunk are zero-filled so that their (zero) probabilities never meet stale or uninitialized values.
// The copies ask L2 to evict their lines first: the cache streams past once per launch, and without
// the hint it pushes out the partials that the combine reads back and that the next launch rewrites,
// which then go back to DRAM (on the H200: H 8 / H 16 decodes 4-11% faster, tree_verify within 1%).
__device__ __forceinline__ void load_subtile(Smem& s, const long long* key_off, const __nv_bfloat16* cache, int sub,
                                             int nkeys, int stage) {
    // LOAD_THREADS threads per key row: one key-offset lookup per thread, then consecutive pieces.
    constexpr int LOAD_THREADS = THREADS / BK;
    const int k = threadIdx.x / LOAD_THREADS, first = threadIdx.x % LOAD_THREADS;
    const int key = sub * BK + k;
    const bool valid = key < nkeys;
    const __nv_bfloat16* src = cache + (valid ? key_off[key] : 0) + 8 * first;
    __nv_bfloat16* dst = &s.kv[stage][k][8 * swizzle(first, k)];
    const u64 policy = l2_evict_first();
    static_assert(PIECES % LOAD_THREADS == 0 && LOAD_THREADS == 8, "one 128-byte line of a row per step");
#pragma unroll
    for (int line = 0; line < PIECES / LOAD_THREADS; ++line)
        cp_async16_hint(dst + 64 * line, src + 64 * line, valid ? 16 : 0, policy);
}

// Queues the tile's query rows into the second stage (rows past row1 zero-filled), swizzled like key
// rows: 16-byte copies in the first sub-tile's cp.async group, instead of each thread's 4-byte loads of
// its fragments, whose latency the first S mma waited on (on the H200: H 16 decodes 1-5%, H 64 8%,
// tree_verify 9-10% faster; unfolded H 8 decodes up to 1.7% slower, the chunk's first sub-tile refill
// now waiting for load_q). The stage is not refilled before run_chunk's first barrier, which comes after
// load_q.
__device__ __forceinline__ void stage_q(Smem& s, const __nv_bfloat16* q, const Task& t) {
    static_assert(STAGES >= 2 && BM <= BK, "the query tile fits the second stage");
    for (int i = threadIdx.x; i < BM * PIECES; i += THREADS) {
        const int r = i / PIECES, p = i % PIECES;
        const bool valid = t.row0 + r < t.row1;
        const __nv_bfloat16* src = q + (long long)(valid ? t.row0 + r : t.row0) * ROW + 8 * p;
        cp_async16(&s.kv[1][r][8 * swizzle(p, r)], src, valid ? 16 : 0);
    }
}

// Q fragments of one dim quarter for m-tile `mtile` from the staged tile: the x4 of k-step j holds
// (rows 0-7, dims k..k+7), (rows 8-15, k..k+7), (rows 0-7, k+8..k+15), (rows 8-15, k+8..k+15), the
// order of the mma's A fragment.
__device__ __forceinline__ void load_q(uint32_t (&qa)[QUARTER_STEPS][4], const Smem& s, int quarter, int mtile,
                                       int lane) {
    const int row = 16 * mtile + (lane & 15), piece = quarter * QUARTER / 8 + (lane >> 4);
#pragma unroll
    for (int j = 0; j < QUARTER_STEPS; ++j) ldmatrix_x4(qa[j], &s.kv[1][row][8 * swizzle(piece + 2 * j, row)]);
}

// Column of key k in row r of an S partial: the four 8-key blocks of a row are permuted by r mod 4, so
// that the mma's float2 stores (rows g .. g + 3 in one phase) hit 32 distinct banks, and the softmax's
// float2 loads (one row of 32 keys per half-warp) still read the whole row at once.
__device__ __forceinline__ int s_col(int r, int k) { return k ^ ((r & 3) << 3); }

// S partial sums of one dim quarter over one m-tile and S_NT n-tiles (from n-tile n0): for each n-tile
// the even and odd k-steps of the quarter are chained in order in their own accumulator (chains of 5
// and 4 dependent mmas instead of one of 9; the four chains interleave); store_scores adds them.
__device__ __forceinline__ void scores(Smem& s, int stage, const uint32_t (&qa)[QUARTER_STEPS][4], int quarter,
                                       int n0, int lane, float (&acc)[S_NT][2][4]) {
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][0][i] = acc[nt][1][i] = 0.f;
    // Lane (row, piece) of x4 j reads piece p + 4j of its row, p = quarter * 18 + lane / 8: for even j
    // that is swizzled p plus 4j pieces, for odd j swizzled p + 4 plus 4(j - 1) (see swizzle).
    const int row = n0 * 8 + (lane & 7), piece = quarter * QUARTER / 8 + (lane >> 3);
    const __nv_bfloat16* even = &s.kv[stage][row][8 * swizzle(piece, row)];
    const __nv_bfloat16* odd = &s.kv[stage][row][8 * swizzle(piece + 4, row)];
    // Each x4 holds two k-steps of one n-tile, loaded after the mmas of the pair before (whose chain
    // step the next pair waits for anyway). The last step (dims 128..143 of the quarter, piece p + 16
    // for lanes 0..15) is an x2 (lanes 16..31 give no address).
    constexpr int PAIRS = QUARTER_STEPS / 2;
    uint32_t b[S_NT][4];
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt) ldmatrix_x4(b[nt], even + nt * 8 * KV_STRIDE);
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt) mma_bf16(acc[nt][0], qa[2 * j], b[nt][0], b[nt][1]);
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt) mma_bf16(acc[nt][1], qa[2 * j + 1], b[nt][2], b[nt][3]);
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt) {
            if (j + 1 < PAIRS) {
                const int step = j + 1;  // x4 number
                ldmatrix_x4(b[nt], (step % 2 == 0 ? even : odd) + nt * 8 * KV_STRIDE + 32 * (step / 2 * 2));
            } else {
                uint32_t last[2];
                ldmatrix_x2(last, even + nt * 8 * KV_STRIDE + 8 * 2 * (QUARTER_STEPS - 1));
                b[nt][0] = last[0];
                b[nt][1] = last[1];
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt) mma_bf16(acc[nt][0], qa[QUARTER_STEPS - 1], b[nt][0], b[nt][1]);
}

// Stores the S partials that `scores` accumulated to s_part[quarter].
// HALF: only rows 0..7 of the tile are valid (see run_chunk), so rows g + 8 are left out.
template <bool HALF>
__device__ __forceinline__ void store_scores(Smem& s, const float (&acc)[S_NT][2][4], int quarter, int mtile,
                                             int n0, int lane) {
    const int g = 16 * mtile + (lane >> 2);
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt) {
        const int col = s_col(g, (n0 + nt) * 8 + 2 * (lane & 3));  // the same for row g + 8
        *reinterpret_cast<float2*>(&s.s_part[quarter][g][col]) =
            make_float2(__fadd_rn(acc[nt][0][0], acc[nt][1][0]), __fadd_rn(acc[nt][0][1], acc[nt][1][1]));
        if (!HALF)
            *reinterpret_cast<float2*>(&s.s_part[quarter][g + 8][col]) =
                make_float2(__fadd_rn(acc[nt][0][2], acc[nt][1][2]), __fadd_rn(acc[nt][0][3], acc[nt][1][3]));
    }
}

// Running max / sum of one row in the ROW_THREADS threads that handle that row. The max is replicated;
// during a chunk each thread keeps its own share of the sum (its key's terms, rescaled with the row),
// and row_sum adds the shares once the chunk is done, so that no butterfly over the sum sits in the
// softmax of every sub-tile.
struct RowState {
    float m;  // running max of the scores, base 2
    float l;  // running sum of 2^(score - m): this thread's share, or the row's (row_sum)
};

// The row's sum from its threads' shares, replicated: each butterfly step is commutative, so every
// thread of the row gets the same bits.
__device__ __forceinline__ float row_sum(float share) {
#pragma unroll
    for (int o = ROW_THREADS / 2; o > 0; o >>= 1) share = __fadd_rn(share, __shfl_xor_sync(0xFFFFFFFFu, share, o));
    return share;
}

// Online softmax over sub-tile `sub`: thread (row, 2 consecutive keys); writes P (hi, lo) and the row's
// alpha. The max butterfly gives every thread of a row the same max (each step is commutative). HALF: the
// warps of rows 8..15 have nothing to do (those rows' P, alpha and state never reach a stored result).
template <bool HALF>
__device__ __forceinline__ void softmax_step(Smem& s, int sub, int nkeys, float scale_log2, RowState& st) {
    static_assert(!HALF || (MT == 1 && 32 / ROW_THREADS == 2), "HALF: warps 4..7 hold rows 8..15");
    if (HALF && threadIdx.x >= 8 * ROW_THREADS) return;  // warp-uniform
    const int row = threadIdx.x / ROW_THREADS, k0 = (threadIdx.x % ROW_THREADS) * ROW_KEYS, col = s_col(row, k0);
    float2 part[4];
#pragma unroll
    for (int qr = 0; qr < 4; ++qr) part[qr] = *reinterpret_cast<const float2*>(&s.s_part[qr][row][col]);
    const float acc[ROW_KEYS] = {
        __fadd_rn(__fadd_rn(__fadd_rn(part[0].x, part[1].x), part[2].x), part[3].x),
        __fadd_rn(__fadd_rn(__fadd_rn(part[0].y, part[1].y), part[2].y), part[3].y)};
    const int key0 = sub * BK + k0;
    float x[ROW_KEYS];
#pragma unroll
    for (int j = 0; j < ROW_KEYS; ++j) x[j] = key0 + j < nkeys ? __fmul_rn(acc[j], scale_log2) : -INFINITY;
    float mx = fmaxf(x[0], x[1]);
#pragma unroll
    for (int o = ROW_THREADS / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    // A sub-tile holds at least one valid key, so m_new is finite and the padding keys get p = 0.
    const float m_new = fmaxf(st.m, mx);
    const float p0 = ex2(__fsub_rn(x[0], m_new)), p1 = ex2(__fsub_rn(x[1], m_new));
    const float alpha = ex2(__fsub_rn(st.m, m_new));
    st.l = __fmaf_rn(st.l, alpha, __fadd_rn(p0, p1));
    st.m = m_new;
    const __nv_bfloat162 hi = __floats2bfloat162_rn(p0, p1);
    const float2 h = __bfloat1622float2(hi);
    *reinterpret_cast<__nv_bfloat162*>(&s.p_hi[row][k0]) = hi;
    *reinterpret_cast<__nv_bfloat162*>(&s.p_lo[row][k0]) =
        __floats2bfloat162_rn(__fsub_rn(p0, h.x), __fsub_rn(p1, h.y));
    if (k0 == 0) s.alpha[row] = alpha;
}

// O = O * alpha + P_hi.V + P_lo.V over the sub-tile's two k-steps of 16 keys (in that order for every
// element) for every m-tile and this warp's WARP_DIMS output dims: each V fragment feeds 4 * MT mmas.
// HALF: rows g + 8 are not rescaled (their alpha is not written; they are never stored).
template <bool HALF>
__device__ __forceinline__ void accumulate_pv(Smem& s, int stage, float (&o)[MT][PV_NT][4], int warp, int lane) {
    constexpr int KS = BK / 16, PAIRS = PV_NT / 2;
    const int g = lane >> 2;
    // Every fragment of the sub-tile is loaded first (the asm statements keep their order), so that the
    // loads overlap each other and the rescale below instead of each waiting in front of its mmas.
    uint32_t ph[KS][MT][4], pl[KS][MT][4], v[KS][PAIRS][4];
    // Lane (key, half) of x4 `pair` reads piece 8 * warp + 2 * pair + half of its key row: pairs differ in
    // the swizzled bits, so each has its own offset.
    const int vkey = (lane & 7) + 8 * ((lane >> 3) & 1);
    const __nv_bfloat16* vrow = &s.kv[stage][vkey][warp * WARP_DIMS];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            ldmatrix_x4(ph[ks][mt], &s.p_hi[16 * mt + (lane & 15)][16 * ks + 8 * (lane >> 4)]);
            ldmatrix_x4(pl[ks][mt], &s.p_lo[16 * mt + (lane & 15)][16 * ks + 8 * (lane >> 4)]);
        }
#pragma unroll
        for (int pair = 0; pair < PAIRS; ++pair)
            ldmatrix_x4_trans(v[ks][pair], vrow + 16 * ks * KV_STRIDE + 8 * swizzle(pair * 2 + (lane >> 4), vkey));
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const float a0 = s.alpha[16 * mt + g], a1 = HALF ? 1.f : s.alpha[16 * mt + g + 8];
#pragma unroll
        for (int nt = 0; nt < PV_NT; ++nt) {
            o[mt][nt][0] = __fmul_rn(o[mt][nt][0], a0);
            o[mt][nt][1] = __fmul_rn(o[mt][nt][1], a0);
            if (!HALF) {
                o[mt][nt][2] = __fmul_rn(o[mt][nt][2], a1);
                o[mt][nt][3] = __fmul_rn(o[mt][nt][3], a1);
            }
        }
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int pair = 0; pair < PAIRS; ++pair) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_bf16(o[mt][2 * pair], ph[ks][mt], v[ks][pair][0], v[ks][pair][1]);
                mma_bf16(o[mt][2 * pair + 1], ph[ks][mt], v[ks][pair][2], v[ks][pair][3]);
                mma_bf16(o[mt][2 * pair], pl[ks][mt], v[ks][pair][0], v[ks][pair][1]);
                mma_bf16(o[mt][2 * pair + 1], pl[ks][mt], v[ks][pair][2], v[ks][pair][3]);
            }
        }
    }
}

// Writes the chunk's partial results of the tile's valid rows to slot t.chunk: output, then (max, sum).
// The outputs are stored evict-last, so that they stay in L2 for the combine (1-5% more on unfolded
// decodes); fold_partial's group states do not take the hint, which was 1-2% slower on folded launches.
__device__ __forceinline__ void store_partial(const Task& t, const float (&o)[MT][PV_NT][4], const RowState& st,
                                              int warp, int lane, int max_chunks, float* part_o, float* part_ml) {
    const int g = lane >> 2;
    const u64 policy = l2_evict_last();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = t.row0 + 16 * mt + g + 8 * half;
            if (r >= t.row1) continue;
            float* dst =
                part_o + ((long long)r * max_chunks + t.chunk) * LATENT + warp * WARP_DIMS + 2 * (lane & 3);
#pragma unroll
            for (int nt = 0; nt < PV_NT; ++nt)
                st_float2_hint(dst + 8 * nt, make_float2(o[mt][nt][2 * half], o[mt][nt][2 * half + 1]), policy);
        }
    }
    const int r = t.row0 + threadIdx.x / ROW_THREADS;
    if (threadIdx.x % ROW_THREADS == 0 && r < t.row1) {
        float* ml = part_ml + ((long long)r * max_chunks + t.chunk) * 2;
        ml[0] = st.m;
        ml[1] = st.l;
    }
}

// Folds the chunk just computed (o, st) into the group state of the tile's valid rows kept in slot
// `slot` (output in part_o, (max, sum) in `group`, replicated like RowState); `first`: the state is
// the initial one (-inf, 0, 0), which is not read. Each thread reads back only the elements it wrote.
__device__ __forceinline__ void fold_partial(Smem& s, const Task& t, const float (&o)[MT][PV_NT][4], const RowState& st,
                                             RowState& group, bool first, int slot, int warp, int lane,
                                             int max_chunks, float* part_o) {
    float a, b;
    fold_ml(group.m, group.l, st.m, st.l, a, b);
    if (threadIdx.x % ROW_THREADS == 0) {
        s.fold_a[threadIdx.x / ROW_THREADS] = a;
        s.fold_b[threadIdx.x / ROW_THREADS] = b;
    }
    __syncthreads();  // fold factors visible
    const int g = lane >> 2;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int tr = 16 * mt + g + 8 * half, r = t.row0 + tr;
            if (r >= t.row1) continue;
            const float fa = s.fold_a[tr], fb = s.fold_b[tr];
            float* dst = part_o + ((long long)r * max_chunks + slot) * LATENT + warp * WARP_DIMS + 2 * (lane & 3);
#pragma unroll
            for (int nt = 0; nt < PV_NT; ++nt) {
                float2 acc = make_float2(0.f, 0.f);
                if (!first) acc = *reinterpret_cast<const float2*>(dst + 8 * nt);
                acc.x = fold_o(acc.x, fa, o[mt][nt][2 * half], fb);
                acc.y = fold_o(acc.y, fa, o[mt][nt][2 * half + 1], fb);
                *reinterpret_cast<float2*>(dst + 8 * nt) = acc;
            }
        }
    }
}

// Starts the first chunk (t.chunk) of a CTA's run for a tile of query rows sharing its key list: builds
// the key list in buffer 0 and queues the first STAGES - 1 sub-tiles (one cp.async group each, sub-tile
// j in stage j), the query rows in the first group (stage_q). Returns the chunk's key count. The CTA's
// later chunks are begun by run_chunk (see NextChunk).
__device__ int begin_chunk(Smem& s, const Task& t, const Pages& pg, int n_rows, const __nv_bfloat16* q,
                           const __nv_bfloat16* cache, int* status) {
    const int nkeys = min(SPLIT, t.len - t.chunk * SPLIT);
    build_key_list(s.key_off[0], t, pg, n_rows, nkeys, status);
    __syncthreads();  // key_off is complete
    const int nsub = (nkeys + BK - 1) / BK;
    stage_q(s, q, t);
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < nsub) load_subtile(s, s.key_off[0], cache, st, nkeys, st);
        cp_async_commit();
    }
    return nkeys;
}

// The chunk a CTA computes after the current one, in decode and prefix modes: the next chunk of the same
// tile's sequence, whose key list the caller has built in the other buffer before the current chunk's
// run_chunk. run_chunk queues its first sub-tile behind the current chunk's last one, so that the stream
// runs on across the chunk border instead of draining and starting again (the current chunk is a whole
// SPLIT, an even number of sub-tiles, so the next one starts in stage 0 as begin_chunk's would).
struct NextChunk {
    bool valid;
    int nkeys;
};
static_assert(SPLIT / BK % STAGES == 0, "NextChunk: a whole chunk ends where the ring starts again");

// The one routine that computes a chunk (begun by begin_chunk or by the run_chunk before it) for a tile of
// query rows: leaves the unnormalized output in o and the rows' (max, sum) in row (the sum replicated).
// Three barriers per sub-tile of BK keys: the sub-tile has landed (and the previous one's stage is
// released), the S partials are complete, P is complete. Sub-tile `sub` lives in stage sub % STAGES; the
// stage refilled at iteration sub is that of sub - 1, which every warp has finished reading at the first
// barrier. `buf`: the chunk's key list; `first`: the CTA's first chunk, whose query rows begin_chunk
// staged: their fragments are loaded into qa here and kept for the CTA's later chunks (same rows).
// HALF (a tile of at most 8 valid rows, as in every 8-head decode): the work on rows 8..15 that only
// they use is left out; rows 0..7 get the same operations.
template <bool HALF>
__device__ void run_chunk(Smem& s, int buf, int nkeys, const NextChunk& next_chunk, bool first,
                          const __nv_bfloat16* cache, float scale_log2, uint32_t (&qa)[QUARTER_STEPS][4],
                          float (&o)[MT][PV_NT][4], RowState& row) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // S: warp = (quarter, m-tile, n-group); the Q fragments of its quarter and m-tile stay in registers.
    const int quarter = warp / (WARPS / 4), mtile = warp / (NT / S_NT) % MT, n0 = warp % (NT / S_NT) * S_NT;
    if (first) {
        cp_async_wait<0>();  // the query rows (and sub-tile 0) have landed for this thread ...
        __syncthreads();     // ... and for every thread
        load_q(qa, s, quarter, mtile, lane);
    }
    const int nsub = (nkeys + BK - 1) / BK;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < PV_NT; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    row = RowState{-INFINITY, 0.f};
    for (int sub = 0, stage = 0; sub < nsub; ++sub) {
        // At most STAGES - 2 groups pending: sub-tile `sub` (group `sub`) has landed for this thread.
        cp_async_wait<STAGES - 2>();
        // ... and for every thread, and every thread is done with iteration sub - 1, so its stage can be
        // refilled and s_part / P / alpha rewritten.
        __syncthreads();
        // Queued first: with two stages the next sub-tile has only this iteration to land.
        // (One call for both cases, so that the copies' addressing is compiled once.)
        const int next = sub + STAGES - 1, refill = stage == 0 ? STAGES - 1 : stage - 1;
        const bool same_chunk = next < nsub;
        if (same_chunk || (next == nsub && next_chunk.valid))
            load_subtile(s, s.key_off[same_chunk ? buf : buf ^ 1], cache, same_chunk ? next : 0,
                         same_chunk ? nkeys : next_chunk.nkeys, refill);
        cp_async_commit();
        float acc[S_NT][2][4];
        scores(s, stage, qa, quarter, n0, lane, acc);
        store_scores<HALF>(s, acc, quarter, mtile, n0, lane);
        __syncthreads();
        softmax_step<HALF>(s, sub, nkeys, scale_log2, row);
        __syncthreads();
        accumulate_pv<HALF>(s, stage, o, warp, lane);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
    row.l = row_sum(row.l);
    if (!next_chunk.valid) cp_async_wait<0>();  // only empty groups remain; leave none in flight at exit
}

// mla_combine's shared memory, fold list and windows (described above the kernel).
constexpr int COMBINE_THREADS = 128;
constexpr int STAGE_FLOATS = 8192;                        // staged partial outputs of a window (32 KB)
constexpr int MIN_SLICE = 16;                             // fewest output dims per CTA (slices <= 32)
constexpr int MAX_ITEMS = STAGE_FLOATS / MIN_SLICE;       // most items of a window
static_assert(LATENT / 4 <= COMBINE_THREADS, "slices >= 4: one output dim per thread");
static_assert(FOLD <= STAGE_FLOATS / (LATENT / 4), "a window holds at least one group");

struct CombineSmem {
    float o[STAGE_FLOATS];     // [item][slice dim] partial outputs, then [group's first item] group outputs
    float2 item[MAX_ITEMS];    // items' (max, sum), then the factors (a, b) that fold each into its group
    float2 group[MAX_ITEMS];   // groups' (sum, weight)
    float warp_max[COMBINE_THREADS / 32];  // row_max's per-warp maxima
};
static_assert(sizeof(CombineSmem) <= 48 * 1024, "static shared memory");

// A row's fold list (above mla_combine): `chunks` chunks, the first `pre` folded by mla_chunk.
struct FoldList {
    int chunks, pre, pre_groups;
    __device__ __forceinline__ int items_before(int g) const {  // I(g)
        return g < pre_groups ? g : pre_groups - pre + min(g * FOLD, chunks);
    }
    __device__ __forceinline__ int slot(int i) const { return i < pre_groups ? i * FOLD : pre + i - pre_groups; }
};

// The end of the window that starts at group g0: the most groups (at least one) whose items fit `cap`.
__device__ __forceinline__ int window_end(const FoldList& f, int g0, int groups, int cap) {
    const int limit = f.items_before(g0) + cap;
    int lo = g0 + 1, hi = min(groups, g0 + cap);  // I(lo) <= limit (a group has at most FOLD <= cap items)
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (f.items_before(mid) <= limit) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The row's max M over the maxima of its `items` fold items (row_ml: the row's (max, sum) slots), for a
// block of THREADS_ threads; returns it in every thread (one barrier). Every chunk's max sits in exactly
// one item (a folded state holds the max of its chunks), so M is the max over the row's chunks, and both
// combine kernels call this with the same block size and item list, so they get the same bits.
template <int THREADS_>
__device__ __forceinline__ float row_max(const FoldList& f, int items, const float* row_ml, float* warp_max) {
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < items; i += THREADS_) mx = fmaxf(mx, row_ml[2 * (long long)f.slot(i)]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = warp_max[0];
#pragma unroll
    for (int w = 1; w < THREADS_ / 32; ++w) mx = fmaxf(mx, warp_max[w]);
    return mx;
}

}  // namespace mla
}  // namespace kdt

using namespace kdt::mla;

// grid (m-tiles of the row group, bs or bs * N, chunk slots), THREADS threads, sizeof(Smem) dynamic smem.
// decode: y = request, z = chunk; prefix: y = request, z = chunk (only chunks wholly inside the prefix);
// tail: y = request * N + tree row, z = chunk - seq_len / SPLIT (two slots: the chunks holding tree rows
// start at seq_len / SPLIT and span at most two, as (SPLIT - 1 + N) <= 2 * SPLIT for N <= 257).
// `run` (decode and prefix modes only; tail takes one chunk a CTA): z is a run of that many consecutive
// chunks instead of a chunk, which the CTA computes in order with one stream of sub-tiles across them
// (see NextChunk); each chunk's result goes to its own slot, as from a run of one, unless `fold` (then
// `run` is FOLD and z a fold group): the CTA folds its chunks into one state in the group's first slot.
// `visibility` is unused (may be null) in decode mode, where n_rows is 1. `status` is two words: CTA
// (0, 0, 0) clears status[0], the run's word, and the launch ORs its bits into status[1] (see mla_combine).
// mla_chunk_half is the same kernel but gives tiles of at most 8 valid rows run_chunk<true>; the launcher
// takes it for launches whose tiles all have at most 8 rows (8 heads or fewer, decode or tree tail), and
// mla_chunk, which never halves, for the others, whose code it leaves as it was: with both paths in one
// kernel the full-tile launches ran up to 2% slower on the H200 (tree_verify bs 1, short 16-head decodes).
template <bool MAY_HALVE>
__device__ __forceinline__ void chunk_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ cache,
                                             const int* __restrict__ block_table, const int* __restrict__ seq_len,
                                             const uint32_t* __restrict__ visibility, int mode, int run, int fold,
                                             int num_pages, int page_size, int pages_per_req, int n_rows, int words,
                                             int heads, int max_chunks, float scale, float* __restrict__ part_o,
                                             float* __restrict__ part_ml, int* __restrict__ status) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& s = *reinterpret_cast<Smem*>(smem_raw);
    // The run's status word is cleared here (nothing else writes it before the combine), and this
    // launch's bits go to the second word, which mla_combine moves into the first and clears.
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) status[0] = 0;
    status += 1;
    const int request = mode == MODE_TAIL ? blockIdx.y / n_rows : blockIdx.y;
    const int prefix = max(seq_len[request], 0);
    const bool folding = fold != 0 && mode != MODE_TAIL;
    const int per_cta = mode == MODE_TAIL ? 1 : run;
    Task t;
    t.prefix = prefix;
    t.vis = nullptr;
    int group_rows = heads;
    if (mode == MODE_DECODE) {
        t.row0 = request * heads;
        t.len = prefix;
        t.chunk = (int)blockIdx.z * per_cta;
    } else if (mode == MODE_PREFIX) {
        group_rows = n_rows * heads;
        t.row0 = request * group_rows;
        t.len = prefix / SPLIT * SPLIT;  // the full chunks only
        t.chunk = (int)blockIdx.z * per_cta;
    } else {
        t.vis = visibility + (long long)blockIdx.y * words;
        t.row0 = blockIdx.y * heads;
        t.len = prefix + tree_count(t.vis, n_rows);
        t.chunk = prefix / SPLIT + blockIdx.z;
    }
    if ((long long)t.chunk * SPLIT >= t.len || (int)blockIdx.x * BM >= group_rows) return;
    if (t.chunk >= max_chunks) {
        if (threadIdx.x == 0) atomicOr(status, STATUS_TOO_LONG);
        return;
    }
    t.row1 = t.row0 + min(group_rows, (int)(blockIdx.x + 1) * BM);
    t.row0 += blockIdx.x * BM;
    const Pages pg{block_table + (long long)request * pages_per_req, pages_per_req, page_size, num_pages};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float scale_log2 = __fmul_rn(scale, LOG2E);
    int nkeys = begin_chunk(s, t, pg, n_rows, q, cache, status);
    uint32_t qa[QUARTER_STEPS][4];
    float o[MT][PV_NT][4];
    RowState row;
    // run_chunk<MAY_HALVE> rather than run_chunk<true>: where `half` holds MAY_HALVE is true, and mla_chunk
    // then never instantiates the halved path, so its code stays the full-tile one alone.
    const bool half = MAY_HALVE && t.row1 - t.row0 <= 8;
    // The run's chunks in order; folded, each into the group state exactly as mla_combine would fold their
    // partials (fold_ml / fold_o from the initial state, in chunk order). The next chunk's first sub-tile
    // is already loading while a chunk's result is stored or folded.
    const int first = t.chunk, chunks = (t.len + SPLIT - 1) / SPLIT;
    const int last = min(min(first + per_cta, chunks), max_chunks);
    RowState group{-INFINITY, 0.f};
    for (int c = first; c < last; ++c) {
        const int buf = (c - first) & 1;
        const NextChunk next{c + 1 < last, min(SPLIT, t.len - (c + 1) * SPLIT)};
        if (next.valid) {
            // Its buffer was last read before the previous chunk's last barrier (or never); it is next
            // read by this chunk's last refill, several barriers on.
            t.chunk = c + 1;
            build_key_list(s.key_off[buf ^ 1], t, pg, n_rows, next.nkeys, status);
        }
        if (half)
            run_chunk<MAY_HALVE>(s, buf, nkeys, next, c == first, cache, scale_log2, qa, o, row);
        else
            run_chunk<false>(s, buf, nkeys, next, c == first, cache, scale_log2, qa, o, row);
        t.chunk = c;
        if (folding)
            fold_partial(s, t, o, row, group, c == first, first, warp, lane, max_chunks, part_o);
        else
            store_partial(t, o, row, warp, lane, max_chunks, part_o, part_ml);
        nkeys = next.nkeys;
    }
    if (!folding) return;
    const int r = t.row0 + threadIdx.x / ROW_THREADS;
    if (threadIdx.x % ROW_THREADS == 0 && r < t.row1) {
        float* ml = part_ml + ((long long)r * max_chunks + first) * 2;
        ml[0] = group.m;
        ml[1] = group.l;
    }
}

#define KDT_MLA_CHUNK(NAME, MAY_HALVE)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS, 2 / MT)                                               \
        NAME(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ cache,                       \
             const int* __restrict__ block_table, const int* __restrict__ seq_len,                               \
             const uint32_t* __restrict__ visibility, int mode, int run, int fold, int num_pages, int page_size,  \
             int pages_per_req, int n_rows, int words, int heads, int max_chunks, float scale,                   \
             float* __restrict__ part_o, float* __restrict__ part_ml, int* __restrict__ status) {                \
        chunk_kernel<MAY_HALVE>(q, cache, block_table, seq_len, visibility, mode, run, fold, num_pages,          \
                                page_size, pages_per_req, n_rows, words, heads, max_chunks, scale, part_o,       \
                                part_ml, status);                                                               \
    }
KDT_MLA_CHUNK(mla_chunk, false)
KDT_MLA_CHUNK(mla_chunk_half, true)

// The combine kernels' shared prologue. CTA 0 moves the chunk launches' status bits (status[1]) into
// the run's word (see mla_chunk).
__device__ __forceinline__ void collect_chunk_status(int* status) {
    const int bits = status[1];
    if (bits != 0) atomicOr(status, bits);
    status[1] = 0;
}

// Row r's chunk count and how many of its leading chunks mla_chunk folded (`pre`). A row longer than
// max_seq_len (or than the plan's chunks) gets no chunks, and the thread with `flag` reports it.
struct RowChunks {
    int chunks, pre;
};

__device__ __forceinline__ RowChunks row_chunks(long long r, const int* seq_len, const uint32_t* visibility,
                                                int n_rows, int words, int heads, int max_chunks, int max_seq_len,
                                                int folded, bool flag, int* status) {
    const long long tree_row = r / heads;
    const int request = (int)(tree_row / n_rows);
    const int prefix = max(seq_len[request], 0);
    int len = prefix;
    if (visibility != nullptr) len += tree_count(visibility + tree_row * words, n_rows);
    int chunks = (len + SPLIT - 1) / SPLIT;
    if (len > max_seq_len || chunks > max_chunks) {
        if (flag) atomicOr(status, STATUS_TOO_LONG);
        chunks = 0;
    }
    const int pre = folded == 0 ? 0 : (visibility != nullptr ? min(prefix / SPLIT, chunks) : chunks);
    return {chunks, pre};
}

// One fold group's items as mla_combine_rows loads them: four output dims and the (max, sum) of each.
struct GroupItems {
    int n;       // items (1..FOLD)
    bool state;  // the first item is the group's folded state (mla_chunk's `fold`)
    float4 o[FOLD];
    float2 ml[FOLD];
};

__device__ __forceinline__ GroupItems load_group(const FoldList& f, int g, long long base, const float* part_o,
                                                 const float* part_ml) {
    GroupItems it;
    const int k0 = f.items_before(g);
    it.n = f.items_before(g + 1) - k0;
    it.state = g < f.pre_groups;
#pragma unroll
    for (int j = 0; j < FOLD; ++j) {
        if (j >= it.n) break;
        const long long idx = base + f.slot(k0 + j);
        it.o[j] = reinterpret_cast<const float4*>(part_o + idx * LATENT)[threadIdx.x];
        it.ml[j] = reinterpret_cast<const float2*>(part_ml)[idx];
    }
    return it;
}

// mla_combine_rows: the same fold as mla_combine (below), one CTA of ROWS_THREADS per row, each thread
// folding four output dims group by group straight from global memory. The groups' weights need only
// the row max, so no step waits on the one before but through one FMA: each group's loads are issued one
// group ahead, and with many rows in flight this plain loop moves the partials faster than mla_combine's
// staging, which pays off only for few rows (the launcher picks, see src/cuda/mla.rs). Same operands in
// the same order as mla_combine (and the same row_max), so both give the same bits. Grid (query rows);
// status as in mla_combine.
constexpr int ROWS_THREADS = LATENT / 4;

extern "C" __global__ void __launch_bounds__(ROWS_THREADS)
    mla_combine_rows(const int* __restrict__ seq_len, const uint32_t* __restrict__ visibility, int n_rows,
                     int words, int heads, int max_chunks, int max_seq_len, int folded,
                     const float* __restrict__ part_o, const float* __restrict__ part_ml, float* __restrict__ o,
                     float* __restrict__ lse, int* __restrict__ status) {
    __shared__ float warp_max[ROWS_THREADS / 32];
    const long long r = blockIdx.x;
    if (r == 0 && threadIdx.x == 0) collect_chunk_status(status);
    const RowChunks rc = row_chunks(r, seq_len, visibility, n_rows, words, heads, max_chunks, max_seq_len, folded,
                                    threadIdx.x == 0, status);
    const FoldList f{rc.chunks, rc.pre, (rc.pre + FOLD - 1) / FOLD};
    const int groups = (rc.chunks + FOLD - 1) / FOLD;
    const long long base = r * max_chunks;
    // The first group's loads fly while the row max is taken.
    GroupItems cur;
    if (groups > 0) cur = load_group(f, 0, base, part_o, part_ml);
    const float m_row = row_max<ROWS_THREADS>(f, f.items_before(groups), part_ml + 2 * base, warp_max);
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int g = 0; g < groups; ++g) {
        GroupItems next;
        if (g + 1 < groups) next = load_group(f, g + 1, base, part_o, part_ml);
        // The group's fold in item order, from its state item or the initial state.
        float gm = -INFINITY, gl = 0.f;
        float4 gacc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < FOLD; ++j) {
            if (j >= cur.n) break;
            if (cur.state && j == 0) {
                gm = cur.ml[0].x;
                gl = cur.ml[0].y;
                gacc = cur.o[0];
                continue;
            }
            float a, b;
            fold_ml(gm, gl, cur.ml[j].x, cur.ml[j].y, a, b);
            gacc.x = fold_o(gacc.x, a, cur.o[j].x, b);
            gacc.y = fold_o(gacc.y, a, cur.o[j].y, b);
            gacc.z = fold_o(gacc.z, a, cur.o[j].z, b);
            gacc.w = fold_o(gacc.w, a, cur.o[j].w, b);
        }
        const float w = ex2(__fsub_rn(gm, m_row));
        l = __fmaf_rn(gl, w, l);
        acc.x = __fmaf_rn(gacc.x, w, acc.x);
        acc.y = __fmaf_rn(gacc.y, w, acc.y);
        acc.z = __fmaf_rn(gacc.z, w, acc.z);
        acc.w = __fmaf_rn(gacc.w, w, acc.w);
        cur = next;
    }
    const bool any = groups > 0;
    float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
    if (any) out = make_float4(__fdiv_rn(acc.x, l), __fdiv_rn(acc.y, l), __fdiv_rn(acc.z, l), __fdiv_rn(acc.w, l));
    reinterpret_cast<float4*>(o + r * LATENT)[threadIdx.x] = out;
    if (threadIdx.x == 0) lse[r] = any ? __fmul_rn(__fadd_rn(m_row, log2f(l)), LN2) : -INFINITY;
}

// Queues one cp.async burst of a window's items (groups [gw0, gw1) of the fold list): their (max, sum)
// into s.item (one commit group), then the slice of their partial outputs into s.o (a second group).
__device__ __forceinline__ void stage_window(CombineSmem& s, const FoldList& f, int gw0, int gw1, long long base,
                                             const float* part_ml, const float* src_o, int dims_shift) {
    const int i0 = f.items_before(gw0), n_items = f.items_before(gw1) - i0;
    const int piece_shift = dims_shift - 2;  // 16-byte pieces per item: dims / 4
    for (int k = threadIdx.x; k < n_items; k += COMBINE_THREADS)
        kdt::cp_async8(&s.item[k], part_ml + 2 * (base + f.slot(i0 + k)));
    kdt::cp_async_commit();
    for (int p = threadIdx.x; p < (n_items << piece_shift); p += COMBINE_THREADS) {
        const int k = p >> piece_shift, q = p & ((1 << piece_shift) - 1);
        kdt::cp_async16(&s.o[(k << dims_shift) + 4 * q], src_o + (base + f.slot(i0 + k)) * LATENT + 4 * q, 16);
    }
    kdt::cp_async_commit();
}

// mla_combine: the rest of each row's fixed two-level fold (see the top of the file), then the
// normalization. The order of the fold is a row's "fold list": with P chunks already folded by
// mla_chunk (`pre`: every chunk of a folded decode, the full prefix chunks of a folded tree row, else
// 0) and GP = ceil(P / FOLD) groups starting below P, it is the GP state slots g * FOLD (group g's state
// so far), then the per-chunk slots P, P + 1, ... up to the row's last chunk. Item i < GP is the state
// of group i; item i >= GP is chunk slot P + i - GP; group g's items are [I(g), I(g + 1)) (FoldList).
// Group g's state (m_g, l_g, o_g) starts from its state item (g < GP) or from the initial state and folds
// its other items in order (fold_ml / fold_o, as mla_chunk's `fold` does). The groups are then combined
// with the row max M = max_g m_g (exact in any order; row_max): each group's weight w_g = 2^(m_g - M) is
// independent of the others, and l = sum_g l_g w_g and o = sum_g o_g w_g are FMA chains in group order
// from 0, so that no long chain of dependent (max, exp) steps remains. Output o / l, lse (M + log2 l) ln 2.
//
// Nothing waits on a chain of global loads: a CTA takes one row and a slice of its 512 output dims
// (`slices` CTAs per row) and walks the fold list in windows of whole groups whose items fit the
// staging buffer. The first window's burst is queued before the row max is taken, so their loads
// overlap. Per window: (1) one cp.async burst brings the items' (max, sum) and the slice of their
// partial outputs into shared memory; (2) one thread per group folds the group's (max, sum) in order,
// leaving each item's factors (a, b) and the group's (l_g, w_g); (3) the threads fold each (group,
// dim)'s outputs with the item factors; (4) one thread per dim adds the weighted group outputs (and
// each such thread the weighted sums, so l needs no broadcast).
//
// grid (query rows * slices), COMBINE_THREADS threads; `slices` (a power of two in 4..32) CTAs per row,
// each over LATENT / slices output dims. A row longer than `max_seq_len` flags STATUS_TOO_LONG and gets
// o = 0, lse = -inf. Row r is (request, tree row, head) = (r / (N*H), r / H % N, r % H); decode passes
// n_rows 1 and no visibility. `folded`: the chunk launch folded its fold groups (see `pre` above).
// status[1] holds the chunk launches' bits: CTA 0 moves them into status[0], the run's status word.
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
    mla_combine(const int* __restrict__ seq_len, const uint32_t* __restrict__ visibility, int n_rows, int words,
                int heads, int max_chunks, int max_seq_len, int folded, int slices, const float* __restrict__ part_o,
                const float* __restrict__ part_ml, float* __restrict__ o, float* __restrict__ lse,
                int* __restrict__ status) {
    __shared__ CombineSmem s;
    const int tid = threadIdx.x;
    const int slice_shift = __ffs(slices) - 1, dims_shift = __ffs(LATENT / slices) - 1;
    const int dims = LATENT >> slice_shift;
    const long long r = blockIdx.x >> slice_shift;
    const int slice = blockIdx.x & (slices - 1);
    if (blockIdx.x == 0 && tid == 0) collect_chunk_status(status);
    const RowChunks rc = row_chunks(r, seq_len, visibility, n_rows, words, heads, max_chunks, max_seq_len, folded,
                                    slice == 0 && tid == 0, status);
    const FoldList f{rc.chunks, rc.pre, (rc.pre + FOLD - 1) / FOLD};
    const int groups = (rc.chunks + FOLD - 1) / FOLD;
    const int cap = STAGE_FLOATS >> dims_shift;  // items per window
    const long long base = r * max_chunks;
    const float* src_o = part_o + slice * dims;
    int gw0 = 0, gw1 = groups > 0 ? window_end(f, 0, groups, cap) : 0;
    if (groups > 0) stage_window(s, f, gw0, gw1, base, part_ml, src_o, dims_shift);
    const float m_row = row_max<COMBINE_THREADS>(f, f.items_before(groups), part_ml + 2 * base, s.warp_max);
    float l = 0.f;    // the row's sum (threads tid < dims)
    float acc = 0.f;  // the output of dim `tid` of the slice (tid < dims)
    while (gw0 < groups) {
        const int i0 = f.items_before(gw0), n_groups = gw1 - gw0;
        kdt::cp_async_wait<1>();  // this thread's (max, sum) loads have landed ...
        __syncthreads();          // ... and everyone's
        // Each group's (max, sum) fold, in item order from its state item or the initial state, and
        // its weight.
        for (int gg = tid; gg < n_groups; gg += COMBINE_THREADS) {
            const int g = gw0 + gg;
            int k = f.items_before(g) - i0;
            const int k1 = f.items_before(g + 1) - i0;
            float gm = -INFINITY, gl = 0.f;
            if (g < f.pre_groups) {
                gm = s.item[k].x;
                gl = s.item[k].y;
                ++k;
            }
            for (; k < k1; ++k) {
                const float2 c = s.item[k];
                float a, b;
                fold_ml(gm, gl, c.x, c.y, a, b);
                s.item[k] = make_float2(a, b);
            }
            s.group[gg] = make_float2(gl, ex2(__fsub_rn(gm, m_row)));
        }
        kdt::cp_async_wait<0>();
        __syncthreads();  // item factors, group weights and the staged outputs are complete
        // Each (group, dim)'s output fold over the group's items, left in the group's first item row.
        for (int p = tid; p < (n_groups << dims_shift); p += COMBINE_THREADS) {
            const int g = gw0 + (p >> dims_shift), d = p & (dims - 1);
            const int k0 = f.items_before(g) - i0, n = f.items_before(g + 1) - i0 - k0;
            float v[FOLD];
            float2 ab[FOLD];
#pragma unroll
            for (int j = 0; j < FOLD; ++j) {
                v[j] = j < n ? s.o[((k0 + j) << dims_shift) + d] : 0.f;
                ab[j] = j < n ? s.item[k0 + j] : make_float2(0.f, 0.f);
            }
            const bool state = g < f.pre_groups;
            float gacc = state ? v[0] : 0.f;
#pragma unroll
            for (int j = 0; j < FOLD; ++j)
                if (j < n && !(state && j == 0)) gacc = fold_o(gacc, ab[j].x, v[j], ab[j].y);
            s.o[(k0 << dims_shift) + d] = gacc;
        }
        __syncthreads();  // group outputs are complete
        if (tid < dims) {
#pragma unroll 4
            for (int gg = 0; gg < n_groups; ++gg) {
                const float2 lw = s.group[gg];
                acc = __fmaf_rn(s.o[((f.items_before(gw0 + gg) - i0) << dims_shift) + tid], lw.y, acc);
                l = __fmaf_rn(lw.x, lw.y, l);
            }
        }
        __syncthreads();  // the window's shared memory is free
        gw0 = gw1;
        if (gw0 < groups) {
            gw1 = window_end(f, gw0, groups, cap);
            stage_window(s, f, gw0, gw1, base, part_ml, src_o, dims_shift);
        }
    }
    if (tid < dims) {
        const bool any = groups > 0;
        if (tid == 0 && slice == 0) lse[r] = any ? __fmul_rn(__fadd_rn(m_row, log2f(l)), LN2) : -INFINITY;
        o[r * LATENT + slice * dims + tid] = any ? __fdiv_rn(acc, l) : 0.f;
    }
}
