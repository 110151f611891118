"""A small client for any OpenAI-compatible chat endpoint, and JSON replies from it.

The agents only ever need "send these messages, give me the text back" and
"find the JSON object in that text and check it has the shape I asked for".
Both are here, so the agents stay about *what* they ask, not *how*.

Failures are values, not crashes: an endpoint that times out or answers 500
raises `LLMUnavailable` once the bounded retries are spent; a reply that holds no
valid JSON of the requested shape raises `MalformedReply`. Callers count them
(`LLMStats`) and fall back; neither can hang a diagnosis for longer than
`timeout_s * (max_retries + 1)` per call.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

logger = logging.getLogger(__name__)

ENV_MODEL = "FORGEFLOW_LLM_MODEL"
ENV_BASE_URL = "FORGEFLOW_LLM_BASE_URL"  # forgeflow's own override, wins over the standard one
ENV_STANDARD_BASE_URL = "OPENAI_BASE_URL"  # what the openai client and most tools read
ENV_API_KEY = "OPENAI_API_KEY"
PUBLIC_BASE_URL = "https://api.openai.com/v1"

# Local OpenAI-compatible servers (vLLM, llama.cpp) accept any key, but the
# `openai` client refuses to start without one.
PLACEHOLDER_API_KEY = "not-needed"


class LLMError(Exception):
    """Base of the errors an LLM call can end in."""


class LLMConfigError(LLMError, ValueError):
    """The LLM configuration is incomplete or invalid."""


class LLMUnavailable(LLMError):
    """The endpoint did not answer usefully (timeout, connection refused, HTTP error)."""


class MalformedReply(LLMError):
    """The endpoint answered, but not with JSON of the requested shape."""


class LLMConfig(BaseModel):
    """Where the agents' LLM lives and how patient to be with it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="model name the endpoint serves")
    base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible base URL ending in /v1; None = $OPENAI_BASE_URL, else api.openai.com",
    )
    api_key: SecretStr = SecretStr(PLACEHOLDER_API_KEY)
    timeout_s: float = Field(default=60.0, gt=0, description="per HTTP request")
    max_retries: int = Field(default=2, ge=0, le=10, description="retries after the first try")
    temperature: float = Field(default=0.7, ge=0, le=2)
    max_tokens: int = Field(default=1024, gt=0)
    context_window: int = Field(default=8192, gt=0, description="for llama-index prompt packing")

    @property
    def endpoint(self) -> str:
        """The one base URL every agent talks to (the openai client and llama-index alike).

        Resolved here, once, so no client falls back to its own default: an explicit
        `base_url`, else FORGEFLOW_LLM_BASE_URL, else the standard OPENAI_BASE_URL,
        else the public endpoint.
        """
        return (
            self.base_url
            or os.environ.get(ENV_BASE_URL)
            or os.environ.get(ENV_STANDARD_BASE_URL)
            or PUBLIC_BASE_URL
        )

    @classmethod
    def from_env(cls, **overrides: Any) -> "LLMConfig | None":
        """The config the environment describes, or None when no model is named.

        The model is forgeflow's setting (FORGEFLOW_LLM_MODEL); the endpoint and key
        are the standard OPENAI_BASE_URL / OPENAI_API_KEY (FORGEFLOW_LLM_BASE_URL
        overrides the URL for forgeflow alone). Explicit `overrides` win over the
        environment. No model means no LLM: the agents then fall back to rules and
        retrieval instead of failing.
        """
        values: dict[str, Any] = {}
        if os.environ.get(ENV_MODEL):
            values["model"] = os.environ[ENV_MODEL]
        own_base_url = os.environ.get(ENV_BASE_URL)
        if own_base_url or os.environ.get(ENV_STANDARD_BASE_URL):
            values["base_url"] = own_base_url or os.environ[ENV_STANDARD_BASE_URL]
        if os.environ.get(ENV_API_KEY):
            values["api_key"] = os.environ[ENV_API_KEY]
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values.get("model"):
            # OPENAI_BASE_URL alone is set for many tools; only forgeflow's own
            # URL without a model is a half-finished forgeflow configuration.
            if own_base_url or overrides.get("base_url"):
                raise LLMConfigError(
                    f"an LLM base URL is set ({values['base_url']}) but no model: "
                    f"set {ENV_MODEL}=<model the endpoint serves> or pass model=..."
                )
            return None
        try:
            return cls(**values)
        except ValidationError as exc:
            raise LLMConfigError(f"invalid LLM config: {exc}") from None


