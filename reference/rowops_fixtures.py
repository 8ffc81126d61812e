"""Row operations (rowops): a bit-exact numpy reference and fixtures for the model's small per-row kernels.

Written from the contract in src/cpu/rowops.rs's module documentation (repeated in the section "Row operations
(rowops)" of reference/README.md), never from the Rust or CUDA code. gen_fixtures.py calls rowops_cases() from
its main; it deletes and rewrites fixtures/rowops/<case>/, one case directory per op and shape, each with a
meta.json whose "op" names the operation (rmsnorm | silu_mul | q_rows | kv_rows | embed | argmax | add | to_bf16
| gather) and which holds every shape parameter.

Every output is bit-exact, so every fixture value here is built from numpy float32 operations in the contract's
order: each product and each sum is a separate, correctly rounded f32 operation (numpy never fuses a multiply
and an add into an fma), sqrt is IEEE's correctly rounded f32 sqrt, exp is gen_fixtures.expd (the project's
deterministic exp for d <= 0, 0 below -31), bf16 is round to nearest even on the bit pattern (stored as uint16
bits). The contract:

1. rmsnorm(x [rows, d], w [d], eps): element e goes to lane (e // 4) % 32; each lane sums the f32 squares of its
   elements in increasing e from 0.0; then 5 butterfly steps s = 16, 8, 4, 2, 1 (new[l] = old[l] + old[l ^ s]
   for every lane at once); total = lane 0; mean = total / f32(d); inv = 1 / sqrt(mean + eps);
   y = w * (x * inv).
2. sigmoid(g) = 1 / (1 + expd(-g)) for g >= 0, e / (1 + e) with e = expd(g) for g < 0;
   silu_mul(gu [rows, 2I]) -> out [rows, I] = (g * sigmoid(g)) * u, g = gu[:, j], u = gu[:, I + j].
3. rope_row(x [64], table [64] = 32 cos then 32 sin, interleave): (a, b) = (x[2i], x[2i+1]) if interleave else
   (x[i], x[i+32]); out[i] = a*cos[i] - b*sin[i]; out[i+32] = b*cos[i] + a*sin[i].
4. q_rows(q_latent [T, H, 512], q [T, H, nope+64], table [T, 64], interleave) -> bf16 [T, H, 576]:
   bf16(q_latent) then bf16(rope_row(q[t, h, nope:], table[t])).
5. kv_rows(kv [T, 576], norm_w [512], eps, table [T, 64], interleave, slot [T], cache): cache row slot[t] =
   bf16(rmsnorm(kv[t, :512]) ++ rope_row(kv[t, 512:], table[t])); other rows unchanged.
6. embed(table [V, H] bf16, ids [T]) -> f32 [T, H] (exact widening).
7. add(x, y) = x + y. 8. to_bf16(x): round to nearest even. 9. gather(x [rows, d], idx [R]) = x[idx].
10. argmax(x [rows, V]) -> i32 [rows]: the lowest index of the largest value, NaN larger than every number
    (the first NaN wins), -0.0 == +0.0 (the lower index wins).

Self-checks (assertions): the lane reduction is computed twice (scalar loop and vectorized) and must agree bit
for bit; rmsnorm is within 1e-5 relative of float64 rmsnorm; sigmoid within 4e-7 of 1 / (1 + exp(-g)) for
|g| < 20; rope within a few f32 roundings of a float64 rotation; argmax agrees with a scalar scan; bf16
rounding of chosen ties and overflows gives the expected bits. All fixtures together stay well under 1.5 MB.
"""

import math
import shutil

import numpy as np

from gen_fixtures import F32, FIXTURES, bf16_bits_to_f32, expd, f32_to_bf16_bits, write_case

KERNEL = "rowops"

LANES = 32
PER_LANE = 4                    # element e goes to lane (e // 4) % 32
D_LATENT = 512
D_ROPE = 64
HALF = D_ROPE // 2
D_ROW = D_LATENT + D_ROPE       # 576
EPS = F32(1e-6)
ATTN_FACTOR = 1.2               # a YaRN-like attention factor folded into the cos/sin table (an input)
ROPE_BASE = 50000.0


# ----------------------------------------------------------------------------------------------------------
# The contract, in f32.
# ----------------------------------------------------------------------------------------------------------

