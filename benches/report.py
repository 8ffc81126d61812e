#!/usr/bin/env python3
"""Turns criterion results (target/criterion) into the markdown tables of BENCHMARKS.md.

Usage: benches/report.py CRITERION_DIR [--into BENCHMARKS.md --title "..."]
Without --into the tables go to stdout. With it, they replace the block between the lines
`<!-- bench:<title>:begin -->` and `<!-- bench:<title>:end -->` (appended when absent).
GB/s counts the logits read once; the copy ceiling counts bytes read plus written, as the issue asks.
"""
import argparse
import json
import pathlib
import re

DTYPE_BYTES = {"f32": 4, "bf16": 2}
DEPTH = 15


def median_ns(path):
    return json.loads(path.read_text())["median"]["point_estimate"]


def mean_ns(root, group, function, parameter):
    """criterion's mean of a benchmark's samples (None when absent)."""
    path = root / group / function / parameter / "new" / "estimates.json"
    return json.loads(path.read_text())["mean"]["point_estimate"] if path.exists() else None


def load(root):
    """{(group, function, parameter): median ns} for every benchmark under root."""
    out = {}
    for est in root.glob("*/*/*/new/estimates.json"):
        parameter, function, group = est.parts[-3], est.parts[-4], est.parts[-5]
        out[(group, function, parameter)] = median_ns(est)
    return out


def params(p):
    return {k: int(v) for k, v in re.findall(r"([a-z]+)(\d+)", p)}


def fmt_time(ns):
    return f"{ns / 1e6:.2f} ms" if ns >= 1e6 else f"{ns / 1e3:.1f} µs"


def fmt_speedup(cpu, gpu):
    if not (cpu and gpu):
        return "–"
    ratio = cpu / gpu
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def copy_ceiling(res, label):
    ns = res.get(("copy", "d2d", label))
    return None if ns is None else 2 * (1 << 30) / ns  # bytes per ns = GB/s


def table_start(res, label, title):
    """A table's title and, when the run measured it, its copy ceiling: (lines, ceiling or None)."""
    ceiling = copy_ceiling(res, label)
    lines = [f"### {title}", ""]
    if ceiling:
        lines += [f"Device-to-device copy in the same run: **{ceiling:.0f} GB/s** (read + write).", ""]
    return lines, ceiling


def bandwidth_cells(bytes_, ns, ceiling):
    """The GB/s and % copy cells of `bytes_` moved in `ns` (dashes without a time)."""
    if not ns:
        return ["–", "–"]
    gbs = bytes_ / ns
    return [f"{gbs:.0f}", f"{100 * gbs / ceiling:.0f}%" if ceiling else "–"]


