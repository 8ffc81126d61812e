"""transformers' reference of the DFlash drafter's block draft (research/ddtree.md §1, ENGINE.md §8), for
fixtures/tiny_model/drafter (reference/make_tiny_drafter.py).

For each case: random context features [P, k*H] (as if from the target's layers), a bonus token, and the
drafter run in float32 with transformers' own DeepSeek-V3 modules on the checkpoint's exact weights:
  ctx   = hidden_norm(fc(features))                          the context, positions 0 .. P-1
  x     = embed([bonus, MASK x (block-1)])                   the block, positions P .. P+block-1
  per layer:  h = input_layernorm(x)
              x = x + attn(cat(ctx, h))[P:]   every block row sees every context row and every block row;
                                              the context rows' K/V come from ctx itself (no layer norm)
              x = x + mlp(post_attention_layernorm(x))
  logp  = log_softmax(lm_head(norm(x))[1:])                  the target's lm_head, the masked rows

Writes fixtures/tiny_model/drafter/reference/<case>/{features.npy, logp.npy, meta.json} and, for the test
to show that its bound catches them, the log-probs of four wrong drafters: logp_causal.npy (causal inside
the block), logp_normed_context.npy (the context through input_layernorm), logp_no_hidden_norm.npy (fc
without hidden_norm), logp_shifted.npy (block positions one later).

Needs torch, transformers and safetensors (reference/requirements-model.txt); runs on the CPU in seconds.
  python reference/drafter_reference.py
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_fixtures import FIXTURES  # noqa: E402

SEED = 3
CASES = {"ctx1": 1, "ctx9": 9, "ctx40": 40}
CONFIG_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
    "first_k_dense_replace", "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps",
    "rope_interleave", "n_group", "topk_group", "topk_method", "scoring_func", "norm_topk_prob",
    "routed_scaling_factor",
]


def load_modules(config, weights):
    """The drafter's layers as transformers modules with the checkpoint's weights (float32)."""
    def norm(name, dim):
        m = hf.DeepseekV3RMSNorm(dim, eps=config.rms_norm_eps)
        m.weight.data.copy_(weights[name])
        return m

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}"
        attn = hf.DeepseekV3Attention(config, layer_idx=i)
        attn.load_state_dict({k[len(p) + 11:]: v for k, v in weights.items() if k.startswith(f"{p}.self_attn.")})
        mlp = hf.DeepseekV3MLP(config)
        mlp.load_state_dict({k[len(p) + 5:]: v for k, v in weights.items() if k.startswith(f"{p}.mlp.")})
        h = config.hidden_size
        layers.append((norm(f"{p}.input_layernorm.weight", h), attn,
                       norm(f"{p}.post_attention_layernorm.weight", h), mlp))
    return layers, norm("hidden_norm.weight", config.hidden_size), norm("norm.weight", config.hidden_size)


def draft(config, modules, fc, embed, lm_head, features, bonus, mask_id, block, variant=None):
    """log_softmax of the masked rows' logits, [block-1, V]; `variant` names a wrong drafter."""
    layers, hidden_norm, final_norm = modules
    p = features.shape[0]
    ctx = features @ fc.T
    if variant != "no_hidden_norm":
        ctx = hidden_norm(ctx)
    x = embed[torch.tensor([bonus] + [mask_id] * (block - 1))]
    start = p + 1 if variant == "shifted" else p
    positions = torch.cat([torch.arange(p), torch.arange(start, start + block)])[None]
    rotary = hf.DeepseekV3RotaryEmbedding(config=config)
    t = p + block
    mask = torch.zeros(1, 1, t, t)
    if variant == "causal":
        mask[0, 0, p:, p:] = torch.triu(torch.full((block, block), float("-inf")), diagonal=1)
    for input_norm, attn, post_norm, mlp in layers:
        h = input_norm(x)
        c = input_norm(ctx) if variant == "normed_context" else ctx
        hs = torch.cat([c, h])[None]
        cos_sin = rotary(hs, positions)
        out = attn(hidden_states=hs, position_embeddings=cos_sin, attention_mask=mask)[0][0]
        x = x + out[p:]
        x = x + mlp(post_norm(x))
    logits = final_norm(x) @ lm_head.T
    return torch.log_softmax(logits[1:], dim=-1)


def main():
    torch.set_num_threads(1)
    target_dir = FIXTURES / "tiny_model"
    drafter_dir = target_dir / "drafter"
    raw = json.loads((drafter_dir / "config.json").read_text())
    dflash = raw["dflash_config"]
    config = DeepseekV3Config(**{k: raw[k] for k in CONFIG_KEYS if k in raw}, attn_implementation="eager")
    weights = {k: v.to(torch.float32) for k, v in load_file(drafter_dir / "model.safetensors").items()}
    target = load_file(target_dir / "model.safetensors")
    embed = target["model.embed_tokens.weight"].to(torch.float32)
    lm_head = target["lm_head.weight"].to(torch.float32)
    k, h, block = len(dflash["target_layer_ids"]), config.hidden_size, dflash["block_size"]
    rng = np.random.default_rng(SEED)
    with torch.no_grad():
        modules = load_modules(config, weights)
        for name, p in CASES.items():
            features = rng.standard_normal((p, k * h)).astype(np.float32)
            bonus = int(rng.integers(0, config.vocab_size - 8))
            args = (config, modules, weights["fc.weight"], embed, lm_head, torch.from_numpy(features), bonus,
                    dflash["mask_token_id"], block)
            out = drafter_dir / "reference" / name
            out.mkdir(parents=True, exist_ok=True)
            np.save(out / "features.npy", features)
            np.save(out / "logp.npy", draft(*args).numpy().astype(np.float32))
            for variant in ["causal", "normed_context", "no_hidden_norm", "shifted"]:
                np.save(out / f"logp_{variant}.npy", draft(*args, variant=variant).numpy().astype(np.float32))
            meta = {
                "description": "transformers DeepSeek-V3 modules (float32, the drafter's exact weights): log-probs "
                               "of the masked block rows after a context of random features",
                "context": p, "bonus": bonus, "block": block, "vocab": config.vocab_size, "seed": SEED,
                "dtype": "f32",
            }
            (out / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
            print(f"{name}: context {p}, bonus {bonus}")


if __name__ == "__main__":
    main()
