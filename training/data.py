"""`forgeflow prepare`: corpus -> byte-level BPE tokenizer -> packed token files.

Layout of `spec.data.data_dir` after `prepare_data(spec)`::

    tokenizer/        tokenizer.json, tokenizer_config.json, special_tokens_map.json
                      (Hugging Face format: AutoTokenizer and vLLM load it offline)
    train.bin         every training document's tokens followed by <|endoftext|>,
    val.bin           back to back (numpy memmap; uint16 if vocab < 65536 else uint32)
    meta.json         dtype, token counts, vocab, corpus fingerprint — written LAST

The split into train and validation is by document: a fixed-seed shuffle of the
documents, then documents go to validation until they hold `val_fraction` of the
corpus bytes. The tokenizer is trained on the training documents only.

Idempotent and crash-safe: everything is written under temporary names and
renamed into place, and `meta.json` (the "complete" mark) goes last and is
removed first, so a prepare that was killed never leaves data that looks
complete. A second call with the same corpus (same content fingerprint), vocab
and split returns the existing files without work.

The corpus is held in memory while it is prepared (tiny-cpu's 12 MB stdlib corpus
prepares in a few seconds on 2 cores); cap large corpora with `data.max_corpus_mb`.

Reading the data for training is `training.sampler` (re-exported here).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from infra.atomic_write import atomic_write_json
from training.config import JobSpec
from training.corpus import DataError, Document, corpus_fingerprint, gather_corpus
from training.sampler import (  # noqa: F401  (re-exported: the worker's entry points)
    META_NAME,
    BatchSampler,
    PackedTokens,
    SkippedBatches,
    eval_batches,
    micro_batches_per_rank,
    read_meta,
)

# Bump when the layout or tokenizer recipe changes: older prepared data is then redone.
FORMAT_VERSION = 1
EOT_TOKEN = "<|endoftext|>"  # document separator; also bos/eos for Hugging Face
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOT_TOKEN, PAD_TOKEN)  # the BPE trainer gives them ids 0, 1
_BYTE_ALPHABET = 256
_SPLIT_SEED = 0  # the train/val document split must not depend on the training seed
_ENCODE_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class PreparedData:
    data_dir: Path
    tokenizer_dir: Path
    train_path: Path
    val_path: Path
    meta_path: Path
    dtype: str
    vocab_size: int  # the model's vocabulary (>= the tokenizer's)
    tokenizer_vocab_size: int
    eot_token_id: int
    pad_token_id: int
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int
    corpus_fingerprint: str
    reused: bool = False  # True when an earlier prepare's files were returned as they were


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size < 65536 else "uint32"


def _prepare_key(spec: JobSpec, fingerprint: str) -> dict:
    """What the prepared files depend on; a different key means prepare again."""
    return {
        "format_version": FORMAT_VERSION,
        "corpus_fingerprint": fingerprint,
        "vocab_size": spec.model.vocab_size,
        "val_fraction": spec.data.val_fraction,
    }


def load_prepared(data_dir: str | Path, reused: bool = True) -> PreparedData:
    """The PreparedData that `meta.json` in `data_dir` describes."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    return PreparedData(
        data_dir=data_dir,
        tokenizer_dir=data_dir / "tokenizer",
        train_path=data_dir / "train.bin",
        val_path=data_dir / "val.bin",
        meta_path=data_dir / META_NAME,
        dtype=meta["dtype"],
        vocab_size=meta["vocab_size"],
        tokenizer_vocab_size=meta["tokenizer_vocab_size"],
        eot_token_id=meta["eot_token_id"],
        pad_token_id=meta["pad_token_id"],
        train_tokens=meta["train_tokens"],
        val_tokens=meta["val_tokens"],
        train_documents=meta["train_documents"],
        val_documents=meta["val_documents"],
        corpus_fingerprint=meta["corpus_fingerprint"],
        reused=reused,
    )