def bandwidth_table(res, group, rows_of, title):
    lines, ceiling = table_start(res, group, title)
    lines += ["| bs | B | V | CPU f32 | GPU f32 | speedup | GB/s | % copy | GPU bf16 | GB/s | % copy |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({p for (g, _, p) in res if g == group}, key=lambda p: (-params(p)["v"], params(p)["b"], params(p)["bs"]))
    for p in keys:
        q = params(p)
        rows = rows_of(q)
        cells = [str(q["bs"]), str(q["b"]), str(q["v"])]
        cpu = res.get((group, "cpu_f32", p))
        cells.append(fmt_time(cpu) if cpu else "–")
        for i, dtype in enumerate(["f32", "bf16"]):
            gpu = res.get((group, f"gpu_{dtype}", p))
            if gpu is None:
                cells += ["–"] * (3 if i else 4)
                continue
            gbs = rows * q["v"] * DTYPE_BYTES[dtype] / gpu
            cells.append(fmt_time(gpu))
            if i == 0:
                cells.append(fmt_speedup(cpu, gpu))
            cells += [f"{gbs:.0f}", f"{100 * gbs / ceiling:.0f}%" if ceiling else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tree_table(res):
    lines = ["### tree_build (given top-K, L 15)", "", "| bs | B | CPU | GPU | speedup |", "|---:|---:|---:|---:|---:|"]
    keys = sorted({p for (g, _, p) in res if g == "tree_build"}, key=lambda p: (params(p)["b"], params(p)["bs"]))
    for p in keys:
        q = params(p)
        cpu, gpu = res.get(("tree_build", "cpu", p)), res.get(("tree_build", "gpu", p))
        speed = fmt_speedup(cpu, gpu)
        lines.append(f"| {q['bs']} | {q['b']} | {fmt_time(cpu) if cpu else '–'} | {fmt_time(gpu) if gpu else '–'} | {speed} |")
    return lines


def compact_table(res):
    """KV compaction: bytes read plus written (61 layers, 1152 B rows), against the copy ceiling."""
    lines, ceiling = table_start(res, "kv_compact", "kv_compact (61 layers, 576-element rows, page 64)")
    lines += ["| bs | accepted | CPU | GPU | speedup | GB/s | % copy |", "|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({p for (g, _, p) in res if g == "kv_compact"}, key=lambda p: (params(p)["a"], params(p)["bs"]))
    for p in keys:
        q = params(p)
        cpu, gpu = res.get(("kv_compact", "cpu", p)), res.get(("kv_compact", "gpu", p))
        cells = [str(q["bs"]), str(q["a"]), fmt_time(cpu) if cpu else "–", fmt_time(gpu) if gpu else "–", fmt_speedup(cpu, gpu)]
        cells += bandwidth_cells(2 * q["bs"] * q["a"] * 61 * 1152, gpu, ceiling)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


GEMM_SHAPES = {(1536, 7168): "q_a", (12288, 1536): "q_b", (576, 7168): "kv_a", (7168, 8192): "o_proj",
               (4096, 7168): "shared gate+up", (7168, 2048): "shared down", (36864, 7168): "dense gate+up",
               (7168, 18432): "dense down", (163840, 7168): "lm_head"}


def flops_cells(flops, ns, mma):
    """The TFLOP/s and % of the mma.sync rate cells of `flops` done in `ns`."""
    if not ns:
        return ["–", "–"]
    tflops = flops / ns / 1e3
    return [f"{tflops:.1f}", f"{100 * tflops / mma:.0f}%" if mma else "–"]


def gemm_table(res, mma):
    """Dense bf16 GEMM: the weight bytes (N · K bf16) over the run's time against the copy ceiling, and
    2 · N · K · T FLOPs against the mma.sync rate, beside cuBLAS on the same shapes."""
    title = "gemm_bf16 (dense projections, bf16 weights, f32 activations split into bf16 hi + lo)"
    lines, ceiling = table_start(res, "gemm_bf16", title)
    if mma:
        lines += [f"mma.sync m16n8k16 bf16 rate in the same run: **{mma:.0f} TFLOP/s** "
                  "(the hi + lo split runs two mma per product, so this kernel's ceiling is half of it).", ""]
    lines += ["| shape | N | K | T | GPU | GB/s | % copy | TFLOP/s | % mma | cuBLAS | GB/s | TFLOP/s | cuBLAS time / GPU | CPU |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({p for (g, _, p) in res if g == "gemm_bf16"},
                  key=lambda p: (list(GEMM_SHAPES).index((params(p)["n"], params(p)["k"]))
                                 if (params(p)["n"], params(p)["k"]) in GEMM_SHAPES else 99, params(p)["t"]))
    for p in keys:
        q = params(p)
        cpu, gpu, blas = (res.get(("gemm_bf16", row, p)) for row in ("cpu", "gpu", "cublas_bf16"))
        weight_bytes, flops = 2 * q["n"] * q["k"], 2 * q["n"] * q["k"] * q["t"]
        cells = [GEMM_SHAPES.get((q["n"], q["k"]), "–"), str(q["n"]), str(q["k"]), str(q["t"]),
                 fmt_time(gpu) if gpu else "–"]
        cells += bandwidth_cells(weight_bytes, gpu, ceiling) + flops_cells(flops, gpu, mma)
        cells += [fmt_time(blas) if blas else "–", bandwidth_cells(weight_bytes, blas, ceiling)[0],
                  flops_cells(flops, blas, mma)[0], f"{blas / gpu:.2f}" if blas and gpu else "–",
                  fmt_time(cpu) if cpu else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


MLA_ROW_BYTES = 1152  # one cache row: 576 bf16


def heap_visible(n):
    """Mean tree rows a row of a heap tree of n rows sees (itself and its ancestors)."""
    return sum((i + 1).bit_length() for i in range(n)) / n


def mla_cost(q, n=1, tree=False):
    """(bytes, flops) of one MLA launch: every cache row read once per request, q read, o and lse written;
    2 * (576 + 512) FLOPs per (query row, head, visible row)."""
    bs, h, s = q["bs"], q["h"], q["s"]
    rows = bs * n * h
    visible = s + (heap_visible(n) if tree else 0)
    bytes_ = bs * (s + (n if tree else 0)) * MLA_ROW_BYTES + rows * (576 * 2 + 512 * 4 + 4)
    return bytes_, 2 * rows * visible * (576 + 512)


def mla_tables(res, mma_rate=None):
    """mla_decode and tree_verify against the roofline max(bytes / copy, flops / mma) of the same run."""
    ceiling = copy_ceiling(res, "mla")
    gemm = res.get(("mla_ceiling", "cublas_bf16", "m8192"))
    mma = 2 * 8192 ** 3 / gemm / 1e3 if gemm else None  # TFLOP/s
    lines = ["### mla_decode (latent 512 + rope 64, page 64)", ""]
    if ceiling:
        lines.append(f"Device-to-device copy in the same run: **{ceiling:.0f} GB/s** (read + write).")
    if mma:
        lines.append(f"cuBLAS bf16 GEMM 8192³ (f32 accumulate) in the same run: **{mma:.0f} TFLOP/s**.")
    if any(g == "mla" and f == "gpu_unfused" for (g, f, _) in res):
        lines += ["", "unfused: what a user might write instead over a contiguous cache: a cuBLAS strided-batched "
                  "bf16 GEMM for the scores (f32 compute, bf16 out), a row softmax kernel (bf16 P), a second one "
                  "for P·V; the three timed together, queued directly (no graph). fused vs unfused: unfused time "
                  "over GPU time."]
    lines += ["", "| H | bs | prefix | GPU | GB/s | TFLOP/s | % roofline | unfused | fused vs unfused | CPU |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({p for (g, f, p) in res if g == "mla" and f == "gpu_decode"},
                  key=lambda p: (params(p)["h"], params(p)["bs"], params(p)["s"]))
    for p in keys:
        q = params(p)
        t = res[("mla", "gpu_decode", p)]
        bytes_, flops = mla_cost(q)
        bound = max(bytes_ / ceiling if ceiling else 0, flops / (mma * 1e3) if mma else 0)
        cpu, unfused = res.get(("mla", "cpu_decode", p)), res.get(("mla", "gpu_unfused", p))
        lines.append(f"| {q['h']} | {q['bs']} | {q['s']} | {fmt_time(t)} | {bytes_ / t:.0f} | {flops / t / 1e3:.1f} | "
                     f"{100 * bound / t:.0f}% | {fmt_time(unfused) if unfused else '–'} | "
                     f"{fmt_speedup(unfused, t)} | {fmt_time(cpu) if cpu else '–'} |")
    lines += tree_verify_table(res, ceiling, mma_rate or mma, "mma.sync" if mma_rate else "cuBLAS 8192³")
    return lines


def tree_verify_table(res, ceiling, mma, mma_name):
    """tree_verify against its roofline and against N decodes of the same heads, batch and prefix."""
    trees = sorted({p for (g, f, p) in res if g == "mla" and f == "gpu_tree"},
                   key=lambda p: tuple(params(p)[k] for k in ("n", "h", "bs", "s")))
    if not trees:
        return []
    lines = ["", f"### tree_verify (heap tree of N rows) vs N separate decodes; roofline with the {mma_name} rate", "",
             "| N | H | bs | prefix | tree_verify | GB/s | TFLOP/s | % roofline | N decodes | speedup |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in trees:
        q = params(p)
        t = res[("mla", "gpu_tree", p)]
        decode = res.get(("mla", "gpu_decode", f"h{q['h']}_bs{q['bs']}_s{q['s']}"))
        rows = decode * q["n"] if decode else None
        bytes_, flops = mla_cost(q, q["n"], tree=True)
        bound = max(bytes_ / ceiling if ceiling else 0, flops / (mma * 1e3) if mma else 0)
        lines.append(f"| {q['n']} | {q['h']} | {q['bs']} | {q['s']} | {fmt_time(t)} | {bytes_ / t:.0f} | "
                     f"{flops / t / 1e3:.1f} | {100 * bound / t:.0f}% | {fmt_time(rows) if rows else '–'} | "
                     f"{fmt_speedup(rows, t)} |")
    return lines


def throughput_bytes(root, group, function, parameter):
    """The Throughput::Bytes a bench declared (criterion keeps it in benchmark.json)."""
    path = root / group / function / parameter / "new" / "benchmark.json"
    if not path.exists():
        return None
    return (json.loads(path.read_text()).get("throughput") or {}).get("Bytes")


def moe_table(res, root, group):
    """MoE at Kimi dims: weight bytes of the touched experts over time, against the copy ceiling and the
    cuBLAS bf16 baseline of the same run."""
    layout = "tiled" if group.endswith("_tiled") else "native"
    lines, ceiling = table_start(res, group, f"moe_int4 ({layout} layout): H 7168, I 2048, 384 experts, top-8")
    copy_mean = mean_ns(root, "copy", "d2d", group)
    ceiling_mean = 2 * (1 << 30) / copy_mean if copy_mean else None
    lines += ["GB/s = packed weights + scales of the distinct experts the routing touches, over the time of "
              "the two grouped GEMMs and the combine (`experts`); `step` adds routing and alignment. cuBLAS: the "
              "same experts dequantized to bf16, two GEMMs per active expert (GEMMs only, a lower bound on that "
              "path). Times are medians of criterion's samples, as in every table; `mean` is the samples' mean "
              "against the copy's mean, which also counts slow samples (such as those of the clock dip about a "
              "second into a short run, notes/benchmarks-history-2026-11.md, session 23).", "",
              "| T | expert MB | GPU experts | GB/s | % copy | mean | % copy, mean | GPU step | cuBLAS bf16 "
              "| vs cuBLAS | CPU | CPU vs GPU |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({p for (g, _, p) in res if g == group}, key=lambda p: params(p)["t"])
    for p in keys:
        gpu = res.get((group, "gpu_experts", p))
        if gpu is None:
            continue
        nbytes = throughput_bytes(root, group, "gpu_experts", p)
        gbps = nbytes / gpu if nbytes else None
        step, blas, cpu = (res.get((group, f, p)) for f in ("gpu_step", "cublas_bf16", "cpu"))
        pct = f"{100 * gbps / ceiling:.0f}%" if gbps and ceiling else "–"
        mean = mean_ns(root, group, "gpu_experts", p)
        pct_mean = f"{100 * nbytes / mean / ceiling_mean:.0f}%" if nbytes and mean and ceiling_mean else "–"
        lines.append(
            f"| {params(p)['t']} | {nbytes / 1e6:.0f} | {fmt_time(gpu)} | {gbps:.0f} | {pct} | "
            f"{fmt_time(mean) if mean else '–'} | {pct_mean} | "
            f"{fmt_time(step) if step else '–'} | {fmt_time(blas) if blas else '–'} | {fmt_speedup(blas, gpu)} | "
            f"{fmt_time(cpu) if cpu else '–'} | {fmt_speedup(cpu, gpu)} |")
    return lines


def render(res, root, mma=None):
    lines = []
    if any(g == "topk" for (g, _, _) in res):
        lines += bandwidth_table(res, "topk", lambda q: q["bs"] * DEPTH, "topk + logsumexp (L 15, K = B)") + [""]
    if any(g == "tree_build" for (g, _, _) in res):
        lines += tree_table(res) + [""]
    if any(g == "greedy_accept" for (g, _, _) in res):
        lines += bandwidth_table(res, "greedy_accept", lambda q: q["bs"] * (q["b"] + 1),
                                 "greedy_accept: argmax + walk (N = B + 1 rows, all valid)") + [""]
    if any(g == "kv_compact" for (g, _, _) in res):
        lines += compact_table(res) + [""]
    if any(g == "gemm_bf16" for (g, _, _) in res):
        lines += gemm_table(res, mma) + [""]
    if any(g == "mla" for (g, _, _) in res):
        lines += mla_tables(res, mma) + [""]
    for group in ("moe_int4", "moe_int4_tiled"):
        if any(g == group for (g, _, _) in res):
            lines += moe_table(res, root, group) + [""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("criterion_dir", type=pathlib.Path)
    ap.add_argument("--into", type=pathlib.Path)
    ap.add_argument("--title", default="tables")
    ap.add_argument("--mma-rate", type=float, help="mma.sync rate in TFLOP/s (benches/microbench/mma_rate.cu)")
    args = ap.parse_args()
    tables = render(load(args.criterion_dir), args.criterion_dir, args.mma_rate)
    if not args.into:
        print(tables)
        return
    begin, end = f"<!-- bench:{args.title}:begin -->", f"<!-- bench:{args.title}:end -->"
    doc = args.into.read_text() if args.into.exists() else ""
    block = f"{begin}\n{tables}\n{end}"
    if begin in doc and end in doc:
        doc = doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    args.into.write_text(doc)


if __name__ == "__main__":
    main()
