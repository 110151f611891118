"""How long `forgeflow prepare` takes for tiny-cpu's corpus, and how fast the sampler serves.

    .venv/bin/python benchmarks/data_prepare.py [CONFIG]   (default configs/tiny-cpu.yaml)
    .venv/bin/python benchmarks/data_prepare.py --smoke    # 1 MB of the corpus, 50 batches: seconds

Prepares into a fresh temporary directory (nothing cached), then reads micro batches
the way the worker does. The last line is one JSON object of the headline figures
(HEADLINE_KEYS).
"""

from __future__ import annotations

import json
import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.headline import checked_headline  # noqa: E402
from training.config import load_job_spec  # noqa: E402
from training.corpus import gather_corpus  # noqa: E402
from training.data import BatchSampler, PackedTokens, prepare_data, split_documents, train_tokenizer  # noqa: E402


HEADLINE_KEYS = ("prepare_s", "reuse_s", "tokens", "prepare_tokens_per_s", "bytes_per_token",
                 "sampler_micro_batches_per_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/tiny-cpu.yaml")
    parser.add_argument("--smoke", action="store_true",
                        help="1 MB of the corpus and 50 sampled batches: seconds, same code path and keys")
    args = parser.parse_args()
    data: dict[str, object] = {"data_dir": None}
    with tempfile.TemporaryDirectory() as tmp:
        data["data_dir"] = tmp
        if args.smoke:
            data["max_corpus_mb"] = 1
        spec = load_job_spec(args.config, {"data": data})
        t0 = time.perf_counter()
        documents = gather_corpus(spec.data.corpus, spec.data.jsonl_text_key, spec.data.max_corpus_mb)
        read_s = time.perf_counter() - t0
        corpus_mb = sum(len(d.text.encode()) for d in documents) / 2**20
        train_docs, _ = split_documents(documents, spec.data.val_fraction)
        t0 = time.perf_counter()
        train_tokenizer(train_docs, spec.model.vocab_size)
        bpe_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        prepared = prepare_data(spec, progress=False)
        prepare_s = time.perf_counter() - t0
        tokens = prepared.train_tokens + prepared.val_tokens
        t0 = time.perf_counter()
        again = prepare_data(spec, progress=False)
        reuse_s = time.perf_counter() - t0
        assert again.reused

        cfg = spec.training
        sampler = BatchSampler(PackedTokens(prepared.train_path, spec.model.seq_length), cfg.seed)
        sampler.get_micro_batch(0, 0, 1, 0, cfg.micro_batch_size, cfg.global_batch_size)  # imports torch
        n = 50 if args.smoke else 500
        t0 = time.perf_counter()
        for step in range(n):
            sampler.get_micro_batch(step, 0, 1, 0, cfg.micro_batch_size, cfg.global_batch_size)
        batches_per_s = n / (time.perf_counter() - t0)

    print(f"corpus: {len(documents)} documents, {corpus_mb:.1f} MiB (read in {read_s:.2f} s)")
    print(f"BPE tokenizer (vocab {spec.model.vocab_size}) trained in {bpe_s:.2f} s")
    print(f"prepare_data from scratch: {prepare_s:.2f} s, {tokens:,} tokens "
          f"({prepared.train_tokens:,} train / {prepared.val_tokens:,} val), "
          f"{corpus_mb * 2**20 / tokens:.2f} bytes/token, {tokens / prepare_s:,.0f} tokens/s")
    print(f"prepare_data again (reused): {reuse_s:.2f} s")
    print(f"sampler: {batches_per_s:,.0f} micro batches/s "
          f"({cfg.micro_batch_size} x {spec.model.seq_length} tokens)")
    print(json.dumps(checked_headline({"prepare_s": round(prepare_s, 2), "reuse_s": round(reuse_s, 2),
                    "tokens": tokens, "prepare_tokens_per_s": round(tokens / prepare_s),
                    "bytes_per_token": round(corpus_mb * 2**20 / tokens, 3),
                    "sampler_micro_batches_per_s": round(batches_per_s)}, HEADLINE_KEYS)), flush=True)


if __name__ == "__main__":
    main()
