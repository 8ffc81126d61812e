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
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reference"))
from moe_fixtures import dequant  # noqa: E402

NEW_TOKENS = 256
BATCHES = (1, 8, 32)


def dequantized_checkpoint(model_dir, out_dir):
    """Writes the checkpoint to out_dir with every INT4 routed expert dequantized to float32 (exact) and no
    quantization_config, in the per-expert names transformers converts when it loads."""
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(model_dir / "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith(".weight_shape") or name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            scale = tensors[f"{base}.weight_scale"].view(torch.int16).numpy().view(np.uint16)
            state[f"{base}.weight"] = torch.from_numpy(dequant(t.numpy(), scale).astype(np.float32))
        else:
            state[name] = t.float().contiguous()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load(checkpoint, dtype):
    model = DeepseekV3ForCausalLM.from_pretrained(str(checkpoint), dtype=dtype, attn_implementation="sdpa")
    return model.to("cuda").eval(), model.config


def tok_per_s(model, config, batch, cache):
    prompt = torch.full((batch, 5), 100, dtype=torch.long, device="cuda")
    prompt[:, 1:] = torch.arange(1, 5, device="cuda") * 7
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        # Warm-up at the timed length: the static cache is sized by it, so a shorter warm-up would leave
        # its set-up inside the timed call.
        model.generate(prompt, **kwargs)
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
    checkpoint = Path(tempfile.mkdtemp(prefix="hf_bench_"))
    dequantized_checkpoint(Path(args.model), checkpoint)
    for dtype in (torch.float32, torch.bfloat16):
        model, config = load(checkpoint, dtype)
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
