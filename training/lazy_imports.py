"""Modules megatron-core imports when it is imported, loaded when first used instead.

megatron-core 0.16.1 imports `wandb` at the top of modules a rank imports (`megatron.core.timers`,
and `megatron.core.inference.contexts.dynamic_context` through `megatron.core.inference_params`),
inside `try: import wandb`, to know whether it could write metrics there. A rank uses W&B only
when its job asks for it (training.metrics: `metrics.wandb_project`, rank 0 only), yet every
rank of every attempt paid for importing it: 0.59 s of a rank's start-up here (`python -X
importtime`: the self time of the 286 modules only that import brings in), in the standby's
ranks and the suite's hundreds of rank starts alike.

`install()` puts in its place a module object that holds only what the import system set (its
`__spec__`, `__file__`, `__path__`...) and runs the package's code at the first read of any other
name (`wandb.init`, `from wandb import ...`), into that same object. What megatron sees is
unchanged (the import succeeds, so its `HAVE_WANDB` is true as before), and a job that logs to
W&B loads it as before, at its sink's first call. (The standard library's
`importlib.util.LazyLoader` loads at the first read of any name, `__file__` included, and torch
reads every module's `__file__` while it registers its operators, through
`inspect.getmodule`: that loaded it at once.) A package that is not installed is left to fail
as usual; one imported before is left as it is. A second thread's first read waits for the
load the first one started.

`training/__init__.py` installs it next to training.fusion_compile, before megatron is imported.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

LAZY = ("wandb",)


_LOADING = threading.RLock()  # one load at a time: a second thread's first read waits for it
_running: set[str] = set()  # the modules whose code runs now


class _Deferred(types.ModuleType):
    """A module whose code runs at the first read of a name the import system did not set."""

    def __getattr__(self, name: str):  # called only for a name not in the module's dict
        with _LOADING:
            if type(self) is _Deferred:
                if self.__name__ in _running:  # its own code reads a name it has not set yet
                    raise AttributeError(f"partially initialized module {self.__name__!r} has no "
                                         f"attribute {name!r}")
                _running.add(self.__name__)
                try:
                    self.__spec__.loader.exec_module(self)
                finally:
                    _running.discard(self.__name__)
                self.__class__ = types.ModuleType  # an ordinary module from here on
        return getattr(self, name)  # (loaded by this thread or by the one it waited for)


def install(names: tuple[str, ...] = LAZY) -> None:
    """Make each module of `names` that is not imported yet run its code at its first use
    (idempotent; a name imported before, or not installed, is left as it is)."""
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)  # __spec__, __file__, __path__, __loader__
        module.__class__ = _Deferred
        sys.modules[name] = module