def sum_squares_lanes(x):
    """The contract's sum of squares of one f32 row: per-lane sequential sums, then the 5-step butterfly.
    Written as a scalar loop over np.float32 values, one rounded operation at a time."""
    assert x.dtype == F32 and x.ndim == 1
    lanes = [F32(0.0)] * LANES
    for e in range(len(x)):
        v = x[e]
        sq = F32(v * v)
        lane = (e // PER_LANE) % LANES
        lanes[lane] = F32(lanes[lane] + sq)
    for s in (16, 8, 4, 2, 1):
        lanes = [F32(lanes[l] + lanes[l ^ s]) for l in range(LANES)]
    return lanes[0]


def sum_squares_lanes_vec(x):
    """The same reduction vectorized over rows of x [rows, d] (an independent implementation for the
    self-check): pad d with zeros to a multiple of 128 (adding +0.0 to a non-negative f32 sum is exact),
    view as [rows, rounds, 32 lanes, 4], and add the rounds' elements to the lane sums in increasing e."""
    rows, d = x.shape
    span = LANES * PER_LANE
    rounds = -(-d // span)
    pad = np.zeros((rows, rounds * span), F32)
    pad[:, :d] = x
    sq = (pad * pad).reshape(rows, rounds, LANES, PER_LANE)
    acc = np.zeros((rows, LANES), F32)
    for r in range(rounds):
        for k in range(PER_LANE):
            acc = (acc + sq[:, r, :, k]).astype(F32)
    lane_ids = np.arange(LANES)
    for s in (16, 8, 4, 2, 1):
        acc = (acc + acc[:, lane_ids ^ s]).astype(F32)
    assert (acc == acc[:, :1]).all()              # after a full butterfly every lane holds the same total
    return acc[:, 0]


def rmsnorm(x, w, eps):
    """x [rows, d] f32, w [d] f32, eps f32 -> y [rows, d] f32."""
    x, w, eps = np.asarray(x, F32), np.asarray(w, F32), F32(eps)
    rows, d = x.shape
    assert w.shape == (d,)
    y = np.zeros_like(x)
    totals_vec = sum_squares_lanes_vec(x)
    for t in range(rows):
        total = sum_squares_lanes(x[t])
        assert total.view(np.uint32) == totals_vec[t].view(np.uint32), (t, total, totals_vec[t])
        mean = F32(total / F32(d))
        inv = F32(F32(1.0) / np.sqrt(F32(mean + eps)))
        assert inv.dtype == F32
        scaled = (x[t] * inv).astype(F32)          # x * inv, rounded
        y[t] = (w * scaled).astype(F32)            # then w * (x * inv), rounded
    return y


def sigmoid(g):
    """The contract's f32 sigmoid, elementwise."""
    g = np.asarray(g, F32)
    assert not np.isnan(g).any()
    out = np.zeros(g.shape, F32)
    pos = g >= 0                                  # -0.0 >= 0: the first branch (both give 0.5)
    one = F32(1.0)
    ep = expd(-g[pos])                            # -g <= 0
    out[pos] = (one / (one + ep).astype(F32)).astype(F32)
    en = expd(g[~pos])
    out[~pos] = (en / (one + en).astype(F32)).astype(F32)
    return out


def silu_mul(gu, inter):
    """gu [rows, 2I] f32 -> out [rows, I] f32 = (g * sigmoid(g)) * u."""
    gu = np.asarray(gu, F32)
    assert gu.shape[1] == 2 * inter
    g, u = gu[:, :inter], gu[:, inter:]
    silu = (g * sigmoid(g)).astype(F32)
    return (silu * u).astype(F32)


def rope_row(x, table, interleave):
    """x [64] f32, table [64] f32 (32 cos then 32 sin) -> out [64] f32."""
    x, table = np.asarray(x, F32), np.asarray(table, F32)
    assert x.shape == (D_ROPE,) and table.shape == (D_ROPE,)
    cos, sin = table[:HALF], table[HALF:]
    if interleave:
        a, b = x[0::2], x[1::2]
    else:
        a, b = x[:HALF], x[HALF:]
    out = np.zeros(D_ROPE, F32)
    out[:HALF] = ((a * cos).astype(F32) - (b * sin).astype(F32)).astype(F32)
    out[HALF:] = ((b * cos).astype(F32) + (a * sin).astype(F32)).astype(F32)
    return out


def q_rows(q_latent, q, heads, nope, table, interleave):
    """q_latent [T, H, 512], q [T, H, nope + 64], table [T, 64] -> bf16 bits [T, H, 576]."""
    T = q_latent.shape[0]
    assert q_latent.shape == (T, heads, D_LATENT) and q.shape == (T, heads, nope + D_ROPE)
    assert table.shape == (T, D_ROPE)
    out = np.zeros((T, heads, D_ROW), np.uint16)
    for t in range(T):
        for h in range(heads):
            out[t, h, :D_LATENT] = f32_to_bf16_bits(q_latent[t, h])
            out[t, h, D_LATENT:] = f32_to_bf16_bits(rope_row(q[t, h, nope:nope + D_ROPE], table[t], interleave))
    return out


def kv_rows(kv, norm_w, eps, table, interleave, slot, cache):
    """kv [T, 576], norm_w [512], table [T, 64], slot [T] i32, cache [rows, 576] bf16 bits -> the new cache."""
    T = kv.shape[0]
    assert kv.shape == (T, D_ROW) and norm_w.shape == (D_LATENT,) and table.shape == (T, D_ROPE)
    assert slot.shape == (T,) and cache.shape[1] == D_ROW
    out = cache.copy()
    normed = rmsnorm(kv[:, :D_LATENT], norm_w, eps)
    for t in range(T):
        row = np.concatenate([normed[t], rope_row(kv[t, D_LATENT:], table[t], interleave)])
        out[slot[t]] = f32_to_bf16_bits(row)
    return out


def embed(table_bits, ids):
    return bf16_bits_to_f32(table_bits[ids])


def argmax_rows(x):
    """x [rows, V] f32 -> [rows] i32: first NaN if any, else the lowest index of the max (-0.0 == +0.0)."""
    out = np.zeros(x.shape[0], np.int32)
    for r, row in enumerate(x):
        nan = np.flatnonzero(np.isnan(row))
        if len(nan):
            out[r] = nan[0]
        else:
            out[r] = np.flatnonzero(row == row.max())[0]
    return out


def argmax_scan(row):
    """An independent scalar scan: replace the best only by something strictly larger (NaN is larger than
    every number and no NaN is larger than a NaN)."""
    best = 0
    for i in range(1, len(row)):
        v, b = row[i], row[best]
        if math.isnan(b):
            break
        if math.isnan(v) or v > b:
            best = i
    return best


# ----------------------------------------------------------------------------------------------------------
# Self-checks against float64.
# ----------------------------------------------------------------------------------------------------------

def rmsnorm64(x, w, eps):
    x64 = x.astype(np.float64)
    ms = (x64 * x64).mean(axis=1, keepdims=True)
    return w.astype(np.float64) * x64 / np.sqrt(ms + float(eps))


def check_rmsnorm(x, w, eps, y):
    ref = rmsnorm64(x, w, eps)
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= 1e-5 * np.abs(ref) + 1e-37).all(), err.max()


def rotate64(x, table, interleave):
    x, t = x.astype(np.float64), table.astype(np.float64)
    cos, sin = t[:HALF], t[HALF:]
    a, b = (x[0::2], x[1::2]) if interleave else (x[:HALF], x[HALF:])
    return np.concatenate([a * cos - b * sin, b * cos + a * sin])


def check_rope(x, table, interleave, got):
    ref = rotate64(x, table, interleave)
    # Each output is two rounded products and one rounded sum: within 2 ulp of the larger product's size.
    bound = 2.0 ** -22 * (np.abs(np.concatenate([x, x])).max() * np.abs(table).max() * 2)
    assert np.abs(got.astype(np.float64) - ref).max() <= bound


def self_check():
    # sigmoid against float64 on a dense grid, and its exact edges.
    g = np.concatenate([np.linspace(-20, 20, 400001, dtype=F32)[1:-1], np.array([0.0, -0.0], F32)])
    ref = 1.0 / (1.0 + np.exp(-g.astype(np.float64)))
    assert np.abs(sigmoid(g).astype(np.float64) - ref).max() < 4e-7
    edges = sigmoid(np.array([0.0, -0.0, 31.5, -31.5, 50.0, -50.0, 31.0, -31.0], F32))
    assert edges[0] == 0.5 and edges[1] == 0.5 and edges[2] == 1.0 and edges[3] == 0.0
    assert edges[4] == 1.0 and edges[5] == 0.0 and 0.0 < edges[7] < 1e-13 and edges[6] == 1.0
    # silu_mul against float64.
    rng = np.random.default_rng(1)
    gu = rng.uniform(-20, 20, (4, 200)).astype(F32)
    got = silu_mul(gu, 100).astype(np.float64)
    g64, u64 = gu[:, :100].astype(np.float64), gu[:, 100:].astype(np.float64)
    ref = g64 / (1.0 + np.exp(-g64)) * u64
    assert (np.abs(got - ref) <= 1e-6 * np.abs(ref) + 4e-7 * np.abs(g64 * u64)).all()
    # bf16 ties and overflow.
    bits = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,
                     0xFF7F8000, 0x00008000, 0x00018000, 0x7F800000, 0xFF800000, 0x80000000], np.uint32)
    expect = [0x3F80, 0x3F82, 0xBF80, 0xBF82, 0x7F7F, 0x7F80, 0x7F80, 0xFF80, 0x0000, 0x0002, 0x7F80, 0xFF80,
              0x8000]
    assert f32_to_bf16_bits(bits.view(F32)).tolist() == expect
    # The scalar and vectorized lane reductions agree (also asserted inside rmsnorm) on an awkward length.
    x = rng.standard_normal((2, 333)).astype(F32)
    assert sum_squares_lanes(x[1]) == sum_squares_lanes_vec(x)[1]
    # rope is a rotation: with a unit table it preserves each pair's norm in float64.
    ang = rng.uniform(0, 2 * np.pi, HALF)
    table = np.concatenate([np.cos(ang), np.sin(ang)]).astype(F32)
    for il in (False, True):
        xr = rng.standard_normal(D_ROPE).astype(F32)
        check_rope(xr, table, il, rope_row(xr, table, il))
    # argmax edge rules.
    assert argmax_rows(np.array([[-1.0, 2.0, np.nan, 5.0, np.nan]], F32))[0] == 2
    assert argmax_rows(np.array([[-1.0, -0.0, 0.0, -2.0]], F32))[0] == 1
    assert argmax_rows(np.full((1, 5), -np.inf, F32))[0] == 0


