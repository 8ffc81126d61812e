// Top-K with logsumexp over the vocabulary (DESIGN.md §4.1 step 1; exact contract in reference/README.md).
//
// Two launches. topk_chunk: one CTA per (chunk of 8192 logits, row) reads its chunk once, keeps it in
// registers, writes the chunk's max, its exact fixed-point exp-sum and its K best composite keys (value
// descending, index ascending; unordered). topk_merge: one CTA per row selects the K best of the chunks'
// candidates, ranks them and combines the chunk sums into the row's lse.
#include "common.cuh"

namespace kdt {
namespace topk {

constexpr int THREADS = 512;
constexpr int CHUNK = 8192;
constexpr int CHUNK_ITEMS = CHUNK / THREADS;  // per thread, in registers
constexpr int MERGE_ITEMS = 8;
constexpr int MERGE_SLOTS = MERGE_ITEMS * THREADS;
constexpr int MAX_K = 512;
constexpr int CAP = 2048;  // candidates kept in shared memory; more take the register-resident path
constexpr int CAP_ITEMS = CAP / THREADS;

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

// Key sources for the selection: item i of this thread as a composite u64 key (0 = empty slot).
// Chunk keys keep only the 32-bit value key in registers and rebuild the index from the item position.
template <typename T>
__device__ __forceinline__ int item_index(int i);

template <typename T, int ITEMS>
struct ChunkKeys {
    uint32_t value[ITEMS];
    int base;
    __device__ __forceinline__ u64 get(int i) const {
        return value[i] == 0 ? 0ull : composite_key(value[i], (uint32_t)(base + item_index<T>(i)));
    }
};

template <int ITEMS>
struct PlainKeys {
    u64 key[ITEMS];
    __device__ __forceinline__ u64 get(int i) const { return key[i]; }
};

// Candidates gathered into shared memory: slot i * THREADS + tid of the first n.
template <int ITEMS>
struct SmemKeys {
    const u64* buf;
    unsigned int n;
    __device__ __forceinline__ u64 get(int i) const {
        unsigned int idx = i * THREADS + threadIdx.x;
        return idx < n ? buf[idx] : 0ull;
    }
};

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

// A key L such that at least K non-empty keys are >= L (1 when there are fewer than K). Duplicates are
// fine: only the bound matters, not which keys reach it.
template <int ITEMS, typename Keys>
__device__ u64 kth_lower_bound(const Keys& keys, int k_wanted, SelectSmem& s) {
    u64 local_max = 0, local_min = ~0ull, local_n = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        u64 k = keys.get(i);
        if (k != 0) {
            local_max = max(local_max, k);
            local_min = min(local_min, k);
            ++local_n;
        }
    }
    u64 n = block_sum(local_n, s);
    if (n < (u64)k_wanted) return 1;
    u64 hi = block_max(local_max, s), lo = block_min(local_min, s);
    if (n == (u64)k_wanted) return lo;
    int shift;
    u64 t;
    block_select<ITEMS>(keys, k_wanted, lo, hi, s, shift, t);
    return max(t, 1ull);
}

struct ChunkSmem {
    SelectSmem sel;
    u64 picked[MAX_K];
    u64 cand[CAP];
};

// Copies the keys whose value part is >= lo_value (at least 1, so empty slots never pass) into buf
// when they fit in CAP; returns their count.
template <int ITEMS, typename Keys>
__device__ unsigned int gather_candidates(const Keys& keys, uint32_t lo_value, u64* buf, SelectSmem& s) {
    lo_value = max(lo_value, 1u);
    unsigned int mine = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) mine += keys.value[i] >= lo_value;
    unsigned int offset, total;
    Scan(s.scan).ExclusiveSum(mine, offset, total);
    if (total <= (unsigned)CAP) {
#pragma unroll
        for (int i = 0; i < ITEMS; ++i)
            if (keys.value[i] >= lo_value) buf[offset++] = keys.get(i);
    }
    __syncthreads();
    return total;
}

// The rare path (more than CAP candidates, e.g. many equal logits): radix select over all of the
// chunk's keys. Not inlined, so that its register needs do not weigh on the common path.
template <typename Keys>
__device__ __noinline__ unsigned int select_top_fallback(const Keys& keys, int k_wanted, u64 lo_hint, u64* out,
                                                         SelectSmem& s) {
    return select_top<CHUNK_ITEMS>(keys, k_wanted, lo_hint, out, s);
}

