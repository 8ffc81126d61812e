"""MoE with INT4 experts: reference and fixtures for moe_routing and moe_int4.

Written from ../shared/DESIGN.md section 4.4, ../shared/research/kernels.md sections 1.3-1.4 and the section
"MoE with INT4 experts" of reference/README.md, never from the Rust or CUDA code. gen_fixtures.py calls
moe_cases() from its main; it deletes and rewrites fixtures/{moe_routing,moe_int4}/<case>/.

Routing (bit-exact): s = 1 / (1 + exp(-x)) in float64 from the f32 logits (Python's math.exp, the platform libm,
one value at a time); the k experts with the largest s + bias (float64, bias widened from f32), ties to the
smaller expert id, best first; topk_weights = float32((s_e / sum) * routed_scaling_factor) with the sum of the
chosen s taken in float64 in slot order (best first) and routed_scaling_factor the float64 nearest 2.827.
Alignment: pair p = t * k + slot; sorted_pairs lists the pairs grouped by expert id, each group in increasing p;
expert_offsets[e] is the first index of expert e's group (expert_offsets[E] = T * k).

INT4 pack-quantized: per group of 32 along the input dim, scale = bf16(max|w| / 7) (the float64 quotient rounded
once to bf16, nearest even; a zero group has scale 1.0), q = clip(rint(w / scale), -8, 7) (float64 division,
half to even), stored as q + 8, eight nibbles per int32, low nibble first. Dequant (nibble - 8) * scale is exact
in f32 (a bf16 scale times an integer of at most 4 bits), so the stored f32 w13 / w2 are exact.

Math: the reference runs grouped by expert, as the kernels do (the pairs of expert e, from the alignment, form one
[n, H] block of x): gu = x . w13[e]^T, g = gu[:, :I], u = gu[:, I:], h = bf16(silu(g) * u) with silu(g) =
g / (1 + exp(-g)) in float64 and the float64 product rounded once to bf16 (nearest even), y = h . w2[e]^T, then
out[t] = sum over slots, in slot order, of float64(topk_weights[t, slot]) * y(t, slot), stored as f32.

No BLAS anywhere (numpy's OpenBLAS picks its kernels by CPU): dot products are elementwise float64 products
reduced with np.sum, exps are math.exp (numpy's float64 exp has AVX-512 code paths that may differ from libm in
the last bit), so the same command gives the same bytes on CI (checked with numpy's AVX/AVX2/AVX-512 dispatch
disabled through NPY_DISABLE_CPU_FEATURES). With these inputs the float64 dot products are in fact exact (a bf16
value times a dequantized weight has at most 20 significant bits), so the grouped reference and the naive
per-token loop with math.fsum agree to 0, not just to the 1e-12 that the self-check asks.

Sizes: the packed weights dominate (E * H * I * 1.6875 bytes per case), and fixtures/ must stay near 20 MB, so
the INT4 cases are small (H <= 256, I <= 128); the dequantized f32 weights (E * H * I * 12 bytes) are stored only
for the smallest case. Kimi-K2 shapes are checked GPU-vs-CPU on data generated at test time.
"""

import math
import shutil

import numpy as np

from gen_fixtures import (F32, F32_EPS, FIXTURES, TOL_MULTIPLE, bf16_bits_to_f32, f32_to_bf16_bits, mutant_meta,
                          round_to_bf16, row_errors, seq_sum, write_case)

KERNELS = ("moe_routing", "moe_int4")

GROUP = 32                      # quantization group along the input dim
PACK = 8                        # nibbles per int32
RSF_KIMI = 2.827                # routed_scaling_factor of Kimi-K2 (float64)
BF16_ONE = 0x3F80               # the scale of an all-zero group


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------

def widen(bits):
    """bf16 bit patterns -> float64 values (exact)."""
    return bf16_bits_to_f32(bits).astype(np.float64)


def f64_to_bf16_bits(x):
    """float64 -> bf16 bits, rounded once to nearest even (no double rounding through f32): first round to f32
    by round-to-odd (truncate toward zero, then set the last bit if inexact), then f32 -> bf16 nearest even,
    which is exact rounding since f32 keeps more than two extra bits. Finite inputs well inside the f32 range."""
    x = np.asarray(x, dtype=np.float64)
    assert np.isfinite(x).all() and (np.abs(x) < 3e38).all()
    f = x.astype(F32)
    back = f.astype(np.float64)
    f = np.where(np.abs(back) > np.abs(x), np.nextafter(f, F32(0)), f).astype(F32)
    bits = f.view(np.uint32) | (f.astype(np.float64) != x).astype(np.uint32)
    return f32_to_bf16_bits(bits.view(F32))


