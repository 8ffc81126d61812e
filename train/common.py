"""What train/target.py and train/drafter.py share: the shipped model's shape, the token data, held-out
perplexity, and the checkpoint format the Rust loader reads (src/model/weights.rs, src/model/config.rs).

The target is transformers' own DeepseekV3ForCausalLM (the implementation the Rust engine is tested
against), so the PyTorch perplexity and the engine's perplexity are of the same function. On disk the
routed experts are Kimi-K2's compressed-tensors INT4 (group 32, symmetric, bf16 scales); every other
weight is bf16 except the routing biases (float32).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "reference"))
from gen_fixtures import f32_to_bf16_bits  # noqa: E402
from moe_fixtures import GROUP, dequant, pack_nibbles, quantize  # noqa: E402

MODEL_DIR = ROOT / "fixtures" / "models" / "tiny-k2"
DATA_DIR = ROOT / "train" / "data"
VOCAB = 4096
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "[PAD]"]
SPECIAL_IDS = {s: VOCAB - len(SPECIALS) + i for i, s in enumerate(SPECIALS)}
# Held-out perplexity is measured over consecutive windows of this many tokens, each read from its start.
WINDOW = 512

# The target's shape. The MLA kernels fix kv_lora_rank 512 and qk_rope_head_dim 64; the rest is sized so
# that target + drafter + tokenizer stay under 16 MB.
TARGET_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
    norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096, rope_theta=10000.0,
    rope_scaling=None, rope_interleave=True, rms_norm_eps=1e-6, tie_word_embeddings=True,
)

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "input_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                    "dynamic": False, "actorder": None, "observer": "minmax"},
    }},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}


# A run fits its schedule to its --minutes from the pace of steps WARM_STEPS .. CALIBRATION_STEPS: the
# first steps also compile kernels and grow the allocator, and timing them would plan too few steps.
WARM_STEPS = 10
CALIBRATION_STEPS = 40


class StepBudget:
    """Fits a run's step count to `minutes` of wall time (0: the count is left as it is)."""

    def __init__(self, minutes):
        import time
        self.minutes, self.started, self.warm_at, self.clock = minutes, time.time(), None, time.time

    def fit(self, step, steps):
        """Called before each step: at CALIBRATION_STEPS, the most steps (at least one more, at most
        `steps`) that fit the budget at the pace since WARM_STEPS, printed with the flags that replay
        it; else `steps` unchanged."""
        if not self.minutes:
            return steps
        if step == WARM_STEPS:
            self.warm_at = self.clock()
        if step != CALIBRATION_STEPS:
            return steps
        now = self.clock()
        per_step = (now - self.warm_at) / (CALIBRATION_STEPS - WARM_STEPS)
        left = self.minutes * 60 - (now - self.started)
        fitted = max(step + 1, min(steps, step + int(left / per_step)))
        print(f"{per_step * 1e3:.1f} ms per step: {fitted} steps fit in {self.minutes} minutes "
              f"(rerun with --steps {fitted} --minutes 0 for the same schedule)", flush=True)
        return fitted


def lr_at(step, steps, peak, warmup, floor):
    """Linear warm-up over `warmup` steps, then cosine decay from `peak` to `floor` x `peak`."""
    import math
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def hf_config(shape, attn="eager", **extra):
    """A transformers DeepseekV3Config of `shape` with the attention implementation `attn`."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**shape, bos_token_id=SPECIAL_IDS["[BOS]"], eos_token_id=SPECIAL_IDS["[EOS]"],
                            pad_token_id=SPECIAL_IDS["[PAD]"], attn_implementation=attn, **extra)


def config_json(shape, architecture, **extra):
    """The config.json text: the shape's keys written out (not transformers' to_dict, whose rope keys
    moved between versions), plus what the Rust loader and transformers both read."""
    cfg = dict(shape)
    cfg.update(architectures=[architecture], model_type="deepseek_v3", torch_dtype="bfloat16",
               bos_token_id=SPECIAL_IDS["[BOS]"], eos_token_id=SPECIAL_IDS["[EOS]"],
               pad_token_id=SPECIAL_IDS["[PAD]"], hidden_act="silu", attention_bias=False, **extra)
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def load_tokens(split, data_dir=DATA_DIR):
    """The tokenized split (train/tokenizer.py) as int64."""
    return torch.from_numpy(np.load(data_dir / f"{split}.u16.npy").astype(np.int64))


def token_digest(tokens):
    """{count, sha256 of the ids as little-endian u32}: what tests/trained_model.rs checks the Rust
    tokenizer's cut of the held-out text against."""
    import hashlib
    ids = np.asarray(tokens, dtype="<u4")
    return {"count": int(ids.size), "sha256_u32le": hashlib.sha256(ids.tobytes()).hexdigest()}


