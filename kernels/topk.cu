// Top-K with logsumexp over the vocabulary (DESIGN.md §4.1 step 1; exact contract in reference/README.md).
//
// topk_chunk: one CTA of 256 threads per (chunk of 8192 logits, row) reads its chunk once
// and keeps it in registers (32 values a thread, loaded as 16-byte vectors). Most of the work is each
// value's exact fixed-point exp term (13 instructions); the selection is kept to a few instructions a
// value. The maxima of the chunk's 512 groups of 16 values give, by a one- or two-round histogram of
// their order keys, a bound at or below the chunk's K-th value (K group maxima reach it); only groups whose
// max reaches the bound look at their values (a bit mask a group), and the few values that pass (about K
// to 1.4K on random logits) are placed in shared memory by a warp scan. Up to 64 of them are ranked by
// counting (one thread a candidate), up to 256 go through one warp's 8-bit radix select, more through the
// CTA's (one barrier a round); each finds the exact K best composite keys (value descending, index
// ascending). Chunks with more than CAP values at the bound (many equal logits) select over the whole
// chunk instead. The chunk writes its max, exp-sum and K best keys (unordered); in a row merged inside
// topk_chunk (below), a chunk of at most 2K candidates writes them all unselected instead, since one
// select over the row's candidates costs less than one in every chunk.
// The merge selects the K best of a row's chunk candidates with the same radix select, ranks them and
// combines the chunk sums into the row's lse. Rows of chunks * 2K <= FUSED_SLOTS chunk slots are merged
// inside topk_chunk by the last CTA of the row to finish (a per-row arrival count), while other
// rows' chunks still stream; larger rows by a second launch, topk_merge: one CTA per row, selecting over
// all candidates in registers when they are too many for shared memory, else over those gathered at or
// above the best chunk K-th key.
#include "common.cuh"

namespace kdt {
namespace topk {

constexpr int THREADS = 512;  // merge
constexpr int CHUNK = 8192;
constexpr int CHUNK_THREADS = 256;
constexpr int CHUNK_WARPS = CHUNK_THREADS / 32;
constexpr int CHUNK_ITEMS = CHUNK / CHUNK_THREADS;  // per thread, in registers
// CTAs an SM should hold: 4 caps the chunk kernel at 64 registers (enough, without spills, for the f32
// kernel), for 32 warps an SM rather than 24 at 3 (80 registers) to hide the barriers and loads.
constexpr int CHUNK_MIN_BLOCKS = 4;
constexpr int GROUP_ITEMS = 16;
constexpr int GROUPS = CHUNK / GROUP_ITEMS;
constexpr int MERGE_ITEMS = 8;
constexpr int MERGE_REG = 16;  // chunk candidates per merge thread held in registers
constexpr int MERGE_SLOTS = MERGE_ITEMS * THREADS;
constexpr int MAX_K = 512;
constexpr int MAX_CHUNKS = 64;  // V < 2^19 (reference/README.md)
constexpr int CAP = 2048;  // candidates kept in shared memory; more take a slower path
// Chunk slots of a row merged inside topk_chunk (chunks * 2K at most; the launcher checks): each chunk of
// such a row writes up to 2K candidates unselected, zeros after them.
constexpr int FUSED_SLOTS = 2 * CAP;
// Up to RANK_MAX chunk candidates are ranked by counting (n^2 compares, cheapest for few), up to
// WARP_SELECT_MAX by one warp's radix select, more by the whole CTA's.
constexpr int RANK_MAX = 64;
constexpr int WARP_ITEMS = 8;
constexpr int WARP_SELECT_MAX = 32 * WARP_ITEMS;
constexpr uint32_t NEG_INF_KEY = 0x007FFFFFu;  // order_key(-inf)
constexpr unsigned FULL_MASK = 0xFFFFFFFFu;
static_assert(GROUPS >= MAX_K, "K group maxima must exist for the chunk bound");
static_assert(CAP >= MAX_K, "the slow path assumes more than K candidates");
static_assert(RANK_MAX <= CHUNK_THREADS, "one ranked candidate a thread");
static_assert(WARP_SELECT_MAX <= CAP && RANK_MAX < WARP_SELECT_MAX, "the warp select takes the next counts");
static_assert(CHUNK_ITEMS % GROUP_ITEMS == 0 && GROUP_ITEMS % 8 == 0, "groups are whole 16-byte vectors");
static_assert(GROUP_ITEMS % 4 == 0 && GROUP_ITEMS <= 32, "a group is whole float4 and fits a bit mask");

typedef cub::BlockScan<unsigned int, THREADS> Scan;
typedef cub::BlockReduce<u64, THREADS> ReduceU64;

struct SelectSmem {
    unsigned int hist[256];
    typename Scan::TempStorage scan;
    typename ReduceU64::TempStorage reduce;
    unsigned int digit, above, in_digit, count;
    u64 bcast;
};

__device__ __forceinline__ u64 block_max(u64 v, SelectSmem& s) {
    u64 r = ReduceU64(s.reduce).Reduce(v, MaxOp());
    if (threadIdx.x == 0) s.bcast = r;
    __syncthreads();
    r = s.bcast;
    __syncthreads();
    return r;
}

__device__ __forceinline__ u64 block_min(u64 v, SelectSmem& s) {
    u64 r = ReduceU64(s.reduce).Reduce(v, MinOp());
    if (threadIdx.x == 0) s.bcast = r;
    __syncthreads();
    r = s.bcast;
    __syncthreads();
    return r;
}

__device__ __forceinline__ u64 block_sum(u64 v, SelectSmem& s) {
    u64 r = ReduceU64(s.reduce).Sum(v);
    if (threadIdx.x == 0) s.bcast = r;
    __syncthreads();
    r = s.bcast;
    __syncthreads();
    return r;
}

// Radix select over distinct u64 keys held in registers (0 = empty). Among keys >= lo (lo > 0, at least K
// of them, all <= hi), finds (shift, T) such that exactly K keys k >= lo satisfy (k >> shift) >= (T >> shift).
// Digits are 8 bits wide and start below the common prefix of lo and hi, so clustered keys do not pile
// into one histogram bin.
template <int ITEMS, typename Keys>
__device__ void block_select(const Keys& keys, int k_wanted, u64 lo, u64 hi, SelectSmem& s,
                             int& out_shift, u64& out_t) {
    int top_bit = (hi == lo) ? 0 : 63 - __clzll((long long)(hi ^ lo));
    int group_shift = top_bit + 1;  // bits at and above group_shift are fixed
    int shift = top_bit >= 7 ? top_bit - 7 : 0;
    u64 t = shr64(hi, group_shift) << (group_shift >= 64 ? 0 : group_shift);
    if (group_shift >= 64) t = 0;
    unsigned int needed = (unsigned int)k_wanted;
    while (true) {
        if (threadIdx.x < 256) s.hist[threadIdx.x] = 0;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            u64 k = keys.get(i);
            if (k >= lo && shr64(k, group_shift) == shr64(t, group_shift))
                atomicAdd(&s.hist[(k >> shift) & 255], 1u);
        }
        __syncthreads();
        int digit = 255 - (int)threadIdx.x;  // scan from the largest digit down; extra threads add 0
        unsigned int h = digit >= 0 ? s.hist[digit] : 0u;
        unsigned int above;
        Scan(s.scan).ExclusiveSum(h, above);
        if (above < needed && needed <= above + h) {
            s.digit = digit;
            s.above = above;
            s.in_digit = h;
        }
        __syncthreads();
        needed -= s.above;
        t = (t & ~(255ull << shift)) | ((u64)s.digit << shift);
        bool resolved = (s.in_digit == needed) || shift == 0;
        __syncthreads();
        if (resolved) break;
        group_shift = shift;
        shift = shift >= 8 ? shift - 8 : 0;
    }
    out_shift = shift;
    out_t = t;
}

// Appends the selected keys to out[] in arrival order; returns how many were written.
template <int ITEMS, typename Keys>
__device__ unsigned int block_compact(const Keys& keys, u64 lo, int shift, u64 t, bool take_all,
                                      u64* out, SelectSmem& s) {
    if (threadIdx.x == 0) s.count = 0;
    __syncthreads();
    const unsigned lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        u64 k = keys.get(i);
        bool sel = k >= lo && k != 0 && (take_all || shr64(k, shift) >= shr64(t, shift));
        unsigned mask = __ballot_sync(0xFFFFFFFFu, sel);
        if (mask == 0) continue;
        unsigned base = 0;
        int leader = __ffs(mask) - 1;
        if ((int)lane == leader) base = atomicAdd(&s.count, (unsigned)__popc(mask));
        base = __shfl_sync(0xFFFFFFFFu, base, leader);
        if (sel) out[base + __popc(mask & ((1u << lane) - 1))] = k;
    }
    __syncthreads();
    unsigned int n = s.count;
    __syncthreads();
    return n;
}

