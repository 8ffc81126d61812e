"""Fixed-order bf16 GEMM y = x . W^T: float64 reference and fixtures for gemm_bf16.

Written from ../shared/DESIGN.md section 4.4 (the dense projections) and the section "bf16 GEMM" of
reference/README.md, never from the Rust or CUDA code. gen_fixtures.py calls gemm_cases() from its main; it
deletes and rewrites fixtures/gemm_bf16/<case>/.

Weights are bf16 [N, K] (stored as bit patterns), activations f32 [T, K]; the reference is float64 from exactly
those values (elementwise products reduced with np.sum, no BLAS), stored as f32. A correct kernel sums in f32:
the CPU in index order, the CUDA kernel in K chunks with x split into two bf16 halves (hi + lo, within 2^-17
of x). The tolerance bounds each token's relative L2 error over its N outputs: TOL_MULTIPLE times the worst
token error of f32 emulations of both, no smaller than one f32 rounding.
"""

import shutil

import numpy as np

from gen_fixtures import (F32, F32_EPS, FIXTURES, TOL_MULTIPLE, bf16_bits_to_f32, f32_to_bf16_bits, mutant_meta,
                          round_to_bf16, row_errors, seq_sum, write_case)

KERNEL = "gemm_bf16"
Y_SCALE = 1.001                 # the 0.1% output scale of the `y_scale` mutant


def gemm_ref(w_bits, x):
    """float64 y [T, N] = x . W^T from the exact bf16 weights and f32 activations."""
    w = bf16_bits_to_f32(w_bits).astype(np.float64)
    return (x.astype(np.float64)[:, None, :] * w[None, :, :]).sum(axis=2)


def gemm_f32_in_order(w_bits, x):
    """f32 products summed in index order (the CPU reference's order)."""
    return seq_sum(x[:, None, :] * bf16_bits_to_f32(w_bits)[None, :, :], axis=2)


def gemm_f32_split_x(w_bits, x, chunk=128):
    """x split into bf16 hi + lo halves, each half's products summed in f32 per K chunk, the chunks added in
    order (the shape of the tensor-core kernel)."""
    hi = round_to_bf16(x)
    lo = round_to_bf16((x - hi).astype(F32))
    w = bf16_bits_to_f32(w_bits)
    y = np.zeros((x.shape[0], w.shape[0]), F32)
    for c in range(0, x.shape[1], chunk):
        part = seq_sum(hi[:, None, c:c + chunk] * w[None, :, c:c + chunk], axis=2)
        part = part + seq_sum(lo[:, None, c:c + chunk] * w[None, :, c:c + chunk], axis=2)
        y = (y + part).astype(F32)
    return y


def gemm_case(name, description, seed, N, K, T):
    rng = np.random.default_rng(seed)
    w = f32_to_bf16_bits(rng.uniform(-1, 1, (N, K)).astype(F32))
    x = rng.uniform(-2, 2, (T, K)).astype(F32)
    y = gemm_ref(w, x).astype(F32)
    observed = max(row_errors(f(w, x), y).max() for f in (gemm_f32_in_order, gemm_f32_split_x))
    tol = TOL_MULTIPLE * max(observed, F32_EPS)
    wrong_row = w.copy()
    wrong_row[N // 2] = w[N // 2 + 1]
    mutants = {
        "x_bf16": ("x rounded to bf16 (the lo half of the split dropped)", gemm_ref(w, round_to_bf16(x))),
        "y_scale": (f"y scaled by {Y_SCALE} (0.1%)", y.astype(np.float64) * Y_SCALE),
        "wrong_row": (f"output {N // 2} computed with weight row {N // 2 + 1} (one wrong row)", gemm_ref(wrong_row, x)),
        "k_short": ("the last input column left out (K - 1 terms)", gemm_ref(w[:, :K - 1], x[:, :K - 1])),
    }
    for m, (_, got) in mutants.items():
        assert (row_errors(got, y) > tol).any(), f"{name}: the tolerance accepts the {m} mutant"
    arrays = {"w": w, "x": x, "y": y}
    arrays.update({f"mutant_{m}_y": got.astype(F32) for m, (_, got) in mutants.items()})
    write_case(KERNEL, name, arrays,
               {"N": N, "K": K, "T": T, "tol_y_rel": tol, "observed_y_rel": observed, "tol_multiple": TOL_MULTIPLE,
                **mutant_meta({m: d for m, (d, _) in mutants.items()}),
                "seed": seed, "description": description + " w uniform(-1, 1) as bf16, x uniform(-2, 2) as f32."})
    return observed, tol


def gemm_cases():
    shutil.rmtree(FIXTURES / KERNEL, ignore_errors=True)
    report = [
        gemm_case("n64_k512_t5", "N 64, K 512 (4 chunks of 128), T 5.", 901, 64, 512, 5),
        gemm_case("n40_k2048_t3", "N 40 (not a multiple of the 16-row tile), K 2048, T 3.", 902, 40, 2048, 3),
        gemm_case("n130_k96_t17", "N 130, K 96 (one partial chunk), T 17 (several token tiles).", 903, 130, 96, 17),
    ]
    worst = max(o for o, _ in report)
    print(f"gemm_bf16: tolerances {TOL_MULTIPLE}x the f32 emulations' worst token error (worst {worst:.2e}); "
          f"every mutant rejected")
