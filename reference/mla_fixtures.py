"""MLA absorbed attention: float64 reference and fixtures for mla_decode and tree_verify.

Written from ../shared/DESIGN.md section 4.3 and the section "MLA absorbed attention" of reference/README.md,
never from the Rust or CUDA code. gen_fixtures.py calls mla_cases() from its main; it deletes and rewrites
fixtures/{mla_decode,tree_verify}/<case>/.

The reference is float64 from exactly the bf16 inputs: widen to float64, score = (q . k) * softmax_scale over all
576 dims, softmax over the visible rows (max subtracted), o = sum p * c_kv, lse = max + log(sum exp(score - max)).
o and lse are stored as float32. A row with no visible rows has o = 0 and lse = -inf.

No BLAS anywhere (numpy's OpenBLAS picks its kernels by CPU): dot products and weighted sums are elementwise
products reduced with np.sum, whose order does not depend on the machine, so the same command gives the same
bytes on CI.

Sizes: one (query row, head) costs 3.2 KB (q 1152 B + o 2048 B) and one cache row 1152 B, and every request of a
case has the same number of pages, so the cases below are chosen to keep all MLA fixtures under 2.5 MB.
"""

import math
import shutil

import numpy as np

import gen_fixtures as gf
from gen_fixtures import (F32, F32_EPS, FIXTURES, TOL_MULTIPLE, bf16_bits_to_f32, f32_to_bf16_bits, mutant_meta,
                          seq_sum, write_case)

KERNELS = ("mla_decode", "tree_verify")

D_LATENT = 512                  # c_kv / q_latent
D_ROPE = 64                     # k_pe / q_pe
D_QK = D_LATENT + D_ROPE        # 576: a query row and a cache row

MSCALE = 0.1 * math.log(32) + 1                          # YaRN mscale for Kimi-K2 (factor 32, mscale 1)
SOFTMAX_SCALE = F32(MSCALE ** 2 / math.sqrt(192))        # the f32 value the kernels get, used as-is (widened)

CHUNK = 256                     # chunk length of the f32 emulation below (README: chunks of 256 visible rows)


# ----------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------

def widen(bits):
    """bf16 bit patterns -> float64 values (exact)."""
    return bf16_bits_to_f32(bits).astype(np.float64)


def attend(q, kv, scale=SOFTMAX_SCALE):
    """q [R, 576] (one row per head), kv [S, 576] the visible cache rows in logical order, both float64.
    Returns o [R, 512] and lse [R] in float64."""
    R = q.shape[0]
    if kv.shape[0] == 0:
        return np.zeros((R, D_LATENT)), np.full(R, -np.inf)
    s = (q[:, None, :] * kv[None, :, :]).sum(axis=2) * float(scale)         # [R, S]
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - m)
    z = e.sum(axis=1)
    o = (e[:, :, None] * kv[None, :, :D_LATENT]).sum(axis=1) / z[:, None]
    lse = m[:, 0] + np.log(z)
    return o, lse


