#!/usr/bin/env python3
"""Train a 4096-token byte-level BPE tokenizer on train/data/train.txt.

What it does
    * Trains a byte-level BPE (HF ``tokenizers``) to 4088 entries: the 256-byte
      ByteLevel alphabet + 3832 merges.  Pre-tokenizer: digits split one by
      one, then GPT-2 style ByteLevel (add_prefix_space=False, use_regex=True);
      decoder ByteLevel; no normalizer, no post-processor.
    * Appends 8 special tokens LAST, ids 4088..4095:
      [BOS] [EOS] <|im_end|> <|im_user|> <|im_assistant|> <|im_system|>
      <|im_middle|> [PAD]  (special=True, normalized=False).
    * Writes tokenizer.json and tokenizer_config.json (same keys and chat
      template as fixtures/tiny_model/tokenizer_config.json) into --out.
    * Encodes train.txt and heldout.txt (plain text, no BOS/EOS inserted) to
      train.u16.npy / heldout.u16.npy (1-D uint16) next to the text files, and
      prints tokens per split and bytes per token.  Encoding is done in ~1 MB
      pieces cut just before a "\\n\\n" paragraph separator, which pre-tokenizes
      exactly like the whole text; this is checked on held-out against a
      single-call encoding, and decode(ids) == text is checked for both splits.

Only standard components are used, so tokenizer.json loads in the Rust
``tokenizers`` crate 0.23.2 (features = ["fancy-regex"]) used by
src/model/tokenizer.rs.  Training is deterministic for a given train.txt.

How to run (from the repository root, after train/corpus.py)
    /work/venv/bin/python train/tokenizer.py [--data train/data] [--out train/data/tokenizer]
Requires: pip install tokenizers==0.22.2 numpy
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

BPE_SIZE = 4088
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
            "<|im_system|>", "<|im_middle|>", "[PAD]"]
VOCAB_SIZE = BPE_SIZE + len(SPECIALS)
PIECE_BYTES = 1 << 20

# Same content as fixtures/tiny_model/tokenizer_config.json.
TOKENIZER_CONFIG = {
    "add_bos_token": False,
    "add_eos_token": False,
    "bos_token": "[BOS]",
    "chat_template": (
        "{%- if messages[0]['role'] != 'system' -%}<|im_system|>system<|im_middle|>"
        "You are a helpful assistant.<|im_end|>{%- endif -%}{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
        "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
        "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
        "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}{%- endif -%}"
        "{{ message['content'] }}<|im_end|>{%- endfor -%}{%- if add_generation_prompt -%}"
        "<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    ),
    "clean_up_tokenization_spaces": False,
    "eos_token": "[EOS]",
    "model_max_length": 4096,
    "pad_token": "[PAD]",
    "tokenizer_class": "PreTrainedTokenizerFast",
}
FIXTURE_CONFIG = REPO / "fixtures" / "tiny_model" / "tokenizer_config.json"


def pieces(text: str, size: int = PIECE_BYTES) -> list[str]:
    """Cut `text` into ~size-char pieces; every piece after the first starts
    with the "\\n\\n" that separates two paragraphs, so the ByteLevel regex
    splits each piece exactly as it splits the whole text."""
    out, start = [], 0
    while start < len(text):
        cut = text.find("\n\n", start + size)
        if cut < 0:
            out.append(text[start:])
            break
        out.append(text[start:cut])
        start = cut
    return out


def build(train_text: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(pieces(train_text), trainer=trainer)
    if tok.get_vocab_size() != BPE_SIZE:
        raise SystemExit(f"FATAL: BPE trained to {tok.get_vocab_size()} tokens, wanted {BPE_SIZE}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    for i, t in enumerate(SPECIALS):
        assert tok.token_to_id(t) == BPE_SIZE + i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tok


def encode(tok: Tokenizer, text: str) -> np.ndarray:
    encs = tok.encode_batch(pieces(text), add_special_tokens=False)
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encs])
    assert ids.max() < BPE_SIZE, "special token id produced from plain text"
    return ids.astype(np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=HERE / "data",
                    help="folder with train.txt / heldout.txt; .u16.npy files go here "
                         "(default: train/data)")
    ap.add_argument("--out", type=Path, default=HERE / "data" / "tokenizer",
                    help="tokenizer output folder (default: train/data/tokenizer)")
    args = ap.parse_args()
    t0 = time.time()
    texts = {s: (args.data / f"{s}.txt").read_text(encoding="utf-8") for s in ("train", "heldout")}

    tok = build(texts["train"])
    t_train = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"), pretty=True)
    cfg = json.dumps(TOKENIZER_CONFIG, indent=2, ensure_ascii=False) + "\n"
    if FIXTURE_CONFIG.is_file():
        assert json.loads(FIXTURE_CONFIG.read_text()) == TOKENIZER_CONFIG, \
            "TOKENIZER_CONFIG drifted from fixtures/tiny_model/tokenizer_config.json"
    (args.out / "tokenizer_config.json").write_text(cfg, encoding="utf-8")

    # Reload from disk so what we check is what we ship.
    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE

    held_whole = np.asarray(tok.encode(texts["heldout"], add_special_tokens=False).ids)
    print(f"{'split':8} {'bytes':>11} {'tokens':>10} {'bytes/tok':>9}")
    for split, text in texts.items():
        ids = encode(tok, text)
        if split == "heldout":
            assert np.array_equal(ids, held_whole), "piecewise encoding != whole-text encoding"
        assert tok.decode(ids.tolist(), skip_special_tokens=False) == text, f"{split}: round trip failed"
        path = args.data / f"{split}.u16.npy"
        np.save(path, ids)
        nbytes = len(text.encode("utf-8"))
        print(f"{split:8} {nbytes:>11,} {len(ids):>10,} {nbytes / len(ids):>9.3f}   "
              f"sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:16]}")
    tj = (args.out / "tokenizer.json").read_bytes()
    print(f"tokenizer.json sha256 {hashlib.sha256(tj).hexdigest()}")
    print(f"trained in {t_train:.1f}s, total {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
