"""Trains the shipped DFlash-style drafter (fixtures/models/tiny-k2/drafter) on the frozen, INT4-quantized
target of train/target.py, in the drafter format src/model/drafter.rs reads.

The drafter (research/anchors-2026-12.md §2, ENGINE.md §8): the target's hidden states leaving layers
TARGET_LAYER_IDS, concatenated, through `fc` and `hidden_norm` are the context; a block
[anchor token, MASK x (BLOCK - 1)] at the positions after the context runs through 2 dense MLA layers
(every block row sees the whole context before the anchor and every row of its block), the target's own
embedding and lm_head (frozen) outside them. Training follows the recipe's shape:
  - sequences: continuations the target itself writes from train-split prompts (three quarters greedy,
    the rest sampled at temperature 1), since the drafter is judged on the target's own outputs, and
    random 512-token windows of the train split (a quarter of each batch);
  - per sequence ANCHORS random anchors, each block attending under a block-sparse mask;
  - the loss at block position k (1 .. BLOCK - 1) is the cross-entropy against the target's
    distribution of that token (a KL up to the target's entropy), weighted exp(-(k - 1) / GAMMA).

Writes config.json (a DeepSeek-V3 config of the draft layers plus dflash_config), model.safetensors and
training.json (loss curve, the draft's top-1 agreement with the target by block position).

  python train/drafter.py               # on the H200, after train/target.py; about 5 minutes
Needs torch and transformers 5; fixed seeds.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from common import DATA_DIR, MODEL_DIR, SPECIAL_IDS, TARGET_SHAPE, WINDOW, config_json, StepBudget, hf_config, \
    load_target, load_tokens, lr_at

BLOCK = 16
GAMMA = 7.0                       # the recipe's decay for block 16
TARGET_LAYER_IDS = [1, 3]         # after the first MoE layer, and the last layer (before the final norm)
MASK_TOKEN = SPECIAL_IDS["[PAD]"]
DRAFTER_SHAPE = dict(TARGET_SHAPE, num_hidden_layers=2, first_k_dense_replace=2, intermediate_size=384)


class Drafter(torch.nn.Module):
    """The draft layers, fc and the two norms; the embedding and lm_head are the target's, passed in."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.fc = torch.nn.Linear(len(TARGET_LAYER_IDS) * h, h, bias=False)
        self.hidden_norm = hf.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = hf.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = torch.nn.ModuleList()
        for i in range(config.num_hidden_layers):
            layer = torch.nn.Module()
            layer.input_layernorm = hf.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
            layer.self_attn = hf.DeepseekV3Attention(config, layer_idx=i)
            layer.post_attention_layernorm = hf.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
            layer.mlp = hf.DeepseekV3MLP(config)
            self.layers.append(layer)
        self.rotary = hf.DeepseekV3RotaryEmbedding(config=config)

    def forward(self, features, block_embeds, positions, mask):
        """features [b, T, k*H], block_embeds [b, R, H], positions [b, T + R], additive mask
        [b, 1, T + R, T + R] -> the block rows' final hidden states [b, R, H]."""
        ctx = self.hidden_norm(self.fc(features))
        t = ctx.shape[1]
        x = block_embeds
        for layer in self.layers:
            hs = torch.cat([ctx, layer.input_layernorm(x)], dim=1)
            cos_sin = self.rotary(hs, positions)
            out = layer.self_attn(hidden_states=hs, position_embeddings=cos_sin, attention_mask=mask)[0]
            x = x + out[:, t:]
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def block_layout(anchors, t, device):
    """For anchors [b, n] in a sequence of t context rows: positions [b, t + n*BLOCK] and the additive mask
    [b, 1, t + n*BLOCK, t + n*BLOCK]. Context rows see context rows up to themselves (their outputs are not
    used); block rows of block i see context rows before anchors[i] and every row of block i."""
    b, n = anchors.shape
    r = n * BLOCK
    offs = torch.arange(BLOCK, device=device)
    block_pos = (anchors[:, :, None] + offs).reshape(b, r)
    positions = torch.cat([torch.arange(t, device=device).expand(b, t), block_pos], dim=1)
    allowed = torch.zeros(b, t + r, t + r, dtype=torch.bool, device=device)
    allowed[:, :t, :t] = torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))
    row_anchor = anchors.repeat_interleave(BLOCK, dim=1)                      # [b, r]
    allowed[:, t:, :t] = torch.arange(t, device=device)[None, None, :] < row_anchor[:, :, None]
    block_id = torch.arange(r, device=device) // BLOCK
    allowed[:, t:, t:] = (block_id[:, None] == block_id[None, :])[None]
    mask = torch.zeros(b, 1, t + r, t + r, device=device)
    mask.masked_fill_(~allowed[:, None], float("-inf"))
    return positions, mask


