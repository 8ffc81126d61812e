"""A small random DFlash drafter for the tiny random target (fixtures/tiny_model), in the drafter format
the Rust loader reads (src/model/drafter.rs):

  fixtures/tiny_model/drafter/config.json        the target's DeepSeek-V3 config with 2 dense layers, no
                                                 routed experts in use, and a dflash_config
  fixtures/tiny_model/drafter/model.safetensors  fc.weight [H, k*H], hidden_norm.weight, norm.weight and
                                                 layers.{i}.* named like the target's model.layers.{i}.*

Its weights are random (normal, scaled by 1/sqrt(fan-in); norm weights 1 + 0.25 normal, so that no norm
is an identity a wrong drafter could hide behind), so its drafts mean nothing: it exists so
that every drafter path (context features, block step, top-K, the engine's bookkeeping) runs in tests
before a trained drafter does. Deterministic (fixed seed); needs numpy only. CI does not run it: the output
is committed.

  python reference/make_tiny_drafter.py
"""

import json
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_fixtures import FIXTURES, f32_to_bf16_bits  # noqa: E402

SEED = 7
LAYERS = 2
BLOCK_SIZE = 8
TARGET_LAYER_IDS = [1, 2]
MASK_TOKEN = "[PAD]"


def write_safetensors(path, tensors):
    """Writes {name: (dtype, shape, bytes)} as a safetensors file (8-byte header length, JSON, data)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def main():
    target_dir = FIXTURES / "tiny_model"
    config = json.loads((target_dir / "config.json").read_text())
    tokenizer = json.loads((target_dir / "tokenizer.json").read_text())
    mask_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == MASK_TOKEN)
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    latent, q_rank, inter = config["kv_lora_rank"], config["q_lora_rank"], config["intermediate_size"]
    config.update(num_hidden_layers=LAYERS, first_k_dense_replace=LAYERS, num_nextn_predict_layers=0)
    config.pop("quantization_config", None)
    config["architectures"] = ["DFlashDraftModel"]
    config["dflash_config"] = {
        "block_size": BLOCK_SIZE,
        "target_layer_ids": TARGET_LAYER_IDS,
        "mask_token_id": mask_id,
    }

    rng = np.random.default_rng(SEED)
    tensors = {}

    def linear(name, out, inp):
        w = rng.standard_normal((out, inp)).astype(np.float32) / np.sqrt(inp)
        tensors[name] = ("BF16", (out, inp), f32_to_bf16_bits(w).tobytes())

    def norm(name, dim):
        w = 1.0 + 0.25 * rng.standard_normal(dim).astype(np.float32)
        tensors[name] = ("BF16", (dim,), f32_to_bf16_bits(w).tobytes())

    linear("fc.weight", h, len(TARGET_LAYER_IDS) * h)
    norm("hidden_norm.weight", h)
    norm("norm.weight", h)
    for i in range(LAYERS):
        p = f"layers.{i}"
        norm(f"{p}.input_layernorm.weight", h)
        norm(f"{p}.post_attention_layernorm.weight", h)
        linear(f"{p}.self_attn.q_a_proj.weight", q_rank, h)
        norm(f"{p}.self_attn.q_a_layernorm.weight", q_rank)
        linear(f"{p}.self_attn.q_b_proj.weight", heads * (nope + rope), q_rank)
        linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight", latent + rope, h)
        norm(f"{p}.self_attn.kv_a_layernorm.weight", latent)
        linear(f"{p}.self_attn.kv_b_proj.weight", heads * (nope + v), latent)
        linear(f"{p}.self_attn.o_proj.weight", h, heads * v)
        linear(f"{p}.mlp.gate_proj.weight", inter, h)
        linear(f"{p}.mlp.up_proj.weight", inter, h)
        linear(f"{p}.mlp.down_proj.weight", h, inter)

    out = target_dir / "drafter"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_safetensors(out / "model.safetensors", tensors)
    print(f"wrote {out}: {len(tensors)} tensors, mask token {mask_id}")


if __name__ == "__main__":
    main()