// Selects the K largest keys (0 = empty) and writes them unordered to out[]; returns the count written
// (min(K, non-empty keys)). lo_hint: a key known to be <= the K-th largest, or 1.
template <int ITEMS, typename Keys>
__device__ unsigned int select_top(const Keys& keys, int k_wanted, u64 lo_hint, u64* out, SelectSmem& s) {
    u64 local_max = 0, local_min = ~0ull;
    unsigned int local_n = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        u64 k = keys.get(i);
        if (k != 0 && k >= lo_hint) {
            local_max = k > local_max ? k : local_max;
            local_min = k < local_min ? k : local_min;
            ++local_n;
        }
    }
    u64 hi = block_max(local_max, s);
    u64 lo = block_min(local_min, s);
    u64 n = block_sum(local_n, s);
    if (n <= (u64)k_wanted) return block_compact<ITEMS>(keys, lo, 0, 0, true, out, s);
    int shift;
    u64 t;
    block_select<ITEMS>(keys, k_wanted, lo, hi, s, shift, t);
    return block_compact<ITEMS>(keys, lo, shift, t, false, out, s);
}

// (acc << 1) | sign bit of d: one funnel shift appends a value's sign to a mask.
__device__ __forceinline__ uint32_t append_sign(uint32_t acc, float d) {
    uint32_t r;
    asm("shf.l.clamp.b32 %0, %1, %2, 1;" : "=r"(r) : "r"(__float_as_uint(d)), "r"(acc));
    return r;
}

// Bit j set iff v[j] >= t, for GROUP_ITEMS values, in two instructions a value (a compare, a select and an
// or take three): the sign of v[j] - t_sub is clear iff v[j] >= t, with t_sub = t except -0.0 for a zero t
// (so that -0.0 - t_sub is +0.0). A difference of floats is zero only when they are equal; NaN values
// (whose rows are errors) may pass. For t = -inf the caller takes every value instead: -inf - -inf is NaN.
__device__ __forceinline__ uint32_t ge_bits(const float* v, float t_sub) {
    uint32_t signs = 0;
#pragma unroll
    for (int j = GROUP_ITEMS - 1; j >= 0; --j) signs = append_sign(signs, __fsub_rn(v[j], t_sub));
    return ~signs & ((1u << GROUP_ITEMS) - 1);
}

// acc - (x < y) for u64 x, y: the borrow of x - y, taken by a subtraction with borrow-in (three
// instructions, where a 64-bit compare and a conditional add take four).
__device__ __forceinline__ unsigned int sub_if_less(unsigned int acc, u64 x, u64 y) {
    unsigned int r;
    asm("{\n\t.reg .u32 t;\n\t"
        "sub.cc.u32 t, %1, %3;\n\t"
        "subc.cc.u32 t, %2, %4;\n\t"
        "subc.u32 %0, %5, 0;\n\t}"
        : "=r"(r)
        : "r"((uint32_t)x), "r"((uint32_t)(x >> 32)), "r"((uint32_t)y), "r"((uint32_t)(y >> 32)), "r"(acc));
    return r;
}

// The number of keys of list[0, n) larger than x (list 16-byte aligned): two keys a 16-byte load and
// three instructions a compare.
__device__ __forceinline__ unsigned int count_larger(u64 x, const u64* list, unsigned int n) {
    const ulonglong2* pairs = reinterpret_cast<const ulonglong2*>(list);
    unsigned int neg_rank = 0;  // minus the number of larger keys
    for (unsigned int j = 0; j < n / 2; ++j) {
        const ulonglong2 y = pairs[j];
        neg_rank = sub_if_less(neg_rank, x, y.x);
        neg_rank = sub_if_less(neg_rank, x, y.y);
    }
    if (n & 1) neg_rank = sub_if_less(neg_rank, x, list[n - 1]);
    return 0u - neg_rank;
}

// max that returns NaN when either input is NaN (fmaxf would hide it), so NaN logits reach the status.
__device__ __forceinline__ float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// Warp sum of the threads' exp-term sums (CHUNK_ITEMS terms of at most 2^44 each): as two
// 32-bit reductions (REDUX) of 26-bit pieces, whose warp sums stay below 2^31, rather than five rounds of
// 64-bit shuffles and adds.
__device__ __forceinline__ u64 warp_sum_terms(u64 v) {
    static_assert(CHUNK_ITEMS <= 64, "a thread's sum is at most 2^50, so both pieces' warp sums fit 32 bits");
    const unsigned int lo = __reduce_add_sync(FULL_MASK, (unsigned int)(v & 0x3FFFFFFu));
    const unsigned int hi = __reduce_add_sync(FULL_MASK, (unsigned int)(v >> 26));
    return ((u64)hi << 26) + lo;
}

__device__ __forceinline__ u64 warp_min_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ int top_bit(uint32_t x) { return 31 - __clz((int)x); }
__device__ __forceinline__ int top_bit(u64 x) { return 63 - __clzll((long long)x); }

// The largest t with count(t) >= want, where count(t) is the number of keys >= t, found bit by bit below
// the common prefix of lo and hi (the smallest and largest key, at least want keys in all). Bits below
// stop_bit stay 0, which only lowers t. With exact, the search ends as soon as exactly want keys reach t;
// for distinct keys and stop_bit 0 the result is then the want-th largest key either way. count must
// return the same value to every caller.
template <typename K, typename Count>
__device__ __forceinline__ K search_kth(const Count& count, K lo, K hi, unsigned int want, int stop_bit, bool exact) {
    if (lo == hi) return lo;
    const int top = top_bit(lo ^ hi);
    const int fixed = top + 1;  // bits at and above stay those of lo
    K t = fixed >= (int)(8 * sizeof(K)) ? K(0) : (lo >> fixed) << fixed;
    for (int b = top; b >= stop_bit; --b) {
        const K c = t | (K(1) << b);
        const unsigned int n = count(c);
        if (n >= want) {
            t = c;
            if (exact && n == want) break;
        }
    }
    return t;
}

// A digit picked from a 256-bin histogram of keys (bin = digit): the digit d such that fewer than `need`
// counted keys have a larger digit (above) and at least `need` have d or larger; in_digit is d's count.
struct DigitPick {
    unsigned int digit, above, in_digit;
    bool found;  // false when fewer than `need` keys were counted
};

