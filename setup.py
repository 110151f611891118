"""The build's one compiled part: the compressor's native line pass (diagnosis/native).

Everything else is in pyproject.toml. ``diagnosis.native._linescan`` is a C++ extension
linking RE2 through its public API (``re2/re2.h``; Debian's ``libre2-dev``, which
``make`` installs). It is optional: without a C++ compiler or RE2's headers the install
goes on without it and the compressor runs its pure-Python scan (same result, slower),
saying so once per process (``diagnosis.native``).
"""

import hashlib
import shlex
import subprocess
from pathlib import Path

from setuptools import Extension, setup

SOURCE = Path("diagnosis/native/linescan.cc")


def _re2_flags() -> tuple[list[str], list[str]]:
    """RE2's compile and link flags from pkg-config (an RE2 built on Abseil needs its
    libraries too); plain ``-lre2`` where pkg-config or its re2.pc is missing."""
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "re2"], capture_output=True, text=True, check=True).stdout
        libs = subprocess.run(["pkg-config", "--libs", "re2"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [], ["-lre2"]
    return shlex.split(cflags), shlex.split(libs)


cflags, libs = _re2_flags()
setup(
    ext_modules=[
        Extension(
            "diagnosis.native._linescan",
            sources=[str(SOURCE)],
            language="c++",
            define_macros=[("FF_SOURCE_SHA256", '"%s"' % hashlib.sha256(SOURCE.read_bytes()).hexdigest())],
            extra_compile_args=["-std=c++17", "-O3", *cflags],
            extra_link_args=libs,
            optional=True,
        )
    ],
)
