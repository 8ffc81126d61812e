"""Hugging Face transformers' greedy generate on a tiny checkpoint of this repository, the baseline of the
engine's tok/s table (issue 32): batch 1, 8 and 32, 256 new tokens, float32 and bfloat16, the static cache
with sdpa attention (transformers' fastest configuration on this model) and the default dynamic cache.

The checkpoint's INT4 routed experts are dequantized to the exact values the Rust engine runs with, so both
run the same model. Prints one line per configuration and writes them as CSV to --out (default stdout only).

Usage (on the GPU machine): python3 scripts/hf_generate_bench.py [--model fixtures/tiny_model] [--out FILE]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reference"))
from moe_fixtures import dequant  # noqa: E402

NEW_TOKENS = 256
BATCHES = (1, 8, 32)


def load(model_dir, dtype):
    """The checkpoint as a transformers model on the GPU, its INT4 experts dequantized."""
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    raw["attn_implementation"] = "sdpa"
    config = DeepseekV3Config(**raw)
    tensors = load_file(str(model_dir / "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith(".weight_shape") or name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            scale = tensors[f"{base}.weight_scale"].view(torch.int16).numpy().view(np.uint16)
            w = dequant(t.numpy(), scale).astype(np.float32)
            state[f"{base}.weight"] = torch.from_numpy(w)
        else:
            state[name] = t.float()
    model = DeepseekV3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to("cuda", dtype=dtype).eval(), config


def tok_per_s(model, config, batch, cache):
    prompt = torch.full((batch, 5), 100, dtype=torch.long, device="cuda")
    prompt[:, 1:] = torch.arange(1, 5, device="cuda") * 7
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        model.generate(prompt, **{**kwargs, "max_new_tokens": 16, "min_new_tokens": 16})  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    assert out.shape[1] == 5 + NEW_TOKENS, out.shape
    return batch * NEW_TOKENS / elapsed, elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="fixtures/tiny_model")
    p.add_argument("--out")
    args = p.parse_args()
    rows = ["dtype,cache,batch,tok_per_s,seconds"]
    for dtype in (torch.float32, torch.bfloat16):
        model, config = load(Path(args.model), dtype)
        for cache in ("static", "dynamic"):
            for batch in BATCHES:
                rate, secs = tok_per_s(model, config, batch, cache)
                name = str(dtype).removeprefix("torch.")
                rows.append(f"{name},{cache},{batch},{rate:.1f},{secs:.3f}")
                print(f"transformers {name} {cache} cache, batch {batch}: {rate:.1f} tok/s ({secs:.2f} s)", flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