// Every warp reads the whole histogram and gets the same answer, so no barrier is needed to share it. Lane
// l holds digits 8l .. 8l + 7; the lane whose digits hold the pick finds it without branches: with s_j
// the count of its digits j and above and `larger` that of the higher lanes, the digits j with
// larger + s_j >= need are exactly those at or below the pick (s_j does not increase with j), so their
// number gives the digit and the other digits' counts give `above`.
__device__ __forceinline__ DigitPick pick_digit(const unsigned int* hist, unsigned int need) {
    const int lane = threadIdx.x & 31;
    const uint4 a = reinterpret_cast<const uint4*>(hist)[2 * lane];
    const uint4 b = reinterpret_cast<const uint4*>(hist)[2 * lane + 1];
    const unsigned int c[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    unsigned int s[8];
    s[7] = c[7];
#pragma unroll
    for (int j = 6; j >= 0; --j) s[j] = s[j + 1] + c[j];
    const unsigned int mine = s[0];
    unsigned int incl = mine;  // this lane's bins and every larger digit
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned int y = __shfl_down_sync(FULL_MASK, incl, o);
        if (lane + o < 32) incl += y;
    }
    const unsigned int larger = incl - mine;
    const bool here = larger < need && need <= incl;
    const unsigned int ballot = __ballot_sync(FULL_MASK, here);
    DigitPick p{0, 0, 0, ballot != 0};
    if (ballot == 0) return p;
    // Only the lane `here` uses these; there larger < need, so need - larger does not wrap.
    const unsigned int rest = need - larger;
    unsigned int at_or_below = 0, above = larger;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const bool reach = s[j] >= rest;
        at_or_below += reach;
        above += reach ? 0u : c[j];
    }
    const int src = __ffs(ballot) - 1;
    p.digit = 8 * src + __shfl_sync(FULL_MASK, at_or_below, src) - 1;
    p.above = __shfl_sync(FULL_MASK, above, src);
    p.in_digit = hist[p.digit];
    return p;
}

// Keys held by the threads of a CTA, ITEMS each: key i of this thread, 0 for none.
template <int ITEMS>
struct PlainKeys {
    u64 key[ITEMS];
    __device__ __forceinline__ u64 get(int i) const { return key[i]; }
};

// The first n keys of a buffer, slot i * NT + tid for item i of this thread: in shared memory, or with
// THROUGH_L2 in global memory that other CTAs of the launch wrote.
template <int NT, int ITEMS, bool THROUGH_L2>
struct SlotKeys {
    const u64* buf;
    unsigned int n;
    __device__ __forceinline__ u64 get(int i) const {
        const unsigned int idx = i * NT + threadIdx.x;
        return idx < n ? (THROUGH_L2 ? __ldcg(buf + idx) : buf[idx]) : 0ull;
    }
};
template <int NT, int ITEMS>
using SmemKeys = SlotKeys<NT, ITEMS, false>;
template <int NT, int ITEMS>
using GlobalKeys = SlotKeys<NT, ITEMS, true>;

// One round's end in the radix selects: takes the picked digit into t and moves (shift, fixed) to the
// next digit below it, skipping the bits every key shares. Returns false when t is final: the pick found
// fewer than `need` keys, the digit holds exactly the keys still needed, or no differing bit is left.
__device__ __forceinline__ bool next_digit(const DigitPick& p, u64 same_mask, u64 same_bits, u64& t,
                                           unsigned int& need, int& shift, int& fixed) {
    if (!p.found) return false;
    t |= (u64)p.digit << shift;
    need -= p.above;
    if (p.in_digit == need || shift == 0) return false;
    // More than one key is left in the digit, so some bit below shift still differs between keys.
    const u64 below = (1ull << shift) - 1;
    const u64 free_bits = below & ~same_mask;
    if (free_bits == 0) return false;
    const int top = top_bit(free_bits);
    t |= same_bits & same_mask & below & ~((2ull << top) - 1);
    fixed = top + 1;
    shift = max(top - 7, 0);
    return true;
}

// Radix select, 8 bits a round: the k-th largest of the distinct nonzero keys in [lo, hi] (more than k of
// them), so that exactly k of those keys are >= the result. Every key has the bits same_bits where
// same_mask is set (the high bits of the index part, from the index range); the rounds skip them, so
// that ties in value cost one or two rounds on the index rather than four. hist: three 256-bin
// histograms used in turn, the first zero on entry; each round zeroes the next one, which nobody reads
// any more, so one barrier a round suffices. Keys above hi (only in rows with NaN, which are reported as
// errors) can end the search early; the caller then caps what it writes. With shared_pick, warp 0 alone
// picks each digit and shares it there, a second barrier a round in place of every other warp's pick
// (about a hundred instructions); the slot is written again only after the next round's first barrier,
// which every reader of the last pick has reached.
template <int NT, int ITEMS, typename Keys>
__device__ u64 block_radix_kth(const Keys& keys, unsigned int k, u64 lo, u64 hi, u64 same_mask, u64 same_bits,
                               unsigned int (*hist)[256], DigitPick* shared_pick = nullptr) {
    int shift = lo == hi ? 0 : max(top_bit(lo ^ hi) - 7, 0);
    int fixed = shift + 8;  // bits at and above are those of t; the last digit may overlap them
    u64 t = fixed >= 64 ? 0ull : (lo >> fixed) << fixed;
    unsigned int need = k;
    for (int round = 0;; ++round) {
        unsigned int* h = hist[round % 3];
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const u64 x = keys.get(i);
            if (x != 0 && x >= lo && shr64(x, fixed) == shr64(t, fixed)) atomicAdd(&h[(x >> shift) & 255], 1u);
        }
        if (threadIdx.x < 256) hist[(round + 1) % 3][threadIdx.x] = 0;
        __syncthreads();
        DigitPick p;
        if (shared_pick == nullptr) {
            p = pick_digit(h, need);
        } else {
            if (threadIdx.x < 32) {
                const DigitPick q = pick_digit(h, need);
                if (threadIdx.x == 0) *shared_pick = q;
            }
            __syncthreads();
            p = *shared_pick;
        }
        if (!next_digit(p, same_mask, same_bits, t, need, shift, fixed)) return t;
    }
}

// block_radix_kth within one warp: the keys are its lanes' (0 for none), and it uses two 256-bin histograms
// in turn, hist[0] zero on entry. Each round zeroes the other histogram, which the previous round's pick
// read; the __syncwarp at a round's start orders that pick's reads before the zeroing.
template <int ITEMS>
__device__ u64 warp_radix_kth(const u64 (&keys)[ITEMS], unsigned int k, u64 lo, u64 hi, u64 same_mask,
                              u64 same_bits, unsigned int (*hist)[256]) {
    const int lane = threadIdx.x & 31;
    int shift = lo == hi ? 0 : max(top_bit(lo ^ hi) - 7, 0);
    int fixed = shift + 8;  // bits at and above are those of t; the last digit may overlap them
    u64 t = fixed >= 64 ? 0ull : (lo >> fixed) << fixed;
    unsigned int need = k;
    for (int round = 0;; ++round) {
        unsigned int* h = hist[round & 1];
        __syncwarp();
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const u64 x = keys[i];
            if (x != 0 && x >= lo && shr64(x, fixed) == shr64(t, fixed)) atomicAdd(&h[(x >> shift) & 255], 1u);
        }
        uint4* other = reinterpret_cast<uint4*>(hist[(round + 1) & 1]);
        other[2 * lane] = make_uint4(0, 0, 0, 0);
        other[2 * lane + 1] = make_uint4(0, 0, 0, 0);
        __syncwarp();
        const DigitPick p = pick_digit(h, need);
        if (!next_digit(p, same_mask, same_bits, t, need, shift, fixed)) return t;
    }
}