def exp64(a):
    """Elementwise float64 exp through math.exp (libm), independent of numpy's SIMD exp."""
    a = np.asarray(a, dtype=np.float64)
    return np.array([math.exp(v) for v in a.ravel().tolist()], dtype=np.float64).reshape(a.shape)


def silu64(g):
    return g / (1.0 + exp64(-g))


def dot_rows(a, b):
    """a [n, K], b [M, K] float64 -> [n, M] = a . b^T as elementwise products summed with np.sum (no BLAS)."""
    return (a[:, None, :] * b[None, :, :]).sum(axis=2)


def rel_frobenius(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return math.sqrt(float(((a - ref) ** 2).sum())) / math.sqrt(float((ref ** 2).sum()))


# ----------------------------------------------------------------------------------------------------------
# Routing and alignment
# ----------------------------------------------------------------------------------------------------------

def sigmoid64(v):
    """s = 1 / (1 + exp(-v)) in float64 for one finite value (exp overflow gives s = 0, as IEEE inf would)."""
    try:
        return 1.0 / (1.0 + math.exp(-v))
    except OverflowError:
        return 0.0


def route(logits, bias, k, rsf=RSF_KIMI):
    """logits [T, E] f32, bias [E] f32 -> topk_ids [T, k] i32, topk_weights [T, k] f32."""
    T, E = logits.shape
    assert logits.dtype == F32 and bias.dtype == F32 and bias.shape == (E,) and 1 <= k <= E
    assert np.isfinite(logits).all() and np.isfinite(bias).all()
    ids, weights = np.zeros((T, k), np.int32), np.zeros((T, k), F32)
    b = [float(v) for v in bias]
    for t in range(T):
        s = [sigmoid64(float(v)) for v in logits[t]]
        score = [s[e] + b[e] for e in range(E)]
        chosen = sorted(range(E), key=lambda e: (-score[e], e))[:k]
        total = 0.0
        for e in chosen:                         # slot order
            total += s[e]
        assert total > 0.0, "every chosen s is 0 (logits below about -709): s_e / sum is 0 / 0"
        ids[t] = chosen
        weights[t] = [F32(s[e] / total * rsf) for e in chosen]
    return ids, weights


def align(ids, E):
    """topk_ids [T, k] -> expert_offsets [E+1] i32, sorted_pairs [T*k] i32."""
    flat = ids.ravel().astype(np.int64)
    assert ((flat >= 0) & (flat < E)).all()
    counts = np.bincount(flat, minlength=E)
    offsets = np.zeros(E + 1, np.int32)
    offsets[1:] = np.cumsum(counts)
    pairs = np.argsort(flat, kind="stable").astype(np.int32)   # stable: increasing p inside each expert
    return offsets, pairs


def route_alt(logits, bias, k, rsf=RSF_KIMI):
    """A second implementation for the self-check: vectorized scores, np.lexsort for the selection."""
    T, E = logits.shape
    s = np.array([[sigmoid64(float(v)) for v in row] for row in logits], dtype=np.float64).reshape(T, E)
    score = s + bias.astype(np.float64)[None, :]
    ids = np.zeros((T, k), np.int32)
    weights = np.zeros((T, k), F32)
    for t in range(T):
        order = np.lexsort((np.arange(E), -score[t]))[:k]
        ids[t] = order
        sel = s[t, order]
        total = 0.0
        for v in sel.tolist():
            total += v
        weights[t] = ((sel / total) * rsf).astype(F32)
    return ids, weights


def check_alignment(ids, E, offsets, pairs):
    T, k = ids.shape
    assert offsets[0] == 0 and offsets[E] == T * k and (np.diff(offsets) >= 0).all()
    assert sorted(pairs.tolist()) == list(range(T * k))
    for e in range(E):
        group = pairs[offsets[e]:offsets[e + 1]].tolist()
        assert group == [p for p in range(T * k) if ids[p // k, p % k] == e]


# ----------------------------------------------------------------------------------------------------------
# INT4 pack-quantized
# ----------------------------------------------------------------------------------------------------------

def pack_nibbles(nib):
    """[..., n] values 0..15 -> [..., n/8] int32, element 8j + i in bits 4i .. 4i+3 of word j."""
    nib = np.asarray(nib)
    assert nib.shape[-1] % PACK == 0 and ((nib >= 0) & (nib <= 15)).all()
    nib = nib.astype(np.uint32).reshape(*nib.shape[:-1], nib.shape[-1] // PACK, PACK)
    word = np.zeros(nib.shape[:-1], np.uint32)
    for i in range(PACK):
        word |= nib[..., i] << np.uint32(4 * i)
    return word.view(np.int32)


def unpack_nibbles(packed):
    """[..., n/8] int32 -> [..., n] uint32 nibbles."""
    assert packed.dtype == np.int32
    u = packed.view(np.uint32)
    nib = np.stack([(u >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(PACK)], axis=-1)
    return nib.reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


def quantize(w_bits):
    """bf16 weights [..., out, in] -> nibbles [..., out, in] (uint32), scale bf16 bits [..., out, in/32]."""
    *lead, n_in = w_bits.shape
    assert n_in % GROUP == 0
    w = widen(w_bits).reshape(*lead, n_in // GROUP, GROUP)
    amax = np.abs(w).max(axis=-1)
    scale_bits = f64_to_bf16_bits(amax / 7.0)
    scale_bits[amax == 0] = BF16_ONE
    scale = widen(scale_bits)
    assert (scale > 0).all()
    q = np.clip(np.rint(w / scale[..., None]), -8, 7)          # float64 division, rint = half to even
    nib = (q + 8).astype(np.uint32).reshape(*lead, n_in)
    return nib, scale_bits


def dequant(packed, scale_bits):
    """packed [..., out, in/8] i32, scale [..., out, in/32] bf16 bits -> float64 [..., out, in]."""
    q = unpack_nibbles(packed).astype(np.float64) - 8.0
    w = q * np.repeat(widen(scale_bits), GROUP, axis=-1)
    assert (w.astype(F32).astype(np.float64) == w).all()       # exact in f32
    return w


# ----------------------------------------------------------------------------------------------------------
# MoE forward: grouped reference, naive per-token loop, f32 kernel emulation
# ----------------------------------------------------------------------------------------------------------

def moe_ref(x_bits, ids, weights, w13, w2):
    """x [T, H] bf16 bits, topk_ids / topk_weights [T, k], w13 [E, 2I, H], w2 [E, H, I] float64 (dequantized)
    -> out [T, H] float64, grouped by expert through the alignment."""
    x = widen(x_bits)
    T, k = ids.shape
    E, two_i, H = w13.shape
    I = two_i // 2
    offsets, pairs = align(ids, E)
    y = np.zeros((T * k, H))
    for e in range(E):
        p = pairs[offsets[e]:offsets[e + 1]].astype(np.int64)
        if len(p) == 0:
            continue
        gu = dot_rows(x[p // k], w13[e])                       # [n, 2I]
        h = widen(f64_to_bf16_bits(silu64(gu[:, :I]) * gu[:, I:]))
        y[p] = dot_rows(h, w2[e])                              # [n, H]
    y = y.reshape(T, k, H)
    out = np.zeros((T, H))
    for slot in range(k):                                      # slot order
        out = out + weights[:, slot].astype(np.float64)[:, None] * y[:, slot]
    return out


def moe_naive(x_bits, ids, weights, w13, w2):
    """One (token, slot) at a time, every dot product an exact sum (math.fsum) rounded once."""
    x = widen(x_bits)
    T, k = ids.shape
    I = w13.shape[1] // 2
    out = np.zeros((T, w13.shape[2]))
    for t in range(T):
        xt = x[t].tolist()
        acc = [0.0] * w13.shape[2]
        for slot in range(k):
            e = int(ids[t, slot])
            gu = [math.fsum(a * b for a, b in zip(xt, row)) for row in w13[e].tolist()]
            h = [g / (1.0 + math.exp(-g)) * u for g, u in zip(gu[:I], gu[I:])]
            h = widen(f64_to_bf16_bits(np.array(h))).tolist()
            y = [math.fsum(a * b for a, b in zip(h, row)) for row in w2[e].tolist()]
            wt = float(weights[t, slot])
            acc = [a + wt * v for a, v in zip(acc, y)]
        out[t] = acc
    return out


OUT_SCALE = 1.001               # the 0.1% output scale of the `out_scale` mutant
TIE_MARGIN = 2.0 ** -16         # h this close (relative) to a bf16 midpoint counts as a rounding near-tie
SCALE_BINADE = 2.0 ** -7        # INT4 group scales are drawn from [2^-7, 2^-6) (see int4_case)


def grouped_dot(x, packed, scale_bits):
    """x [K] f32 against INT4 rows [M, K/8] the way the kernels take them: per group of 32 the exact products
    x * (nibble - 8) summed in f32, then times the group's scale and added in group order, in f32."""
    q = (unpack_nibbles(packed).astype(np.int64) - 8).astype(F32)                       # [M, K]
    M, K = q.shape
    partial = seq_sum((x[None, :] * q).reshape(M, K // GROUP, GROUP), axis=2)           # [M, K/32]
    return seq_sum(partial * bf16_bits_to_f32(scale_bits), axis=1)


def moe_emulate_f32(x_bits, ids, weights, w13, w2, packed=None, round_h=True, bf16_weights=False):
    """What an f32-accumulating kernel computes: f32 products summed in sequence, f32 silu, h rounded to bf16,
    f32 combine in slot order. With `packed` ((w13_packed, w13_scale, w2_packed, w2_scale)) the dot products
    go group by group with the scale applied once per group, as the tensor-core kernels do; else over the
    dequantized weights. Two contract violations for the mutants: round_h False keeps h in f32, bf16_weights
    rounds the dequantized weights to bf16 (a kernel that dequantizes into bf16 MMA operands)."""
    x = bf16_bits_to_f32(x_bits)
    W13, W2 = w13.astype(F32), w2.astype(F32)
    if bf16_weights:
        W13, W2 = round_to_bf16(W13), round_to_bf16(W2)
    T, k = ids.shape
    I = w13.shape[1] // 2
    out = np.zeros((T, w13.shape[2]), F32)
    for t in range(T):
        for slot in range(k):
            e = ids[t, slot]
            if packed is None:
                gu = seq_sum(x[t][None, :] * W13[e], axis=1)
            else:
                gu = grouped_dot(x[t], packed[0][e], packed[1][e])
            g, u = gu[:I], gu[I:]
            h = g / (F32(1) + np.exp(-g)) * u
            h = round_to_bf16(h) if round_h else h
            y = seq_sum(h[None, :] * W2[e], axis=1) if packed is None else grouped_dot(h, packed[2][e], packed[3][e])
            out[t] = out[t] + weights[t, slot] * y
    return out


def near_ties(h64, margin=TIE_MARGIN):
    """h values within `margin` (relative) of a bf16 rounding midpoint, where an f32 kernel's h could round the
    other way than the float64 reference's."""
    return f64_to_bf16_bits(h64 * (1 + margin)) != f64_to_bf16_bits(h64 * (1 - margin))


def pair_h64(x, ids, w13):
    """float64 h [k, I] of one token (x [H] float64), before its bf16 rounding."""
    I = w13.shape[1] // 2
    gu = np.stack([dot_rows(x[None, :], w13[e])[0] for e in ids])
    return silu64(gu[:, :I]) * gu[:, I:]


# ----------------------------------------------------------------------------------------------------------
# Self-checks
# ----------------------------------------------------------------------------------------------------------

def self_check_bf16_rounding():
    """f64_to_bf16_bits is the nearest bf16, ties to even, including values that double rounding through f32
    gets wrong (just above or below a bf16 midpoint, within one f32 half-ulp)."""
    rng = np.random.default_rng(0)
    base = f32_to_bf16_bits((rng.standard_normal(2000) * 10.0 ** rng.integers(-6, 6, 2000)).astype(F32))
    lo = widen(base)
    ulp = np.abs(widen(base + np.uint16(1)) - lo)               # next bf16 away from zero (no overflow here)
    mid = lo + np.sign(lo) * ulp / 2
    probes = np.concatenate([mid, mid + np.sign(lo) * 2.0 ** -40 * np.abs(lo), mid - np.sign(lo) * 2.0 ** -40 *
                             np.abs(lo), lo + np.sign(lo) * ulp * rng.uniform(0, 1, lo.size)])
    got = widen(f64_to_bf16_bits(probes))
    for v, g in zip(probes.tolist(), got.tolist()):
        # nearest of the two bf16 neighbours of v, by exact float64 differences (Sterbenz)
        b = int(f32_to_bf16_bits(np.array([v], F32))[0])
        cands = {b, (b + 1) & 0xFFFF, (b - 1) & 0xFFFF}
        best = min(cands, key=lambda c: (abs(float(widen(np.array([c], np.uint16))[0]) - v), c & 1))
        assert g == float(widen(np.array([best], np.uint16))[0]), (v, g)
    # The double-rounding case itself: 1 + 2^-8 + 2^-30 is above the midpoint of 1 and 1 + 2^-7.
    assert f64_to_bf16_bits(np.array([1 + 2 ** -8 + 2 ** -30]))[0] == 0x3F81
    assert f32_to_bf16_bits(np.array([1 + 2 ** -8 + 2 ** -30], F32))[0] == 0x3F80   # through f32: wrong
    assert f64_to_bf16_bits(np.array([1 + 2 ** -8]))[0] == 0x3F80                  # exact tie: even
    assert f64_to_bf16_bits(np.array([0.0, -0.0])).tolist() == [0x0000, 0x8000]


def self_check_int4():
    # Bit positions: low nibble first.
    assert pack_nibbles(np.arange(8)).tolist() == [0x76543210]
    assert pack_nibbles(np.arange(8, 16)).view(np.uint32).tolist() == [0xFEDCBA98]
    assert pack_nibbles(np.arange(8, 16)).tolist() == [0xFEDCBA98 - 2 ** 32]
    assert pack_nibbles(np.full(8, 8)).view(np.uint32).tolist() == [0x88888888]
    # Round trip over every nibble value in every position.
    rng = np.random.default_rng(1)
    nib = rng.integers(0, 16, size=(5, 7, 64))
    nib[0, 0, :16], nib[0, 1, 48:] = np.arange(16), np.arange(16)
    packed = pack_nibbles(nib)
    assert packed.shape == (5, 7, 8) and packed.dtype == np.int32
    assert (unpack_nibbles(packed) == nib).all()
    # Quantize: scale = bf16(max|w| / 7), |w - dequant| <= scale / 2, exact when w = q * scale, zero group.
    w = f32_to_bf16_bits((rng.standard_normal((3, 6, 96)) * 0.05).astype(F32))
    w[1, 2, 32:64] = 0
    nib, scale = quantize(w)
    assert scale[1, 2, 1] == BF16_ONE and (nib[1, 2, 32:64] == 8).all()
    deq = dequant(pack_nibbles(nib), scale)
    amax = np.abs(widen(w)).reshape(3, 6, 3, 32).max(axis=-1)
    nz = amax > 0
    assert (widen(scale)[nz] == widen(f64_to_bf16_bits(amax[nz] / 7))).all()
    assert (np.abs(deq - widen(w)) <= np.repeat(widen(scale), 32, axis=-1) / 2).all()
    assert nib.min() >= 1 and nib.max() <= 15            # max|w| / scale <= 7 * (1 + 2^-8): never -8
    assert (dequant(pack_nibbles(nib), scale) == deq).all()
    # Hand-made group: q = -8 .. 7 twice with scale 0.5 quantizes back to itself except -8 (max|w| = 4 gives
    # scale bf16(4 / 7) and other nibbles); dequant of nibble 0 is -8 * scale.
    q = np.tile(np.arange(-8, 8), 2)
    assert (dequant(pack_nibbles(q + 8), np.array([0x3F00], np.uint16)) == q * 0.5).all()


def self_check_routing():
    """The hand-computed case (also written as fixture tiny_e8_k2_t2)."""
    logits, bias = hand_routing_inputs()
    ids, w = route(logits, bias, 2)
    # token 0: s = 0.5 except s_5 = 1; s + bias = 1.0 for expert 1 (0.5 + 0.5) and expert 5 (1 + 0): a tie,
    #          the smaller id (1) first. Weights use s only: 0.5 / 1.5 and 1 / 1.5 of 2.827.
    # token 1: s_6 = s_7 = 1 (logit 40), s_1 = 1/(1+e^40) ~ 4e-18; s + bias: e7 1.0, e6 0.75 (bias -0.25);
    #          expert 1's 4e-18 + 0.5 rounds to 0.5, equal to expert 0's. Weights 1/2 of 2.827 each.
    assert ids.tolist() == [[1, 5], [7, 6]]
    assert w.tolist() == [[F32(2.827 / 3), F32(2.827 * 2 / 3)], [F32(1.4135), F32(1.4135)]]
    assert w.dtype == F32 and F32(2.827 / 3) == F32(0.94233333)
    offsets, pairs = align(ids, 8)
    assert offsets.tolist() == [0, 0, 1, 1, 1, 1, 2, 3, 4] and pairs.tolist() == [0, 1, 3, 2]
    assert sigmoid64(40.0) == 1.0 and sigmoid64(0.0) == 0.5 and sigmoid64(-800.0) == 0.0
    assert sigmoid64(-40.0) + 0.5 == 0.5
    # all-equal scores: experts 0 .. k-1 in order
    ids, w = route(np.zeros((1, 6), F32), np.zeros(6, F32), 3)
    assert ids.tolist() == [[0, 1, 2]] and (w == F32(2.827 / 3)).all()


def hand_routing_inputs():
    logits = np.array([[0, 0, 0, 0, 0, 40, 0, 0],
                       [0, -40, 0, 0, 0, 0, 40, 40]], F32)
    bias = np.array([0, 0.5, 0, 0, 0, 0, -0.25, 0], F32)
    return logits, bias


# ----------------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------------

def routing_case(name, description, seed, logits, bias, k, rsf=RSF_KIMI):
    T, E = logits.shape
    ids, w = route(logits, bias, k, rsf)
    ids2, w2 = route_alt(logits, bias, k, rsf)
    assert (ids == ids2).all() and (w == w2).all()
    offsets, pairs = align(ids, E)
    check_alignment(ids, E, offsets, pairs)
    write_case("moe_routing", name,
               {"router_logits": logits, "bias": bias, "topk_ids": ids, "topk_weights": w,
                "expert_offsets": offsets, "sorted_pairs": pairs},
               {"T": T, "E": E, "k": k, "routed_scaling_factor": rsf, "seed": seed, "description": description})
    return ids, w, offsets


def random_router(rng, T, E, empty=(), mean=-1.0, std=2.0, bias_std=0.05):
    """Router logits N(mean, std) and a small bias N(0, bias_std), as f32. Experts in `empty` get bias -4, so
    that their s + bias < -3 is below every other expert's (> -1): they receive no token."""
    logits = rng.normal(mean, std, size=(T, E)).astype(F32)
    bias = rng.normal(0.0, bias_std, size=E).astype(F32)
    assert (np.abs(bias) < 1).all()
    for e in empty:
        bias[e] = F32(-4.0)
    return logits, bias


def empty_experts(offsets):
    return [e for e in range(len(offsets) - 1) if offsets[e] == offsets[e + 1]]


def routing_cases():
    logits, bias = hand_routing_inputs()
    routing_case("tiny_e8_k2_t2", "Hand-checkable (E 8, k 2, T 2), rsf 2.827. Token 0: logits 0 except expert 5 "
                 "(40, s = 1.0); bias 0.5 on expert 1, so experts 1 and 5 tie at s + bias = 1.0: ids [1, 5], "
                 "weights [2.827/3, 2*2.827/3] (bias only selects). Token 1: logits 40 on experts 6, 7 (s = 1), "
                 "bias -0.25 on 6: ids [7, 6], weights [1.4135, 1.4135]. Experts 0, 2, 3, 4 get no token; "
                 "inputs are written by hand (the seed is unused).", 701, logits, bias, 2)

    # Ties: logits from a few values, so equal logits are everywhere; s(40) = 1.0 exactly and s(-40) + 0.5 ==
    # 0.5, so equal s + bias also comes from different s. Row 0: all logits 0, so only the bias and the ids decide.
    rng = np.random.default_rng(702)
    logits = rng.choice(np.array([-40, -1, 0, 1, 40], F32), size=(8, 16), p=[0.15, 0.2, 0.3, 0.2, 0.15])
    bias = rng.choice(np.array([-0.5, 0, 0.5], F32), size=16)
    logits[0] = 0
    ids, _, _ = routing_case("ties_e16_k4_t8", "Exact ties (E 16, k 4, T 8): logits drawn from {-40, -1, 0, 1, "
                             "40}, bias from {-0.5, 0, 0.5}; s(40) = 1.0 and s(-40) + 0.5 == 0.5 in float64, so "
                             "equal s + bias also arises from different s. Ties go to the smaller expert id. "
                             "Token 0 has all logits 0.", 702, logits, bias, 4)
    # The case really has ties at the selection boundary, some between different s.
    s = np.vectorize(sigmoid64)(logits.astype(np.float64))
    score = s + bias.astype(np.float64)
    boundary_ties = distinct_s_ties = 0
    for t in range(8):
        kth = score[t, ids[t, -1]]
        tied = [e for e in range(16) if score[t, e] == kth]
        if len(tied) > 1 and any(e not in ids[t] for e in tied):
            boundary_ties += 1
            distinct_s_ties += len({s[t, e] for e in tied}) > 1
    assert boundary_ties >= 4 and distinct_s_ties >= 1, (boundary_ties, distinct_s_ties)

    rng = np.random.default_rng(703)
    routing_case("kimi_e384_k8_t1", "Kimi-K2 routing (E 384, k 8, rsf 2.827), T 1: logits N(-1, 2), bias N(0, "
                 "0.05), as f32.", 703, *random_router(rng, 1, 384), 8)
    rng = np.random.default_rng(706)
    _, _, offsets = routing_case("kimi_e384_k8_t33", "Kimi-K2 routing, T 33 (264 pairs over 384 experts: many "
                                 "experts get no token).", 706, *random_router(rng, 33, 384), 8)
    assert len(empty_experts(offsets)) > 100

    rng = np.random.default_rng(705)
    _, w, offsets = routing_case("empty_e16_k1_t8", "k 1 (E 16, T 8): every weight is s/s * 2.827. Experts 0, 7 "
                                 "and 15 (first, middle, last) have bias -4 and get no token.", 705,
                                 *random_router(rng, 8, 16, empty=(0, 7, 15)), 1)
    assert {0, 7, 15} <= set(empty_experts(offsets)) and (w == F32(2.827)).all()

    rng = np.random.default_rng(707)
    routing_case("e32_k4_t128", "T 128 with a small E (E 32, k 4, rsf 2.827).", 707,
                 *random_router(rng, 128, 32), 4)


TOL_REPORT = []


def random_scales(rng, shape):
    """bf16 scales m * 2^-14 with m uniform in 128 .. 255: one binade, [2^-7, 2^-6)."""
    scale = rng.integers(128, 256, size=shape).astype(np.float64) * (SCALE_BINADE / 128)
    return f64_to_bf16_bits(scale)


def tie_free_tokens(rng, T, H, ids, w13):
    """x [T, H] bf16 bits, values k/4 for integers k in -16 .. 16, each token drawn again until none of its h
    values is a rounding near-tie. With such x and one-binade scales, every x . w13 product is an integer
    multiple of 2^-16 and every partial sum stays below 2^24 of them, so g and u are exact in f32 in any
    order; with no near-tie either, a correct f32 kernel rounds every h as the float64 reference does."""
    x = np.zeros((T, H))
    for t in range(T):
        for _ in range(200):
            x[t] = rng.integers(-16, 17, size=H) / 4.0
            if not near_ties(pair_h64(x[t], ids[t], w13)).any():
                break
        else:
            raise AssertionError(f"no tie-free x for token {t} in 200 draws")
    return f32_to_bf16_bits(x.astype(F32))


def check_exact_gate_up(x_bits, ids, w13, packed):
    """Both f32 orders (sequential over the dequantized row, grouped with the scale per group) give the
    float64 gate/up values bit for bit."""
    x = bf16_bits_to_f32(x_bits)
    for t in range(ids.shape[0]):
        for e in ids[t]:
            want = dot_rows(x[t][None, :].astype(np.float64), w13[e])[0]
            assert (seq_sum(x[t][None, :] * w13[e].astype(F32), axis=1).astype(np.float64) == want).all()
            assert (grouped_dot(x[t], packed[0][e], packed[1][e]).astype(np.float64) == want).all()


def moe_mutants(x, ids, weights, w13, w2, out):
    """Contract violations applied to the reference: name -> (description, out)."""
    E = w13.shape[0]
    wrong_ids = ids.copy()
    wrong_ids[0, 0] = next(e for e in range(E) if e not in ids[0])
    return {
        "h_unrounded": ("h kept in f32 (the contract's bf16 rounding of h skipped)",
                        moe_emulate_f32(x, ids, weights, w13, w2, round_h=False)),
        "out_scale": (f"out scaled by {OUT_SCALE} (0.1%)", out * F32(OUT_SCALE)),
        "weights_bf16": ("dequantized weights rounded to bf16 (a kernel that dequantizes into bf16 MMA operands)",
                         moe_emulate_f32(x, ids, weights, w13, w2, bf16_weights=True)),
        "wrong_expert": ("token 0's first slot computed with an expert it did not choose (one wrong pair)",
                         moe_ref(x, wrong_ids, weights, w13, w2).astype(F32)),
    }


def int4_case(name, description, seed, T, H, I, E, k, empty=(), zero_groups=True, full_range=False,
              store_dequant=False):
    """Routing from random logits and bias; bf16 weights N(0, 1) * 0.05 quantized, then the group scales
    drawn again on one binade (random_scales); x tie-free (tie_free_tokens).
    zero_groups: one all-zero group in w13 (gate row 0, group 0) and in w2 (row 1, last group) of the first
    token's first expert. full_range: one group of w13 (an up row) and of w2 set directly to the nibbles 0 .. 15
    twice (shuffled), so the dequant of nibble 0 (q = -8), which the quantizer never produces, is exercised."""
    assert H % GROUP == 0 and I % GROUP == 0 and k <= E - len(empty) and H <= 256
    rng = np.random.default_rng(seed)
    logits, bias = random_router(rng, T, E, empty=empty)
    ids, weights = route(logits, bias, k)
    offsets, pairs = align(ids, E)
    check_alignment(ids, E, offsets, pairs)
    w13_bits = f32_to_bf16_bits((rng.standard_normal((E, 2 * I, H)) * 0.05).astype(F32))
    w2_bits = f32_to_bf16_bits((rng.standard_normal((E, H, I)) * 0.05).astype(F32))
    e0 = int(ids[0, 0])
    if zero_groups:
        w13_bits[e0, 0, :GROUP] = 0
        w2_bits[e0, 1, I - GROUP:] = 0
    nib13, s13 = quantize(w13_bits)
    nib2, s2 = quantize(w2_bits)
    s13 = np.where(s13 == BF16_ONE, s13, random_scales(rng, s13.shape)).astype(np.uint16)
    s2 = np.where(s2 == BF16_ONE, s2, random_scales(rng, s2.shape)).astype(np.uint16)
    if zero_groups:
        assert s13[e0, 0, 0] == BF16_ONE and s2[e0, 1, I // GROUP - 1] == BF16_ONE
    if full_range:
        e1 = int(ids[0, 1]) if k > 1 else e0
        nib13[e1, I + 3, H - GROUP:] = rng.permutation(np.tile(np.arange(16), 2))
        nib2[e0, 5, :GROUP] = rng.permutation(np.tile(np.arange(16), 2))
    w13_packed, w2_packed = pack_nibbles(nib13), pack_nibbles(nib2)
    w13, w2 = dequant(w13_packed, s13), dequant(w2_packed, s2)
    assert w13_packed.shape == (E, 2 * I, H // PACK) and s13.shape == (E, 2 * I, H // GROUP)
    assert w2_packed.shape == (E, H, I // PACK) and s2.shape == (E, H, I // GROUP)
    x = tie_free_tokens(rng, T, H, ids, w13)
    packed = (w13_packed, s13, w2_packed, s2)
    check_exact_gate_up(x, ids, w13, packed)

    out64 = moe_ref(x, ids, weights, w13, w2)
    naive = moe_naive(x, ids, weights, w13, w2)
    assert np.abs(out64 - naive).max() <= 1e-12, np.abs(out64 - naive).max()
    out = out64.astype(F32)
    observed = max(row_errors(moe_emulate_f32(x, ids, weights, w13, w2, packed=p), out).max()
                   for p in (None, packed))
    tol = TOL_MULTIPLE * max(observed, F32_EPS)
    mutants = moe_mutants(x, ids, weights, w13, w2, out)
    for m, (_, got) in mutants.items():
        assert (row_errors(got, out) > tol).any(), f"{name}: the tolerance accepts the {m} mutant"
    TOL_REPORT.append((name, observed, tol, {m: row_errors(got, out).max() for m, (_, got) in mutants.items()}))
    for e in empty:
        assert offsets[e] == offsets[e + 1]
    no_token = empty_experts(offsets)
    assert no_token, "every case has an expert that receives no token"
    description += (f" Routing by the moe_routing reference (rsf 2.827) from logits N(-1, 2) and bias N(0, 0.05); x "
                    f"tie-free, values k/4 for integers k in -16..16; weights N(0, 1) * 0.05 as bf16, quantized, "
                    f"scales drawn again on [2^-7, 2^-6). Experts with no token: {', '.join(map(str, no_token))}.")

    arrays = {"x": x, "topk_ids": ids, "topk_weights": weights, "w13_packed": w13_packed, "w13_scale": s13,
              "w2_packed": w2_packed, "w2_scale": s2, "out": out}
    arrays.update({f"mutant_{m}_out": got.astype(F32) for m, (_, got) in mutants.items()})
    if store_dequant:
        arrays["w13"], arrays["w2"] = w13.astype(F32), w2.astype(F32)
    write_case("moe_int4", name, arrays,
               {"T": T, "H": H, "I": I, "E": E, "k": k, "tol_out_rel": tol, "observed_out_rel": observed,
                "tol_multiple": TOL_MULTIPLE, **mutant_meta({m: d for m, (d, _) in mutants.items()}), "seed": seed,
                "description": description})


def int4_cases():
    int4_case("tiny_h64_i32_e4_k2_t2", "Smallest case, with the dequantized w13 / w2 stored as f32. H 64, I 32, "
              "E 4, k 2, T 2; expert 3 has bias -4; an all-zero group (scale 1.0) in w13 (gate row 0, "
              "group 0) and w2 (row 1, group 0) of topk_ids[0][0]; one group of w13 (up row I+3, last group) of "
              "topk_ids[0][1] and one of w2 (row 5, group 0) of topk_ids[0][0] hold the nibbles 0..15 twice, "
              "set directly (the quantizer never makes q = -8).", 801, T=2, H=64, I=32, E=4, k=2, empty=(3,),
              full_range=True, store_dequant=True)
    int4_case("h256_i128_e3_k2_t1", "T 1 (H 256, I 128, E 3, k 2); an all-zero group "
              "in w13 and w2 of topk_ids[0][0].", 802, T=1, H=256, I=128, E=3, k=2)
    int4_case("h128_i64_e8_k4_t8", "T 8 (H 128, I 64, E 8, k 4); experts 0 and 5 have bias -4; an "
              "all-zero group in w13 and w2 of topk_ids[0][0].", 803, T=8, H=128, I=64, E=8, k=4, empty=(0, 5))
    int4_case("h128_i64_e8_k3_t33", "T 33 (H 128, I 64, E 8, k 3); expert 7 (the last) has bias -4; "
              "an all-zero group in w13 and w2 of topk_ids[0][0].", 804, T=33, H=128, I=64, E=8, k=3,
              empty=(7,))
    for name, observed, tol, mutants in TOL_REPORT:
        print(f"moe_int4/{name}: observed out_rel {observed:.2e}, tolerance {tol:.2e}; mutants "
              + ", ".join(f"{m} {e:.1e}" for m, e in mutants.items()))


def moe_cases():
    for k in KERNELS:
        shutil.rmtree(FIXTURES / k, ignore_errors=True)
    self_check_bf16_rounding()
    self_check_int4()
    self_check_routing()
    routing_cases()
    int4_cases()