# ----------------------------------------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------------------------------------

def varied(rng, shape):
    """Normal values times 10^uniform(-2, 2): magnitudes over four decades."""
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, shape)).astype(F32)


def rope_table(positions):
    """[T, 64] f32: cos then sin of inv_freq * position (base 50000, 64 rope dims) times ATTN_FACTOR, computed
    in float64 and rounded to f32 (inputs: any values would do)."""
    inv_freq = ROPE_BASE ** (-np.arange(0, D_ROPE, 2, dtype=np.float64) / D_ROPE)
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    return (np.concatenate([np.cos(ang), np.sin(ang)], axis=1) * ATTN_FACTOR).astype(F32)


def random_bf16(rng, shape, scale=1.0):
    return f32_to_bf16_bits((rng.standard_normal(shape) * scale).astype(F32))


# ----------------------------------------------------------------------------------------------------------
# Cases.
# ----------------------------------------------------------------------------------------------------------

def rmsnorm_case(seed, d, T, description):
    rng = np.random.default_rng(seed)
    x = varied(rng, (T, d))
    w = (1.0 + 0.5 * rng.standard_normal(d)).astype(F32)
    y = rmsnorm(x, w, EPS)
    check_rmsnorm(x, w, EPS, y)
    write_case(KERNEL, f"rmsnorm_d{d}_t{T}", {"x": x, "w": w, "y": y},
               {"op": "rmsnorm", "d": d, "T": T, "eps": float(EPS), "seed": seed,
                "description": description + " x normal * 10^uniform(-2, 2), w 1 + 0.5 normal, eps 1e-6 as f32."})