// The bits of the index part (~index) shared by every index in [first, last]: a mask and their values.
__device__ __forceinline__ void index_bits(uint32_t first, uint32_t last, u64& same_mask, u64& same_bits) {
    const uint32_t varying = first == last ? 0u : 0xFFFFFFFFu >> __clz((int)(first ^ last));
    same_mask = (u64)(~varying);
    same_bits = (u64)(~first);
}

// One warp: the row's lse from the chunks' (max, fixed-point sum), in float64 as the contract says. The
// chunks' terms are computed in parallel; lane 0 adds them in chunk order (a chunk with a zero sum adds
// +0.0, which changes nothing). Returns the row's max (fmaxf of the chunk maxima) to every lane. Reads
// through L2 (ld.global.cg): in a fused launch other CTAs of this launch wrote the chunk results.
__device__ float combine_lse(const float* chunk_max, const u64* chunk_sum, const int* chunk_flags, int chunks,
                            double* terms, float& lse, int& flags) {
    const int lane = threadIdx.x & 31;
    float big = -INFINITY;
    unsigned int f = 0;
    for (int c = lane; c < chunks; c += 32) {
        big = fmaxf(big, __ldcg(chunk_max + c));
        f |= (unsigned)__ldcg(chunk_flags + c);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(FULL_MASK, big, o));
    f = __reduce_or_sync(FULL_MASK, f);
    for (int c = lane; c < chunks; c += 32) {
        const double w = (double)expd(__fsub_rn(__ldcg(chunk_max + c), big));
        const u64 sum = __ldcg(chunk_sum + c);
        terms[c] = sum == 0 ? 0.0 : __dmul_rn(__ull2double_rn(sum), w);
    }
    __syncwarp();
    if (lane == 0) {
        double total = 0.0;
        for (int c = 0; c < chunks; ++c) total = __dadd_rn(total, terms[c]);
        if (big == -INFINITY) f |= STATUS_NO_FINITE;
        flags = (int)f;
        lse = __double2float_rn(__dadd_rn((double)big, log(__dmul_rn(total, 0x1p-44))));
    }
    return big;
}

// Loads item i of this thread: element ((i / VEC) * CHUNK_THREADS + tid) * VEC + i % VEC of the chunk,
// 16-byte vectors when aligned; items past the chunk's end read as -inf.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, int base, int len, bool vec_ok,
                                           float (&vals)[CHUNK_ITEMS]) {
    constexpr int VEC = 16 / sizeof(T);
    const int tid = threadIdx.x;
    if (vec_ok && len == CHUNK) {
        // One pointer and constant offsets, rather than a 64-bit address computed for every vector.
        const uint4* src = reinterpret_cast<const uint4*>(row + base) + tid;
#pragma unroll
        for (int v = 0; v < CHUNK_ITEMS / VEC; ++v) {
            uint4 raw = __ldcs(src + v * CHUNK_THREADS);
            const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int j = 0; j < VEC; ++j) vals[v * VEC + j] = to_f32(x[j]);
        }
    } else {
#pragma unroll
        for (int v = 0; v < CHUNK_ITEMS / VEC; ++v)
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                int e = (v * CHUNK_THREADS + tid) * VEC + j;
                vals[v * VEC + j] = e < len ? to_f32(row[base + e]) : -INFINITY;
            }
    }
}

// Element index of item i (matches load_chunk's layout).
template <typename T>
__device__ __forceinline__ int item_index(int i) {
    constexpr int VEC = 16 / sizeof(T);
    return ((i / VEC) * CHUNK_THREADS + (int)threadIdx.x) * VEC + (i % VEC);
}

struct ChunkSmem {
    alignas(16) unsigned int bound_hist[2][256];  // the bound's two rounds
    unsigned int bound_digit[2], bound_above;       // their picks, shared by warp 0
    alignas(16) unsigned int select_hist[3][256];
    uint32_t warp_lo[CHUNK_WARPS], warp_hi[CHUNK_WARPS];
    unsigned int warp_real[CHUNK_WARPS];
    u64 warp_sum[CHUNK_WARPS];
    u64 warp_lo64[CHUNK_WARPS], warp_hi64[CHUNK_WARPS];
    unsigned int warp_count[2][CHUNK_WARPS];
    unsigned int count, taken;
    u64 kth;
    DigitPick pick;  // block_radix_kth's shared pick
    alignas(16) u64 cand[CAP];
    // The stash is done with when a CTA merges its row, so the merge's buffers share its space.
    union {
        float4 stash[GROUP_ITEMS / 4][CHUNK_THREADS];  // a passing group's values, a thread's own column
        struct {
            alignas(16) u64 acc[MAX_K];  // the row's K best keys, unordered
            double terms[MAX_CHUNKS];
        } merge;
    };
    u64 merge_lo;  // a key at or below the row's K-th (the largest chunk K-th key, or 1)
    float merge_top, merge_lse;  // the row's max and lse
    int merge_flags;
    unsigned int last;  // nonzero in the CTA that merges its row
};

// One warp: the K best of the n distinct keys cand[0, n) (n > K, n <= 32 * ITEMS), written unordered to
// out[] in slot order; returns the threshold of warp_radix_kth (exactly K keys reach it).
template <int ITEMS>
__device__ u64 warp_select(const u64* cand, unsigned int n, unsigned int k, u64 lo, u64 hi, u64 same_mask,
                           u64 same_bits, u64* out, unsigned int (*hist)[256]) {
    const unsigned int lane = threadIdx.x & 31;
    u64 x[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const unsigned int at = i * 32 + lane;
        x[i] = at < n ? cand[at] : 0ull;
    }
    const u64 t = warp_radix_kth<ITEMS>(x, k, lo, hi, same_mask, same_bits, hist);
    unsigned int taken = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const bool sel = x[i] != 0 && x[i] >= t;
        const unsigned int mask = __ballot_sync(FULL_MASK, sel);
        const unsigned int at = taken + __popc(mask & ((1u << lane) - 1));
        if (sel && at < k) out[at] = x[i];
        taken += __popc(mask);
    }
    return t;
}

