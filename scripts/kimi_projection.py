#!/usr/bin/env python3
"""The engine table projected to Kimi-K2 on 8 GPUs.

Prices every measured engine run (scripts/gpu-run.sh spec lines: steps by tree budget, the draft and
host-side stage times) at the real-dimension step times of examples/bench_step (8 heads, one GPU's
share of eight), and prints a markdown table of projected tok/s.

Step times (ms), from graph steps at 3 and 5 layers (A, B): a MoE layer is (B - A) / 2 and the rest
is A less two MoE layers; 61 layers = A + 58 MoE layers. On 8 GPUs the routed and shared experts, the
dense MLP and lm_head are split eight ways: each graph time keeps 1 - 7/8 of their share of it, the
share taken from the profiled (op by op) split of the same steps (B - A for a layer). Attention and
the projections are already one GPU's share (8 heads). No communication is counted, so this is a
lower bound for eight GPUs.
Drafter: a 6-layer dense model of the target's width (`bench_step --layers 6 --dense 6`) at its block
rows, its dense MLP and lm_head split eight ways the same way.

Steady state, every step at the run's full batch (the engine's own runs shrink as sequences finish):
a run's projected time = its steps at each budget x the verify step of B + 1 rows at its batch (budget
0: the decode step), + its drafted steps x the drafter step, + its host-side stages as measured (tree
build, accept, compaction, host); its tokens = batch x (the measured mean accepted length on a step
that verified a draft, 1 on a plain one). `auto`'s plain steps that still drafted (before drafting is
switched off) are counted from its draft time over the ddtree runs' draft time a step at its batch.

Usage: kimi_projection.py STEP3.csv STEP5.csv DRAFTER.csv SUMMARY.txt [--section TEXT]
"""
import argparse
import csv
import re
import sys

UNITS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}


def read_steps(path):
    with open(path) as f:
        return {(r["kind"], int(r["batch"]), int(r["rows"])): r for r in csv.DictReader(f)}


def num(r, key):
    return float(r[key])


SPLIT = ("moe_ms", "sharedexpert_ms", "densemlp_ms", "lmhead_ms")


def eight_gpus(graph, profiled, split):
    """A graph-step time with the share `split / profiled` of it split eight ways."""
    return graph * (1 - 7 / 8 * split / profiled)


def target_ms(a, b):
    """61 layers on 8 GPUs from the 3-layer row a and the 5-layer row b of one step shape."""
    moe_layer = eight_gpus(
        (num(b, "step_ms") - num(a, "step_ms")) / 2,
        (num(b, "profiled_ms") - num(a, "profiled_ms")) / 2,
        sum(num(b, k) - num(a, k) for k in SPLIT) / 2,
    )
    three_layers = eight_gpus(num(a, "step_ms"), num(a, "profiled_ms"), sum(num(a, k) for k in SPLIT))
    return three_layers + 58 * moe_layer


def drafter_ms(r):
    return eight_gpus(num(r, "step_ms"), num(r, "profiled_ms"), sum(num(r, k) for k in SPLIT))


