"""Inference backends: one small interface, a registry, two implementations.

A backend loads a Hugging Face model folder and answers two questions:

- `generate(prompts, config)`: for each prompt (token ids), `config.n` texts;
- `loglikelihood(pairs)`: for each (context ids, continuation ids), the summed
  log-probability of the continuation and whether greedy decoding would have
  produced it.

`run_shard` (shared by all backends) turns a shard's tokenised requests into the
JSONL records of `evalsuite.records`, so every backend writes the same schema.

``transformers`` runs anywhere (CPU or GPU). ``vllm`` is GPU-only, lives in the
optional ``[gpu]`` extra and is imported only when used; it cannot run on a
CPU-only machine, so its code is kept to the few calls vLLM's documented API
needs and is exercised only where a GPU and vLLM are present.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evalsuite.datasets import EvalDataset, GenerationConfig, TokenizedRequest
from evalsuite.errors import (BackendUnavailableError, DuplicateBackendError, EvalConfigError,
                              UnknownBackendError)
from evalsuite.records import CompletionRecord, GenerationRecord, LoglikelihoodRecord, ShardWriter


class BackendOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    batch_size: int = Field(default=8, gt=0, description="requests per forward pass (transformers)")
    torch_threads: int | None = Field(default=None, gt=0, description="intra-op CPU threads per trial")
    # vLLM only
    tensor_parallel_size: int = Field(default=1, gt=0)
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    max_model_len: int | None = Field(default=None, gt=0)


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """Cut `text` at the earliest stop sequence (backends may overshoot by a few tokens)."""
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if s and i != -1:
            cut = min(cut, i)
    return text[:cut]


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class Backend(ABC):
    name: ClassVar[str]

    def __init__(self, model_path: str | Path, options: BackendOptions) -> None:
        self.model_path = str(model_path)
        self.options = options

    @abstractmethod
    def generate(self, prompts: list[list[int]], config: GenerationConfig) -> list[list[str]]:
        """`config.n` completions (text, stop sequences not yet cut) per prompt."""

    @abstractmethod
    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, continuation is the greedy one) per pair."""

    def close(self) -> None:
        """Release the model (GPU memory) before the next trial loads one."""

    @classmethod
    def import_dependencies(cls) -> None:
        """Import heavy modules once, from the main thread, before slot threads start:
        transformers' lazy module is not safe to import from two threads at once."""

    @property
    def chunk_size(self) -> int:
        return self.options.batch_size

    @classmethod
    def batch_granularity(cls, options: BackendOptions) -> int:
        """Requests answered in one pass, known before loading: the planner cuts split datasets
        at multiples of it (a partly filled pass costs about as much as a full one)."""
        return options.batch_size

    def run_shard(self, dataset: EvalDataset, requests: list[TokenizedRequest], writer: ShardWriter,
                  on_progress: Callable[[int], None] | None = None) -> CompletionRecord:
        """Answer every request of one shard, writing records as they come; completion last."""
        started = time.perf_counter()
        for chunk in _batches(requests, self.chunk_size):
            if dataset.kind == "generate":
                gen = dataset.generation or GenerationConfig()
                texts = self.generate([r.prompt_ids for r in chunk], gen)
                for req, outs in zip(chunk, texts, strict=True):
                    writer.write(GenerationRecord(request_id=req.request_id, sample_index=req.sample_index,
                                                  outputs=[truncate_at_stop(t, gen.stop) for t in outs]))
            else:
                scores = self.loglikelihood([(r.context_ids, r.continuation_ids) for r in chunk])
                for req, (logprob, greedy) in zip(chunk, scores, strict=True):
                    writer.write(LoglikelihoodRecord(request_id=req.request_id, sample_index=req.sample_index,
                                                     logprob=logprob, is_greedy=greedy,
                                                     num_tokens=len(req.continuation_ids)))
            if on_progress:
                on_progress(len(chunk))
        return writer.finish(time.perf_counter() - started)


# ----------------------------------------------------------------------------- registry

_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(name: str) -> Callable[[type[Backend]], type[Backend]]:
    def decorate(cls: type[Backend]) -> type[Backend]:
        if name in _BACKENDS and _BACKENDS[name] is not cls:
            raise DuplicateBackendError(f"backend {name!r} is already registered by {_BACKENDS[name].__qualname__}")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return decorate


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def parse_backend_options(options: dict[str, Any] | BackendOptions | None) -> BackendOptions:
    if isinstance(options, BackendOptions):
        return options
    try:
        return BackendOptions.model_validate(options or {})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise EvalConfigError(f"backend options: {problems}") from None


def backend_class(name: str) -> type[Backend]:
    if name not in _BACKENDS:
        raise UnknownBackendError(f"unknown backend {name!r}; known: {', '.join(available_backends())}")
    return _BACKENDS[name]


def load_backend(name: str, model_path: str | Path, options: dict[str, Any] | BackendOptions | None = None) -> Backend:
    return backend_class(name)(model_path, parse_backend_options(options))


# ----------------------------------------------------------------------------- transformers