SILU_EDGES = [0.0, -0.0, -31.5, 31.5, 50.0, -50.0, 31.0, -31.0, 40.0, -40.0, 30.999998, -30.999998, 1e-30, -1e-30]


def silu_case(seed, inter, T, description):
    rng = np.random.default_rng(seed)
    g = rng.uniform(-40, 40, (T, inter)).astype(F32)
    g.reshape(-1)[:len(SILU_EDGES)] = np.array(SILU_EDGES, F32)
    g.reshape(-1)[len(SILU_EDGES):len(SILU_EDGES) + 20] = rng.uniform(-1, 1, 20).astype(F32)  # near 0
    u = varied(rng, (T, inter))
    gu = np.concatenate([g, u], axis=1)
    out = silu_mul(gu, inter)
    write_case(KERNEL, f"silu_mul_i{inter}_t{T}", {"gu": gu, "out": out},
               {"op": "silu_mul", "I": inter, "T": T, "seed": seed,
                "description": description + " g uniform(-40, 40) with 0, -0.0, +-31.5, +-31, +-50, +-40, "
                               "+-30.999998, +-1e-30 and some values in (-1, 1); u normal * 10^uniform(-2, 2)."})


def q_rows_case(seed, heads, nope, T, interleave, positions, description):
    rng = np.random.default_rng(seed)
    q_latent = varied(rng, (T, heads, D_LATENT))
    q = varied(rng, (T, heads, nope + D_ROPE))
    table = rope_table(positions)
    out = q_rows(q_latent, q, heads, nope, table, interleave)
    for t in range(T):
        for h in range(heads):
            check_rope(q[t, h, nope:], table[t], interleave, rope_row(q[t, h, nope:], table[t], interleave))
    tag = "interleaved" if interleave else "halves"
    write_case(KERNEL, f"q_rows_h{heads}_nope{nope}_t{T}_{tag}",
               {"q_latent": q_latent, "q": q, "table": table, "out": out},
               {"op": "q_rows", "T": T, "heads": heads, "nope": nope, "rope_dim": D_ROPE, "latent_dim": D_LATENT,
                "interleave": int(interleave), "positions": [int(p) for p in positions], "seed": seed,
                "description": description + f" q_latent and q normal * 10^uniform(-2, 2); table cos/sin of "
                               f"inv_freq (base {ROPE_BASE:g}) * position times {ATTN_FACTOR}; out bf16 bits."})