def duration_ms(text):
    m = re.fullmatch(r"([0-9.]+)\s*(ns|µs|us|ms|s)", text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def read_runs(path, section):
    """The spec lines under the headings that contain `section` (every line with no section)."""
    runs, inside = [], section is None
    for line in open(path, encoding="utf-8"):
        if line.startswith("#"):
            inside = section is None or section in line
            continue
        if not inside or not line.startswith("spec |") or "tok/s" not in line:
            continue
        cells = [c.strip() for c in line.split("|")]
        if not cells[3].isdigit():
            continue  # the header line
        steps = {int(b): int(n) for b, n in re.findall(r"B (\d+): (\d+)", cells[7].split(";")[0])}
        stages = dict(
            (m.group(1), duration_ms(m.group(2)))
            for m in re.finditer(r"([a-z ]+?) ([0-9.]+\s*(?:ns|µs|us|ms|s))(?:,|;|$)", cells[8].split(";")[0])
        )
        runs.append({
            "mode": cells[2], "budget": int(cells[3]), "batch": int(cells[4]),
            "tok_s": float(cells[5].split()[0]), "accepted": float(cells[6]), "steps": steps, "stages": {k.strip(): v for k, v in stages.items()},
        })
    return runs


def label(run):
    return run["mode"] if run["mode"] in ("ar", "chain") else (
        f"ddtree B {run['budget']}" if run["mode"] == "ddtree" else f"auto (B ≤ {run['budget']})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("step3")
    p.add_argument("step5")
    p.add_argument("drafter")
    p.add_argument("summary")
    p.add_argument("--section", help="a heading's text: only the spec lines under it")
    args = p.parse_args()
    a, b, d = read_steps(args.step3), read_steps(args.step5), read_steps(args.drafter)
    runs = read_runs(args.summary, args.section)
    if not runs:
        sys.exit("no spec lines found")
    tree_rows = sorted({k[2] for k in a if k[0] == "tree"})

    def verify(budget, batch):
        if budget == 0:
            key = ("decode", batch, 1)
        else:
            rows = budget + 1
            rows = min((n for n in tree_rows if n >= rows), default=None)
            if rows is None:
                raise KeyError(f"no tree step of {budget + 1} rows or more")
            key = ("tree", batch, rows)
        return target_ms(a[key], b[key])

    draft = {k[1]: drafter_ms(r) for k, r in d.items() if k[0] == "tree"}
    per_step_draft = {}
    for r in runs:
        if r["mode"] == "ddtree":
            per_step_draft.setdefault(r["batch"], []).append(r["stages"]["draft"] / sum(r["steps"].values()))
    table, batches = {}, sorted({r["batch"] for r in runs})
    for r in runs:
        batch, steps = r["batch"], r["steps"]
        total = sum(steps.values())
        drafted = sum(n for bud, n in steps.items() if bud > 0)
        if r["mode"] == "auto" and per_step_draft.get(batch):
            # Steps at budget 0 that still drafted (before drafting was switched off, or a losing draft).
            mean = sum(per_step_draft[batch]) / len(per_step_draft[batch])
            drafted = max(drafted, min(total, round(r["stages"]["draft"] / mean)))
        elif r["mode"] != "ar":
            drafted = total
        host = sum(r["stages"].get(k, 0.0) for k in ("tree build", "accept", "compaction", "host"))
        time = sum(n * verify(bud, batch) for bud, n in steps.items()) + drafted * draft[batch] + host
        tokens = sum(n * batch * (r["accepted"] if bud > 0 else 1.0) for bud, n in steps.items())
        table[(label(r), batch)] = (tokens / time * 1e3, time / total, tokens / batch / total)
    labels = list(dict.fromkeys(label(r) for r in runs))
    print("| mode | " + " | ".join(f"batch {x}" for x in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for name in labels:
        cells = []
        for x in batches:
            cell = table.get((name, x))
            cells.append(f"{cell[0]:,.0f} ({cell[1]:.2f} ms, {cell[2]:.2f})" if cell else "–")
        print(f"| {name} | " + " | ".join(cells) + " |")
    autos = [n for n in labels if n.startswith("auto")]
    for auto in autos:
        ratios = []
        for x in batches:
            others = [v[0] for (n, bx), v in table.items() if bx == x and not n.startswith("auto")]
            ratios.append(f"{table[(auto, x)][0] / max(others):.2f}" if (auto, x) in table and others else "–")
        print(f"| {auto} / best | " + " | ".join(ratios) + " |")
    print()
    print("Step times, ms (61 layers, 8 GPUs, no communication):")
    print("| step | " + " | ".join(f"batch {x}" for x in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    print("| decode | " + " | ".join(f"{verify(0, x):.2f}" for x in batches) + " |")
    for n in tree_rows:
        print(f"| verify {n} rows | " + " | ".join(f"{target_ms(a[('tree', x, n)], b[('tree', x, n)]):.2f}" for x in batches) + " |")
    print("| drafter, 16 rows | " + " | ".join(f"{draft[x]:.2f}" for x in batches) + " |")


if __name__ == "__main__":
    main()