@dataclass
class LLMStats:
    """What happened to the calls an agent made; shown in reports and asserted in tests."""

    calls: int = 0
    replies: int = 0
    unavailable: int = 0
    malformed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def as_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "replies": self.replies,
            "unavailable": self.unavailable,
            "malformed": self.malformed,
        }


class ChatLLM:
    """Sends chat messages to an OpenAI-compatible endpoint and returns the reply text."""

    def __init__(self, config: LLMConfig):
        import openai  # imported here: the CLI must start fast without it

        self.config = config
        self.stats = LLMStats()
        self._openai = openai
        # The client's own retry loop is bounded by max_retries and backs off;
        # it retries timeouts, connection errors, 408/409/429 and 5xx.
        self._client = openai.OpenAI(
            base_url=config.endpoint,
            api_key=config.api_key.get_secret_value(),
            timeout=config.timeout_s,
            max_retries=config.max_retries,
        )

    def chat(self, messages: list[dict[str, str]], *, temperature: float | None = None) -> str:
        """The text of one reply. Raises LLMUnavailable when the endpoint fails."""
        openai = self._openai
        self.stats.count("calls")
        try:
            response = self._client.chat.completions.create(
                model=self.config.model,
                messages=messages,  # type: ignore[arg-type]
                temperature=self.config.temperature if temperature is None else temperature,
                max_tokens=self.config.max_tokens,
            )
        except openai.APITimeoutError:
            self.stats.count("unavailable")
            raise LLMUnavailable(
                f"LLM at {self._where()} did not answer within {self.config.timeout_s:g} s "
                f"({self.config.max_retries} retries); raise timeout_s or check the server"
            ) from None
        except openai.APIStatusError as exc:
            self.stats.count("unavailable")
            raise LLMUnavailable(
                f"LLM at {self._where()} answered HTTP {exc.status_code} "
                f"after {self.config.max_retries} retries: {_short(str(exc))}"
            ) from None
        except openai.APIConnectionError as exc:
            self.stats.count("unavailable")
            raise LLMUnavailable(f"cannot reach LLM at {self._where()}: {exc}") from None
        except openai.OpenAIError as exc:
            self.stats.count("unavailable")
            raise LLMUnavailable(f"LLM call to {self._where()} failed: {exc}") from None
        choices = getattr(response, "choices", None) or []
        content = choices[0].message.content if choices and choices[0].message else None
        if not content:
            self.stats.count("malformed")
            raise MalformedReply("LLM reply had no message content")
        self.stats.count("replies")
        return content

    def chat_json(
        self,
        messages: list[dict[str, str]],
        schema: type[ModelT],
        *,
        temperature: float | None = None,
    ) -> ModelT:
        """One reply parsed into `schema`; MalformedReply (counted) when it does not fit."""
        text = self.chat(messages, temperature=temperature)
        try:
            return parse_json_reply(text, schema)
        except MalformedReply:
            self.stats.count("malformed")
            raise

    def _where(self) -> str:
        return self.config.endpoint


ModelT = TypeVar("ModelT", bound=BaseModel)

_FENCE = re.compile(r"```[ \t]*(?:json|JSON|javascript)?[ \t]*\n?(.*?)```", re.DOTALL)


def extract_json(text: str) -> Any:
    """The first JSON object or array in an LLM reply.

    Tolerant of how models wrap JSON (```json fences, a sentence before or after);
    strict about JSON itself (no trailing commas, no single quotes). Raises
    MalformedReply when there is none.
    """
    if not isinstance(text, str) or not text.strip():
        raise MalformedReply("empty reply")
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for candidate in candidates:
        candidate = candidate.strip()
        for start, char in enumerate(candidate):
            if char not in "{[":
                continue
            try:
                value, _ = decoder.raw_decode(candidate, start)
            except json.JSONDecodeError:
                continue
            return value
    raise MalformedReply(f"no JSON object in reply: {_short(text)!r}")


def parse_json_reply(text: str, schema: type[ModelT]) -> ModelT:
    """The reply's JSON validated against a pydantic model; MalformedReply otherwise."""
    value = extract_json(text)
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()[:5]
        )
        raise MalformedReply(f"reply JSON does not fit {schema.__name__}: {problems}") from None


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