def kv_rows_case(seed, T, cache_rows, slots, interleave, positions, description):
    rng = np.random.default_rng(seed)
    kv = varied(rng, (T, D_ROW))
    norm_w = (1.0 + 0.5 * rng.standard_normal(D_LATENT)).astype(F32)
    table = rope_table(positions)
    slot = np.array(slots, np.int32)
    assert len(set(slots)) == T and all(0 <= s < cache_rows for s in slots)
    cache_in = random_bf16(rng, (cache_rows, D_ROW))
    cache_out = kv_rows(kv, norm_w, EPS, table, interleave, slot, cache_in)
    check_rmsnorm(kv[:, :D_LATENT], norm_w, EPS, rmsnorm(kv[:, :D_LATENT], norm_w, EPS))
    untouched = np.setdiff1d(np.arange(cache_rows), slot)
    assert (cache_out[untouched] == cache_in[untouched]).all() and (cache_out[slot] != cache_in[slot]).any(axis=1).all()
    tag = "interleaved" if interleave else "halves"
    write_case(KERNEL, f"kv_rows_t{T}_rows{cache_rows}_{tag}",
               {"kv": kv, "norm_w": norm_w, "table": table, "slot": slot, "cache_in": cache_in,
                "cache_out": cache_out},
               {"op": "kv_rows", "T": T, "rows": cache_rows, "rope_dim": D_ROPE, "latent_dim": D_LATENT,
                "eps": float(EPS), "interleave": int(interleave), "positions": [int(p) for p in positions],
                "seed": seed,
                "description": description + " kv normal * 10^uniform(-2, 2), norm_w 1 + 0.5 normal, eps 1e-6 "
                               "as f32; cache_in random bf16 (rows not in slot must stay unchanged)."})


def embed_case(seed, V, H, T):
    rng = np.random.default_rng(seed)
    table = random_bf16(rng, (V, H), scale=0.5)
    ids = np.array([0, V - 1, 7, 0, 23, V - 2][:T], np.int32)
    assert len(ids) == T
    out = embed(table, ids)
    write_case(KERNEL, f"embed_v{V}_h{H}_t{T}", {"table": table, "ids": ids, "out": out},
               {"op": "embed", "V": V, "H": H, "T": T, "seed": seed,
                "description": "Embedding lookup: table random bf16 (0.5 normal), ids include 0, V - 1 and a "
                               "repeat; out is the exact f32 widening."})


