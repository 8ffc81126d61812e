// Shared device helpers: logit loading, order-preserving keys, the deterministic exp, block-wide
// reductions, and the PTX wrappers (cp.async, ldmatrix, mma.sync) of the MLA and MoE kernels. The
// deterministic exp is the one of reference/README.md.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace kdt {

typedef unsigned long long u64;

// Row status bits written by the kernels that validate logits (mirrored in src/cuda/mod.rs).
constexpr int STATUS_NAN = 1;
constexpr int STATUS_POS_INF = 2;
constexpr int STATUS_NO_FINITE = 4;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// Maps f32 bits to a u32 whose unsigned order is the float order (-inf lowest; NaN above +inf). Adding
// +0.0 first reads -0.0 as +0.0, as the contract says.
__device__ __forceinline__ uint32_t order_key(float v) {
    uint32_t b = __float_as_uint(__fadd_rn(v, 0.0f));
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// Composite key: value descending, then index ascending, as one u64 compared unsigned. Never 0 for a real
// element (the value part of -inf is 0x007FFFFF), so 0 marks an empty slot.
__device__ __forceinline__ u64 composite_key(uint32_t value_key, uint32_t index) {
    return ((u64)value_key << 32) | (u64)(~index);
}

// Status bits from the largest and smallest order keys seen: +inf and positive NaN sort above every
// finite key, negative NaN below -inf's key.
__device__ __forceinline__ int status_of_keys(uint32_t kmax, uint32_t kmin) {
    const uint32_t pos_inf = 0xFF800000u, neg_inf = 0x007FFFFFu;
    int flags = kmin < neg_inf ? STATUS_NAN : 0;
    if (kmax > pos_inf) flags |= STATUS_NAN;
    if (kmax == pos_inf) flags |= STATUS_POS_INF;
    return flags;
}

// exp(d) * 2^E for d in [-32, 0], bit-identical to the numpy and Rust expd times 2^E: the contract's
// FMAs are spelled out (__fmaf_rn), and the _rn subtraction cannot be fused. Two steps are cheaper than
// the contract's text yet give the same bits: k comes from one FMA, d * LOG2E + 1.5 * 2^23, whose f32
// grid has spacing 1 there, so its one rounding is rint (half to even) of the exact product, and the
// sum's bits are 0x4B400000 + k; and p * 2^k is an integer add of k << 23 (those bits shifted, modulo
// 2^32) to the exponent field. The polynomial runs on coefficients scaled by 2^E, which scales each FMA's
// result by exactly 2^E, as every one stays normal. reference/check_expd_scaled.py checks every f32 d in
// [-32, 0] against the contract: expd<0> bit for bit, and lse_term's floor at 2^44.
template <int E>
__device__ __forceinline__ float expd_scaled(float d) {
    static_assert(E >= 0 && E <= 64, "2^E scales the coefficients without overflow");
    const float log2e = __uint_as_float(0x3FB8AA3Bu);
    const float ln2 = __uint_as_float(0x3F317218u);
    constexpr uint32_t SCALE = (uint32_t)E << 23;  // 2^E in the exponent field
    const float magic = 12582912.0f;
    const float km = __fmaf_rn(d, log2e, magic);
    const float k = __fsub_rn(km, magic);
    const float r = __fmaf_rn(-k, ln2, d);
    const uint32_t coeff[6] = {0x3C07D41Au, 0x3D2B9D2Au, 0x3E2AAD35u,   // C5 .. C3
                               0x3EFFFEE3u, 0x3F7FFFFBu, 0x3F800000u};  // C2 .. C0
    float p = __uint_as_float(coeff[0] + SCALE);
#pragma unroll
    for (int i = 1; i < 6; ++i) p = __fmaf_rn(p, r, __uint_as_float(coeff[i] + SCALE));
    return __uint_as_float(__float_as_uint(p) + ((uint32_t)__float_as_int(km) << 23));
}

// The contract's expd: 0 below -31 (and for NaN).
__device__ __forceinline__ float expd(float d) { return d >= -31.0f ? expd_scaled<0>(d) : 0.0f; }

// floor(expd(v - m) * 2^44): the exact fixed-point term of the chunked logsumexp. Below d = -31 the
// term is 0; clamping d at -32 keeps the exponent in range and still floors to 0 there, with no branch
// (NaN from -inf - -inf clamps too).
__device__ __forceinline__ u64 lse_term(float v, float m) {
    float d = fmaxf(__fsub_rn(v, m), -32.0f);
    return __float2ull_rz(expd_scaled<44>(d));
}

// Shift that yields 0 instead of undefined behaviour at 64.
__device__ __forceinline__ u64 shr64(u64 x, int n) { return n >= 64 ? 0ull : (x >> n); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Asynchronous global -> shared copies (sm_80+, so sm_90 and sm_120 alike). `bytes` below the copy size
// fills the rest with zeros; 0 reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
// L2 eviction priorities (createpolicy, sm_80+): evict_first for data read once as it streams past,
// evict_last for small data written and read back soon, so that the stream does not push it out.
__device__ __forceinline__ u64 l2_evict_first() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ u64 l2_evict_last() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// cp_async16 under an L2 policy.
__device__ __forceinline__ void cp_async16_hint(void* dst, const void* src, int bytes, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes), "l"(policy));
}
// A float2 store under an L2 policy.
__device__ __forceinline__ void st_float2_hint(float* dst, float2 v, u64 policy) {
    asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;\n" ::"l"(dst), "f"(v.x), "f"(v.y), "l"(policy)
                 : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src));
}
// cp_async16 and cp_async8 that ask L2 to fetch the source's whole 128-byte line (the .L2::128B prefetch
// size), for reads of a few sectors of a line whose other sectors other warps read soon after.
__device__ __forceinline__ void cp_async16_line(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(bytes));
}
__device__ __forceinline__ void cp_async8_line(uint32_t dst, const void* src) {  // dst: a shared-window address
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async8_line(void* dst, const void* src) { cp_async8_line(smem_addr(dst), src); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// acc (16x8 f32) += a (16x16 bf16, row) * b (16x8 bf16, col).
__device__ __forceinline__ void mma_bf16(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

struct MaxOp {
    template <typename T>
    __device__ __forceinline__ T operator()(const T& a, const T& b) const { return a > b ? a : b; }
};
struct MinOp {
    template <typename T>
    __device__ __forceinline__ T operator()(const T& a, const T& b) const { return a < b ? a : b; }
};

}  // namespace kdt