// The merge of topk_merge, done by the last CTA of a row to finish its chunk, with this CTA's threads and
// shared memory, over the row's chunks * slots chunk slots (at most FUSED_SLOTS, which the launcher
// checks). It reads every chunk's results back from memory in chunk order, as topk_merge does, so what it
// writes does not depend on which CTA merges. The chunk bounds give a bound at or below the row's K-th
// key; the candidates that reach it are gathered in shared memory (up to CAP; more are selected where they
// lie, through L2) and, when more than K, cut to K by the radix select; a key's rank among the K is the
// number of larger ones (keys are distinct).
__device__ void merge_row(const u64* cand, const float* chunk_max, const u64* chunk_sum, const u64* chunk_kth,
                          const int* chunk_flags, int row, int chunks, unsigned int k, unsigned int slots,
                          int* __restrict__ top_ids,
                          float* __restrict__ top_logp, float* __restrict__ lse_out, int* __restrict__ row_status,
                          ChunkSmem& sm) {
    constexpr int ITEMS = CAP / CHUNK_THREADS;  // chunk candidates a thread gathers
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const size_t first = (size_t)row * chunks;
    sm.select_hist[0][tid] = 0;  // block_radix_kth wants it zero; the chunk's own select may have left counts
    if (tid == 0) {
        sm.count = 0;
        sm.taken = 0;
    }
    if (warp == 0) {
        const float top = combine_lse(chunk_max + first, chunk_sum + first, chunk_flags + first, chunks,
                                      sm.merge.terms, sm.merge_lse, sm.merge_flags);
        u64 lo = 1;
        for (int c = lane; c < chunks; c += 32) lo = max(lo, __ldcg(chunk_kth + first + c));
        lo = warp_max_u64(lo);
        if (lane == 0) {
            sm.merge_lo = lo;
            sm.merge_top = top;
        }
    }
    // ITEMS loads in flight a batch; every key that reaches lo is counted, those past CAP are not stored.
    const u64* row_cand = cand + first * slots;
    const unsigned int total = (unsigned)chunks * slots;
    __syncthreads();
    const u64 lo = sm.merge_lo;  // >= 1, so empty slots (0) never pass
    const u64 hi = ((u64)order_key(sm.merge_top) << 32) | 0xFFFFFFFFull;
#pragma unroll 1
    for (unsigned int from = 0; from < total; from += ITEMS * CHUNK_THREADS) {
        u64 x[ITEMS];
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const unsigned int f = from + i * CHUNK_THREADS + tid;
            x[i] = f < total ? __ldcg(row_cand + f) : 0ull;
        }
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const bool sel = x[i] >= lo;
            const unsigned int mask = __ballot_sync(FULL_MASK, sel);
            if (mask == 0) continue;
            const int leader = __ffs(mask) - 1;
            unsigned int at = 0;
            if (lane == leader) at = atomicAdd(&sm.count, (unsigned)__popc(mask));
            at = __shfl_sync(FULL_MASK, at, leader) + __popc(mask & ((1u << lane) - 1));
            if (sel && at < (unsigned)CAP) sm.cand[at] = x[i];
        }
    }
    __syncthreads();
    const unsigned int n = sm.count;
    const u64* best = sm.cand;
    unsigned int n_best = n;
    if (n > k) {
        u64 same_mask, same_bits;  // indices are below chunks * CHUNK
        index_bits(0u, (uint32_t)(chunks * CHUNK - 1), same_mask, same_bits);
        // A round looks at every slot a thread may hold: half of them when they hold every key.
        constexpr int HALF = ITEMS / 2, ALL_SLOTS = FUSED_SLOTS / CHUNK_THREADS;
        u64 t;
        if (n > (unsigned)CAP)
            t = block_radix_kth<CHUNK_THREADS, ALL_SLOTS>(GlobalKeys<CHUNK_THREADS, ALL_SLOTS>{row_cand, total}, k,
                                                          lo, hi, same_mask, same_bits, sm.select_hist, &sm.pick);
        else if (n <= (unsigned)(HALF * CHUNK_THREADS))
            t = block_radix_kth<CHUNK_THREADS, HALF>(SmemKeys<CHUNK_THREADS, HALF>{sm.cand, n}, k, lo, hi, same_mask,
                                                     same_bits, sm.select_hist, &sm.pick);
        else
            t = block_radix_kth<CHUNK_THREADS, ITEMS>(SmemKeys<CHUNK_THREADS, ITEMS>{sm.cand, n}, k, lo, hi,
                                                      same_mask, same_bits, sm.select_hist, &sm.pick);
        // The keys at or above t: from shared memory, or from every slot when not all of them fit there
        // (t >= lo, so the slots below lo, and the empty ones, stay out).
        const bool stored = n <= (unsigned)CAP;
        for (unsigned int i = tid; i < (stored ? n : total); i += CHUNK_THREADS) {
            const u64 y = stored ? sm.cand[i] : __ldcg(row_cand + i);
            if (y >= t) {
                const unsigned int at = atomicAdd(&sm.taken, 1u);
                if (at < k) sm.merge.acc[at] = y;
            }
        }
        __syncthreads();
        best = sm.merge.acc;
        n_best = min(sm.taken, k);
    }
    const float lse = sm.merge_lse;
    for (unsigned int i = tid; i < n_best; i += CHUNK_THREADS) {
        const u64 y = best[i];
        const size_t o = (size_t)row * k + count_larger(y, best, n_best);
        top_ids[o] = (int)(~(uint32_t)y);
        top_logp[o] = __fsub_rn(key_value((uint32_t)(y >> 32)), lse);
    }
    if (tid == 0) {
        lse_out[row] = lse;
        row_status[row] = sm.merge_flags;
    }
}

// Composite key of element e of the chunk (0 past its end), read again from memory: the slow path runs
// too rarely for the chunk's registers to be worth keeping for it.
template <typename T>
__device__ __forceinline__ u64 chunk_key(const T* __restrict__ row, int base, int len, int e) {
    return e < len ? composite_key(order_key(to_f32(row[base + e])), (uint32_t)(base + e)) : 0ull;
}

// The slow path: more than CAP values reached the bound. The whole CTA searches the K-th largest key of the
// whole chunk (counting per bit with one barrier) and writes the K keys at or above it, unordered. len > CAP
// >= K here, so exactly K keys are written.
template <typename T>
__device__ u64 chunk_select_all(const T* __restrict__ row, int base, int len, int k, u64* out, ChunkSmem& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 lo = ~0ull, hi = 0;
    for (int e = threadIdx.x; e < len; e += CHUNK_THREADS) {
        const u64 x = chunk_key(row, base, len, e);
        lo = min(lo, x);
        hi = max(hi, x);
    }
    lo = warp_min_u64(lo);
    hi = warp_max_u64(hi);
    if (lane == 0) {
        sm.warp_lo64[warp] = lo;
        sm.warp_hi64[warp] = hi;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < CHUNK_WARPS; ++w) {
        lo = min(lo, sm.warp_lo64[w]);
        hi = max(hi, sm.warp_hi64[w]);
    }
    int round = 0;
    // Two count buffers in turn: a buffer is written again only after the barrier of the round between.
    auto count = [&](u64 c) {
        unsigned int m = 0;
        for (int e = threadIdx.x; e < len; e += CHUNK_THREADS) m += chunk_key(row, base, len, e) >= c;
        m = __reduce_add_sync(FULL_MASK, m);
        unsigned int* slot = sm.warp_count[round & 1];
        ++round;
        if (lane == 0) slot[warp] = m;
        __syncthreads();
        unsigned int total = 0;
#pragma unroll
        for (int w = 0; w < CHUNK_WARPS; ++w) total += slot[w];
        return total;
    };
    const u64 t = search_kth(count, lo, hi, (unsigned)k, 0, true);
    for (int e = threadIdx.x; e < len; e += CHUNK_THREADS) {
        const u64 x = chunk_key(row, base, len, e);
        if (x >= t) {
            const unsigned int at = atomicAdd(&sm.taken, 1u);
            if (at < (unsigned)k) out[at] = x;
        }
    }
    return t;
}

