#!/usr/bin/env python3
"""Exhaustive check of the CUDA exp (kernels/common.cuh, expd_scaled) against the contract.

The kernels compute expd (reference/README.md, "Top-K with logsumexp") with shortcuts: one FMA for
d - k * LN2_HI, the polynomial on coefficients scaled by 2^E, 2^k applied as an integer add to the exponent
field, and, in lse_term only, two more FMAs: k rounded from the fused d * LOG2E + 1.5 * 2^23, and the first
polynomial step C7 * r + C6 fused. Both results depend only on the f32 d <= 0, so checking every f32 d in
[-32, 0] (about 1.1e9 values, several minutes) proves, for all inputs:
  - q = floor(expd(d) * 2^44) of lse_term (E 44, fused) equals the contract's q (below -32 the kernel
    clamps to -32, where q is 0 as the contract's d < -31 rule says; checked on samples);
  - expd(d) of combine_lse (E 0, not fused) has the contract's bits for every d in [-31, 0].
It also reports on how many d the two fused steps would change expd itself (why E 0 does without them).

    python3 reference/check_expd_scaled.py      (numpy pinned in requirements.txt; exits 1 on a mismatch)
"""

import sys

import numpy as np

F32 = np.float32


def from_bits(b):
    return np.array([b], dtype=np.uint32).view(F32)[0]


LOG2E, LN2_HI, LN2_LO = from_bits(0x3FB8AA3B), from_bits(0x3F317200), from_bits(0x35BFBE8E)
COEFF_BITS = (0x39500D01, 0x3AB60B61, 0x3C088889, 0x3D2AAAAB, 0x3E2AAAAB, 0x3F000000, 0x3F800000, 0x3F800000)
COEFF = [from_bits(b) for b in COEFF_BITS]
MAGIC = F32(12582912.0)


def contract_expd(d):
    """The contract's text: separate f32 roundings, no FMA (for d in [-31, 0])."""
    k = np.rint(d * LOG2E).astype(F32)
    r = d - k * LN2_HI
    r = r - k * LN2_LO
    p = np.full_like(d, COEFF[0])
    for c in COEFF[1:]:
        p = p * r
        p = p + c
    return np.ldexp(p.astype(np.float64), k.astype(np.int32)).astype(F32)  # exact: p * 2^k stays normal


def contract_q(d):
    q = np.floor(contract_expd(d).astype(np.float64) * 2.0**44).astype(np.uint64)
    q[d < F32(-31.0)] = 0
    return q


def fma32(a, b, c):
    """f32 fma(a, b, c), rounded once: a * b is exact in float64; the float64 sum can round, which matters
    only when it lands exactly between two f32 values while the exact sum does not (TwoSum gives its error)."""
    prod = a.astype(np.float64) * b.astype(np.float64)
    c64 = np.float64(c)
    s = prod + c64
    bb = s - prod
    err = (prod - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    rd = r.astype(np.float64)
    nb = np.nextafter(r, np.where(s > rd, F32(np.inf), F32(-np.inf)).astype(F32))
    mid = (s != rd) & (s == (rd + nb.astype(np.float64)) * 0.5)
    up, down = np.maximum(r, nb), np.minimum(r, nb)
    r = np.where(mid & (err > 0), up, r)
    return np.where(mid & (err < 0), down, r)


def kernel_scaled(d, e, fused):
    """expd_scaled<e, fused>(d) step by step as the CUDA code does it."""
    if fused:
        # fma(d, LOG2E, 1.5 * 2^23): the product is exact in float64 (48 bits), and rounding the sum to the
        # f32 grid of spacing 1 there is rint (half to even) of the exact product.
        k_int = np.rint(d.astype(np.float64) * np.float64(LOG2E))
        km = (np.uint32(0x4B400000) + k_int.astype(np.int64).astype(np.uint32)).view(F32)
    else:
        km = (d * LOG2E) + MAGIC
    k = km - MAGIC
    # fma(-k, LN2_HI, d): k * LN2_HI is exact and d - k * LN2_HI spans under 31 bits, so float64 holds it
    # exactly and one rounding to f32 is the FMA's.
    r = (d.astype(np.float64) - k.astype(np.float64) * np.float64(LN2_HI)).astype(F32)
    r = r - k * LN2_LO
    scaled = [from_bits(b + (e << 23)) for b in COEFF_BITS]
    if fused:
        p = fma32(np.full_like(d, scaled[0]), r, scaled[1])
    else:
        p = (np.full_like(d, scaled[0]) * r) + scaled[1]
    for c in scaled[2:]:
        p = p * r
        p = p + c
    return (p.view(np.uint32) + (km.view(np.uint32) << np.uint32(23))).view(F32)


def kernel_q(d):
    """lse_term's floor of expd_scaled<44, true> after the clamp at -32 (fmaxf: NaN clamps too)."""
    x = kernel_scaled(np.fmax(d, F32(-32.0)), 44, True)
    return np.trunc(x.astype(np.float64)).astype(np.uint64)


def main():
    np.seterr(all="ignore")
    lo, hi, step = 0x80000000, 0xC2000000, 1 << 24  # -0.0 down to -32.0, every f32
    last_expd = 0xC1F80000  # -31.0
    bad_q = bad_expd = fused_expd = 0
    for s in range(lo, hi + 1, step):
        d = np.arange(s, min(s + step, hi + 1), dtype=np.uint64).astype(np.uint32).view(F32)
        mismatch = contract_q(d) != kernel_q(d)
        if mismatch.any():
            bad_q += int(mismatch.sum())
            print(f"q mismatch at d bits {int(d.view(np.uint32)[mismatch][0]):#x}")
        d = d[d.view(np.uint32) <= last_expd]
        want = contract_expd(d).view(np.uint32)
        mismatch = want != kernel_scaled(d, 0, False).view(np.uint32)
        if mismatch.any():
            bad_expd += int(mismatch.sum())
            print(f"expd mismatch at d bits {int(d.view(np.uint32)[mismatch][0]):#x}")
        fused_expd += int((want != kernel_scaled(d, 0, True).view(np.uint32)).sum())
    below = np.concatenate([np.array([-np.inf, -1e38, -3e4, -33.0, -32.5, np.nan], dtype=F32),
                            -np.random.default_rng(1).uniform(32, 1e6, 10**6).astype(F32)])
    bad_q += int((kernel_q(below) != 0).sum()) + int(kernel_q(np.array([0.0], dtype=F32))[0] != 2**44)
    print(f"q (E 44, fused): {hi - lo + 1} values of d in [-32, 0] and {below.size + 1} others, "
          f"{bad_q} mismatches")
    print(f"expd (E 0): every d in [-31, 0], {bad_expd} mismatches; fused, it would be "
          f"{fused_expd}")
    return 1 if bad_q or bad_expd else 0


if __name__ == "__main__":
    sys.exit(main())