def argmax_case(seed, V):
    rng = np.random.default_rng(seed)
    rows = []
    # 0: a tie for the max at 200 and 600 (lowest index wins: 200).
    r = rng.standard_normal(V).astype(F32)
    r[200] = r[600] = F32(9.5)
    rows.append(r)
    # 1: a NaN (at 500) after a larger finite value (at 10), then another NaN (at 800): 500.
    r = rng.standard_normal(V).astype(F32)
    r[10] = F32(100.0)
    r[500] = r[800] = F32(np.nan)
    rows.append(r)
    # 2: all -inf: 0.
    rows.append(np.full(V, -np.inf, F32))
    # 3: -0.0 at 3 and +0.0 at 7 as the max, everything else negative: 3.
    r = -np.abs(rng.standard_normal(V).astype(F32)) - F32(0.01)
    r[3], r[7] = F32(-0.0), F32(0.0)
    rows.append(r.astype(F32))
    # 4: random.
    rows.append((rng.standard_normal(V) * 3).astype(F32))
    # 5: the max at the last index.
    r = rng.standard_normal(V).astype(F32)
    r[V - 1] = F32(r.max() + 1.0)
    rows.append(r)
    x = np.stack(rows).astype(F32)
    out = argmax_rows(x)
    assert out.tolist()[:4] == [200, 500, 0, 3] and out[5] == V - 1
    assert [argmax_scan(row.tolist()) for row in x] == out.tolist()
    write_case(KERNEL, f"argmax_rows{x.shape[0]}_v{V}", {"x": x, "out": out},
               {"op": "argmax", "rows": x.shape[0], "V": V, "seed": seed,
                "description": "Row argmax, NaN above every number and the first NaN wins, -0.0 == +0.0. Rows: "
                               "a tie (200 and 600), NaN at 500 and 800 after 100.0 at 10, all -inf, -0.0 at 3 "
                               "and +0.0 at 7 as the max, random, the max at the last index."})


def add_case(seed, rows, d):
    rng = np.random.default_rng(seed)
    x, y = varied(rng, (rows, d)), varied(rng, (rows, d))
    y[0, 0] = -x[0, 0]                            # an exact cancellation to +0.0
    x[0, 1], y[0, 1] = F32(-0.0), F32(-0.0)       # -0.0 + -0.0 = -0.0
    out = (x + y).astype(F32)
    assert out[0, 0] == 0.0 and not np.signbit(out[0, 0]) and np.signbit(out[0, 1])
    write_case(KERNEL, f"add_r{rows}_d{d}", {"x": x, "y": y, "out": out},
               {"op": "add", "rows": rows, "d": d, "seed": seed,
                "description": "Elementwise f32 x + y; x, y normal * 10^uniform(-2, 2), with x + (-x) = +0.0 and "
                               "-0.0 + -0.0 = -0.0 at the start of row 0."})


def to_bf16_case(seed, rows, d):
    rng = np.random.default_rng(seed)
    x = varied(rng, (rows, d)).reshape(-1)
    special = np.array([
        0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,   # exact ties: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6
        0x40498000, 0x404A8000,                           # ties near pi: odd 0x4049 rounds up, even 0x404A stays
        0x3F808001, 0x3F807FFF,                           # just above / below a tie
        0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7FFFFF,   # below bf16 max's tie (stays max), ties and above -> inf
        0xFF7F8000, 0xFF7FFFFF,                           # the same, negative -> -inf
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000,   # inf, -inf, +0, -0
        0x00008000, 0x00018000, 0x00000001, 0x807FFFFF,   # subnormals: ties to even, tiny, the largest negative
        0x00800000, 0x3F800000,                           # smallest normal, 1
    ], np.uint32).view(F32)
    x[:len(special)] = special
    x = x.reshape(rows, d)
    out = f32_to_bf16_bits(x)
    flat = out.reshape(-1)
    assert flat[:6].tolist() == [0x3F80, 0x3F82, 0xBF80, 0xBF82, 0x404A, 0x404A]
    assert flat[8:14].tolist() == [0x7F7F, 0x7F80, 0x7F80, 0x7F80, 0xFF80, 0xFF80]
    # Round to nearest, even on ties: compared with the two bf16 neighbours in float64.
    lo = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(F32)    # the truncation toward zero
    check_bf16_rounding(x.reshape(-1), flat, lo.reshape(-1))
    write_case(KERNEL, f"to_bf16_r{rows}_d{d}", {"x": x, "out": out},
               {"op": "to_bf16", "rows": rows, "d": d, "seed": seed,
                "description": "f32 -> bf16 (bits), round to nearest even: exact ties, values next to ties, "
                               "values above the bf16 maximum rounding to +-inf (and 0x7F7F7FFF staying at the "
                               "maximum), infinities, signed zeros, subnormals, then normal * 10^uniform(-2, 2)."})


