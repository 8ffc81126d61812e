#!/usr/bin/env python3
"""Independent numpy reference for the DDTree kernels and the fixture generator.

Written from ../shared/DESIGN.md sections 4.1, 4.2, 5 and the numeric contract in reference/README.md, never
from the Rust or CUDA code, so that the three implementations triangulate each other.

    python3 reference/gen_fixtures.py      (from the repository root; numpy pinned in requirements.txt)

deletes and rewrites fixtures/{expd,topk,tree_build,greedy_accept,kv_compact}/<case>/ (one .npy per array plus a
meta.json), then fixtures/{mla_decode,tree_verify}/<case>/ through mla_fixtures.py (DESIGN.md section 4.3) and
fixtures/{moe_routing,moe_int4}/<case>/ through moe_fixtures.py (DESIGN.md section 4.4), and fixtures/rowops/<case>/
through rowops_fixtures.py (the bit-exact row operations of src/cpu/rowops.rs's contract).
Every case draws from its own np.random.default_rng(seed), so the same command gives the same bytes.
Self-checks (assertions) run on every invocation.
"""

import heapq
import itertools
import json
import math
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
KERNELS = ("expd", "topk", "tree_build", "greedy_accept", "kv_compact")

F32 = np.float32
NEG_INF = F32(-np.inf)


# ----------------------------------------------------------------------------------------------------------
# bf16 helpers: bf16 arrays travel as their uint16 bit pattern.
# ----------------------------------------------------------------------------------------------------------

def f32_to_bf16_bits(x):
    """Round f32 to bf16 with round-to-nearest-even on the bit pattern (inputs here are never NaN)."""
    x = np.asarray(x, dtype=F32)
    assert not np.isnan(x).any()
    bits = x.view(np.uint32).astype(np.uint64)  # 64-bit so the rounding increment cannot wrap
    lsb = (bits >> np.uint64(16)) & np.uint64(1)
    rounded = (bits + np.uint64(0x7FFF) + lsb) >> np.uint64(16)
    return rounded.astype(np.uint16)


