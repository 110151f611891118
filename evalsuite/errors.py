"""Typed errors of the evaluation library. Flows decide what to do about them."""

from __future__ import annotations


class EvalError(RuntimeError):
    """Base class: something about an evaluation cannot proceed."""


class EvalConfigError(EvalError, ValueError):
    """A suite, task file or option is wrong; the message names it and the fix."""


class UnknownDatasetError(EvalConfigError, KeyError):
    """A dataset name is not in the registry."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateDatasetError(EvalConfigError):
    """Two datasets were registered under one name."""


class DuplicateBackendError(EvalConfigError):
    """Two inference backends were registered under one name."""


class UnknownBackendError(EvalConfigError, KeyError):
    """An inference backend name is not in the registry."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(EvalError):
    """A backend's optional dependency (e.g. vLLM, a GPU) is missing on this machine."""


class PreloadError(EvalError):
    """The checkpoint could not be copied to the node-local preload directory."""


class TrialError(EvalError):
    """A trial (inference over one or more shards) failed."""
