"""Trains the shipped tiny Kimi-architecture target (fixtures/models/tiny-k2) from scratch on the corpus of
train/corpus.py, tokenized by train/tokenizer.py, then quantizes its routed experts to INT4.

The model is transformers' DeepseekV3ForCausalLM with the shape in train/common.py: MLA (q_lora 128,
kv_lora 512, rope 64), 4 layers of which the first is dense, then 16 sigmoid-routed experts (top 4) with a
shared expert, embeddings tied to the lm_head. Training: next-token cross-entropy on random 512-token windows,
AdamW with warm-up and cosine decay, bf16 autocast, and DeepSeek-V3's auxiliary-loss-free balancing (each
routing bias moves by a fixed step against its expert's load). The last 2% of the train tokens are a
validation slice that picks the best checkpoint; the held-out split is only measured.

Writes into --out: config.json and model.safetensors (the Rust loader's format), training.json (the loss
curve, held-out perplexity before and after INT4, timings), and under reference/ what
tests/trained_model.rs and examples/perplexity compare the engine with: heldout_nll.npy (per held-out
window, the quantized model's summed NLL), heldout_token_nll.npy (per token of the first 8 windows) and
heldout_tokens.json (the held-out token ids' count and digest).

  python train/target.py                 # on the H200, about 6 minutes
Needs torch and transformers 5 (the GPU machine's image has both); fixed seeds.
"""

import argparse
import json
import math
import time

import numpy as np
import torch

from common import (DATA_DIR, MODEL_DIR, TARGET_SHAPE, WINDOW, StepBudget, heldout_windows, hf_config, load_tokens, lr_at,
                    perplexity, quantize_experts_, round_to_bf16_, token_digest, token_nll, window_nll, write_target)

BIAS_STEP = 1e-3  # routing-bias update per step (DeepSeek-V3 uses 1e-3)
TOKEN_NLL_WINDOWS = 8  # held-out windows whose per-token NLL is kept for tests/trained_model.rs


class LoadBalancer:
    """Counts each MoE layer's expert choices during training steps and moves the routing biases."""

    def __init__(self, model):
        self.routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.counts = [None] * len(self.routers)
        self.on = False
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self.hook(i))

    def hook(self, i):
        def count(_module, _inputs, output):
            if self.on:
                experts = output[2]
                c = torch.bincount(experts.flatten(), minlength=self.routers[i].num_experts).float()
                self.counts[i] = c if self.counts[i] is None else self.counts[i] + c
        return count

    @torch.no_grad()
    def update(self):
        spread = []
        for r, c in zip(self.routers, self.counts):
            r.e_score_correction_bias.add_(BIAS_STEP * torch.sign(c.mean() - c))
            spread.append(float(c.max() / c.mean()))
        self.counts = [None] * len(self.routers)
        return max(spread)


def batches(tokens, batch, seq, gen, device):
    """Random windows of seq + 1 tokens: inputs and next-token labels."""
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)
    x = tokens[idx].to(device)
    return x[:, :-1], x[:, 1:]



def param_groups(model, weight_decay):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


@torch.no_grad()
def mean_loss(model, windows, device):
    nll = window_nll(model, windows, device=device)
    return float(nll.sum() / (windows.shape[0] * (windows.shape[1] - 1)))


def train(args):
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    device = args.device
    tokens = load_tokens("train", args.data)
    n_val = tokens.numel() // 50
    train_tokens, val_windows = tokens[:-n_val], heldout_windows(tokens[-n_val:])
    heldout = heldout_windows(load_tokens("heldout", args.data))
    print(f"train {train_tokens.numel():,} tokens, validation {val_windows.numel():,}, held-out {heldout.numel():,}")

    model = __import__("transformers").DeepseekV3ForCausalLM(hf_config(TARGET_SHAPE)).to(device)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
    balancer = LoadBalancer(model)
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device == "cuda")
    curve, best = [], (float("inf"), None, -1)
    steps = args.steps
    t0 = time.time()
    budget = StepBudget(args.minutes)
    step = 0
    while step < steps:
        steps = budget.fit(step, steps)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, args.warmup, 0.1)
        x, y = batches(train_tokens, args.batch, args.seq, gen, device)
        model.train()
        balancer.on = True
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(x, use_cache=False).logits
        balancer.on = False
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        spread = balancer.update()
        last = step + 1 == steps
        if (step + 1) % args.eval_every == 0 or last:
            model.eval()
            val = mean_loss(model, val_windows, device)
            point = {"step": step + 1, "seconds": round(time.time() - t0, 1), "train_loss": round(loss.item(), 4),
                     "val_loss": round(val, 4), "val_ppl": round(math.exp(val), 3), "expert_load_max": round(spread, 2)}
            curve.append(point)
            print(json.dumps(point), flush=True)
            if val < best[0]:
                best = (val, {k: v.detach().clone() for k, v in model.state_dict().items()}, step + 1)
        step += 1
    train_seconds = time.time() - t0
    model.load_state_dict(best[1])
    model.eval().float()
    return model, curve, best[2], train_seconds, heldout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=__import__("pathlib").Path, default=DATA_DIR)
    ap.add_argument("--out", type=__import__("pathlib").Path, default=MODEL_DIR)
    ap.add_argument("--steps", type=int, default=6000, help="the most steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=WINDOW)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--minutes", type=float, default=5.0,
                    help="fit the schedule to this many minutes (timed over the first steps); 0: exactly --steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    model, curve, best_step, train_seconds, heldout = train(args)
    round_to_bf16_(model)
    nll_bf16 = window_nll(model, heldout, device=args.device)
    int4 = quantize_experts_(model, TARGET_SHAPE["moe_intermediate_size"])
    nll_int4 = window_nll(model, heldout, device=args.device)
    report = {
        "steps_run": curve[-1]["step"], "best_step": best_step, "train_seconds": round(train_seconds, 1),
        "heldout_windows": int(heldout.shape[0]), "window": WINDOW,
        "heldout_ppl_bf16": round(perplexity(nll_bf16), 4), "heldout_ppl_int4": round(perplexity(nll_int4), 4),
        "args": {k: str(v) for k, v in vars(args).items()}, "curve": curve,
    }
    write_target(args.out, model, TARGET_SHAPE, int4, {})
    (args.out / "reference").mkdir(parents=True, exist_ok=True)
    np.save(args.out / "reference" / "heldout_nll.npy", nll_int4.astype(np.float32))
    np.save(args.out / "reference" / "heldout_token_nll.npy",
            token_nll(model, heldout[:TOKEN_NLL_WINDOWS], device=args.device).astype(np.float32))
    digest = token_digest(load_tokens("heldout", args.data).numpy())
    (args.out / "reference" / "heldout_tokens.json").write_text(json.dumps(digest, indent=1) + "\n")
    (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"held-out perplexity: bf16 {report['heldout_ppl_bf16']}, INT4 experts {report['heldout_ppl_int4']} "
          f"(best step {best_step} of {report['steps_run']}, {train_seconds:.0f} s)")


if __name__ == "__main__":
    main()
