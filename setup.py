"""The compiled transpose kernel, and the build backend that makes sure it can be built.

`syncd/engine/write/kernels/_transpose.c` is plain C (no Python headers; loaded with ctypes), so all it needs
is a C compiler. Where the machine has none (a fresh Debian, Ubuntu or Fedora with only Python), the
transposes would run on numpy at a third to a half of the compiled speed (bench/results/results.md). So:

* as a PEP 517 backend (pyproject.toml: `build-backend = "setup"`), this module wraps setuptools' and asks
  for one more build requirement, the `ziglang` wheel (Zig's toolchain, which includes a C compiler, on the
  package index for Linux, macOS and Windows), only when no working C compiler is found;
* as the setup script, it builds the kernel with the machine's compiler, or with `python -m ziglang cc` when
  there is none and ziglang is importable (it is, in the isolated build environment of the first point).

The extension stays `optional`: if even that fails, the install goes on and syncd uses its numpy kernel,
which writes identical bytes (`syncd.engine.write.kernels.KERNEL_NAME` says which one runs).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the other PEP 517 hooks, unchanged)

ZIGLANG = "ziglang>=0.11"


def default_c_compiler() -> list[str]:
    """The compiler setuptools will use: $CC, else the one Python was built with."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def c_compiler_works(compiler: list[str] | None = None) -> bool:
    """True if `compiler` (default: the one setuptools will use) compiles a C file here."""
    compiler = compiler or default_c_compiler()
    if not compiler or shutil.which(compiler[0]) is None:
        return False
    with tempfile.TemporaryDirectory() as scratch:
        source = os.path.join(scratch, "probe.c")
        with open(source, "w") as file:
            file.write("#include <stdint.h>\nint probe(void) { return (int)sizeof(uint64_t); }\n")
        try:
            done = subprocess.run([*compiler, "-c", source, "-o", source + ".o"], capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0


def _ziglang_importable() -> bool:
    try:
        import ziglang  # noqa: F401  (a wheel holding the zig binary; `python -m ziglang cc` runs its clang)
    except ImportError:
        return False
    return True


def _compiler_requirements() -> list[str]:
    return [] if c_compiler_works() else [ZIGLANG]


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    return [*_setuptools.get_requires_for_build_wheel(config_settings), *_compiler_requirements()]


def get_requires_for_build_editable(config_settings: Any = None) -> list[str]:
    return [*_setuptools.get_requires_for_build_editable(config_settings), *_compiler_requirements()]


@contextlib.contextmanager
def ziglang_when_no_compiler() -> Iterator[None]:
    """Within: setuptools pointed at Zig's C compiler (through $CC and $LDSHARED, which it honours) when the
    machine's does not work; the environment as it was, after. `-mcpu=baseline`: zig targets the building CPU
    by default; the kernel's speed comes from SSE2, which every x86-64 has, and a venv may be shared by
    machines of several CPU generations."""
    saved = {name: os.environ.get(name) for name in ("CC", "LDSHARED")}
    if not c_compiler_works() and _ziglang_importable():
        zig = f"{shlex.quote(sys.executable)} -m ziglang cc -mcpu=baseline"
        os.environ["CC"] = zig
        os.environ["LDSHARED"] = f"{zig} -shared"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


if __name__ == "__main__":
    from setuptools import Extension, setup

    with ziglang_when_no_compiler():
        setup(
            ext_modules=[
                Extension(
                    "syncd.engine.write.kernels._transpose",
                    ["syncd/engine/write/kernels/_transpose.c"],
                    extra_compile_args=["-O3"],
                    optional=True,
                )
            ]
        )