// Loads item i of this thread: element (i * THREADS + tid) of the chunk, 16-byte vectors when aligned.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, int base, int len, bool vec_ok,
                                           float (&vals)[CHUNK_ITEMS]) {
    constexpr int VEC = 16 / sizeof(T);
    const int tid = threadIdx.x;
    if (vec_ok && len == CHUNK) {
#pragma unroll
        for (int v = 0; v < CHUNK_ITEMS / VEC; ++v) {
            int e = (v * THREADS + tid) * VEC;
            uint4 raw = __ldcs(reinterpret_cast<const uint4*>(row + base + e));
            const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int j = 0; j < VEC; ++j) vals[v * VEC + j] = to_f32(x[j]);
        }
    } else {
#pragma unroll
        for (int v = 0; v < CHUNK_ITEMS / VEC; ++v)
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                int e = (v * THREADS + tid) * VEC + j;
                vals[v * VEC + j] = e < len ? to_f32(row[base + e]) : -INFINITY;
            }
    }
}

// Element index of item i (matches load_chunk's layout).
template <typename T>
__device__ __forceinline__ int item_index(int i) {
    constexpr int VEC = 16 / sizeof(T);
    return ((i / VEC) * THREADS + (int)threadIdx.x) * VEC + (i % VEC);
}

template <typename T>
__device__ void chunk_kernel(const T* __restrict__ logits, int vocab, int k_wanted, u64* __restrict__ cand,
                             float* __restrict__ chunk_max, u64* __restrict__ chunk_sum,
                             u64* __restrict__ chunk_kth, int* __restrict__ chunk_flags) {
    __shared__ ChunkSmem sm;
    const int chunk = blockIdx.x, row = blockIdx.y, chunks = gridDim.x;
    const int base = chunk * CHUNK;
    const int len = min(CHUNK, vocab - base);
    const T* row_ptr = logits + (size_t)row * vocab;
    const bool vec_ok = (vocab % (16 / (int)sizeof(T))) == 0 && ((uintptr_t)logits % 16) == 0;

    float vals[CHUNK_ITEMS];  // items past the chunk's end read as -inf
    load_chunk<T>(row_ptr, base, len, vec_ok, vals);
    float vmax = -INFINITY;
#pragma unroll
    for (int i = 0; i < CHUNK_ITEMS; ++i) vmax = fmaxf(vmax, vals[i]);  // NaN is caught by the keys below
    const float m = key_value((uint32_t)block_max(order_key(vmax), sm.sel));

    // One pass turns each value into its fixed-point exp term and its order key; the values die here.
    ChunkKeys<T, CHUNK_ITEMS> keys;
    keys.base = base;
    u64 local_sum = 0;
    uint32_t kmin = ~0u;
#pragma unroll
    for (int i = 0; i < CHUNK_ITEMS; ++i) {
        local_sum += lse_term(vals[i], m);
        uint32_t k = order_key(vals[i]);
        kmin = min(kmin, k);
        keys.value[i] = (len == CHUNK || item_index<T>(i) < len) ? k : 0u;
    }
    const u64 sum = block_sum(local_sum, sm.sel);

    // A lower bound for the chunk's K-th value: the K-th largest of G >= K group maxima (each a distinct
    // element). Groups of 16 items (8 when K > 256) keep the bound tight, so only about K to 2K
    // candidates reach the exact selection in shared memory.
    PlainKeys<2> groups;
    uint32_t kmax = 0;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        uint32_t m8 = 0;
#pragma unroll
        for (int i = 8 * g; i < 8 * g + 8; ++i) m8 = max(m8, keys.value[i]);
        groups.key[g] = (u64)m8 << 32;
        kmax = max(kmax, m8);
    }
    const int flags = __syncthreads_or(status_of_keys(kmax, kmin));
    if (k_wanted <= THREADS / 2) {
        groups.key[0] = max(groups.key[0], groups.key[1]);
        groups.key[1] = 0;
    }
    const u64 lo_hint = kth_lower_bound<2>(groups, k_wanted, sm.sel);

    const unsigned int n_cand = gather_candidates<CHUNK_ITEMS>(keys, (uint32_t)(lo_hint >> 32), sm.cand, sm.sel);
    unsigned int n;
    if (n_cand <= (unsigned)CAP) {
        SmemKeys<CAP_ITEMS> cand{sm.cand, n_cand};
        n = select_top<CAP_ITEMS>(cand, k_wanted, 1, sm.picked, sm.sel);
    } else {
        n = select_top_fallback(keys, k_wanted, lo_hint, sm.picked, sm.sel);  // e.g. many equal logits
    }
    size_t slot = (size_t)row * chunks + chunk;
    u64* out = cand + slot * k_wanted;
    u64 local_kth = ~0ull;
    for (unsigned int i = threadIdx.x; i < (unsigned)k_wanted; i += THREADS) {
        u64 k = i < n ? sm.picked[i] : 0ull;  // 0 marks the unused tail for the merge
        out[i] = k;
        if (i < n) local_kth = min(local_kth, k);
    }
    u64 kth = block_min(local_kth, sm.sel);
    if (threadIdx.x == 0) {
        chunk_max[slot] = m;
        chunk_sum[slot] = sum;
        chunk_kth[slot] = n == (unsigned)k_wanted ? kth : 1;
        chunk_flags[slot] = flags;
    }
}