@register_backend("transformers")
class TransformersBackend(Backend):
    """Hugging Face transformers on CPU or one GPU; batched, left-padded generation."""

    @classmethod
    def import_dependencies(cls) -> None:
        import torch  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria  # noqa: F401

    def __init__(self, model_path: str | Path, options: BackendOptions) -> None:
        super().__init__(model_path, options)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # trials report their own progress

        if options.torch_threads:
            torch.set_num_threads(options.torch_threads)
        device = options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
                 "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[options.dtype]
        self.torch, self.device = torch, torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device).eval()
        cfg = self.model.config
        self.max_len = int(getattr(cfg, "max_position_embeddings", 2048))
        self.eos_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else cfg.eos_token_id
        self.pad_id = next((t for t in (self.tokenizer.pad_token_id, self.eos_id) if t is not None), 0)

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def generate(self, prompts: list[list[int]], config: GenerationConfig) -> list[list[str]]:
        torch = self.torch
        keep = max(1, self.max_len - config.max_new_tokens)
        prompts = [p[-keep:] if p else [self.eos_id or 0] for p in prompts]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        torch.manual_seed(config.seed)
        sample = config.temperature > 0
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=config.max_new_tokens, do_sample=sample,
                temperature=config.temperature if sample else None, top_p=config.top_p if sample else None,
                num_return_sequences=config.n, pad_token_id=self.pad_id, eos_token_id=self.eos_id,
                stopping_criteria=self._stop_criteria(width, config.stop),
            )
        texts = self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return [texts[i * config.n : (i + 1) * config.n] for i in range(len(prompts))]

    def _stop_criteria(self, prompt_width: int, stop: list[str]) -> Any:
        from transformers import StoppingCriteria, StoppingCriteriaList

        if not stop:
            return None
        tokenizer, torch = self.tokenizer, self.torch

        class _StopStrings(StoppingCriteria):
            # Per-sequence: a finished row stops growing while the others continue.
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                texts = tokenizer.batch_decode(input_ids[:, prompt_width:], skip_special_tokens=True)
                return torch.tensor([any(s in t for s in stop) for t in texts], device=input_ids.device)

        return StoppingCriteriaList([_StopStrings()])

    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        torch = self.torch
        rows = []
        for ctx, cont in pairs:
            seq = (list(ctx) + list(cont))[-(self.max_len + 1):]  # keep the continuation, cut old context
            # Scored tokens: the continuation, less any the window cut (an empty context
            # leaves the first token without anything to condition it).
            rows.append((seq[:-1], seq[1:], min(len(cont), len(seq) - 1)))
        width = max(len(inp) for inp, _, _ in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (inp, _, _) in enumerate(rows):  # right padding: positions line up with targets
            ids[i, : len(inp)] = torch.tensor(inp)
            mask[i, : len(inp)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            logprobs = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for i, (inp, target, n_cont) in enumerate(rows):
            span = slice(len(inp) - n_cont, len(inp))
            tgt = torch.tensor(target[-n_cont:], device=logprobs.device)
            lp = logprobs[i, span].gather(-1, tgt[:, None]).squeeze(-1)
            greedy = bool((logprobs[i, span].argmax(-1) == tgt).all())
            out.append((float(lp.sum()), greedy))
        return out


# ----------------------------------------------------------------------------- vLLM (GPU only)

@register_backend("vllm")
class VllmBackend(Backend):
    """vLLM's offline engine, `LLM(model=local_path)`. Needs CUDA and the [gpu] extra; not run here.

    One engine per slot: the trial's own process sees only its slot's GPUs
    (CUDA_VISIBLE_DEVICES), and the engine's tensor-parallel size is their count
    (`evalsuite.trials.backend_options_for`). vLLM cannot be pointed at one GPU of
    several from inside a process, so a device other than the visible ones is refused.
    """

    def __init__(self, model_path: str | Path, options: BackendOptions) -> None:
        super().__init__(model_path, options)
        if options.device not in ("auto", "cuda", "cuda:0"):
            raise EvalConfigError(
                f"backend 'vllm' runs on the GPUs its process sees (CUDA_VISIBLE_DEVICES), not device "
                f"{options.device!r}: give the suite devices per slot (e.g. [cuda:0, 'cuda:1,2']) with "
                "isolation: process")
        try:
            from vllm import LLM
        except ImportError as e:
            raise BackendUnavailableError(
                f"backend 'vllm' needs vLLM and a CUDA GPU ({e}); install forgeflow[gpu] on a GPU node "
                "or use backend: transformers"
            ) from None
        kwargs: dict[str, Any] = dict(model=self.model_path, tensor_parallel_size=options.tensor_parallel_size,
                                      gpu_memory_utilization=options.gpu_memory_utilization)
        if options.dtype != "auto":
            kwargs["dtype"] = options.dtype
        if options.max_model_len:
            kwargs["max_model_len"] = options.max_model_len
        self.llm = LLM(**kwargs)

    @property
    def chunk_size(self) -> int:
        return 1 << 30  # hand vLLM the whole shard: its scheduler batches continuously

    @classmethod
    def batch_granularity(cls, options: BackendOptions) -> int:
        return 1        # continuous batching: any cut is as good

    def close(self) -> None:
        del self.llm

    def generate(self, prompts: list[list[int]], config: GenerationConfig) -> list[list[str]]:
        from vllm import SamplingParams

        params = SamplingParams(n=config.n, temperature=config.temperature, top_p=config.top_p,
                                max_tokens=config.max_new_tokens, stop=config.stop or None, seed=config.seed)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[c.text for c in o.outputs] for o in outs]

    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        from vllm import SamplingParams

        # prompt_logprobs=1 returns, per prompt position, the actual token's logprob and rank.
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = self.llm.generate([{"prompt_token_ids": list(c) + list(t)} for c, t in pairs], params, use_tqdm=False)
        results = []
        for (ctx, cont), o in zip(pairs, outs, strict=True):
            total, greedy = 0.0, True
            for pos, token in enumerate(cont, start=len(ctx)):
                if o.prompt_logprobs[pos] is None:
                    continue  # the first prompt token has no prediction (empty context)
                entry = o.prompt_logprobs[pos][token]
                total += entry.logprob
                greedy = greedy and entry.rank == 1
            results.append((total, greedy))
        return results
