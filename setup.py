"""The optional compiled transpose kernel: `optional=True` makes a failed compile (no compiler, no Python
headers) a warning, never a failed install; syncd then uses its numpy kernel, which writes identical bytes."""

from setuptools import Extension, setup

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