template <typename T>
__device__ void chunk_kernel(const T* __restrict__ logits, int vocab, int k_wanted, u64* cand, float* chunk_max,
                             u64* chunk_sum, u64* chunk_kth, int* chunk_flags, int fused_slots,
                             unsigned int* arrivals, int* top_ids, float* top_logp, float* lse_out, int* row_status) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int GROUPS_PER_THREAD = CHUNK_ITEMS / GROUP_ITEMS;
    __shared__ ChunkSmem sm;
    const int chunk = blockIdx.x, row = blockIdx.y, chunks = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int base = chunk * CHUNK;
    const int len = min(CHUNK, vocab - base);
    const T* row_ptr = logits + (size_t)row * vocab;
    const bool vec_ok = (vocab % VEC) == 0 && ((uintptr_t)logits % 16) == 0;
    const unsigned int k = (unsigned)k_wanted;
    // Slots of this chunk's results: K, or with a fused merge, room for the usual candidates unselected.
    const unsigned int slots = fused_slots != 0 ? (unsigned)fused_slots : k;

    float vals[CHUNK_ITEMS];
    load_chunk<T>(row_ptr, base, len, vec_ok, vals);
    sm.bound_hist[0][tid] = 0;
    sm.bound_hist[1][tid] = 0;
    sm.select_hist[0][tid] = 0;
    if (tid == 0) {
        sm.count = 0;
        sm.taken = 0;
    }

    // Group g of this thread is items [16g, 16g + 16): whole vectors, so its first element is that of its
    // first item. Padding is -inf, so a group's max is that of its real values (if it has any). The order
    // keys of the group maxima give the chunk's max and, with max_nan, its NaN and +inf status.
    float group_max[GROUPS_PER_THREAD];
    uint32_t group_key[GROUPS_PER_THREAD];
    uint32_t lo = ~0u, hi = 0;
    unsigned int real = 0;
#pragma unroll
    for (int g = 0; g < GROUPS_PER_THREAD; ++g) {
        float gm = vals[g * GROUP_ITEMS];
#pragma unroll
        for (int i = g * GROUP_ITEMS + 1; i < (g + 1) * GROUP_ITEMS; ++i) gm = max_nan(gm, vals[i]);
        group_max[g] = gm;
        const bool is_real = item_index<T>(g * GROUP_ITEMS) < len;
        group_key[g] = is_real ? order_key(gm) : 0u;
        lo = min(lo, is_real ? group_key[g] : ~0u);
        hi = max(hi, group_key[g]);
        real += is_real;
    }
    lo = __reduce_min_sync(FULL_MASK, lo);
    hi = __reduce_max_sync(FULL_MASK, hi);
    real = __reduce_add_sync(FULL_MASK, real);
    if (lane == 0) {
        sm.warp_lo[warp] = lo;
        sm.warp_hi[warp] = hi;
        sm.warp_real[warp] = real;
    }
    __syncthreads();
    lo = sm.warp_lo[0];
    hi = sm.warp_hi[0];
    real = sm.warp_real[0];
#pragma unroll
    for (int w = 1; w < CHUNK_WARPS; ++w) {
        lo = min(lo, sm.warp_lo[w]);
        hi = max(hi, sm.warp_hi[w]);
        real += sm.warp_real[w];
    }
    const float m = key_value(hi);  // the chunk's max, -0.0 read as +0.0

    // The bound, a key at or below the chunk's K-th value: the K-th largest group max (K distinct
    // elements reach it), rounded down to a histogram bin of the group keys. With fewer than K real
    // groups every value is a candidate. First round: the 8 bits below the common prefix of lo and hi.
    const bool bounded = real >= k && lo != hi;
    const int shift1 = bounded ? max(top_bit(lo ^ hi) - 7, 0) : 0;
    if (bounded) {
#pragma unroll
        for (int g = 0; g < GROUPS_PER_THREAD; ++g)
            if (group_key[g] != 0) atomicAdd(&sm.bound_hist[0][(group_key[g] >> shift1) & 255], 1u);
    }

    u64 local_sum = 0;
#pragma unroll
    for (int i = 0; i < CHUNK_ITEMS; ++i) local_sum += lse_term(vals[i], m);
    local_sum = warp_sum_terms(local_sum);
    if (lane == 0) sm.warp_sum[warp] = local_sum;
    __syncthreads();

    // Warp 0 alone picks each round's digit and shares it through shared memory: a barrier costs less
    // than every warp repeating the pick's hundred-odd instructions. bounded and shift1 are the same in
    // every thread, so every thread reaches the barriers.
    uint32_t bound = real >= k ? lo : 0u;
    if (bounded) {
        if (warp == 0) {
            const DigitPick p = pick_digit(sm.bound_hist[0], k);
            if (lane == 0) {
                sm.bound_digit[0] = p.digit;
                sm.bound_above = p.above;
            }
        }
        __syncthreads();
        bound = (uint32_t)(((u64)lo >> (shift1 + 8)) << (shift1 + 8)) | (sm.bound_digit[0] << shift1);
        // A second round within the picked bin when the first one's bins are wide (more than 2^12 keys).
        if (shift1 > 12) {
            const int shift2 = shift1 - 8;
#pragma unroll
            for (int g = 0; g < GROUPS_PER_THREAD; ++g)
                if (group_key[g] != 0 && (group_key[g] >> shift1) == (bound >> shift1))
                    atomicAdd(&sm.bound_hist[1][(group_key[g] >> shift2) & 255], 1u);
            __syncthreads();
            if (warp == 0) {
                const DigitPick p = pick_digit(sm.bound_hist[1], k - sm.bound_above);
                if (lane == 0) sm.bound_digit[1] = p.digit;
            }
            __syncthreads();
            bound |= sm.bound_digit[1] << shift2;
        }
    }

    // order_key(v) >= bound is v >= key_value(bound) for every non-NaN v, except for bounds at or below
    // -inf's key (not floats, or -inf itself), where every value passes. A group whose max is below the
    // threshold has no candidate.
    // Candidates are counted first and placed by a warp scan and one atomic per warp, so that writing one
    // costs a few instructions rather than a warp-wide atomic sequence per item. Bit j of pass[g] marks
    // value j of group g, so that writing costs a loop over the candidates rather than over every value
    // of a passing group (in a warp, some lane's group passes far more often than some value of it).
    const float threshold = bound <= NEG_INF_KEY ? -INFINITY : key_value(bound);
    const float t_sub = threshold == 0.0f ? -0.0f : threshold;
    uint32_t real_bits[GROUPS_PER_THREAD];  // the values of each group inside the chunk
#pragma unroll
    for (int g = 0; g < GROUPS_PER_THREAD; ++g) real_bits[g] = (1u << GROUP_ITEMS) - 1;
    if (len < CHUNK) {
#pragma unroll
        for (int i = 0; i < CHUNK_ITEMS; ++i)
            if (item_index<T>(i) >= len) real_bits[i / GROUP_ITEMS] &= ~(1u << (i % GROUP_ITEMS));
    }
    uint32_t pass[GROUPS_PER_THREAD];
    unsigned int mine = 0;
#pragma unroll
    for (int g = 0; g < GROUPS_PER_THREAD; ++g) {
        uint32_t bits = 0;
        if (threshold == -INFINITY)
            bits = real_bits[g];
        else if (group_max[g] >= threshold)
            bits = ge_bits(&vals[g * GROUP_ITEMS], t_sub) & real_bits[g];
        pass[g] = bits;
        mine += __popc(bits);
    }
    if (__any_sync(FULL_MASK, mine != 0)) {
        unsigned int incl = mine;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned int y = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += y;
        }
        unsigned int at = 0;
        if (lane == 31) at = atomicAdd(&sm.count, incl);
        at = __shfl_sync(FULL_MASK, at, 31) + incl - mine;
        // Registers cannot be indexed by the bit found at run time, so a passing group's values go through
        // this thread's own slots of sm.stash (no other thread reads them, so no barrier is needed).
        const float* own = reinterpret_cast<const float*>(&sm.stash[0][tid]);