def _existing(data_dir: Path, key: dict) -> PreparedData | None:
    """The prepared data already in `data_dir` if it is complete and matches `key`."""
    try:
        meta = read_meta(data_dir)
    except (DataError, json.JSONDecodeError):
        return None
    if any(meta.get(k) != v for k, v in key.items()):
        return None
    prepared = load_prepared(data_dir)
    itemsize = np.dtype(prepared.dtype).itemsize
    for path, count in ((prepared.train_path, prepared.train_tokens),
                        (prepared.val_path, prepared.val_tokens)):
        if not path.is_file() or path.stat().st_size != count * itemsize:
            return None
    if not (prepared.tokenizer_dir / "tokenizer.json").is_file():
        return None
    return prepared


@contextlib.contextmanager
def _exclusive(data_dir: Path) -> Iterator[None]:
    """One prepare per data_dir at a time (two ranks or two commands may race)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def split_documents(documents: list[Document], val_fraction: float
                    ) -> tuple[list[Document], list[Document]]:
    """(train, val) by document; val holds about `val_fraction` of the bytes, >= 1 doc."""
    if len(documents) < 2:
        train_part, val_part = _split_single(documents[0], val_fraction)
        return [train_part], [val_part]
    sizes = np.array([len(d.text) for d in documents], dtype=np.int64)
    order = np.random.Generator(np.random.PCG64(_SPLIT_SEED)).permutation(len(documents))
    target = val_fraction * sizes.sum()
    val_ids: set[int] = set()
    held = 0
    for i in order[:-1]:  # always leave one document for training
        if val_ids and held >= target:
            break
        val_ids.add(int(i))
        held += sizes[i]
    train = [d for i, d in enumerate(documents) if i not in val_ids]
    val = [d for i, d in enumerate(documents) if i in val_ids]
    return train, val


def _split_single(doc: Document, val_fraction: float) -> list[Document]:
    # One document (e.g. a single big text file): cut it at a line boundary instead.
    cut = int(len(doc.text) * (1 - val_fraction))
    newline = doc.text.rfind("\n", 0, cut)
    cut = newline + 1 if newline > 0 else cut
    if cut <= 0 or cut >= len(doc.text):
        raise DataError(f"data.corpus: {doc.name} is too short to split into train and "
                        "validation parts; add more text")
    return [Document(doc.name + "#train", doc.text[:cut]), Document(doc.name + "#val", doc.text[cut:])]


def train_tokenizer(documents: list[Document], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `documents`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < _BYTE_ALPHABET + len(SPECIAL_TOKENS):
        raise DataError(f"model.vocab_size ({vocab_size}) is below the {_BYTE_ALPHABET} bytes + "
                        f"{len(SPECIAL_TOKENS)} special tokens a byte-level BPE needs; raise it")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((d.text for d in documents), trainer, length=len(documents))
    learned = tokenizer.get_vocab_size()
    if learned < vocab_size:
        raise DataError(
            f"the corpus is too small for model.vocab_size {vocab_size}: byte-level BPE found "
            f"only {learned} tokens; add text (raise data.max_corpus_mb or add files) or "
            f"lower model.vocab_size to at most {learned}"
        )
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, "BpeTrainer puts special tokens first"
    return tokenizer


def save_hf_tokenizer(tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + configs that transformers (4.x and 5.x) and vLLM load offline."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # No unk_token: byte-level BPE encodes every string.
    special = {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "pad_token": PAD_TOKEN}
    config = {
        # The class name every transformers version knows; 5.x maps it to its fast backend.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _encode_to_file(tokenizer, documents: list[Document], path: Path, dtype: str,
                    eot_id: int, advance) -> int:
    """Tokenize documents in parallel batches and append them to `path`; returns #tokens."""
    total = 0
    with open(path, "wb") as out:
        chunk: list[Document] = []
        chunk_bytes = 0

        def flush() -> int:
            written = 0
            # encode_batch runs on all cores (Rust threads); order is preserved.
            for enc in tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False):
                ids = np.asarray(enc.ids + [eot_id], dtype=dtype)
                ids.tofile(out)
                written += len(ids)
            advance(sum(len(d.text) for d in chunk))
            return written

        for doc in documents:
            chunk.append(doc)
            chunk_bytes += len(doc.text)
            if chunk_bytes >= _ENCODE_CHUNK_BYTES:
                total += flush()
                chunk, chunk_bytes = [], 0
        if chunk:
            total += flush()
        out.flush()
        os.fsync(out.fileno())
    return total


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, SpinnerColumn, TaskProgressColumn,
                               TextColumn, TimeElapsedColumn)

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TaskProgressColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not enabled)


