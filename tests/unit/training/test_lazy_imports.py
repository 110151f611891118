"""wandb, which megatron imports eagerly, is loaded when first used, not when a rank starts."""

from __future__ import annotations

import builtins
import subprocess
import sys
import threading
import types

from training import lazy_imports


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_rank_importing_the_trainer_and_megatron_does_not_run_wandb_until_it_is_used():
    # a fresh interpreter, as a rank starts; torch's operator registration reads every module's
    # __file__ (inspect.getmodule) on the way, which must not load it either
    _run("import sys, training.train, training.model, training.checkpointing, training.metrics\n"
         "import megatron.core.distributed, megatron.core.pipeline_parallel, megatron.core.optimizer\n"
         "import megatron.core.timers\n"
         "from megatron.core.inference.contexts import dynamic_context\n"
         "assert dynamic_context.HAVE_WANDB  # megatron still finds it\n"
         "assert 'wandb.sdk' not in sys.modules, 'wandb ran at import'\n"
         "import wandb\n"
         "assert callable(wandb.init) and 'wandb.sdk' in sys.modules  # the first use loads it\n"
         "assert type(sys.modules['wandb']).__name__ == 'module'\n")


def test_a_module_runs_once_at_its_first_read_and_threads_wait_for_that_load(tmp_path, monkeypatch):
    package = tmp_path / "slowpkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import builtins, time\nbuiltins._slowpkg_runs.append(1)\ntime.sleep(0.3)\nVALUE = 42\n")
    monkeypatch.setattr(builtins, "_slowpkg_runs", [], raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    lazy_imports.install(("slowpkg", "not_a_package_anywhere"))
    try:
        import slowpkg

        assert "not_a_package_anywhere" not in sys.modules  # not installed: left to fail as usual
        assert slowpkg.__file__.endswith("__init__.py") and builtins._slowpkg_runs == []  # not run yet
        seen = []
        readers = [threading.Thread(target=lambda: seen.append(slowpkg.VALUE)) for _ in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        assert seen == [42] * 4 and builtins._slowpkg_runs == [1]  # run once, every reader saw it whole
        assert type(slowpkg) is types.ModuleType
    finally:
        sys.modules.pop("slowpkg", None)
