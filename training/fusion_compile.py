"""megatron-core's fused kernels compiled when first called, not when megatron is imported.

megatron-core 0.16.1 decorates its fusions (bias-GeLU, GeGLU, SwiGLU, RoPE, ...) with
`megatron.core.jit.jit_fuser`, which is `torch.compile` on torch >= 2.2 (jit.py:16-33).
Calling `torch.compile(fn)` compiles nothing yet, but it imports torch._dynamo and
inductor's compile_fx: 1.6 of the 4.0 s it takes a rank to import the trainer and megatron
on this machine (`python -X importtime`), paid by every rank of every attempt, while a job
that never calls a fused function (forgeflow's Llama-style models on the local layer spec)
never compiles anything.

What it saves a rank is less than that: torch.optim's constructor imports torch._dynamo at its
first call anyway (`torch._disable_dynamo`), so a rank still imports dynamo when it builds its
optimizer; what it no longer imports is inductor's compiler (compile_fx and what it pulls in):
0.9 s of CPU per rank start here (user time of a whole tiny training run, 5.2-5.6 s against
4.1-4.9 s, side by side). A standby rank (training.standby) imports dynamo before its gate.

`install()` makes `jit_fuser` a decorator that calls `torch.compile(fn)` on the function's
first call and the compiled function from then on: what megatron compiles and when it
compiles it (at the first call, as torch.compile does) is unchanged; only the import of the
compiler moves to that first call. It hooks the import of `megatron.core.jit` itself (a
finder on `sys.meta_path` that runs megatron's module, then wraps its `jit_fuser`), because
every fusion module reads `jit_fuser` by name while megatron.core is still being imported:
there is no moment between importing megatron and its fusions when the name could be set.
If megatron disabled the fuser (`noop_decorator`: torch older than 2.2), nothing changes.

`training/__init__.py` installs it, so every process that imports forgeflow's trainer gets
it before megatron is imported; it imports nothing heavy itself.
"""

from __future__ import annotations

import functools
import importlib.machinery
import sys

MODULE = "megatron.core.jit"


def compile_on_first_call(compile_fn):
    """A decorator like `compile_fn` (torch.compile) that calls it at the function's first call."""

    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def run(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn)
            return compiled(*args, **kwargs)

        return run

    return decorate


class _DeferredJitFuser:
    """Finds `megatron.core.jit` as Python would, and wraps its `jit_fuser` once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            fuser = getattr(module, "jit_fuser", None)
            if fuser is not None and fuser is not getattr(module, "noop_decorator", None):
                module.jit_fuser = compile_on_first_call(fuser)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Defer megatron's fusion compiles in this process (idempotent; no effect on a
    `megatron.core.jit` imported before)."""
    if not any(isinstance(f, _DeferredJitFuser) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferredJitFuser())

