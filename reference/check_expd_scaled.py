#!/usr/bin/env python3
"""Exhaustive check of the CUDA exp (kernels/common.cuh, expd_scaled) against the contract.

The kernels compute expd (reference/README.md, "Top-K with logsumexp") in a cheaper form: k from the FMA
d * LOG2E + 1.5 * 2^23 and a subtraction (the f32 grid there has spacing 1, so that is rint of the exact
product), the polynomial on coefficients scaled by 2^E, and 2^k applied as an integer add to the exponent
field; lse_term clamps d at -32 instead of testing the cutoff. Both results depend only on the f32 d <= 0,
so checking every f32 d in [-32, 0] (about 1.1e9 values, some minutes) proves, for all inputs:
  - q = floor(expd(d) * 2^44) of lse_term (E 44) equals the contract's q (below -32 the kernel clamps to
    -32, where q is 0 as the contract's d < -31 rule says; checked on samples);
  - expd(d) of combine_lse (E 0) has the contract's bits for every d in [-31, 0].

    python3 reference/check_expd_scaled.py      (numpy pinned in requirements.txt; exits 1 on a mismatch)
"""

import sys

import numpy as np

from gen_fixtures import EXPD_CUTOFF, F32, LN2, LOG2E, POLY, expd, f32_bits, fma32

MAGIC = F32(12582912.0)


def contract_q(d):
    q = np.floor(expd(d).astype(np.float64) * 2.0**44).astype(np.uint64)
    q[d < EXPD_CUTOFF] = 0
    return q


def kernel_scaled(d, e):
    """expd_scaled<e>(d) step by step as the CUDA code does it."""
    # fma(d, LOG2E, 1.5 * 2^23): the product is exact in float64 (48 bits) and the f32 grid near 1.5 * 2^23
    # has spacing 1, so the one rounding is rint (half to even) of the exact product, added to the magic.
    k_int = np.rint(d.astype(np.float64) * np.float64(LOG2E))
    km = (np.uint32(0x4B400000) + k_int.astype(np.int64).astype(np.uint32)).view(F32)
    k = km - MAGIC
    r = fma32(-k, LN2, d)
    scaled = [F32(np.uint32(f32_bits(c) + (e << 23)).view(F32)) for c in POLY]
    p = np.full_like(d, scaled[-1])
    for c in reversed(scaled[:-1]):
        p = fma32(p, r, c)
    return (p.view(np.uint32) + (km.view(np.uint32) << np.uint32(23))).view(F32)


def kernel_q(d):
    """lse_term's floor of expd_scaled<44> after the clamp at -32 (fmaxf: NaN clamps too)."""
    x = kernel_scaled(np.fmax(d, F32(-32.0)), 44)
    return np.trunc(x.astype(np.float64)).astype(np.uint64)


def main():
    np.seterr(all="ignore")
    lo, hi, step = 0x80000000, 0xC2000000, 1 << 24  # -0.0 down to -32.0, every f32
    last_expd = 0xC1F80000  # -31.0
    bad_q = bad_expd = 0
    for s in range(lo, hi + 1, step):
        d = np.arange(s, min(s + step, hi + 1), dtype=np.uint64).astype(np.uint32).view(F32)
        mismatch = contract_q(d) != kernel_q(d)
        if mismatch.any():
            bad_q += int(mismatch.sum())
            print(f"q mismatch at d bits {int(d.view(np.uint32)[mismatch][0]):#x}")
        d = d[d.view(np.uint32) <= last_expd]
        mismatch = expd(d).view(np.uint32) != kernel_scaled(d, 0).view(np.uint32)
        if mismatch.any():
            bad_expd += int(mismatch.sum())
            print(f"expd mismatch at d bits {int(d.view(np.uint32)[mismatch][0]):#x}")
    below = np.concatenate([np.array([-np.inf, -1e38, -3e4, -33.0, -32.5, np.nan], dtype=F32),
                            -np.random.default_rng(1).uniform(32, 1e6, 10**6).astype(F32)])
    bad_q += int((kernel_q(below) != 0).sum()) + int(kernel_q(np.array([0.0], dtype=F32))[0] != 2**44)
    print(f"q (E 44): {hi - lo + 1} values of d in [-32, 0] and {below.size + 1} others, {bad_q} mismatches")
    print(f"expd (E 0): every d in [-31, 0], {bad_expd} mismatches")
    return 1 if bad_q or bad_expd else 0


if __name__ == "__main__":
    sys.exit(main())