#pragma unroll
        for (int g = 0; g < GROUPS_PER_THREAD; ++g) {
            uint32_t bits = pass[g];
            if (bits == 0) continue;
#pragma unroll
            for (int q = 0; q < GROUP_ITEMS / 4; ++q) {
                const int i = g * GROUP_ITEMS + 4 * q;
                sm.stash[q][tid] = make_float4(vals[i], vals[i + 1], vals[i + 2], vals[i + 3]);
            }
            do {
                const unsigned int j = __ffs(bits) - 1;
                bits &= bits - 1;
                const float v = own[(j / 4) * 4 * CHUNK_THREADS + j % 4];
                const unsigned int i = g * GROUP_ITEMS + j;  // item_index, unsigned for cheap division
                const unsigned int e = (i / VEC * CHUNK_THREADS + (unsigned)tid) * VEC + i % VEC;
                if (at < (unsigned)CAP) sm.cand[at] = composite_key(order_key(v), (uint32_t)base + e);
                ++at;
            } while (bits != 0);
        }
    }
    __syncthreads();
    const unsigned int n = sm.count;

    const size_t slot = (size_t)row * chunks + chunk;
    u64* out = cand + slot * slots;
    // The exact paths below write K keys; the slots after them hold nothing.
    if (n > slots)
        for (unsigned int i = k + tid; i < slots; i += CHUNK_THREADS) out[i] = 0ull;
    u64 kth = 1;
    if (n > (unsigned)CAP) {
        kth = chunk_select_all<T>(row_ptr, base, len, k_wanted, out, sm);
    } else if (n <= slots) {
        // The candidates go out unselected, zeros after them: with slots K, they are all among the K best;
        // with more, the row's merge selects. Whenever the chunk has K real groups, their maxima reach the
        // bound, so the bound is at or below the chunk's K-th key; otherwise it is 0.
        for (unsigned int i = tid; i < slots; i += CHUNK_THREADS) out[i] = i < n ? sm.cand[i] : 0ull;
        kth = max((u64)bound << 32, 1ull);
    } else if (n <= (unsigned)RANK_MAX) {
        // Few candidates: a thread ranks one by counting the larger ones (keys are distinct), which costs
        // far fewer instructions than radix rounds over all CAP slots; the K best land at their ranks.
        if (tid < n) {
            const u64 x = sm.cand[tid];
            const unsigned int rank = count_larger(x, sm.cand, n);
            if (rank < k) out[rank] = x;
            if (rank == k - 1) sm.kth = x;
        }
        __syncthreads();
        kth = sm.kth;
    } else if (n <= (unsigned)WARP_SELECT_MAX) {
        // Warp 0 alone selects: its radix rounds need no block barrier and cost an eighth of the
        // instructions of every warp picking the digits (about half those of ranking 65 to 96 candidates by
        // counting); half the slots a lane when they hold them all. Only thread 0 uses kth.
        if (warp == 0) {
            const u64 lo64 = (u64)bound << 32, hi64 = ((u64)hi << 32) | 0xFFFFFFFFull;
            u64 same_mask, same_bits;
            index_bits((uint32_t)base, (uint32_t)(base + len - 1), same_mask, same_bits);
            kth = n <= (unsigned)(WARP_SELECT_MAX / 2)
                      ? warp_select<WARP_ITEMS / 2>(sm.cand, n, k, lo64, hi64, same_mask, same_bits, out, sm.select_hist)
                      : warp_select<WARP_ITEMS>(sm.cand, n, k, lo64, hi64, same_mask, same_bits, out, sm.select_hist);
        }
    } else {
        const u64 lo64 = (u64)bound << 32, hi64 = ((u64)hi << 32) | 0xFFFFFFFFull;
        u64 same_mask, same_bits;
        index_bits((uint32_t)base, (uint32_t)(base + len - 1), same_mask, same_bits);
        // Each radix round looks at every slot a thread may hold: two of them cover the usual count at
        // large K (about 1.4K), the full CAP / CHUNK_THREADS the rest.
        constexpr int FEW = 2, ALL = CAP / CHUNK_THREADS;
        kth = n <= (unsigned)(FEW * CHUNK_THREADS)
                  ? block_radix_kth<CHUNK_THREADS, FEW>(SmemKeys<CHUNK_THREADS, FEW>{sm.cand, n}, k, lo64, hi64,
                                                        same_mask, same_bits, sm.select_hist, &sm.pick)
                  : block_radix_kth<CHUNK_THREADS, ALL>(SmemKeys<CHUNK_THREADS, ALL>{sm.cand, n}, k, lo64, hi64,
                                                        same_mask, same_bits, sm.select_hist, &sm.pick);
        for (unsigned int i = tid; i < n; i += CHUNK_THREADS) {
            const u64 x = sm.cand[i];
            if (x >= kth) {
                const unsigned int at = atomicAdd(&sm.taken, 1u);
                if (at < k) out[at] = x;
            }
        }
    }
    if (tid == 0) {
        u64 sum = 0;
#pragma unroll
        for (int w = 0; w < CHUNK_WARPS; ++w) sum += sm.warp_sum[w];
        chunk_max[slot] = m;
        chunk_sum[slot] = sum;
        chunk_kth[slot] = kth;
        chunk_flags[slot] = status_of_keys(hi, lo);
    }
    if (fused_slots == 0) return;
    // Count this chunk in, the pattern of a grid barrier: after the CTA's barrier, one thread's fence
    // makes every thread's writes of the chunk results visible device-wide before the count (release); the
    // CTA that brings the count to `chunks` merges the row, after a second fence so that it sees every
    // other chunk's results (acquire), and resets the count for the next launch (every chunk has counted by
    // then). fence.acq_rel suffices for both patterns; __threadfence would be the heavier fence.sc.
    __syncthreads();
    if (tid == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        const unsigned int before = atomicAdd(&arrivals[row], 1u);
        const bool last = before == (unsigned)chunks - 1;
        if (last) {
            arrivals[row] = 0;
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
        }
        sm.last = last;
    }
    __syncthreads();
    if (!sm.last) return;
    merge_row(cand, chunk_max, chunk_sum, chunk_kth, chunk_flags, row, chunks, k, slots, top_ids, top_logp,
              lse_out, row_status, sm);
}

struct MergeSmem {
    SelectSmem sel;
    alignas(16) unsigned int select_hist[3][256];
    unsigned int taken;
    u64 acc[MAX_K];
    u64 next[MAX_K];
    u64 cand[CAP];
    double terms[MAX_CHUNKS];
    float lse;
    int flags;
};

// Copies the chunk candidates >= lo into buf (up to CAP, unordered); returns how many there are.
__device__ unsigned int gather_row_candidates(const u64* row_cand, int total, u64 lo, u64* buf, SelectSmem& s) {
    if (threadIdx.x == 0) s.count = 0;
    __syncthreads();
    const unsigned lane = threadIdx.x & 31;
    for (int base = 0; base < total; base += THREADS) {
        int f = base + threadIdx.x;
        u64 k = f < total ? row_cand[f] : 0ull;
        bool sel = k != 0 && k >= lo;
        unsigned mask = __ballot_sync(0xFFFFFFFFu, sel);
        if (mask == 0) continue;
        int leader = __ffs(mask) - 1;
        unsigned at = 0;
        if ((int)lane == leader) at = atomicAdd(&s.count, (unsigned)__popc(mask));
        at = __shfl_sync(0xFFFFFFFFu, at, leader) + __popc(mask & ((1u << lane) - 1));
        if (sel && at < (unsigned)CAP) buf[at] = k;
    }
    __syncthreads();
    unsigned int n = s.count;
    __syncthreads();
    return n;
}

