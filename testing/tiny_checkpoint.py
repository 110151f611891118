"""A tiny Llama checkpoint in Hugging Face format, built locally in seconds (no download).

Tests and benchmarks need a real model folder that transformers (and
vLLM) can load offline before any training has run: a random-init
`LlamaForCausalLM`, a byte-level BPE tokenizer trained with `tokenizers` on the
running interpreter's own standard library sources, and a packed held-out token
file (`val.bin`, uint16) for perplexity. Same seed, same files.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"


def _stdlib_text(names: list[str]) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((root / n).read_text(encoding="utf-8", errors="replace") for n in names)


def train_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> object:
    """Train a byte-level BPE tokenizer and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = _stdlib_text(["textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py"])
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_checkpoint(out_dir: str | Path, *, vocab_size: int = 512, hidden: int = 64, layers: int = 2,
                         seed: int = 0, val_tokens: int = 8192) -> Path:
    """Write model + tokenizer to `out_dir` and a `val.bin` (uint16) to `out_dir/data/`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out, vocab_size)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(str(out))
    ids = tokenizer(_stdlib_text(["argparse.py"]), add_special_tokens=False)["input_ids"][:val_tokens]
    data = out / "data"
    data.mkdir(exist_ok=True)
    np.asarray(ids, dtype=np.uint16).tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": len(tokenizer)}))
    return out