class TargetFeatures:
    """Forward hooks that keep the hidden states leaving the target's TARGET_LAYER_IDS layers."""

    def __init__(self, target):
        self.saved = {}
        for l in TARGET_LAYER_IDS:
            target.model.layers[l].register_forward_hook(self.hook(l))

    def hook(self, l):
        def keep(_module, _inputs, output):
            self.saved[l] = output[0] if isinstance(output, tuple) else output
        return keep

    def concat(self):
        return torch.cat([self.saved[l].float() for l in TARGET_LAYER_IDS], dim=-1)


@torch.no_grad()
def generate_sequences(target, tokens, count, prompt_len, seq, gen, device, batch=256):
    """`count` sequences of `seq` tokens: a train-split prompt of `prompt_len` tokens and the target's own
    continuation, three quarters greedy (as the engine is judged), the rest sampled at temperature 1."""
    out = []
    greedy = count * 3 // 4
    for sample, total in [(False, greedy), (True, count - greedy)]:
        for i in range(0, total, batch):
            n = min(batch, total - i)
            starts = torch.randint(0, tokens.numel() - prompt_len, (n,), generator=gen)
            prompts = tokens[starts[:, None] + torch.arange(prompt_len)].to(device)
            new = seq - prompt_len
            ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=sample, temperature=1.0 if sample else None,
                                  top_k=0 if sample else None, top_p=None, pad_token_id=SPECIAL_IDS["[PAD]"])
            out.append(ids[:, :seq].cpu())
            print(f"generated {i + n}/{total} {'sampled' if sample else 'greedy'} sequences", flush=True)
    return torch.cat(out)


def draft_loss(drafter, target, features, batch_tokens, n_anchors, gen, device):
    """The position-weighted soft cross-entropy of one batch, and per block position the count of rows
    whose draft argmax is the target's argmax."""
    b, t = batch_tokens.shape
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        target_logits = target(batch_tokens, use_cache=False).logits.float()
        ctx_features = features.concat()
    # anchors in 1 .. t - BLOCK, distinct per sequence: every label position a + k, k < BLOCK, lies inside.
    scores = torch.rand(b, t - BLOCK, generator=gen).to(device)
    anchors = scores.topk(n_anchors, dim=1).indices + 1
    positions, mask = block_layout(anchors, t, device)
    block_tokens = torch.full((b, n_anchors, BLOCK), MASK_TOKEN, device=device)
    block_tokens[:, :, 0] = batch_tokens.gather(1, anchors)
    embed = target.model.embed_tokens.weight
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        hidden = drafter(ctx_features, F.embedding(block_tokens.flatten(1), embed), positions, mask)
        hidden = hidden.view(b, n_anchors, BLOCK, -1)[:, :, 1:]
        logits = (hidden @ embed.T.to(hidden.dtype)).float()                   # [b, n, BLOCK-1, V]
    label_pos = anchors[:, :, None] + torch.arange(BLOCK - 1, device=device)   # predicts token label_pos + 1
    teacher = target_logits.gather(1, label_pos.flatten(1)[:, :, None].expand(-1, -1, target_logits.shape[-1]))
    teacher = teacher.view_as(logits)
    soft_ce = -(torch.softmax(teacher, -1) * torch.log_softmax(logits, -1)).sum(-1)   # [b, n, BLOCK-1]
    weights = torch.exp(-torch.arange(BLOCK - 1, device=device) / GAMMA)
    loss = (soft_ce * weights).sum(-1).mean() / weights.sum()
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float().sum(dim=(0, 1))
    return loss, agree, b * n_anchors


