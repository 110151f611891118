"""megatron's fusions are compiled at their first call, not when a rank imports megatron."""

from __future__ import annotations

import subprocess
import sys

from training.fusion_compile import compile_on_first_call


def test_the_compiler_runs_once_at_the_first_call_and_the_compiled_function_runs_after():
    compiled_for = []

    def fake_compile(fn):
        compiled_for.append(fn.__name__)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    @compile_on_first_call(fake_compile)
    def bias_gelu(x, bias=0):
        return x + bias

    assert compiled_for == []  # decorating compiles nothing
    assert bias_gelu.__name__ == "bias_gelu"
    assert bias_gelu(1, bias=2) == ("compiled", 3)
    assert bias_gelu(5) == ("compiled", 5)
    assert compiled_for == ["bias_gelu"]  # once


def test_a_rank_importing_the_trainer_and_megatron_does_not_import_the_compiler():
    # a fresh interpreter, as a rank starts: the trainer's modules and megatron's, then a fused
    # function of megatron's is the deferred wrapper around torch.compile
    code = (
        "import sys, training.train, training.model, training.checkpointing\n"
        "import megatron.core.distributed, megatron.core.pipeline_parallel, megatron.core.optimizer\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
        "assert jit.jit_fuser.__qualname__.startswith('compile_on_first_call'), jit.jit_fuser\n"
        "assert bias_swiglu.__wrapped__.__name__ == 'bias_swiglu'\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