def check_bf16_rounding(x, bits, lo):
    """Every output is the nearer of the truncation and the next bf16 up in magnitude, the even one on ties."""
    for v, b, l in zip(x.tolist(), bits.tolist(), lo.tolist()):
        lb = int(np.array([l], F32).view(np.uint32)[0]) >> 16
        if math.isinf(v) or v == l:
            assert b == lb, (v, b)
            continue
        hb = lb + 1
        h = float(bf16_bits_to_f32(np.array([hb], np.uint16))[0])   # may be +-inf (the step above the maximum)
        if math.isinf(h):
            h = math.copysign(2.0 ** 128, v)       # round to nearest treats the value past the max as 2^128
        dl, dh = abs(v - l), abs(h - v)
        want = lb if dl < dh else hb if dh < dl else (lb if lb % 2 == 0 else hb)
        assert b == want, (v, hex(b), hex(want))


def gather_case(seed, rows, d, idx):
    rng = np.random.default_rng(seed)
    x = varied(rng, (rows, d))
    idx = np.array(idx, np.int32)
    out = x[idx]
    write_case(KERNEL, f"gather_rows{rows}_d{d}_r{len(idx)}", {"x": x, "idx": idx, "out": out},
               {"op": "gather", "rows": rows, "d": d, "R": len(idx), "seed": seed,
                "description": "Row gather out = x[idx]; idx out of order, with a repeat, the first and the last "
                               "row."})


def rowops_cases():
    self_check()
    shutil.rmtree(FIXTURES / KERNEL, ignore_errors=True)
    rmsnorm_case(1101, 128, 5, "RMSNorm, d 128 (one element per lane-slot of a warp), T 5.")
    rmsnorm_case(1102, 512, 3, "RMSNorm, d 512 (the MLA latent width), T 3.")
    rmsnorm_case(1103, 100, 2, "RMSNorm, d 100 (not a multiple of 4 or 32: lanes 25..31 sum nothing), T 2.")
    rmsnorm_case(1104, 1, 2, "RMSNorm, d 1 (only lane 0 has an element), T 2.")
    rmsnorm_case(1105, 1536, 2, "RMSNorm, d 1536 (12 elements per lane), T 2.")
    rmsnorm_case(1106, 1000, 2, "RMSNorm, d 1000 (7 full strides of 128, then a partial one), T 2.")
    rmsnorm_case(1107, 7168, 1, "RMSNorm, d 7168 (Kimi-K2's hidden size: 56 full strides), T 1.")
    silu_case(1201, 64, 3, "SiLU(gate) * up, I 64, T 3.")
    silu_case(1202, 100, 2, "SiLU(gate) * up, I 100 (not a multiple of 32), T 2.")
    q_rows_case(1301, 2, 32, 3, True, [0, 5, 1000], "Query rows, H 2, nope 32, T 3, interleaved rope pairs.")
    q_rows_case(1302, 1, 128, 2, False, [17, 4095], "Query rows, H 1, nope 128, T 2, rope pairs (i, i + 32).")
    kv_rows_case(1401, 4, 10, [7, 0, 3, 9], True, [3, 4, 5, 6],
                 "Latent cache rows, T 4 into cache rows 7, 0, 3, 9 of 10, interleaved rope pairs.")
    kv_rows_case(1402, 2, 6, [5, 1], False, [0, 777],
                 "Latent cache rows, T 2 into cache rows 5, 1 of 6, rope pairs (i, i + 32).")
    embed_case(1501, 50, 16, 6)
    argmax_case(1601, 1000)
    add_case(1701, 3, 40)
    to_bf16_case(1801, 4, 16)
    gather_case(1901, 8, 24, [5, 0, 7, 5, 2])
    size = sum(p.stat().st_size for p in (FIXTURES / KERNEL).rglob("*") if p.is_file())
    assert size < 1_500_000, size
    print(f"rowops: {size} bytes; bit-exact f32 contract, self-checks against float64 passed")