def slot_rows(cache, block_table_b, slots):
    """Cache rows of the given slots of one request: slot s is (block_table[s / page_size], s % page_size)."""
    ps = cache.shape[1]
    slots = np.asarray(slots, dtype=np.int64)
    return cache[block_table_b[slots // ps], slots % ps]


def visible_tree_rows(vis_row):
    """Rows j whose bit is set in one visibility row [W] u32, increasing."""
    W = vis_row.shape[0]
    return [j for j in range(32 * W) if (int(vis_row[j // 32]) >> (j % 32)) & 1]


def tree_slots(seq_len, vis_row):
    """The logical sequence of a tree row: the prefix slots, then seq_len + j for its visible tree rows j."""
    return list(range(seq_len)) + [seq_len + j for j in visible_tree_rows(vis_row)]


def mla_decode_ref(q, cache, block_table, seq_len):
    """q [bs, H, 576], cache [pages, ps, 576] (bf16 bits), block_table [bs, P], seq_len [bs] -> float64 o, lse."""
    bs, H, _ = q.shape
    q64, c64 = widen(q), widen(cache)
    o, lse = np.zeros((bs, H, D_LATENT)), np.zeros((bs, H))
    for b in range(bs):
        assert seq_len[b] >= 1, "a decode over seq_len 0 is an error"
        o[b], lse[b] = attend(q64[b], slot_rows(c64, block_table[b], range(seq_len[b])))
    return o, lse


def tree_verify_ref(q, cache, block_table, seq_len, visibility):
    """q [bs, N, H, 576], visibility [bs, N, W] -> float64 o [bs, N, H, 512], lse [bs, N, H]."""
    bs, N, H, _ = q.shape
    q64, c64 = widen(q), widen(cache)
    o, lse = np.zeros((bs, N, H, D_LATENT)), np.zeros((bs, N, H))
    for b, i in np.ndindex(bs, N):
        slots = tree_slots(int(seq_len[b]), visibility[b, i])
        o[b, i], lse[b, i] = attend(q64[b, i], slot_rows(c64, block_table[b], slots))
    return o, lse


# ----------------------------------------------------------------------------------------------------------
# Self-checks
# ----------------------------------------------------------------------------------------------------------

def attend_naive(q, kv, scale=SOFTMAX_SCALE):
    """A second float64 reference: per head, one visible row at a time, an online softmax (running max, rescaled
    sum and output); each score an exact sum (math.fsum) of the 576 products."""
    R = q.shape[0]
    o, lse = np.zeros((R, D_LATENT)), np.full(R, -np.inf)
    for h in range(R):
        m, z, acc = -math.inf, 0.0, np.zeros(D_LATENT)
        for row in kv:
            s = math.fsum((q[h] * row).tolist()) * float(scale)
            if s > m:
                alpha = math.exp(m - s)          # 0.0 for the first row (m = -inf)
                z, acc, m = z * alpha + 1.0, acc * alpha + row[:D_LATENT], s
            else:
                w = math.exp(s - m)
                z, acc = z + w, acc + w * row[:D_LATENT]
        if z > 0:
            o[h], lse[h] = acc / z, m + math.log(z)
    return o, lse


def check_naive(rows):
    """rows: (q [R, 576], kv [S, 576], o, lse) float64 from the reference; the naive way agrees to 1e-12."""
    for q, kv, o, lse in rows:
        o2, lse2 = attend_naive(q, kv)
        assert np.abs(o2 - o).max(initial=0.0) <= 1e-12, np.abs(o2 - o).max()
        fin = np.isfinite(lse)
        assert (np.isfinite(lse2) == fin).all() and (lse2[~fin] == lse[~fin]).all()
        assert np.abs(lse2[fin] - lse[fin]).max(initial=0.0) <= 1e-12, np.abs(lse2[fin] - lse[fin]).max()


def check_decode_naive(q, cache, block_table, seq_len, o, lse):
    q64, c64 = widen(q), widen(cache)
    check_naive((q64[b], slot_rows(c64, block_table[b], range(seq_len[b])), o[b], lse[b])
                for b in range(q.shape[0]))


def check_tree_naive(q, cache, block_table, seq_len, visibility, o, lse):
    q64, c64 = widen(q), widen(cache)
    check_naive((q64[b, i], slot_rows(c64, block_table[b], tree_slots(int(seq_len[b]), visibility[b, i])),
                 o[b, i], lse[b, i]) for b, i in np.ndindex(visibility.shape[:2]))


def check_tree_as_decode(q, cache, block_table, seq_len, visibility, o, lse):
    """Every tree row equals mla_decode over a contiguous copy of its logical sequence (prefix rows, then its
    visible tree rows in increasing row order), copied into a fresh paged cache with another page size."""
    bs, N, H, _ = q.shape
    rng = np.random.default_rng(0)
    for b, i in np.ndindex(bs, N):
        slots = tree_slots(int(seq_len[b]), visibility[b, i])
        if not slots:                            # a padding row over an empty prefix
            assert (o[b, i] == 0).all() and (lse[b, i] == -np.inf).all()
            continue
        rows = slot_rows(cache, block_table[b], slots)          # bf16 bits, [S, 576]
        ps = 5                                   # a page size unrelated to the tree's
        pages = -(-len(slots) // ps)
        cache2 = random_bf16(rng, (pages + 1, ps, D_QK))
        table2 = rng.permutation(pages + 1)[:pages]
        for s in range(len(slots)):
            cache2[table2[s // ps], s % ps] = rows[s]
        o2, lse2 = mla_decode_ref(q[b, i][None], cache2, table2[None], np.array([len(slots)]))
        assert np.abs(o2[0] - o[b, i]).max() <= 1e-12 and np.abs(lse2[0] - lse[b, i]).max() <= 1e-12


# ----------------------------------------------------------------------------------------------------------
# Tolerances from the observed error of a correct f32 implementation, and mutants the tolerances reject
# ----------------------------------------------------------------------------------------------------------

O_SCALE = 1.001                 # the 0.1% output scale of the `o_scale` mutant


def emulate_f32(q, kv, bf16_p=False):
    """What an f32 kernel computes: chunks of 256 visible rows, f32 products summed in sequence for the
    scores and for p . c_kv, f32 exp, chunks combined by their max in order. bf16_p rounds p to bf16 before
    the p . c_kv product, which the contract does not allow (the `p_bf16` mutant)."""
    q32, kv32 = q.astype(F32), kv.astype(F32)
    R = q.shape[0]
    if kv.shape[0] == 0:
        return np.zeros((R, D_LATENT), F32), np.full(R, -np.inf, F32)
    parts = []
    for c in range(0, kv.shape[0], CHUNK):
        k = kv32[c:c + CHUNK]
        s = seq_sum(q32[:, None, :] * k[None], axis=2) * SOFTMAX_SCALE
        m = s.max(axis=1)
        p = np.exp(s - m[:, None])
        pv = gf.round_to_bf16(p) if bf16_p else p
        parts.append((m, seq_sum(p, axis=1), seq_sum(pv[:, :, None] * k[None, :, :D_LATENT], axis=1)))
    big_m = np.max([m for m, _, _ in parts], axis=0)
    z = sum(l * np.exp(m - big_m) for m, l, _ in parts)
    acc = sum(a * np.exp(m - big_m)[:, None] for m, _, a in parts)
    return (acc / z[:, None]).astype(F32), (big_m + np.log(z)).astype(F32)


def position_errors(o, lse, o_ref, lse_ref):
    """Errors per position (query row and head): the relative L2 error of its 512 o values and the absolute
    error of its lse. A reference position with nothing visible (o 0, lse -inf) must be matched exactly
    (error 0, else inf). The same definition as the Rust tests' check."""
    o = np.asarray(o, np.float64).reshape(-1, D_LATENT)
    o_ref = np.asarray(o_ref, np.float64).reshape(-1, D_LATENT)
    lse, lse_ref = np.asarray(lse, np.float64).ravel(), np.asarray(lse_ref, np.float64).ravel()
    norm = np.linalg.norm(o_ref, axis=1)
    diff = np.linalg.norm(o - o_ref, axis=1)
    empty = norm == 0
    o_rel = np.where(empty, np.where(diff == 0, 0.0, np.inf), diff / np.where(empty, 1.0, norm))
    fin = np.isfinite(lse_ref)
    lse_abs = np.where(fin, np.abs(lse - np.where(fin, lse_ref, 0.0)), np.where(lse == lse_ref, 0.0, np.inf))
    return o_rel, np.nan_to_num(lse_abs, nan=np.inf)


TOL_REPORT = []


def tolerances(name, rows, o_ref, lse_ref):
    """The case's tolerances: TOL_MULTIPLE times the worst per-position error of the f32 emulation against the
    stored float32 reference (at least one f32 rounding of o, one ulp of the case's largest |lse|).
    rows: (q [R, 576], kv [S, 576]) float64 in the order of o_ref.reshape(-1, R, 512). Returns the meta keys."""
    emulated = [emulate_f32(q, kv) for q, kv in rows]
    o = np.stack([g[0] for g in emulated])
    lse = np.stack([g[1] for g in emulated])
    o_rel, lse_abs = position_errors(o, lse, o_ref, lse_ref)
    fin = np.isfinite(lse_ref)
    lse_ulp = float(np.spacing(np.abs(lse_ref[fin]).max().astype(F32))) if fin.any() else 0.0
    observed_o, observed_lse = float(o_rel.max()), float(lse_abs.max())
    keys = {"observed_o_rel": observed_o, "observed_lse_abs": observed_lse, "tol_multiple": TOL_MULTIPLE,
            "tol_o_rel": TOL_MULTIPLE * max(observed_o, F32_EPS),
            "tol_lse_abs": TOL_MULTIPLE * max(observed_lse, lse_ulp)}
    TOL_REPORT.append((name, keys))
    return keys


def rejected(keys, o, lse, o_ref, lse_ref):
    """True when the case's tolerances reject `o, lse` at some position."""
    o_rel, lse_abs = position_errors(o, lse, o_ref, lse_ref)
    return bool((o_rel > keys["tol_o_rel"]).any() or (lse_abs > keys["tol_lse_abs"]).any())


def mutant_arrays(name, mutants, keys, o_ref, lse_ref):
    """Checks that the tolerances reject every mutant (name -> (description, o, lse)); returns the arrays to
    store (`mutant_<name>_o`, `mutant_<name>_lse`) and the meta keys that list them."""
    arrays = {}
    for m, (_, o, lse) in mutants.items():
        assert rejected(keys, o, lse, o_ref, lse_ref), f"{name}: the tolerances accept the {m} mutant"
        arrays[f"mutant_{m}_o"], arrays[f"mutant_{m}_lse"] = o.astype(F32), lse.astype(F32)
    return arrays, mutant_meta({m: d for m, (d, _, _) in mutants.items()})


def swap_heads(o, lse):
    """Heads 0 and 1 of the first query row exchanged (o [.., H, 512] with H >= 2)."""
    o2, lse2 = o.copy().reshape(-1, o.shape[-2], D_LATENT), lse.copy().reshape(-1, lse.shape[-1])
    o2[0, [0, 1]], lse2[0, [0, 1]] = o2[0, [1, 0]], lse2[0, [1, 0]]
    return o2.reshape(o.shape), lse2.reshape(lse.shape)


def wrong_value_row(cache, block_table, slot, rng):
    """A copy of the cache where the value half (c_kv) of request 0's `slot` holds other bf16 values."""
    cache2 = cache.copy()
    ps = cache.shape[1]
    cache2[block_table[0, slot // ps], slot % ps, :D_LATENT] = random_bf16(rng, D_LATENT)
    return cache2


def common_mutants(rows, o_ref, lse_ref, wrong_row, dropped_last):
    """The mutants of every MLA case with mutants; wrong_row and dropped_last are reference outputs (o, lse)
    over the mutated inputs."""
    bf16_p = [emulate_f32(q, kv, bf16_p=True) for q, kv in rows]
    return {
        "p_bf16": ("p rounded to bf16 before the p . c_kv product (f32 everywhere else)",
                   np.stack([g[0] for g in bf16_p]).reshape(o_ref.shape),
                   np.stack([g[1] for g in bf16_p]).reshape(lse_ref.shape)),
        "o_scale": (f"o scaled by {O_SCALE} (a 0.1% normalization error), lse unchanged",
                    o_ref * O_SCALE, lse_ref),
        "head_swap": ("heads 0 and 1 of the first query row exchanged", *swap_heads(o_ref, lse_ref)),
        "value_row": ("request 0's last prefix slot (its first tree row when the prefix is empty) read with "
                      "other c_kv values (a wrong value row)", *wrong_row),
        "drop_last": ("every query row's last visible row left out (decode: seq_len - 1 rows; tree: a row that "
                      "does not see itself)", *dropped_last),
    }


# ----------------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------------

def random_bf16(rng, shape):
    """Standard normal values rounded to bf16, as bit patterns."""
    return f32_to_bf16_bits(rng.standard_normal(shape).astype(F32))


def paged_cache(rng, bs, page_size, rows_needed, spare_pages=0):
    """A random paged cache and a block table of shuffled distinct page ids (requests never share a page);
    pages_per_req covers rows_needed slots. Rows no request uses are random too."""
    ppr = -(-rows_needed // page_size)
    pages = bs * ppr + spare_pages
    cache = random_bf16(rng, (pages, page_size, D_QK))
    block_table = rng.permutation(pages)[:bs * ppr].reshape(bs, ppr).astype(np.int32)
    assert len(set(block_table.ravel().tolist())) == block_table.size
    return cache, block_table


def meta(bs, H, cache, block_table, seed, description, **extra):
    return {"bs": bs, "H": H, "page_size": cache.shape[1], "pages": cache.shape[0],
            "pages_per_req": block_table.shape[1], "softmax_scale": float(SOFTMAX_SCALE), "seed": seed,
            "description": description, **extra}


def decode_rows(q, cache, block_table, seq_len):
    """(q [H, 576], visible kv [S, 576]) float64 per request."""
    q64, c64 = widen(q), widen(cache)
    return [(q64[b], slot_rows(c64, block_table[b], range(seq_len[b]))) for b in range(q.shape[0])]


def decode_case(name, description, seed, H, seq_len, page_size, spare_pages=0, mutants=False):
    rng = np.random.default_rng(seed)
    bs = len(seq_len)
    seq = np.array(seq_len, np.int32)
    q = random_bf16(rng, (bs, H, D_QK))
    cache, block_table = paged_cache(rng, bs, page_size, int(seq.max()), spare_pages)
    o, lse = mla_decode_ref(q, cache, block_table, seq)
    check_decode_naive(q, cache, block_table, seq, o, lse)
    o, lse = o.astype(F32), lse.astype(F32)
    rows = decode_rows(q, cache, block_table, seq)
    keys = tolerances(name, rows, o, lse)
    arrays = {"q": q, "cache": cache, "block_table": block_table, "seq_len": seq, "o": o, "lse": lse}
    if mutants:
        wrong = mla_decode_ref(q, wrong_value_row(cache, block_table, int(seq[0]) - 1, rng), block_table, seq)
        dropped = [attend(q64, kv[:len(kv) - 1]) for q64, kv in rows]
        dropped = (np.stack([d[0] for d in dropped]), np.stack([d[1] for d in dropped]))
        more, mkeys = mutant_arrays(name, common_mutants(rows, o, lse, wrong, dropped), keys, o, lse)
        arrays.update(more)
        keys.update(mkeys)
    write_case("mla_decode", name, arrays, meta(bs, H, cache, block_table, seed, description, **keys))
    return q, cache, block_table, o, lse


def draft_tree(rng, L, K, budget, V=1000):
    """A real tree_build output for one request: random draft logits -> topk -> build_trees."""
    ids, logp, _ = gf.topk(gf.realistic_logits(rng, 1, L, V), K)
    arrays, _ = gf.build_trees(ids, logp, rng.integers(0, V, size=1).astype(np.int32),
                               np.zeros(1, np.int32), budget)
    return arrays["visibility"][0], int(arrays["num_nodes"][0])


def tree_rows(q, cache, block_table, seq, visibility):
    q64, c64 = widen(q), widen(cache)
    return [(q64[b, i], slot_rows(c64, block_table[b], tree_slots(int(seq[b]), visibility[b, i])))
            for b, i in np.ndindex(visibility.shape[:2])]


def without_diagonal(visibility):
    """Visibility with each row's own bit cleared (a row that does not see itself)."""
    vis = visibility.copy()
    for i in range(vis.shape[1]):
        vis[:, i, i // 32] &= ~np.uint32(1 << (i % 32))
    return vis


def tree_case(name, description, seed, H, budget, prefix, trees, page_size, spare_pages=0, mutants=False):
    """trees[b] = (L, K) of request b's draft (K 1 = a chain of L nodes, as with a k_max cap of 1)."""
    rng = np.random.default_rng(seed)
    bs, N = len(prefix), budget + 1
    built = [draft_tree(rng, L, K, budget) for L, K in trees]
    visibility = np.stack([v for v, _ in built])
    num_nodes = [n for _, n in built]
    W = visibility.shape[2]
    seq = np.array(prefix, np.int32)
    q = random_bf16(rng, (bs, N, H, D_QK))
    cache, block_table = paged_cache(rng, bs, page_size, int(seq.max()) + N, spare_pages)
    o, lse = tree_verify_ref(q, cache, block_table, seq, visibility)
    check_tree_naive(q, cache, block_table, seq, visibility, o, lse)
    check_tree_as_decode(q, cache, block_table, seq, visibility, o, lse)
    o, lse = o.astype(F32), lse.astype(F32)
    rows = tree_rows(q, cache, block_table, seq, visibility)
    keys = tolerances(name, rows, o, lse)
    arrays = {"q": q, "cache": cache, "block_table": block_table, "seq_len": seq, "visibility": visibility,
              "o": o, "lse": lse}
    if mutants:
        wrong_slot = max(int(seq[0]) - 1, 0)    # the last prefix slot, else the root's slot
        wrong = tree_verify_ref(q, wrong_value_row(cache, block_table, wrong_slot, rng), block_table, seq,
                                visibility)
        dropped = tree_verify_ref(q, cache, block_table, seq, without_diagonal(visibility))
        more, mkeys = mutant_arrays(name, common_mutants(rows, o, lse, wrong, dropped), keys, o, lse)
        arrays.update(more)
        keys.update(mkeys)
    write_case("tree_verify", name, arrays, meta(bs, H, cache, block_table, seed, description, N=N, W=W, **keys))
    return num_nodes, o, lse


def mla_cases():
    for k in KERNELS:
        shutil.rmtree(FIXTURES / k, ignore_errors=True)
    # The scale: mscale ~ 1.34657, softmax_scale ~ 0.130861 (README: "about 0.13087").
    assert abs(float(SOFTMAX_SCALE) - 0.1308608) < 1e-7

    # Hand-checkable: one visible row, so p = 1: o is that row's c_kv and lse its score.
    q, cache, block_table, o, lse = decode_case(
        "tiny_h8_seq1_ps1", "Hand-checkable: seq_len 1, so o = the row's c_kv (first 512 values) and lse = its "
        "score (q . k * softmax_scale) for every head.", 501, 8, [1], 1, spare_pages=2)
    row = widen(cache)[block_table[0, 0], 0]
    assert (o[0] == row[:D_LATENT].astype(F32)).all()
    assert (lse[0] == ((widen(q[0]) * row).sum(axis=1) * float(SOFTMAX_SCALE)).astype(F32)).all()

    decode_case("bs8_h8_ps1", "bs 8, seq_len 1..5 varying per request, page size 1 (every slot its own page, "
                "shuffled).", 502, 8, [3, 1, 5, 2, 4, 5, 1, 3], 1, mutants=True)
    decode_case("h64_seq64_ps64", "Kimi-K2 head count 64, seq_len 64 = exactly one page of the default size 64.",
                503, 64, [64], 64)
    decode_case("h128_seq17_ps16", "DeepSeek-V3 head count 128, seq_len 17: one row past a 16-slot page.",
                504, 128, [17], 16)
    decode_case("h16_seq275_ps16", "seq_len 275: two chunks of the 256-row walk (256 + 19), 18 pages of 16 (the "
                "last one 3 rows used).", 505, 16, [275], 16, mutants=True)
    decode_case("h8_seq1300_ps64", "Many chunks: seq_len 1300 = 5 full chunks of 256 and one of 20, 21 pages of "
                "64 (the last one 20 rows used).", 506, 8, [1300], 64, mutants=True)

    # Tree verify. Request 0: a chain of 7 nodes (K 1) over an empty prefix: its padding rows 8..16 see nothing
    # (o 0, lse -inf), its root row sees only itself. Request 1: a real branching tree (L 15, K 16) over a
    # 1-row prefix.
    num_nodes, o, lse = tree_case(
        "bs2_n17_h8_ps1", "Budget 16 (N 17), H 8, page size 1. Request 0: prefix 0 and a chain of 7 nodes "
        "(draft L 7 with K 1), so rows 8..16 are padding rows with no visible rows (o = 0, lse = -inf). "
        "Request 1: prefix 1 and a full branching tree (draft L 15, K 16).", 601, 8, 16, [0, 1],
        [(7, 1), (15, 16)], 1)
    assert num_nodes == [7, 16]
    assert (lse[0, 8:] == -np.inf).all() and (o[0, 8:] == 0).all() and np.isfinite(lse[1]).all()
    num_nodes, _, _ = tree_case(
        "bs1_n33_h8_ps16", "Budget 32 (N 33): two visibility words (rows 32 and up in word 1). H 8, page size "
        "16, prefix 40 (the tree starts mid-page and spans three pages).", 602, 8, 32, [40], [(15, 16)], 16)
    assert num_nodes == [32]
    num_nodes, _, _ = tree_case(
        "bs1_n65_h8_ps64", "Budget 64 (N 65): three visibility words. H 8, page size 64, prefix 100 (the tree "
        "crosses the page boundary at slot 128).", 603, 8, 64, [100], [(15, 64)], 64)
    assert num_nodes == [64]
    num_nodes, _, _ = tree_case(
        "bs1_n5_h64_ps16", "Kimi-K2's 64 heads: budget 4 (N 5), page size 16, prefix 16 (the tree starts on a "
        "page boundary).", 604, 64, 4, [16], [(3, 4)], 16)
    assert num_nodes == [4]
    num_nodes, _, _ = tree_case(
        "budget1_bs3_h16_ps16", "Budget 1 (N 2: the root and one child). H 16, page size 16, prefixes 0, 15 "
        "and 16.", 605, 16, 1, [0, 15, 16], [(4, 1), (1, 1), (7, 16)], 16)
    assert num_nodes == [1, 1, 1]
    num_nodes, _, _ = tree_case(
        "l1_bs1_n9_h8_ps16", "L 1 (draft depth 1): the root and 8 siblings, each seeing the prefix, the root and "
        "itself. H 8, page size 16, prefix 20. Carries the mutants.", 606, 8, 8, [20], [(1, 8)], 16,
        mutants=True)
    assert num_nodes == [8]

    worst_o = max(k["observed_o_rel"] for _, k in TOL_REPORT)
    worst_lse = max(k["observed_lse_abs"] for _, k in TOL_REPORT)
    print(f"mla: tolerances {TOL_MULTIPLE}x the f32 emulation's worst per-position error (worst observed o_rel "
          f"{worst_o:.2e}, lse_abs {worst_lse:.2e}); every mutant rejected")
