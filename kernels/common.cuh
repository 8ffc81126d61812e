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

// exp(d) * 2^E for d in [-32, 0] from single rounded f32 operations, bit-identical to the numpy and Rust
// expd times 2^E. The _rn intrinsics stop nvcc from contracting a multiply and an add into an FMA. Three
// steps are cheaper than the contract's text yet give the same bits: k * LN2_HI is exact (k has at most 6
// significant bits, LN2_HI 15), so one FMA rounds d - k * LN2_HI exactly once, as the two operations do;
// the polynomial runs on coefficients scaled by 2^E, which scales every rounded step by exactly 2^E (the
// steps stay normal; a subnormal r only adds a product far below the next coefficient's last bit); and
// p * 2^k is exact (p * 2^E is near 2^E and k >= -46, so the result stays normal), so it is an add of k to
// the exponent field, one integer multiply-add of the rint sum's bits.
// FLOORED (lse_term, E 44) fuses two more steps, each into one FMA: d * LOG2E + 1.5 * 2^23 (rint of the
// exact product rather than of the rounded one) and the first polynomial step C7 * r + C6. Together they
// change expd itself for 4 d in [-31, 0] (the fused rint picks another k), never q = floor(expd * 2^44);
// fusing the second step as well would change q (for 24 d). reference/check_expd_scaled.py checks every
// f32 d in [-32, 0]: q of the FLOORED form, and the bits of expd from the other form.
template <int E, bool FLOORED>
__device__ __forceinline__ float expd_scaled(float d) {
    static_assert(E >= 0 && E <= 64, "2^E scales the coefficients without overflow");
    static_assert(!FLOORED || E == 44, "the fused steps are proven only under the floor at 2^44");
    const float log2e = __uint_as_float(0x3FB8AA3Bu);
    const float ln2_hi = __uint_as_float(0x3F317200u);
    const float ln2_lo = __uint_as_float(0x35BFBE8Eu);
    constexpr uint32_t SCALE = (uint32_t)E << 23;  // 2^E in the exponent field
    // rint by the 1.5 * 2^23 trick: same value as rintf (round half to even) for |x| < 2^22, and the sum's
    // bits are 0x4B400000 + k, so (bits << 23) is k << 23 modulo 2^32, with no conversion instruction.
    const float magic = 12582912.0f;
    const float km = FLOORED ? __fmaf_rn(d, log2e, magic) : __fadd_rn(__fmul_rn(d, log2e), magic);
    const float k = __fsub_rn(km, magic);
    float r = __fmaf_rn(-k, ln2_hi, d);
    r = __fsub_rn(r, __fmul_rn(k, ln2_lo));
    const float c7 = __uint_as_float(0x39500D01u + SCALE), c6 = __uint_as_float(0x3AB60B61u + SCALE);
    float p = FLOORED ? __fmaf_rn(c7, r, c6) : __fadd_rn(__fmul_rn(c7, r), c6);
    const uint32_t coeff[6] = {0x3C088889u, 0x3D2AAAABu, 0x3E2AAAABu, 0x3F000000u, 0x3F800000u, 0x3F800000u};
#pragma unroll
    for (int i = 0; i < 6; ++i) p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(coeff[i] + SCALE));
    return __uint_as_float(__float_as_uint(p) + ((uint32_t)__float_as_int(km) << 23));
}

// The contract's expd: 0 below -31 (and for NaN).
__device__ __forceinline__ float expd(float d) { return d >= -31.0f ? expd_scaled<0, false>(d) : 0.0f; }

// floor(expd(v - m) * 2^44): the exact fixed-point term of the chunked logsumexp. Below d = -31 the
// term is 0; clamping d at -32 keeps the exponent in range and still floors to 0 there, with no branch
// (NaN from -inf - -inf clamps too).
__device__ __forceinline__ u64 lse_term(float v, float m) {
    float d = fmaxf(__fsub_rn(v, m), -32.0f);
    return __float2ull_rz(expd_scaled<44, true>(d));
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
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src));
}
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