def heldout_windows(tokens, window=WINDOW):
    """[n, window] consecutive windows of the held-out tokens (the tail shorter than a window dropped)."""
    n = tokens.numel() // window
    return tokens[: n * window].view(n, window)


@torch.no_grad()
def window_nll(model, windows, batch=32, device="cuda"):
    """Per window: the summed negative log-likelihood (float64) of tokens 1.. given the tokens before
    them. Perplexity = exp(sum / (windows · (window - 1)))."""
    out = []
    for i in range(0, windows.shape[0], batch):
        x = windows[i: i + batch].to(device)
        logits = model(x, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
        nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1).sum(-1)
        out.append(nll.cpu())
    return torch.cat(out).numpy()


@torch.no_grad()
def token_nll(model, windows, device="cuda"):
    """[n, window - 1] float64: each token's negative log-likelihood given the tokens before it in its window."""
    x = windows.to(device)
    logp = torch.log_softmax(model(x, use_cache=False).logits[:, :-1].double(), dim=-1)
    return (-logp.gather(-1, x[:, 1:, None]).squeeze(-1)).cpu().numpy()


def perplexity(nll, window=WINDOW):
    return float(np.exp(nll.sum() / (len(nll) * (window - 1))))


def round_to_bf16_(model):
    """Every parameter rounded to bf16 (nearest even) in place; the routing biases are buffers and stay
    float32, as on disk."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def int4_expert(w):
    """One routed-expert projection ([out, in] float32 holding bf16 values) -> (packed i32, scale bf16 bits,
    the dequantized float32 weight)."""
    nib, scale_bits = quantize(f32_to_bf16_bits(w.detach().cpu().numpy()))
    packed = pack_nibbles(nib)
    return packed, scale_bits, torch.from_numpy(dequant(packed, scale_bits).astype(np.float32))


def expert_projections(name, t, inter):
    """transformers' fused expert tensors -> {per-expert Kimi name: [out, in]}: gate_up_proj [E, 2I, H]
    holds gate rows then up rows; down_proj [E, H, I]."""
    base = name.rsplit(".", 1)[0]
    out = {}
    for e in range(t.shape[0]):
        if name.endswith("gate_up_proj"):
            out[f"{base}.{e}.gate_proj"] = t[e, :inter]
            out[f"{base}.{e}.up_proj"] = t[e, inter:]
        else:
            out[f"{base}.{e}.down_proj"] = t[e]
    return out


def quantize_experts_(model, inter):
    """Replaces every routed expert's weight by its INT4 value; returns the checkpoint tensors of them."""
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." not in name:
                continue
            for proj, w in expert_projections(name, p.data, inter).items():
                packed, scale_bits, deq = int4_expert(w.float())
                tensors[f"{proj}.weight_packed"] = torch.from_numpy(packed.copy())
                tensors[f"{proj}.weight_scale"] = torch.from_numpy(scale_bits.view(np.int16).copy()).view(
                    torch.bfloat16)
                tensors[f"{proj}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
                w.copy_(deq.to(w.device, w.dtype))
    return tensors


def write_target(out, model, shape, int4_tensors, metadata):
    """config.json + model.safetensors of a bf16-rounded model whose experts `quantize_experts_` replaced."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(int4_tensors)
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name or name == "lm_head.weight":
            continue
        t = t.detach().cpu()
        tensors[name] = t.float().contiguous() if name.endswith("e_score_correction_bias") else \
            t.to(torch.bfloat16).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(config_json(shape, "DeepseekV3ForCausalLM",
                                                 quantization_config=QUANTIZATION_CONFIG, **metadata))


def load_target(model_dir=MODEL_DIR, device="cuda"):
    """The shipped target as transformers' DeepseekV3ForCausalLM in float32, experts dequantized from INT4."""
    from transformers import DeepseekV3ForCausalLM
    raw = json.loads((model_dir / "config.json").read_text())
    shape = {k: raw[k] for k in TARGET_SHAPE}
    model = DeepseekV3ForCausalLM(hf_config(shape))
    saved = load_file(model_dir / "model.safetensors")
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if ".mlp.experts." in name:
            parts = []
            for e in range(t.shape[0]):
                projs = ["gate_proj", "up_proj"] if name.endswith("gate_up_proj") else ["down_proj"]
                ws = []
                for proj in projs:
                    base = f"{name.rsplit('.', 1)[0]}.{e}.{proj}"
                    bits = saved[f"{base}.weight_scale"].view(torch.int16).numpy().view(np.uint16)
                    ws.append(torch.from_numpy(dequant(saved[f"{base}.weight_packed"].numpy(), bits)).float())
                parts.append(torch.cat(ws))
            state[name] = torch.stack(parts)
            assert state[name].shape == t.shape, (name, state[name].shape, t.shape)
        else:
            state[name] = saved[name].float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model.to(device).eval()