def save_drafter(out, drafter):
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("rotary."):
            continue
        tensors[name] = t.detach().cpu().to(torch.bfloat16).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    dflash = {"block_size": BLOCK, "target_layer_ids": TARGET_LAYER_IDS, "mask_token_id": MASK_TOKEN}
    (out / "config.json").write_text(config_json(DRAFTER_SHAPE, "DFlashDraftModel", dflash_config=dflash,
                                                 num_nextn_predict_layers=0))



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA_DIR)
    ap.add_argument("--target", type=Path, default=MODEL_DIR)
    ap.add_argument("--out", type=Path, default=MODEL_DIR / "drafter")
    ap.add_argument("--steps", type=int, default=20000, help="the most steps")
    ap.add_argument("--minutes", type=float, default=3.5,
                    help="fit the schedule to this many minutes (timed over the first steps); 0: exactly --steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--generated", type=int, default=2048, help="target-written sequences in the mix")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = args.device
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    target = load_target(args.target, device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    features = TargetFeatures(target)
    tokens = load_tokens("train", args.data)
    t0 = time.time()
    generated = generate_sequences(target, tokens, args.generated, 64, WINDOW, gen, device) \
        if args.generated else torch.empty(0, WINDOW, dtype=torch.long)
    gen_seconds = time.time() - t0

    drafter = Drafter(hf_config(DRAFTER_SHAPE, attn="sdpa")).to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    curve, agree_sum, rows_sum = [], torch.zeros(BLOCK - 1, device=device), 0
    t1 = time.time()
    steps, warmup = args.steps, 200
    budget = StepBudget(args.minutes)
    step = 0
    while step < steps:
        steps = budget.fit(step, steps)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, warmup, 0.05)
        n_gen = args.batch * 3 // 4 if len(generated) else 0
        starts = torch.randint(0, tokens.numel() - WINDOW, (args.batch - n_gen,), generator=gen)
        rows = [tokens[starts[:, None] + torch.arange(WINDOW)]]
        if n_gen:
            rows.append(generated[torch.randint(0, len(generated), (n_gen,), generator=gen)])
        batch_tokens = torch.cat(rows).to(device)
        drafter.train()
        loss, agree, rows_n = draft_loss(drafter, target, features, batch_tokens, args.anchors, gen, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        agree_sum += agree
        rows_sum += rows_n
        last = step + 1 == steps
        if (step + 1) % 250 == 0 or last:
            point = {"step": step + 1, "seconds": round(time.time() - t1, 1), "loss": round(loss.item(), 4),
                     "top1_agreement_by_position": [round(float(a) / rows_sum, 3) for a in agree_sum]}
            curve.append(point)
            print(json.dumps(point), flush=True)
            agree_sum.zero_()
            rows_sum = 0
        step += 1
    save_drafter(args.out, drafter)
    report = {"steps_run": curve[-1]["step"], "train_seconds": round(time.time() - t1, 1),
              "generation_seconds": round(gen_seconds, 1), "generated_sequences": int(len(generated)),
              "block_size": BLOCK, "gamma": GAMMA, "target_layer_ids": TARGET_LAYER_IDS,
              "args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}
    (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['train_seconds']} s training, {gen_seconds:.0f} s generating)")


if __name__ == "__main__":
    main()