__device__ void merge_kernel(const u64* __restrict__ cand, const float* __restrict__ chunk_max,
                                                       const u64* __restrict__ chunk_sum,
                                                       const u64* __restrict__ chunk_kth,
                                                       const int* __restrict__ chunk_flags, int chunks, int k_wanted,
                                                       int* __restrict__ top_ids, float* __restrict__ top_logp,
                                                       float* __restrict__ lse_out, int* __restrict__ row_status) {
    __shared__ MergeSmem sm;
    const int row = blockIdx.x;
    const size_t first = (size_t)row * chunks;
    const unsigned int k = (unsigned)k_wanted;
    if (threadIdx.x < 256) sm.select_hist[0][threadIdx.x] = 0;
    if (threadIdx.x == 0) sm.taken = 0;
    if (threadIdx.x < 32)
        combine_lse(chunk_max + first, chunk_sum + first, chunk_flags + first, chunks, sm.terms, sm.lse, sm.flags);

    // Any chunk with a full list proves K keys at or above its K-th key; no key is above the largest
    // chunk max.
    u64 local_lo = 1;
    float local_max = -INFINITY;
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
        local_lo = max(local_lo, chunk_kth[first + c]);
        local_max = fmaxf(local_max, chunk_max[first + c]);
    }
    const u64 lo_hint = block_max(local_lo, sm.sel);
    const u64 hi = (block_max((u64)order_key(local_max), sm.sel) << 32) | 0xFFFFFFFFull;

    const u64* row_cand = cand + first * k_wanted;
    const int total = chunks * k_wanted;
    u64 same_mask, same_bits;  // indices are below chunks * CHUNK
    index_bits(0u, (uint32_t)(chunks * CHUNK - 1), same_mask, same_bits);
    unsigned int acc_n = 0;
    if (total > CAP && total <= MERGE_REG * THREADS) {
        // Too many chunk candidates to gather in shared memory, few enough for registers: select among
        // those at or above lo_hint in place.
        PlainKeys<MERGE_REG> keys;
        unsigned int mine = 0;
#pragma unroll
        for (int i = 0; i < MERGE_REG; ++i) {
            const int f = i * THREADS + threadIdx.x;
            const u64 x = f < total ? row_cand[f] : 0ull;
            keys.key[i] = x >= lo_hint ? x : 0ull;
            mine += keys.key[i] != 0;
        }
        const u64 n = block_sum(mine, sm.sel);
        const u64 t =
            n > k ? block_radix_kth<THREADS, MERGE_REG>(keys, k, lo_hint, hi, same_mask, same_bits, sm.select_hist)
                  : 1ull;
#pragma unroll
        for (int i = 0; i < MERGE_REG; ++i) {
            const u64 x = keys.key[i];
            if (x != 0 && x >= t) {
                const unsigned int at = atomicAdd(&sm.taken, 1u);
                if (at < k) sm.acc[at] = x;
            }
        }
        __syncthreads();
        acc_n = min(sm.taken, k);
    } else if (const unsigned int n_cand = gather_row_candidates(row_cand, total, lo_hint, sm.cand, sm.sel);
               n_cand <= k) {
        for (unsigned int i = threadIdx.x; i < n_cand; i += THREADS) sm.acc[i] = sm.cand[i];
        acc_n = n_cand;
        __syncthreads();
    } else if (n_cand <= (unsigned)CAP) {
        const SmemKeys<THREADS, CAP / THREADS> keys{sm.cand, n_cand};
        const u64 t =
            block_radix_kth<THREADS, CAP / THREADS>(keys, k, lo_hint, hi, same_mask, same_bits, sm.select_hist);
        for (unsigned int i = threadIdx.x; i < n_cand; i += THREADS) {
            const u64 x = sm.cand[i];
            if (x >= t) {
                const unsigned int at = atomicAdd(&sm.taken, 1u);
                if (at < k) sm.acc[at] = x;
            }
        }
        __syncthreads();
        acc_n = min(sm.taken, k);
    } else {
        // Too many candidates for shared memory: fold them in register tiles, keeping the best K.
        for (int pos = 0; pos < total;) {
            const int fresh = MERGE_SLOTS - (int)acc_n;
            PlainKeys<MERGE_ITEMS> keys;
#pragma unroll
            for (int i = 0; i < MERGE_ITEMS; ++i) {
                int s = i * THREADS + threadIdx.x;
                int f = pos + s - (int)acc_n;
                keys.key[i] = s < (int)acc_n ? sm.acc[s] : (f < total ? row_cand[f] : 0ull);
            }
            pos += fresh;
            __syncthreads();
            acc_n = select_top<MERGE_ITEMS>(keys, k_wanted, lo_hint, sm.next, sm.sel);
            for (unsigned int i = threadIdx.x; i < acc_n; i += THREADS) sm.acc[i] = sm.next[i];
            __syncthreads();
        }
    }

    // Keys are distinct, so a key's rank is the number of larger keys.
    const float lse = sm.lse;
    for (unsigned int i = threadIdx.x; i < acc_n; i += THREADS) {
        u64 k = sm.acc[i];
        int rank = 0;
        for (unsigned int j = 0; j < acc_n; ++j) rank += sm.acc[j] > k;
        size_t o = (size_t)row * k_wanted + rank;
        top_ids[o] = (int)(~(uint32_t)k);
        top_logp[o] = __fsub_rn(key_value((uint32_t)(k >> 32)), lse);
    }
    if (threadIdx.x == 0) {
        lse_out[row] = lse;
        row_status[row] = sm.flags;
    }
}

}  // namespace topk
}  // namespace kdt

extern "C" __global__ void __launch_bounds__(kdt::topk::CHUNK_THREADS, kdt::topk::CHUNK_MIN_BLOCKS)
    topk_chunk_f32(const float* logits, int vocab, int k, kdt::u64* cand, float* chunk_max, kdt::u64* chunk_sum,
                   kdt::u64* chunk_kth, int* chunk_flags, int fused_slots, unsigned int* arrivals, int* top_ids,
                   float* top_logp, float* lse, int* row_status) {
    kdt::topk::chunk_kernel<float>(logits, vocab, k, cand, chunk_max, chunk_sum, chunk_kth, chunk_flags, fused_slots,
                                   arrivals, top_ids, top_logp, lse, row_status);
}

extern "C" __global__ void __launch_bounds__(kdt::topk::CHUNK_THREADS, kdt::topk::CHUNK_MIN_BLOCKS)
    topk_chunk_bf16(const __nv_bfloat16* logits, int vocab, int k, kdt::u64* cand, float* chunk_max,
                    kdt::u64* chunk_sum, kdt::u64* chunk_kth, int* chunk_flags, int fused_slots, unsigned int* arrivals,
                    int* top_ids, float* top_logp, float* lse, int* row_status) {
    kdt::topk::chunk_kernel<__nv_bfloat16>(logits, vocab, k, cand, chunk_max, chunk_sum, chunk_kth, chunk_flags,
                                           fused_slots, arrivals, top_ids, top_logp, lse, row_status);
}

extern "C" __global__ void __launch_bounds__(kdt::topk::THREADS)
    topk_merge(const kdt::u64* cand, const float* chunk_max, const kdt::u64* chunk_sum, const kdt::u64* chunk_kth,
               const int* chunk_flags, int chunks, int k, int* top_ids, float* top_logp, float* lse,
               int* row_status) {
    kdt::topk::merge_kernel(cand, chunk_max, chunk_sum, chunk_kth, chunk_flags, chunks, k, top_ids, top_logp, lse,
                            row_status);
}
