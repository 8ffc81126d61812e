"""Plots the speculative-mode table of `scripts/gpu-run.sh spec` (its summary.txt): mean accepted length and
tok/s against the tree budget, one line per batch size, for one proposer. ar is budget 0, chain its block's
15 draft positions (a path), auto a dashed line at its tok/s.

  python scripts/spec_plot.py SUMMARY.txt OUT.png [--proposer ngram]
"""

import argparse
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(path, proposer):
    """(mode, budget, batch, tok/s, accepted length) of each spec line of `proposer`."""
    out = []
    for line in open(path):
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 7 or cells[0] != "spec" or cells[1] != proposer:
            continue
        rate = re.match(r"([0-9.]+) tok/s", cells[5])
        if rate and cells[6]:
            out.append((cells[2], int(cells[3]), int(cells[4]), float(rate.group(1)), float(cells[6])))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("summary")
    ap.add_argument("out")
    ap.add_argument("--proposer", default="ngram")
    args = ap.parse_args()
    by_batch = defaultdict(list)
    for mode, budget, batch, rate, accepted in rows(args.summary, args.proposer):
        by_batch[batch].append((mode, budget, rate, accepted))
    fig, (ax_len, ax_rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    for batch in sorted(by_batch):
        entries = by_batch[batch]
        tree = sorted((0 if m == "ar" else b, r, a) for m, b, r, a in entries if m in ("ar", "ddtree"))
        line, = ax_rate.plot([t[0] for t in tree], [t[1] for t in tree], marker="o", label=f"batch {batch}")
        ax_len.plot([t[0] for t in tree], [t[2] for t in tree], marker="o", color=line.get_color(),
                    label=f"batch {batch}")
        for m, b, r, a in entries:
            if m == "chain":
                ax_rate.plot([15], [r], marker="s", color=line.get_color())
                ax_len.plot([15], [a], marker="s", color=line.get_color())
            if m == "auto":
                ax_rate.axhline(r, linestyle="--", color=line.get_color(), linewidth=1)
    ax_len.set(xlabel="tree budget (0 = ar; square = chain)", ylabel="mean accepted length", xscale="symlog")
    ax_rate.set(xlabel="tree budget (0 = ar; square = chain; dashed = auto)", ylabel="tok/s", xscale="symlog",
                yscale="log")
    for ax in (ax_len, ax_rate):
        ax.set_xticks([0, 8, 15, 16, 32, 64])
        ax.set_xticklabels(["0", "8", "", "16", "32", "64"])
        ax.grid(alpha=0.3)
    ax_rate.legend(fontsize=8)
    fig.suptitle(f"tiny checkpoint, H200, {args.proposer} proposer: accepted length and tok/s against the budget")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
