"""The diagnosis vocabulary: root causes, their kinds, and the Diagnosis record.

The root-cause names are the failure taxonomy of the Acme study (NSDI'24, Table 3),
used verbatim so diagnoses can be compared with the published figures, plus the
three training-level outcomes forgeflow adds (LossSpike, Hang, Unknown).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated, Literal

from pydantic import AfterValidator

Kind = Literal["infrastructure", "framework", "script", "training", "unknown"]
# "person": a diagnosis a person confirmed or corrected (`forgeflow diagnose --confirm`)
Source = Literal["rule", "agent", "retrieval", "person", "none"]

INFRASTRUCTURE = (
    "NVLinkError",
    "CUDAError",
    "NodeFailure",
    "ECCError",
    "NetworkError",
    "ConnectionError",
    "S3StorageError",
    "NCCLTimeoutError",
    "NCCLRemoteError",
)
FRAMEWORK = (
    "DataloaderKilled",
    "AttributeError",
    "OutOfMemoryError",
    "RuntimeError",
    "AssertionError",
    "ValueError",
    "ZeroDivisionError",
    "ModelLoadingError",
    "DatasetLoadingError",
)
SCRIPT = (
    "FileNotFoundError",
    "OSError",
    "TypeError",
    "NameError",
    "PermissionError",
    "ImportError",
    "KeyError",
    "SyntaxError",
    "ArgumentError",
    "CalledProcessError",
    "IndexError",
)
TRAINING = ("LossSpike", "Hang")

ROOT_CAUSE_KIND: dict[str, Kind] = {
    **{name: "infrastructure" for name in INFRASTRUCTURE},
    **{name: "framework" for name in FRAMEWORK},
    **{name: "script" for name in SCRIPT},
    **{name: "training" for name in TRAINING},
    "Unknown": "unknown",
}
ROOT_CAUSES: tuple[str, ...] = tuple(ROOT_CAUSE_KIND)
KINDS: tuple[Kind, ...] = ("infrastructure", "framework", "script", "training", "unknown")


class VocabularyError(ValueError):
    """A diagnosis names a root cause or kind outside the vocabulary."""


def kind_of(root_cause: str) -> Kind:
    try:
        return ROOT_CAUSE_KIND[root_cause]
    except KeyError:
        raise VocabularyError(
            f"unknown root_cause {root_cause!r}; use one of: {', '.join(ROOT_CAUSES)}"
        ) from None


def known_root_cause(root_cause: str) -> str:
    """``root_cause`` itself when the vocabulary has it; VocabularyError naming the causes
    there are when not. The check behind ``RootCause``."""
    kind_of(root_cause)
    return root_cause


# A root_cause field of a pydantic model (a rule, an agent's reply): checked by known_root_cause.
RootCause = Annotated[str, AfterValidator(known_root_cause)]


@dataclass
class Diagnosis:
    """What went wrong, how sure we are, and whether restarting can help."""

    root_cause: str
    kind: Kind
    restart_helps: bool
    confidence: float = 1.0
    culprit_lines: list[str] = field(default_factory=list)
    # nodes to check/cordon: the launcher's node names when it gave each node's log, else the
    # hostnames the culprit lines print
    suspect_nodes: list[str] = field(default_factory=list)
    mitigation: str = ""
    source: Source = "rule"
    rule_name: str | None = None
    suspect_ranks: list[int] = field(default_factory=list)
    suspect_gpus: list[str] = field(default_factory=list)  # local GPU index or PCI bus id
    # node -> torchrun local ranks ("[defaultN]:") of culprit lines whose global rank is unknown
    suspect_local_ranks: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        expected = kind_of(self.root_cause)
        if self.kind != expected:
            raise VocabularyError(
                f"root_cause {self.root_cause!r} is of kind {expected!r}, not {self.kind!r}"
            )
        if not 0.0 <= self.confidence <= 1.0:
            raise VocabularyError(f"confidence must be in [0, 1], got {self.confidence}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Diagnosis":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