struct MergeSmem {
    SelectSmem sel;
    u64 acc[MAX_K];
    u64 next[MAX_K];
    u64 cand[CAP];
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

// The row's lse from the chunks' (max, fixed-point sum), in chunk order and float64, as the contract says.
__device__ void combine_lse(const float* chunk_max, const u64* chunk_sum, const int* chunk_flags, int chunks,
                            float& lse, int& flags) {
    float big = -INFINITY;
    flags = 0;
    for (int c = 0; c < chunks; ++c) {
        big = fmaxf(big, chunk_max[c]);
        flags |= chunk_flags[c];
    }
    double total = 0.0;
    for (int c = 0; c < chunks; ++c) {
        if (chunk_sum[c] == 0) continue;
        double w = (double)expd(__fsub_rn(chunk_max[c], big));
        total = __dadd_rn(total, __dmul_rn(__ull2double_rn(chunk_sum[c]), w));
    }
    if (big == -INFINITY) flags |= STATUS_NO_FINITE;
    lse = __double2float_rn(__dadd_rn((double)big, log(__dmul_rn(total, 0x1p-44))));
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
    if (threadIdx.x == 0) combine_lse(chunk_max + first, chunk_sum + first, chunk_flags + first, chunks, sm.lse, sm.flags);

    // Any chunk with a full list proves K keys at or above its K-th key.
    u64 local_lo = 1;
    for (int c = threadIdx.x; c < chunks; c += THREADS) local_lo = max(local_lo, chunk_kth[first + c]);
    const u64 lo_hint = block_max(local_lo, sm.sel);

    const u64* row_cand = cand + first * k_wanted;
    const int total = chunks * k_wanted;
    unsigned int n_cand = gather_row_candidates(row_cand, total, lo_hint, sm.cand, sm.sel);
    unsigned int acc_n = 0;
    if (n_cand <= (unsigned)CAP) {
        SmemKeys<CAP_ITEMS> keys{sm.cand, n_cand};
        acc_n = select_top<CAP_ITEMS>(keys, k_wanted, 1, sm.acc, sm.sel);
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

extern "C" __global__ void __launch_bounds__(kdt::topk::THREADS, 2)
    topk_chunk_f32(const float* logits, int vocab, int k, kdt::u64* cand, float* chunk_max, kdt::u64* chunk_sum,
                   kdt::u64* chunk_kth, int* chunk_flags) {
    kdt::topk::chunk_kernel<float>(logits, vocab, k, cand, chunk_max, chunk_sum, chunk_kth, chunk_flags);
}

extern "C" __global__ void __launch_bounds__(kdt::topk::THREADS, 2)
    topk_chunk_bf16(const __nv_bfloat16* logits, int vocab, int k, kdt::u64* cand, float* chunk_max,
                    kdt::u64* chunk_sum, kdt::u64* chunk_kth, int* chunk_flags) {
    kdt::topk::chunk_kernel<__nv_bfloat16>(logits, vocab, k, cand, chunk_max, chunk_sum, chunk_kth, chunk_flags);
}

extern "C" __global__ void __launch_bounds__(kdt::topk::THREADS)
    topk_merge(const kdt::u64* cand, const float* chunk_max, const kdt::u64* chunk_sum, const kdt::u64* chunk_kth,
               const int* chunk_flags, int chunks, int k, int* top_ids, float* top_logp, float* lse,
               int* row_status) {
    kdt::topk::merge_kernel(cand, chunk_max, chunk_sum, chunk_kth, chunk_flags, chunks, k, top_ids, top_logp, lse,
                            row_status);
}