def bf16_bits_to_f32(bits):
    """Exact widening: the bf16 bits are the top half of the f32 bits."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(F32)


# Float-kernel tolerances (mla_fixtures, moe_fixtures, gemm_fixtures): a case's tolerance is TOL_MULTIPLE times
# the worst error of f32 emulations of a correct kernel, never below one f32 rounding (F32_EPS).
TOL_MULTIPLE = 8
F32_EPS = 2.0 ** -24


def seq_sum(x, axis):
    """A sequential f32 sum (one addition after another, as a kernel's accumulator does), not numpy's
    pairwise one, which is more accurate than any kernel's order."""
    return np.cumsum(x, axis=axis, dtype=F32).take(-1, axis=axis)


def row_errors(got, ref):
    """Relative L2 error of each row of [rows, width] arrays (the Rust tests' per-row check)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)


def mutant_meta(descriptions):
    """The meta.json keys listing a case's mutants: names in order, and name -> description."""
    return {"mutants": list(descriptions), "mutant_descriptions": dict(descriptions)}


def round_to_bf16(x):
    """f32 -> nearest bf16 value, returned widened as f32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def f32_from_bits(u):
    return np.array([u], dtype=np.uint32).view(F32)[0]


def f32_bits(x):
    return int(np.array([x], dtype=F32).view(np.uint32)[0])


# ----------------------------------------------------------------------------------------------------------
# expd: the contract's deterministic exp, one correctly rounded f32 operation or FMA at a time.
# ----------------------------------------------------------------------------------------------------------

# The contract gives the constants as bits; the self-checks bound expd's error against float64 exp.
LOG2E = f32_from_bits(0x3FB8AA3B)
LN2 = f32_from_bits(0x3F317218)
POLY = [f32_from_bits(b) for b in (0x3F800000, 0x3F7FFFFB, 0x3EFFFEE3,   # C0 .. C2
                                   0x3E2AAD35, 0x3D2B9D2A, 0x3C07D41A)]  # C3 .. C5
EXPD_CUTOFF = F32(-31.0)


def fma32(a, b, c):
    """Elementwise f32 fma(a, b, c), rounded once. a * b is exact in float64 (48 bits); the float64 sum s
    can round, and rounding s to f32 then differs from rounding the exact sum only when s lands exactly
    on the midpoint of two f32 values while the exact sum does not (its TwoSum error is nonzero): then
    the error's sign picks the neighbour."""
    a, b, c = (np.asarray(v, dtype=F32) for v in (a, b, c))
    prod = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = prod + c64
    bb = s - prod
    err = (prod - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    rd = r.astype(np.float64)
    nb = np.nextafter(r, np.where(s > rd, F32(np.inf), F32(-np.inf)).astype(F32))
    mid = (s != rd) & (s == (rd + nb.astype(np.float64)) * 0.5)
    up, down = np.maximum(r, nb), np.minimum(r, nb)
    r = np.where(mid & (err > 0), up, r)
    return np.where(mid & (err < 0), down, r).astype(F32)


def expd(d):
    """expd(d) for f32 d <= 0 (or -inf), elementwise; returns f32 of the same shape."""
    d = np.atleast_1d(np.asarray(d, dtype=F32))
    assert not np.isnan(d).any() and not (d > 0).any(), "expd is only defined for d <= 0"
    out = np.zeros(d.shape, dtype=F32)
    live = ~(d < EXPD_CUTOFF)                     # d < -31 (and -inf) gives exactly 0
    x = d[live]
    k = np.rint(x.astype(np.float64) * np.float64(LOG2E)).astype(F32)  # rint of the exact product
    r = fma32(-k, LN2, x)
    p = np.full(x.shape, POLY[-1], dtype=F32)
    for c in reversed(POLY[:-1]):                 # C4 ... C0: p = fma(p, r, c)
        p = fma32(p, r, c)
    ki = k.astype(np.int32)
    assert ((ki >= -45) & (ki <= 0)).all()
    two_k = ((ki + 127).astype(np.uint32) << np.uint32(23)).view(F32)  # 2^k built from its bits
    out[live] = p * two_k                         # exact: a power of two times a normal f32, no underflow
    assert out.dtype == F32
    return out


# ----------------------------------------------------------------------------------------------------------
# Top-K with the chunked fixed-point logsumexp.
# ----------------------------------------------------------------------------------------------------------

CHUNK = 8192
FIX_ONE = 2.0 ** 44


def lse_row(x):
    """The contract's logsumexp of one f32 row (already validated)."""
    chunks = [x[s:s + CHUNK] for s in range(0, len(x), CHUNK)]
    maxes = [F32(c.max()) for c in chunks]
    sums = []
    for c, m_c in zip(chunks, maxes):
        if m_c == NEG_INF:
            # A chunk of only -inf: every value is -inf and "-inf gives 0"; x - m_c would be NaN, so skip it.
            sums.append(np.uint64(0))
            continue
        # q_i = floor(expd(x_i - m_c) * 2^44): f32 -> f64 and the scaling are exact, astype truncates (= floor).
        q = (expd(c - m_c).astype(np.float64) * FIX_ONE).astype(np.uint64)
        sums.append(q.sum(dtype=np.uint64))      # integer sum: exact (at most 8192 * 2^44 < 2^58)
    big_m = max(maxes)
    total = 0.0
    for s_c, m_c in zip(sums, maxes):             # float64, in chunk order, one multiply per term
        total += float(s_c) * float(expd(F32(m_c - big_m))[0])
    return F32(float(big_m) + math.log(total * 2.0 ** -44))


def validate_row(x):
    assert x.dtype == F32
    assert len(x) < 2 ** 19, "V must be below 2^19"
    assert (np.isfinite(x) | (x == NEG_INF)).all(), "NaN or +inf in a row"
    assert np.isfinite(x).any(), "a row of only -inf"


def topk_row(x, k):
    """(ids, logp, lse) of one row: value descending, ties by smaller index."""
    validate_row(x)
    x = x + F32(0.0)                              # the contract reads -0.0 as +0.0
    order = np.lexsort((np.arange(len(x)), -x))   # primary key -x ascending, then the index
    ids = order[:k].astype(np.int32)
    lse = lse_row(x)
    logp = (x[ids] - lse).astype(F32)             # one f32 subtraction
    return ids, logp, lse


def topk(logits, k):
    """logits [bs, L, V] f32 (bf16 already widened) -> top_ids, top_logp [bs, L, K], lse [bs, L]."""
    bs, L, V = logits.shape
    assert 1 <= k <= V
    ids = np.zeros((bs, L, k), np.int32)
    logp = np.zeros((bs, L, k), F32)
    lse = np.zeros((bs, L), F32)
    for b, l in itertools.product(range(bs), range(L)):
        ids[b, l], logp[b, l], lse[b, l] = topk_row(logits[b, l], k)
    return ids, logp, lse


# ----------------------------------------------------------------------------------------------------------
# Best-first tree build (DESIGN.md 4.1).
# ----------------------------------------------------------------------------------------------------------

def build_tree(top_ids, top_logp, root_token, seq_len, budget):
    """One request. top_ids/top_logp [L, K]. Returns the output arrays (length N) plus per-row logw and rank."""
    L, K = top_ids.shape
    N = budget + 1
    W = (N + 31) // 32
    token, depth, parent, rank, logw = [int(root_token)], [0], [-1], [-1], [F32(0.0)]
    heap = []
    seq = itertools.count()

    def push(lw, par, d, r):
        # heap key (-logw, seq): largest logw first, ties to the earlier push; seq is unique, so the
        # comparison never reaches the payload.
        heapq.heappush(heap, (-float(lw), next(seq), lw, par, d, r))

    push(F32(0.0) + top_logp[0, 0], 0, 1, 0)
    while len(token) - 1 < budget and heap:
        _, _, lw, par, d, r = heapq.heappop(heap)
        row = len(token)
        token.append(int(top_ids[d - 1, r]))
        depth.append(d)
        parent.append(par)
        rank.append(r)
        logw.append(lw)
        if r + 1 < K:   # sibling first, then child: that is the push order the sequence numbers record
            push(logw[par] + top_logp[d - 1, r + 1], par, d, r + 1)
        if d < L:
            push(lw + top_logp[d, 0], row, d + 1, 0)
    n = len(token) - 1

    out = {name: np.full(N, -1, np.int32) for name in
           ("node_token", "node_depth", "parent", "first_child", "next_sibling", "position")}
    out["node_token"][:n + 1] = token
    out["node_depth"][:n + 1] = depth
    out["parent"][:n + 1] = parent
    out["position"][:n + 1] = int(seq_len) + np.asarray(depth)
    last_child = {}
    for i in range(1, n + 1):                     # children are linked in row order
        p = parent[i]
        if p in last_child:
            out["next_sibling"][last_child[p]] = i
        else:
            out["first_child"][p] = i
        last_child[p] = i
    vis = np.zeros((N, W), np.uint32)
    for i in range(n + 1):
        j = i
        while j != -1:                            # row i and all its ancestors
            vis[i, j // 32] |= np.uint32(1 << (j % 32))
            j = parent[j]
    out["visibility"] = vis
    out["num_nodes"] = n
    out["logw"] = logw
    out["rank"] = rank
    return out


def build_trees(top_ids, top_logp, root_token, seq_len, budget):
    """Batched build; returns the fixture arrays and the per-request trees (for checks and greedy cases)."""
    bs = top_ids.shape[0]
    trees = [build_tree(top_ids[b], top_logp[b], root_token[b], seq_len[b], budget) for b in range(bs)]
    arrays = {"num_nodes": np.array([t["num_nodes"] for t in trees], np.int32)}
    for name in ("node_token", "node_depth", "parent", "first_child", "next_sibling", "position",
                 "visibility"):
        arrays[name] = np.stack([t[name] for t in trees])
    for b, t in enumerate(trees):
        check_tree(t, top_ids[b], top_logp[b], budget)
    return arrays, trees


def path_score(top_logp, ranks):
    """f32 score of a rank path, summed the way the tree sums it: ((0 + lp[0][r1]) + lp[1][r2]) + ..."""
    s = F32(0.0)
    for d, r in enumerate(ranks):
        s = s + top_logp[d, r]
    return s


def rank_path(tree, i):
    path = []
    while i > 0:
        path.append(tree["rank"][i])
        i = tree["parent"][i]
    return tuple(reversed(path))


def check_tree(t, top_ids, top_logp, budget):
    """Structural invariants, plus a brute-force comparison on trees small enough to enumerate."""
    L, K = top_ids.shape
    n = t["num_nodes"]
    N = budget + 1
    assert 0 <= n <= budget
    seen = set()
    for i in range(1, n + 1):
        p, d, r = t["parent"][i], t["node_depth"][i], t["rank"][i]
        assert 0 <= p < i, "parent < child"
        assert d == t["node_depth"][p] + 1 <= L
        assert t["node_token"][i] == top_ids[d - 1, r]
        assert (p, r) not in seen
        seen.add((p, r))
        assert r == 0 or (p, r - 1) in seen, "rank-closed: the previous sibling is in the tree"
        assert t["logw"][i] == t["logw"][p] + top_logp[d - 1, r]
    # Prefix-closed: every parent is a valid row, checked above (0 <= p < i <= n).
    assert (t["node_token"][n + 1:] == -1).all() and (t["visibility"][n + 1:] == 0).all()
    for name in ("node_depth", "parent", "first_child", "next_sibling", "position"):
        assert (t[name][n + 1:] == -1).all()
    # first_child / next_sibling describe the same parent relation, in row order.
    for p in range(n + 1):
        kids, c = [], t["first_child"][p]
        while c != -1:
            kids.append(c)
            c = t["next_sibling"][c]
        assert kids == [i for i in range(1, n + 1) if t["parent"][i] == p]
    for i in range(n + 1):
        anc, j = set(), i
        while j != -1:
            anc.add(j)
            j = t["parent"][j]
        bits = {j for j in range(N) if (int(t["visibility"][i, j // 32]) >> (j % 32)) & 1}
        assert bits == anc
    # Comparisons, not np.diff: -inf - -inf would be NaN.
    sorted_rows = (top_logp[:, 1:] <= top_logp[:, :-1]).all() and (top_logp <= 0).all()
    if sorted_rows:
        # Scores never increase along a path or along siblings, so best-first pops them in order.
        lw = np.array(t["logw"][1:], dtype=F32)
        assert (lw[1:] <= lw[:-1]).all(), "logw non-increasing in row order"
        brute_force_check(t, top_logp, budget)


BRUTE_FORCE_CHECKED = [0]


def brute_force_check(t, top_logp, budget, limit=200_000):
    """The tree must be a set of B highest-scoring prefixes (all of them when fewer exist)."""
    L, K = top_logp.shape
    if sum(K ** d for d in range(1, L + 1)) > limit:
        return
    BRUTE_FORCE_CHECKED[0] += 1
    scored = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=d):
            scored.append((float(path_score(top_logp, ranks)), ranks))
    scored.sort(key=lambda s: -s[0])
    n = t["num_nodes"]
    tree_paths = {rank_path(t, i) for i in range(1, n + 1)}
    if len(scored) <= budget:
        assert n == len(scored) and tree_paths == {r for _, r in scored}
        return
    assert n == budget
    # The sorted scores always match (any top-B set has the same score multiset) ...
    tree_scores = sorted((float(path_score(top_logp, p)) for p in tree_paths), reverse=True)
    assert tree_scores == [s for s, _ in scored[:budget]]
    # ... and the sets match exactly when there is no tie at the cut.
    if scored[budget - 1][0] > scored[budget][0]:
        assert tree_paths == {r for _, r in scored[:budget]}


# ----------------------------------------------------------------------------------------------------------
# Greedy accept and KV compaction (DESIGN.md 4.2).
# ----------------------------------------------------------------------------------------------------------

def children(first_child, next_sibling, row):
    kids, c = [], first_child[row]
    while c != -1:
        kids.append(int(c))
        c = next_sibling[c]
    return kids


def greedy_accept(node_token, first_child, next_sibling, num_nodes, logits, L):
    """logits [bs, N, V] f32 (bf16 widened). Returns target_argmax, accept_len, accept_rows, emitted."""
    bs, N, _ = logits.shape
    argmax = np.full((bs, N), -1, np.int32)
    accept_len = np.zeros(bs, np.int32)
    accept_rows = np.full((bs, L + 1), -1, np.int32)
    emitted = np.full((bs, L + 1), -1, np.int32)
    for b in range(bs):
        n = int(num_nodes[b])
        assert not np.isnan(logits[b, :n + 1]).any()
        argmax[b, :n + 1] = np.argmax(logits[b, :n + 1], axis=1)   # first maximum = smaller token id
        path, cur = [0], 0
        while True:
            nxt = [c for c in children(first_child[b], next_sibling[b], cur)
                   if node_token[b, c] == argmax[b, cur]]
            if not nxt:
                break
            cur = nxt[0]                              # the first matching child in sibling order
            path.append(cur)
        a = len(path) - 1
        assert a <= L
        accept_len[b] = a
        accept_rows[b, :a + 1] = path
        emitted[b, :a] = node_token[b, path[1:]]
        emitted[b, a] = argmax[b, cur]
    return argmax, accept_len, accept_rows, emitted


def kv_compact(cache, block_table, seq_len, accept_len, accept_rows):
    """cache [layers, pages, page_size, D]; copy slot seq+rows[j] -> slot seq+j, all reads before writes."""
    page_size = cache.shape[2]
    out = cache.copy()

    def where(b, s):
        return int(block_table[b, s // page_size]), s % page_size

    for b in range(block_table.shape[0]):
        a, s0 = int(accept_len[b]), int(seq_len[b])
        srcs = [where(b, s0 + int(accept_rows[b, j])) for j in range(1, a + 1)]
        dsts = [where(b, s0 + j) for j in range(1, a + 1)]
        vals = [out[:, p, o, :].copy() for p, o in srcs]      # read every source first ...
        for (p, o), v in zip(dsts, vals):                   # ... then write
            out[:, p, o, :] = v
    return out


# ----------------------------------------------------------------------------------------------------------
# Fixture writing.
# ----------------------------------------------------------------------------------------------------------

ALLOWED_DTYPES = {"<i4", "<u4", "<f4", "<u2"}


def write_case(kernel, name, arrays, meta):
    d = FIXTURES / kernel / name
    d.mkdir(parents=True)
    for key, a in arrays.items():
        a = np.ascontiguousarray(a)
        assert a.dtype.str in ALLOWED_DTYPES, (kernel, name, key, a.dtype.str)
        np.save(d / f"{key}.npy", a)
    with open(d / "meta.json", "w") as f:
        json.dump(meta, f, sort_keys=True, indent=1)
        f.write("\n")
    params = " ".join(f"{k}={meta[k]}" for k in sorted(meta) if k not in ("description", "seed", "mutant_descriptions"))
    print(f"{kernel}/{name}: {params}")


def realistic_logits(rng, bs, L, V, scale=(1.0, 8.0)):
    """randn times a per-position scale in [1, 8]: peaked, varied top distributions."""
    scale = rng.uniform(scale[0], scale[1], size=(bs, L, 1))
    return (rng.standard_normal((bs, L, V)) * scale).astype(F32)


def as_dtype(logits, dtype):
    """(stored array, exactly widened f32 values) for a logits array in the given storage dtype."""
    if dtype == "f32":
        return logits.astype(F32), logits.astype(F32)
    bits = f32_to_bf16_bits(logits)
    return bits, bf16_bits_to_f32(bits)


# ----------------------------------------------------------------------------------------------------------
# topk cases
# ----------------------------------------------------------------------------------------------------------

def expd_cases():
    """expd itself, bit for bit: the lse of a row hides most of its last bits."""
    rng = np.random.default_rng(500)
    half_ties = ((np.arange(-46, 1) + 0.5) / np.float64(LOG2E)).astype(F32)  # d * LOG2E near k + 1/2
    near_ties = np.concatenate([np.nextafter(half_ties, F32(-np.inf)), np.nextafter(half_ties, F32(0))])
    edges = np.array([0.0, -0.0, -1e-30, -1e-45, -0.34657359, -0.3465736, -30.999998, -31.0, -31.000002,
                      -32.0, -np.inf], dtype=F32)
    d = np.concatenate([edges, half_ties, near_ties, -rng.uniform(0, 32, 20000).astype(F32),
                        -rng.uniform(0, 1e-3, 2000).astype(F32)])
    d = d[d <= 0]
    write_case("expd", "probe", {"d": d, "expd": expd(d)},
               {"description": "expd at edges, near rint ties of d * LOG2E, and uniform in [-32, 0].",
                "seed": 500, "n": int(d.size)})


def topk_case(name, description, seed, logits, budget, dtype="f32"):
    bs, L, V = logits.shape
    K = min(budget, V)
    stored, values = as_dtype(logits, dtype)
    ids, logp, lse = topk(values, K)
    # Sanity of the contract's lse against a plain float64 logsumexp (not a bit-exact check).
    v64 = values.astype(np.float64)
    m = v64.max(axis=2, keepdims=True)
    ref = (m + np.log(np.exp(v64 - m).sum(axis=2, keepdims=True)))[..., 0]
    assert np.allclose(lse, ref, rtol=1e-6, atol=1e-5), np.abs(lse - ref).max()
    write_case("topk", name, {"logits": stored, "top_ids": ids, "top_logp": logp, "lse": lse},
               {"bs": bs, "L": L, "V": V, "K": K, "dtype": dtype, "seed": seed, "description": description})


def topk_cases():
    f = lambda rows: np.array(rows, dtype=F32)
    inf = -np.inf

    topk_case("tiny_v5_k3", "Hand-checkable: one row [1,3,2,0,3], K 3 -> ids [1,4,2] (tie 3/3 to index 1).",
              0, f([[[1, 3, 2, 0, 3]]]), 3)
    topk_case("tiny_bs2_l2_v8_k4", "Hand-checkable small integers, bs 2 L 2 V 8 K 4, one tie per row.", 0,
              f([[[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 7]],
                 [[-1, -2, 5, -3, 5, -4, 0, 1], [0.5, 0.25, 0.5, -1, 2, 0.25, 2, 0]]]), 4)
    topk_case("ties_v10_k6", "Exact ties: equal values are ordered by the smaller index.", 0,
              f([[[2, 5, 5, 1, 5, 2, 0, -1, 2, 5], [1, 1, 0, 1, 0, 1, 0, 1, 0, 1]]]), 6)
    topk_case("signed_zero_ties_v10_k6", "-0.0 and +0.0 are equal values, so they tie by index: ids [2,6,0,1,3,4] "
              "(a sort on raw bit patterns would put +0.0 first).", 0,
              f([[[0.0, -0.0, 1, -0.0, 0.0, -1, 1, 0.0, -0.0, -2]]]), 6)
    topk_case("all_equal_v10_k4", "All-equal rows: ids 0..3, lse = x + log(10).", 0,
              f([[[1.5] * 10, [-3.0] * 10, [0.0] * 10]]), 4)
    topk_case("neginf_v8_k8", "Rows with -inf entries (K = V = 8, so -inf ones are selected, logp -inf, "
              "ties by index); one row has a single finite value (lse = that value).", 0,
              f([[[1, inf, 2, inf, 0, -1, inf, 2], [inf, inf, inf, 4, inf, inf, inf, inf]],
                 [[inf, 0, 0, inf, -3, -3, 7, 7], [-0.5, -0.25, inf, -8, -40, -31, 3, inf]]]), 16)

    rng = np.random.default_rng(101)
    topk_case("k1_bs3_l4_v10", "K 1 (budget 1): argmax and its log-probability.", 101,
              realistic_logits(rng, 3, 4, 10), 1)
    rng = np.random.default_rng(102)
    topk_case("l1_bs4_v64_k8", "L 1.", 102, realistic_logits(rng, 4, 1, 64), 8)
    rng = np.random.default_rng(103)
    topk_case("bs1_l7_v100_k16", "bs 1.", 103, realistic_logits(rng, 1, 7, 100), 16)
    rng = np.random.default_rng(104)
    topk_case("v6_lt_budget16", "V smaller than the budget: K = V = 6, a full sort of each row.", 104,
              realistic_logits(rng, 2, 3, 6), 16)
    rng = np.random.default_rng(105)
    topk_case("bf16_bs2_l3_v300_k16", "bf16 logits (coarse values, so ties are common).", 105,
              realistic_logits(rng, 2, 3, 300), 16, "bf16")

    # Several lse chunks: V not a multiple of 8192, chunks whose max is far below the row max.
    rng = np.random.default_rng(106)
    x = realistic_logits(rng, 2, 3, 20000)
    x[0, 1, 8192:16384] -= F32(40.0)    # chunk 1 max ~40 below: expd(m_c - M) is exactly 0 (< -31)
    x[0, 2, 16384:] -= F32(20.0)        # last (short) chunk 20 below: contributes ~2e-9 relative
    x[1, 0, 19999] = x[1, 0].max() + F32(3.0)   # row max in the last element of the short chunk
    x[1, 1, :8192] -= F32(12.0)         # first chunk below, max in a middle chunk
    x[1, 2, 8192:16384] = x[1, 2, 8191]  # a whole chunk of one repeated value
    topk_case("chunks_bs2_l3_v20000_k32", "V 20000 = 3 chunks (last 3616 long); rows with a chunk 40 or 20 "
              "below the row max, the max in the short chunk, a constant chunk.", 106, x, 32)
    rng = np.random.default_rng(107)
    x = realistic_logits(rng, 1, 2, 20000)
    x[0, 0, 16384:] = NEG_INF
    x[0, 1, 8192:16384] = NEG_INF
    topk_case("chunks_neginf_v20000_k8", "A chunk made only of -inf (masked vocab tail, masked middle chunk): "
              "it contributes 0 to lse.", 107, x, 8)
    rng = np.random.default_rng(108)
    topk_case("chunks_v16384_k8", "V exactly two chunks.", 108, realistic_logits(rng, 1, 2, 16384), 8)
    rng = np.random.default_rng(109)
    x = realistic_logits(rng, 1, 3, 8193)
    x[0, 2, 8192] = x[0, 2].max() + F32(1.0)
    topk_case("chunks_v8193_k8", "V 8193: the last chunk has one element (the row max in row 2).", 109, x, 8)

    # Realistic shapes.
    for seed, bs, L, V, budget in ((110, 64, 7, 512, 64), (111, 8, 15, 1000, 256), (112, 2, 15, 4096, 16)):
        rng = np.random.default_rng(seed)
        topk_case(f"real_bs{bs}_l{L}_v{V}_b{budget}", "Realistic draft logits (randn x scale 1..8).", seed,
                  realistic_logits(rng, bs, L, V), budget)

    # The Kimi-K2 vocabulary.
    rng = np.random.default_rng(113)
    topk_case("kimi_bf16_bs1_l7_v163840_b64", "Kimi-K2 vocabulary (20 chunks), bf16 logits, block 8.", 113,
              realistic_logits(rng, 1, 7, 163840), 64, "bf16")
    rng = np.random.default_rng(114)
    topk_case("kimi_f32_bs1_l2_v163840_b256", "Kimi-K2 vocabulary (20 chunks), f32 logits.", 114,
              realistic_logits(rng, 1, 2, 163840), 256)


# ----------------------------------------------------------------------------------------------------------
# tree_build cases
# ----------------------------------------------------------------------------------------------------------

def random_tree_inputs(rng, bs, L, V, budget, k=None, scale=(1.0, 8.0)):
    """Real top-K outputs from random draft logits, plus root tokens and seq lengths."""
    K = min(budget, V) if k is None else k
    ids, logp, _ = topk(realistic_logits(rng, bs, L, V, scale), K)
    root = rng.integers(0, V, size=bs).astype(np.int32)
    seq = rng.integers(0, 5001, size=bs).astype(np.int32)
    return ids, logp, root, seq


def tree_case(name, description, seed, top_ids, top_logp, root, seq, budget):
    arrays, trees = build_trees(top_ids, top_logp, root, seq, budget)
    bs, L, K = top_ids.shape
    N = budget + 1
    write_case("tree_build", name,
               {"top_ids": top_ids, "top_logp": top_logp, "root_token": root, "seq_len": seq, **arrays},
               {"bs": bs, "L": L, "K": K, "budget": budget, "N": N, "W": (N + 31) // 32, "seed": seed,
                "description": description})
    return arrays, trees


def tree_cases():
    i32 = lambda a: np.array(a, np.int32)
    f32 = lambda a: np.array(a, F32)

    # Worked by hand: pops -0.25 (row1 tok 10), -0.75 (row2 tok 30 under 1), -1.5 (row3 tok 20),
    # -2.0 (row4 tok 30 under 3); the candidate -2.25 (tok 40 under 1) is left out.
    arrays, _ = tree_case("tiny_hand_l2_k2_b4", "Hand-checkable: rows tok 10 (-0.25), 30<-1 (-0.75), 20 (-1.5), "
                          "30<-3 (-2.0).", 0, i32([[[10, 20], [30, 40]]]), f32([[[-0.25, -1.5], [-0.5, -2.0]]]),
                          i32([7]), i32([100]), 4)
    assert arrays["node_token"].tolist() == [[7, 10, 30, 20, 30]]
    assert arrays["parent"].tolist() == [[-1, 0, 1, 0, 3]]

    # Exact ties: all sums are exact in f32, so many candidates tie and the push order decides.
    ids = i32([[[11, 12, 13], [21, 22, 23], [31, 32, 33]],
               [[11, 12, 13], [21, 22, 23], [31, 32, 33]]])
    logp = f32([[[-1.0, -1.0, -2.0], [-0.5, -0.5, -1.0], [-0.5, -1.0, -1.0]],
                [[-0.5, -0.5, -0.5], [-0.5, -0.5, -0.5], [-0.5, -0.5, -0.5]]])
    tree_case("ties_l3_k3_b10", "Exact score ties (sums of -0.5/-1/-2): the earlier push wins.", 0,
              ids, logp, i32([1, 2]), i32([0, 1]), 10)
    logp2 = f32([[[-1.0, -2.0], [-1.0, -1.0]]])
    arrays, _ = tree_case("ties_hand_l2_k2_b3", "Hand-checkable tie: after row1 (-1) the sibling (-2, pushed first) "
                          "beats the child (-2, pushed second).", 0, i32([[[5, 6], [7, 8]]]), logp2,
                          i32([0]), i32([0]), 3)
    assert arrays["node_token"].tolist() == [[0, 5, 6, 7]] and arrays["parent"].tolist() == [[-1, 0, 0, 1]]

    cases = [
        # name, description, seed, bs, L, V, budget, k override
        ("budget1_bs3_l4", "Budget 1: one draft node, the top-1 token at depth 1.", 201, 3, 4, 50, 1, None),
        ("l1_bs2_b8", "L 1: a star of the top-8 tokens.", 202, 2, 1, 100, 8, None),
        ("k1_bs2_l4_b8", "K 1 (as with a k_max cap of 1): a chain of L nodes, fewer than B.", 203, 2, 4, 100, 8, 1),
        ("v3_lt_budget_l2_b16", "V 3 < B: K = 3, the tree holds all 3 + 9 prefixes (12 < 16), padding after.",
         204, 2, 2, 3, 16, None),
        ("small_bs4_l3_b12", "Small real case, checked against brute force over all prefixes.", 205, 4, 3, 40, 12,
         None),
        ("small_bs2_l5_k4_b20", "K 4 cap, L 5, checked against brute force.", 206, 2, 5, 30, 20, 4),
        ("real_bs1_l15_b16", "Realistic: bs 1, block 16.", 207, 1, 15, 1000, 16, None),
        ("real_bs64_l7_b64", "Realistic: bs 64, block 8, budget 64.", 208, 64, 7, 512, 64, None),
        ("real_bs32_l15_b16", "Realistic: bs 32, block 16, budget 16.", 209, 32, 15, 2048, 16, None),
        ("real_bs8_l15_b256", "Realistic: bs 8, block 16, budget 256 (W 9).", 210, 8, 15, 1000, 256, None),
    ]
    for name, desc, seed, bs, L, V, budget, k in cases:
        rng = np.random.default_rng(seed)
        tree_case(name, desc, seed, *random_tree_inputs(rng, bs, L, V, budget, k), budget)

    # -inf log-probabilities (from -inf logits): those candidates tie at -inf and come last, by push order.
    rng = np.random.default_rng(211)
    x = realistic_logits(rng, 2, 2, 6)
    x[0, :, [1, 4]] = NEG_INF
    x[1, 0, [0, 2, 3, 5]] = NEG_INF
    ids, logp, _ = topk(x, 6)
    tree_case("neginf_logp_l2_k6_b30", "top_logp with -inf entries (masked logits): -inf scores come last, "
              "ties by push order.", 211, ids, logp, rng.integers(0, 6, 2).astype(np.int32),
              rng.integers(0, 5001, 2).astype(np.int32), 30)


# ----------------------------------------------------------------------------------------------------------
# greedy_accept cases
# ----------------------------------------------------------------------------------------------------------

MARGIN = 4.0


def forced_value(row):
    """A value strictly above every entry of the row, an integer, so it is exact in f32 and bf16."""
    v = F32(math.ceil(float(row.max())) + MARGIN)
    assert round_to_bf16(v) == v
    return v


def ancestors_path(tree, row):
    path = []
    while row != -1:
        path.append(row)
        row = tree["parent"][row]
    return path[::-1]                                   # [0, ..., row]


def child_tokens(tree, row):
    return {tree["node_token"][c] for c in children(tree["first_child"], tree["next_sibling"], row)}


def force_path(rng, logits_b, tree, target, V, stop="nonchild"):
    """Make the walk accept exactly root -> target: a unique max on the next path token at each path row,
    then at target a token that is not a child ("nonchild") or not in the tree at all ("absent")."""
    path = ancestors_path(tree, target)
    for p, c in zip(path, path[1:]):
        logits_b[p, tree["node_token"][c]] = forced_value(logits_b[p])
    n = tree["num_nodes"]
    banned = set(tree["node_token"][:n + 1].tolist()) if stop == "absent" else child_tokens(tree, target)
    choices = [t for t in range(V) if t not in banned]
    logits_b[target, choices[rng.integers(len(choices))]] = forced_value(logits_b[target])
    return len(path) - 1


def greedy_case(name, description, seed, trees, arrays, logits, L, dtype="f32", expect=None):
    """logits are f32 values that are already exact in dtype (forced values are integers)."""
    bs, N, V = logits.shape
    stored, values = as_dtype(logits, dtype)
    assert (values == logits).all(), "forced logits must be representable in the storage dtype"
    am, alen, arows, emitted = greedy_accept(arrays["node_token"], arrays["first_child"], arrays["next_sibling"],
                                             arrays["num_nodes"], values, L)
    if expect is not None:
        assert alen.tolist() == list(expect), (name, alen.tolist(), expect)
    for b in range(bs):   # the accepted rows form a root path of the tree
        rows = arows[b, :alen[b] + 1]
        assert rows[0] == 0 and all(trees[b]["parent"][r] == p for p, r in zip(rows, rows[1:]))
    write_case("greedy_accept", name,
               {"node_token": arrays["node_token"], "first_child": arrays["first_child"],
                "next_sibling": arrays["next_sibling"], "num_nodes": arrays["num_nodes"],
                "target_logits": stored, "target_argmax": am, "accept_len": alen, "accept_rows": arows,
                "emitted": emitted},
               {"bs": bs, "N": N, "V": V, "L": L, "dtype": dtype, "seed": seed, "description": description})


def random_trees(rng, bs, L, V, budget, k=None, scale=(1.0, 8.0)):
    ids, logp, root, seq = random_tree_inputs(rng, bs, L, V, budget, k, scale)
    return build_trees(ids, logp, root, seq, budget)


def base_target_logits(rng, bs, N, V, dtype):
    """Random target logits, already rounded to the storage dtype so forcing can work on exact values."""
    x = (rng.standard_normal((bs, N, V)) * rng.uniform(1.0, 8.0, size=(bs, N, 1))).astype(F32)
    return round_to_bf16(x) if dtype == "bf16" else x


def nodes_at_depth(tree, d):
    n = tree["num_nodes"]
    return [i for i in range(1, n + 1) if tree["node_depth"][i] == d]


def greedy_cases():
    # Hand-checkable: the tiny hand tree of tree_build (rows tok 7 | 10, 30<-1, 20, 30<-3), V 50.
    i32 = lambda a: np.array(a, np.int32)
    f32 = lambda a: np.array(a, F32)
    ids, logp = i32([[[10, 20], [30, 40]]] * 3), f32([[[-0.25, -1.5], [-0.5, -2.0]]] * 3)
    arrays, trees = build_trees(ids, logp, i32([7, 7, 7]), i32([0, 0, 0]), 4)
    x = np.zeros((3, 5, 50), F32)        # an all-zero row has argmax 0 (ties to the smaller id)
    x[0, 0, 0] = 1                       # req 0: root argmax 0, not a child -> nothing accepted, emits [0]
    x[1, 0, 10], x[1, 1, 30], x[1, 2, 5] = 1, 1, 1   # req 1: 10, 30 accepted (depth L=2), bonus 5
    x[2, 0, 20], x[2, 3, 40] = 1, 2      # req 2: 20 accepted (row 3), then 40 is not a child: emits [20, 40]
    greedy_case("tiny_hand_b4_v50", "Hand-checkable: emitted [0] / [10,30,5] / [20,40] on the tiny hand tree.",
                0, trees, arrays, x, 2, expect=[0, 2, 1])

    # No draft accepted.
    rng = np.random.default_rng(301)
    arrays, trees = random_trees(rng, 4, 7, 500, 16)
    x = base_target_logits(rng, 4, 17, 500, "f32")
    for b in range(4):
        force_path(rng, x[b], trees[b], 0, 500)
    greedy_case("none_accepted_bs4_n17", "Root argmax is never a child: accept_len 0, emitted = [bonus].",
                301, trees, arrays, x, 7, expect=[0] * 4)

    # Every draft accepted down to depth L.
    # Seed 324 is one whose 4 trees all reach depth L with budget 16 (the assertion below guards it).
    rng = np.random.default_rng(324)
    arrays, trees = random_trees(rng, 4, 7, 1000, 16, scale=(8.0, 12.0))  # a peaked draft reaches depth L
    x = base_target_logits(rng, 4, 17, 1000, "f32")
    for b in range(4):
        deep = nodes_at_depth(trees[b], 7)
        assert deep, "the realistic tree should reach depth L"
        force_path(rng, x[b], trees[b], deep[rng.integers(len(deep))], 1000)
    greedy_case("full_depth_bs4_n17_l7", "A full-depth path: accept_len = L = 7 (peaked draft, scale 8..12).",
                324, trees, arrays, x, 7, expect=[7] * 4)

    # Partial acceptance, the stop token elsewhere in the tree or absent from it.
    rng = np.random.default_rng(303)
    arrays, trees = random_trees(rng, 6, 15, 500, 16)
    x = base_target_logits(rng, 6, 17, 500, "f32")
    expect = []
    for b in range(6):
        d = 1 + b % min(4, int(trees[b]["node_depth"].max()))   # depths 1..4 where the tree is deep enough
        rows = nodes_at_depth(trees[b], d)
        expect.append(force_path(rng, x[b], trees[b], rows[rng.integers(len(rows))], 500,
                                 "absent" if b % 2 else "nonchild"))
    greedy_case("partial_bs6_n17_l15", "Partial acceptance at depths 1..4; odd requests stop on a token absent "
                "from the tree.", 303, trees, arrays, x, 15, expect=expect)

    rng = np.random.default_rng(304)
    arrays, trees = random_trees(rng, 2, 7, 500, 16)
    x = base_target_logits(rng, 2, 17, 500, "f32")
    e = [force_path(rng, x[0], trees[0], 0, 500, "absent"),
         force_path(rng, x[1], trees[1], nodes_at_depth(trees[1], 2)[0], 500, "absent")]
    greedy_case("bonus_absent_bs2_n17", "The bonus token (argmax at the last accepted row) appears nowhere in the "
                "tree.", 304, trees, arrays, x, 7, expect=e)

    # Argmax ties between equal logits: the smaller token id wins.
    rng = np.random.default_rng(305)
    arrays, trees = random_trees(rng, 3, 3, 64, 16)
    x = base_target_logits(rng, 3, 17, 64, "f32")
    expect = []
    # req 0: the smallest-token child ties with a larger non-child token -> the child wins, accepted.
    t0 = trees[0]
    kids = children(t0["first_child"], t0["next_sibling"], 0)
    c = min(kids, key=lambda r: t0["node_token"][r])
    other = max(t for t in range(64) if t not in child_tokens(t0, 0))
    assert other > t0["node_token"][c]
    force_path(rng, x[0], t0, c, 64, "absent")  # unique max on c's token at the root, stop at c
    x[0, 0, other] = x[0, 0, t0["node_token"][c]]  # ... then make it a tie
    expect.append(1)
    # req 1: two children tie; the one with the smaller token id wins even when it is the later sibling.
    t1 = trees[1]
    kids = children(t1["first_child"], t1["next_sibling"], 0)
    pairs = [(a, b) for a in kids for b in kids if a < b and t1["node_token"][b] < t1["node_token"][a]]
    a, bb = pairs[0] if pairs else (kids[0], kids[1])
    win = bb if t1["node_token"][bb] < t1["node_token"][a] else a
    force_path(rng, x[1], t1, win, 64, "absent")
    v = x[1, 0, t1["node_token"][win]]
    x[1, 0, t1["node_token"][a]] = x[1, 0, t1["node_token"][bb]] = v
    expect.append(1)
    # req 2: the largest-token child ties with a smaller non-child token -> the non-child wins, nothing accepted.
    t2 = trees[2]
    kids = children(t2["first_child"], t2["next_sibling"], 0)
    c = max(kids, key=lambda r: t2["node_token"][r])
    other = min(t for t in range(64) if t not in child_tokens(t2, 0))
    assert other < t2["node_token"][c]
    v = forced_value(x[2, 0])
    x[2, 0, t2["node_token"][c]] = x[2, 0, other] = v
    expect.append(0)
    greedy_case("argmax_ties_bs3_n17_v64", "Argmax ties: child vs larger non-child (accepted), two children "
                "(smaller id wins), child vs smaller non-child (rejected).", 305, trees, arrays, x, 3,
                expect=expect)
    am = np.argmax(x[1, 0])
    assert am == t1["node_token"][win]

    # Duplicate sibling tokens (not produced by top-K, but the walk must take the first in sibling order).
    ids = i32([[[7, 7, 9], [3, 4, 5]]])
    logp = f32([[[-0.5, -1.0, -2.0], [-0.5, -1.0, -1.5]]])
    arrays, trees = build_trees(ids, logp, i32([1]), i32([10]), 6)
    x = np.zeros((1, 7, 20), F32)
    x[0, 0, 7] = 1
    second_7 = [r for r in children(trees[0]["first_child"], trees[0]["next_sibling"], 0)
                if trees[0]["node_token"][r] == 7][1]
    x[0, 1, 4] = 1                          # the first 7's row: its child 4 is in the tree
    x[0, second_7, 3] = 1
    greedy_case("dup_sibling_tokens_b6_v20", "Two siblings with the same token 7 (rows 1, 2): the first in "
                "sibling order is taken, emitted [7, 4, 0].", 0, trees, arrays, x, 2, expect=[2])
    assert second_7 == 2

    # V smaller than the budget: every node below depth L has all V tokens as children -> always depth L.
    rng = np.random.default_rng(306)
    arrays, trees = random_trees(rng, 3, 2, 3, 16)
    x = base_target_logits(rng, 3, 17, 3, "f32")
    greedy_case("v3_lt_budget_n17_l2", "V 3 < B 16: any argmax is a child, so every walk reaches depth L = 2.",
                306, trees, arrays, x, 2, expect=[2, 2, 2])

    # Budget 1 (N 2): the root and its one child, the top-1 token at depth 1, with L 3 (so accept_rows and
    # emitted [bs, 4] are padded past accept_len + 1).
    rng = np.random.default_rng(311)
    V = 32
    arrays, trees = random_trees(rng, 4, 3, V, 1)
    x = base_target_logits(rng, 4, 2, V, "f32")
    for t in trees:
        assert t["num_nodes"] == 1 and t["node_token"][0] != t["node_token"][1]
    force_path(rng, x[0], trees[0], 0, V, "absent")             # req 0: child rejected, bonus not in the tree
    force_path(rng, x[1], trees[1], 0, V)                       # req 1: child rejected, bonus = the root token
    x[1, 0, trees[1]["node_token"][0]] = forced_value(x[1, 0])
    force_path(rng, x[2], trees[2], 1, V, "absent")             # req 2: child accepted, bonus not in the tree
    force_path(rng, x[3], trees[3], 1, V)                       # req 3: child accepted, bonus = its own token
    x[3, 1, trees[3]["node_token"][1]] = forced_value(x[3, 1])
    greedy_case("budget1_bs4_n2_l3", "Budget 1 (N 2, L 3): the one child rejected (bonus absent / the root "
                "token) and accepted (bonus absent / the child's token again).", 311, trees, arrays, x, 3,
                expect=[0, 0, 1, 1])

    # L 1: the tree is the root plus a star of K = B siblings, so accept_len is 0 or 1 and accept_rows /
    # emitted are [bs, 2]. Seed 312 is one whose request 1 has a root token that is no child token (the
    # assertion below guards it).
    rng = np.random.default_rng(312)
    arrays, trees = random_trees(rng, 4, 1, V, 8)
    x = base_target_logits(rng, 4, 9, V, "f32")
    for t in trees:
        assert t["num_nodes"] == 8 and (t["node_depth"][1:] == 1).all(), "L 1 with K = B: a star of 8 siblings"
    force_path(rng, x[0], trees[0], 0, V, "absent")             # req 0: root argmax in no row of the tree
    t1 = trees[1]                                               # req 1: root argmax = the root's own token
    assert t1["node_token"][0] not in child_tokens(t1, 0)
    force_path(rng, x[1], t1, 0, V)
    x[1, 0, t1["node_token"][0]] = forced_value(x[1, 0])
    force_path(rng, x[2], trees[2], 1, V, "absent")             # req 2: the first sibling (row 1) accepted
    t3 = trees[3]                                               # req 3: the last sibling (row 8) accepted,
    force_path(rng, x[3], t3, 8, V)                             # bonus = the token of sibling row 1 (in the
    x[3, 8, t3["node_token"][1]] = forced_value(x[3, 8])        # tree, but not a child of row 8)
    greedy_case("l1_star_bs4_n9_v32", "L 1 (a star of 8 siblings): rejected with the bonus absent from the tree / "
                "equal to the root token; row 1 / row 8 accepted, row 8's bonus is row 1's token.", 312, trees,
                arrays, x, 1, expect=[0, 0, 1, 1])
    assert x[3, 8].argmax() == t3["node_token"][1]

    # Realistic mixes: per request a random target depth (0..L), a random node at that depth.
    for seed, bs, L, V, budget in ((307, 16, 7, 1000, 16), (308, 1, 15, 4096, 64)):
        rng = np.random.default_rng(seed)
        arrays, trees = random_trees(rng, bs, L, V, budget)
        x = base_target_logits(rng, bs, budget + 1, V, "f32")
        expect = []
        for b in range(bs):
            maxd = int(trees[b]["node_depth"].max())
            rows = nodes_at_depth(trees[b], int(rng.integers(0, maxd + 1))) or [0]
            expect.append(force_path(rng, x[b], trees[b], rows[rng.integers(len(rows))], V))
        greedy_case(f"real_bs{bs}_n{budget + 1}_l{L}_v{V}", "Realistic: forced paths to random depths.", seed,
                    trees, arrays, x, L, expect=expect)

    # Kimi vocabulary, bf16 target logits.
    rng = np.random.default_rng(310)
    V = 163840
    arrays, trees = random_trees(rng, 1, 7, V, 8)
    x = base_target_logits(rng, 1, 9, V, "bf16")
    deep = [r for r in range(1, trees[0]["num_nodes"] + 1) if trees[0]["node_depth"][r] >= 2]
    target = deep[-1]
    a = force_path(rng, x[0], trees[0], target, V, "absent")
    # At the stop row, a bf16 tie between two tokens absent from the tree: the smaller id is the bonus.
    n = trees[0]["num_nodes"]
    stop_tok = int(np.argmax(x[0, target]))
    twin = next(t for t in range(stop_tok + 1, V) if t not in set(trees[0]["node_token"][:n + 1].tolist()))
    x[0, target, twin] = x[0, target, stop_tok]
    greedy_case("kimi_bf16_bs1_n9_l7", "Kimi-K2 vocabulary, bf16 target logits, partial path, bf16 tie for the "
                "bonus token.", 310, trees, arrays, x, 7, "bf16", expect=[a])


# ----------------------------------------------------------------------------------------------------------
# kv_compact cases
# ----------------------------------------------------------------------------------------------------------

def kv_case(name, description, seed, layers, page_size, D, L, pages_per_req, extra_pages, seq_len, paths,
            n_rows=None):
    """paths[b] = accept_rows without padding ([0, ...]); the cache is random bf16 bit patterns (any bits:
    the op is a copy, so NaN payloads must survive too). n_rows: the tree's N when the case models a given
    budget (then all N tree rows after each prefix fit in the block table); default the rows the paths need."""
    rng = np.random.default_rng(seed)
    bs = len(paths)
    pages = bs * pages_per_req + extra_pages
    cache = rng.integers(0, 1 << 16, size=(layers, pages, page_size, D), dtype=np.uint16)
    block_table = rng.permutation(pages)[:bs * pages_per_req].reshape(bs, pages_per_req).astype(np.int32)
    seq = np.array(seq_len, np.int32)
    accept_len = np.array([len(p) - 1 for p in paths], np.int32)
    accept_rows = np.full((bs, L + 1), -1, np.int32)
    for b, p in enumerate(paths):
        assert p[0] == 0 and all(x < y for x, y in zip(p, p[1:])) and len(p) <= L + 1
        assert seq[b] + p[-1] < pages_per_req * page_size, "every slot is inside the block table"
        accept_rows[b, :len(p)] = p
    assert len(set(block_table.ravel().tolist())) == block_table.size, "requests never share a page"
    out = kv_compact(cache, block_table, seq, accept_len, accept_rows)
    if n_rows is None:
        n_rows = max(L + 1, max(p[-1] for p in paths) + 1)   # the tree rows written after each prefix
    else:
        assert all(p[-1] < n_rows for p in paths)
        assert (seq + n_rows - 1 < pages_per_req * page_size).all(), "the N tree rows fit in the block table"
    write_case("kv_compact", name,
               {"cache": cache, "block_table": block_table, "seq_len": seq, "accept_len": accept_len,
                "accept_rows": accept_rows, "cache_out": out},
               {"layers": layers, "pages": pages, "page_size": page_size, "D": D, "bs": bs, "L": L, "N": n_rows,
                "seed": seed,
                "description": description})
    return cache, out


def naive_descending_copy(cache, seed, page_size, seq_len, paths):
    """In-place copies for j = A..1 (a wrong order), on the block table kv_case drew from the same seed."""
    rng = np.random.default_rng(seed)
    rng.integers(0, 1 << 16, size=cache.shape, dtype=np.uint16)      # replay the draws of kv_case
    pages_per_req = (cache.shape[1]) // len(paths)
    bt = rng.permutation(cache.shape[1])[:len(paths) * pages_per_req].reshape(len(paths), pages_per_req)
    out = cache.copy()
    for b, p in enumerate(paths):
        for j in range(len(p) - 1, 0, -1):
            s, d = seq_len[b] + p[j], seq_len[b] + j
            out[:, bt[b, d // page_size], d % page_size] = out[:, bt[b, s // page_size], s % page_size]
    return out


def random_paths(rng, bs, L, max_row):
    """Increasing rows [0, r1, ...], accept length uniform in 0..L, rows drawn from 1..max_row."""
    paths = []
    for _ in range(bs):
        a = int(rng.integers(0, L + 1))
        paths.append([0] + sorted(rng.choice(np.arange(1, max_row + 1), a, replace=False).tolist()))
    return paths


def kv_cases():
    kv_case("ps1_d8_tiny", "Page size 1 (every slot its own page), shuffled pages.", 401, 3, 1, 8, 3, 8, 2,
            [4, 2], [[0, 1, 3], [0, 2, 3, 5]])
    c, o = kv_case("accept_len0_ps16_d8", "accept_len 0 everywhere: the cache is unchanged.", 402, 3, 16, 8, 7, 2,
                   1, [0, 5, 15], [[0], [0], [0]])
    assert (c == o).all()
    kv_case("full_depth_ps16_d8", "Full-depth acceptance (L 7): contiguous rows 0..7 (self copies) and "
            "non-contiguous rows.", 403, 3, 16, 8, 7, 3, 2, [3, 20], [list(range(8)), [0, 1, 3, 6, 10, 11, 14, 16]])
    kv_case("noncontig_ps16_d576", "Non-contiguous rows [0,2,5,9] across a page boundary, D 576.", 404, 3, 16,
            576, 3, 2, 0, [12, 3], [[0, 2, 5, 9], [0, 2, 5, 9]])
    c, o = kv_case("dst_is_later_src_ps16_d8", "A destination is the source of a later step (rows [0,2,3], [0,2,3,4], "
            "[0,1,2,4]): all reads happen before writes.", 405, 3, 16, 8, 3, 2, 0, [0, 14, 9],
            [[0, 2, 3], [0, 2, 3, 4], [0, 1, 2, 4]])
    # The case does exercise the read-before-write rule: copying in place in descending j order (which reads
    # slots already overwritten) gives a different cache.
    assert not (naive_descending_copy(c, 405, 16, [0, 14, 9], [[0, 2, 3], [0, 2, 3, 4], [0, 1, 2, 4]]) == o).all()
    kv_case("page_boundary_ps16_d8", "seq_len 15/16/0/31 so sources and destinations straddle page boundaries.",
            406, 3, 16, 8, 7, 4, 3, [15, 16, 0, 31], [[0, 1, 2, 17], [0, 3, 16, 17, 30], [0, 15, 16], [0, 1, 32]])
    kv_case("ps64_d576", "Kimi MLA latent (D 576) in 64-slot pages.", 407, 3, 64, 576, 7, 1, 0, [40, 0],
            [[0, 1, 4, 9, 16], [0, 3]])
    rng = np.random.default_rng(408)
    kv_case("ps1_d576_bs2_l7", "Page size 1, D 576, random paths.", 408, 3, 1, 576, 7, 24, 2,
            rng.integers(0, 8, 2).tolist(), random_paths(rng, 2, 7, 16))
    # L 1 (a star tree of budget 8, N 9): accept_len 0 or 1, the one accepted row anywhere in 1..8. Page size 4:
    # seq_len 3 and 7 end a page (slot seq + 1 opens the next one), seq_len 2 makes seq + 1 a page's last slot.
    c, o = kv_case("l1_n9_ps4_d8", "L 1, N 9, page size 4: row 5 from seq_len 3 (a page end: slot 8 to slot 4, "
                   "both on later pages), row 1 from seq_len 7 (a self copy of a page's first slot), row 8 from "
                   "seq_len 2 (into a page's last slot), accept_len 0 from seq_len 0 and 4.", 410, 3, 4, 8, 1, 4, 2,
                   [3, 0, 7, 2, 4], [[0, 5], [0], [0, 1], [0, 8], [0]], n_rows=9)
    assert not (c == o).all()
    # Budget 1 (N 2) with L 3: the only draft row, row 1, is already slot seq + 1, so every move is a self copy
    # and the cache must come back unchanged; accept_rows [bs, 4] is padded after [0, 1].
    c, o = kv_case("budget1_n2_l3_ps4_d8", "Budget 1 (N 2, L 3), page size 4: accept_len 1 (row 1 onto itself) "
                   "from seq_len 3 / 7 (page ends) and 2, accept_len 0 from seq_len 0; the cache is unchanged.",
                   411, 3, 4, 8, 3, 3, 1, [3, 0, 7, 2], [[0, 1], [0], [0, 1], [0, 1]], n_rows=2)
    assert (c == o).all()
    rng = np.random.default_rng(409)
    kv_case("real_bs8_ps16_d8_l15", "bs 8, L 15, rows up to 64 (budget 64), random seq_len and paths.", 409, 3,
            16, 8, 15, 8, 4, rng.integers(0, 128 - 64, 8).tolist(), random_paths(rng, 8, 15, 64))


# ----------------------------------------------------------------------------------------------------------
# Self-checks of the numeric building blocks, then the cases.
# ----------------------------------------------------------------------------------------------------------

def f32_round_exact(x):
    """The f32 nearest to the rational x (ties to even), exactly, through integers."""
    if x == 0:
        return 0.0
    e = math.floor(math.log2(abs(x)))             # may be off by one near powers of two: fixed below
    while abs(x) >= Fraction(2) ** (e + 1):
        e += 1
    while abs(x) < Fraction(2) ** e:
        e -= 1
    e = max(e, -126)                              # subnormals keep the exponent of the smallest normal
    m = round(x * Fraction(2) ** (23 - e))        # Fraction round: half to even
    return float(m * Fraction(2) ** (e - 23))


def expd_exact(d):
    """expd for one value with every step done in exact rational arithmetic and rounded to f32 once: an
    independent check of numpy's fma32 and of the vectorized expd."""
    if d < -31:
        return 0.0
    fd = Fraction(d)
    k = round(fd * Fraction(float(LOG2E)))
    r = Fraction(f32_round_exact(fd - k * Fraction(float(LN2))))
    p = Fraction(float(POLY[-1]))
    for c in reversed(POLY[:-1]):
        p = Fraction(f32_round_exact(p * r + Fraction(float(c))))
    return float(p * Fraction(2) ** k)


def self_check_primitives():
    # expd: exact at 0 and below the cutoff, within 3 ulp of exp elsewhere.
    assert expd(F32(0.0))[0] == 1.0 and expd(NEG_INF)[0] == 0.0 and expd(F32(-31.5))[0] == 0.0
    d = -np.linspace(0, 31, 100001, dtype=F32)
    exact = np.exp(d.astype(np.float64))
    ulps = np.abs(expd(d).astype(np.float64) - exact) / np.spacing(exact.astype(F32)).astype(np.float64)
    assert ulps.max() < 3.0, ulps.max()
    probe = np.concatenate([-np.random.default_rng(0).uniform(0, 31, 3000).astype(F32), d[::997],
                            np.array([-0.34657359, -0.3465736, -1e-30, -30.999998, -31.0], F32)])
    got = expd(probe)
    for v, g in zip(probe.tolist(), got.tolist()):
        assert g == expd_exact(v), (v, g, expd_exact(v))
    # uint64 -> float64 rounds to nearest even (numpy uses the hardware conversion).
    assert float(np.uint64(2 ** 53 + 1)) == 2.0 ** 53 and float(np.uint64(2 ** 53 + 3)) == 2.0 ** 53 + 4
    # bf16 rounding: ties to even, -inf preserved.
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -np.inf, -2.5e-3], F32)
    b = f32_to_bf16_bits(x)
    assert b.tolist()[:4] == [0x3F80, 0x3F80, 0x3F82, 0xFF80]
    assert bf16_bits_to_f32(b)[4] == np.float32(-0.00250244140625)


def main():
    if np.__version__ != "2.2.6":
        print(f"warning: numpy {np.__version__}, the fixtures are pinned to 2.2.6", file=sys.stderr)
    self_check_primitives()
    for k in KERNELS:
        shutil.rmtree(FIXTURES / k, ignore_errors=True)
    expd_cases()
    topk_cases()
    tree_cases()
    greedy_cases()
    kv_cases()
    import mla_fixtures   # here, not at the top: it imports this module (see the end of the file)
    mla_fixtures.mla_cases()
    import moe_fixtures
    moe_fixtures.moe_cases()
    import gemm_fixtures
    gemm_fixtures.gemm_cases()
    import rowops_fixtures
    rowops_fixtures.rowops_cases()
    print(f"self-checks passed ({BRUTE_FORCE_CHECKED[0]} trees also checked against brute force)")


if __name__ == "__main__":
    # Run as a script this module is __main__; register it under its own name so that mla_fixtures'
    # `import gen_fixtures` shares these helpers and counters instead of loading a second copy.
    sys.modules.setdefault("gen_fixtures", sys.modules[__name__])
    main()