def _check_enough_tokens(prepared: PreparedData, seq_length: int) -> None:
    for split, count in (("train", prepared.train_tokens), ("validation", prepared.val_tokens)):
        if count < seq_length + 1:
            raise DataError(
                f"the {split} split has {count} tokens, fewer than one sample of model.seq_length "
                f"{seq_length} (+1); add text to data.corpus (or raise data.max_corpus_mb"
                + (", data.val_fraction" if split == "validation" else "") + ")"
            )


def prepare_data(spec: JobSpec, progress: bool = True) -> PreparedData:
    """Make (or reuse) the tokenizer and packed token files for `spec`; see module doc."""
    cfg = spec.data
    data_dir = Path(cfg.data_dir)
    with _progress(progress) as bar:
        reading = bar.add_task("reading corpus", total=None)
        documents = gather_corpus(cfg.corpus, cfg.jsonl_text_key, cfg.max_corpus_mb)
        fingerprint = corpus_fingerprint(documents)
        bar.update(reading, total=1, completed=1,
                   description=f"read corpus: {len(documents)} documents")
        key = _prepare_key(spec, fingerprint)
        with _exclusive(data_dir):
            existing = _existing(data_dir, key)
            if existing is not None:
                _check_enough_tokens(existing, spec.model.seq_length)
                return existing
            prepared = _prepare(spec, documents, key, data_dir, bar)
    _check_enough_tokens(prepared, spec.model.seq_length)
    return prepared


def _prepare(spec: JobSpec, documents: list[Document], key: dict, data_dir: Path,
             bar) -> PreparedData:
    meta_path = data_dir / META_NAME
    meta_path.unlink(missing_ok=True)  # from here on the directory is "incomplete"
    for stale in [*data_dir.glob("*.tmp-*"), *data_dir.glob(".*.tmp")]:  # left by a prepare that was killed
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    train_docs, val_docs = split_documents(documents, spec.data.val_fraction)

    fitting = bar.add_task(f"training BPE tokenizer (vocab {spec.model.vocab_size})", total=None)
    tokenizer = train_tokenizer(train_docs, spec.model.vocab_size)
    bar.update(fitting, total=1, completed=1)

    suffix = f".tmp-{os.getpid()}"
    tok_tmp = data_dir / f"tokenizer{suffix}"
    shutil.rmtree(tok_tmp, ignore_errors=True)
    save_hf_tokenizer(tokenizer, tok_tmp, spec.model.seq_length)

    dtype = token_dtype(spec.model.vocab_size)
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    counts = {}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        task = bar.add_task(f"tokenizing {split} ({len(docs)} documents)",
                            total=sum(len(d.text) for d in docs))
        counts[split] = _encode_to_file(tokenizer, docs, data_dir / f"{split}.bin{suffix}", dtype,
                                        eot_id, lambda n, task=task: bar.advance(task, n))

    tok_dir = data_dir / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    os.replace(tok_tmp, tok_dir)
    for split in ("train", "val"):
        os.replace(data_dir / f"{split}.bin{suffix}", data_dir / f"{split}.bin")

    prepared = PreparedData(
        data_dir=data_dir, tokenizer_dir=tok_dir, train_path=data_dir / "train.bin",
        val_path=data_dir / "val.bin", meta_path=meta_path, dtype=dtype,
        vocab_size=spec.model.vocab_size, tokenizer_vocab_size=tokenizer.get_vocab_size(),
        eot_token_id=eot_id, pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
        train_tokens=counts["train"], val_tokens=counts["val"],
        train_documents=len(train_docs), val_documents=len(val_docs),
        corpus_fingerprint=key["corpus_fingerprint"], reused=False,
    )
    meta = {k: v for k, v in asdict(prepared).items()
            if k not in {"data_dir", "tokenizer_dir", "train_path", "val_path", "meta_path", "reused"}}
    meta.update(key, corpus=list(spec.data.corpus), max_corpus_mb=spec.data.max_corpus_mb)
    atomic_write_json(meta_path, meta, indent=2)  # last: now the directory is complete
    return prepared
