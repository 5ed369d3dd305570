"""Helpers for the conversion tests: read checkpoints without syncd, run the real CLI.

The readers here parse both formats from the bytes with struct, json and cbor2 only, so a conversion is never
checked with the code that wrote it.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
from conftest import REPO

from syncd.errors import VerificationError
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.fileio import TensorFileReader

SYNCD_PREFIX = "syncd."


@dataclass(frozen=True)
class Tensor:
    dtype: Any  # bpk: the CBOR DType exactly as stored ("F32", {"Bool": "U8"}, ...); safetensors: "F32", "BOOL"
    shape: tuple[int, ...]
    data: bytes
    param_id: int | None = None


@dataclass
class Checkpoint:
    tensors: dict[str, Tensor]
    order: list[str]  # data order (ascending offset)
    metadata: dict[str, str]
    scalars: dict[str, Any]  # bpk only, as decoded CBOR ({"Float": 0.5}, ...)
    layout: str  # bpk: "aligned" | "packed"; safetensors: "safetensors"

    def own_metadata(self) -> dict[str, str]:
        return {k: v for k, v in self.metadata.items() if not k.startswith(SYNCD_PREFIX)}

    def param_ids(self) -> dict[str, int | None]:
        return {name: t.param_id for name, t in self.tensors.items()}


def read_bpk(path: str | os.PathLike[str]) -> Checkpoint:
    raw = Path(path).read_bytes()
    magic, version, size = struct.unpack("<IHI", raw[:10])
    assert (magic, version) == (0x4255524E, 1), f"{path}: not a burnpack v1 file"
    doc = cbor2.loads(raw[10 : 10 + size])
    descs = doc["tensors"]
    max_end = max((d["data_offsets"][1] for d in descs.values()), default=0)
    unaligned = 10 + size
    aligned = -(-unaligned // 256) * 256
    starts_aligned = all(d["data_offsets"][0] % 256 == 0 for d in descs.values())
    if len(raw) == aligned + max_end and starts_aligned:
        layout, base = "aligned", aligned
    elif len(raw) == unaligned + max_end:
        layout, base = "packed", unaligned
    else:
        raise AssertionError(f"{path}: {len(raw)} bytes fit neither burnpack layout")
    if layout == "aligned":
        assert raw[unaligned:aligned] == bytes(aligned - unaligned), "padding must be zero bytes"
    tensors = {
        name: Tensor(
            d["dtype"],
            tuple(d["shape"]),
            raw[base + d["data_offsets"][0] : base + d["data_offsets"][1]],
            d.get("param_id"),
        )
        for name, d in descs.items()
    }
    order = sorted(descs, key=lambda n: descs[n]["data_offsets"][0])
    return Checkpoint(tensors, order, dict(doc.get("metadata", {})), dict(doc.get("scalars", {})), layout)


def read_safetensors(path: str | os.PathLike[str]) -> Checkpoint:
    raw = Path(path).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + size
    tensors = {
        name: Tensor(e["dtype"], tuple(e["shape"]), raw[base + e["data_offsets"][0] : base + e["data_offsets"][1]])
        for name, e in header.items()
    }
    order = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    return Checkpoint(tensors, order, metadata, {}, "safetensors")


def read_any(path: str | os.PathLike[str]) -> Checkpoint:
    return read_bpk(path) if Path(path).read_bytes()[:4] == b"NRUB" else read_safetensors(path)


def transposed(data: bytes, shape: tuple[int, ...], itemsize: int) -> bytes:
    """The bytes of a row-major [a, b] tensor laid out as [b, a] (elements as opaque byte groups)."""
    return np.frombuffer(data, dtype=f"V{itemsize}").reshape(shape).T.copy().tobytes()


def cli_env(hide: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment a `syncd` subprocess gets: this checkout's code, no debugging tracebacks; `hide` names
    packages that interpreter cannot import (as on a machine without them: `hide=("transformers",)`)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *([hiding(hide)] if hide else [])]))
    env.pop("SYNCD_DEBUG", None)
    return env


def run_cli(
    *args: object, cwd: str | os.PathLike[str] | None = None, hide: tuple[str, ...] = (), timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`syncd ARGS` in a fresh interpreter, as a user runs it (`hide`: see cli_env; `timeout` catches a hang)."""
    return subprocess.run(
        [sys.executable, "-m", "syncd", *map(str, args)],
        cwd=cwd,
        env=cli_env(hide),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def hiding(packages: tuple[str, ...]) -> str:
    """A directory that, put on PYTHONPATH, makes `import NAME` fail for each of `packages` with ImportError,
    before the real one in site-packages is found."""
    directory = Path(tempfile.gettempdir()) / f"syncd-hide-{os.getuid()}-{'-'.join(sorted(packages))}"
    for package in packages:
        init = directory / package / "__init__.py"
        init.parent.mkdir(parents=True, exist_ok=True)
        init.write_text(f"raise ImportError('{package} is not installed here (hidden by the test)')\n")
    return str(directory)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    """Exit `code`, nothing on stdout, exactly one line on stderr containing each fragment, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def dir_listing(path: Path) -> list[str]:
    """Every name in a directory, hidden ones (scratch files) included."""
    return sorted(os.listdir(path))


UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def verify_tensor(
    source: TensorFileReader, src_name: str, output: TensorFileReader, out_name: str, transpose: bool
) -> None:
    """Compare one written tensor with its source directly, without any checksum taken while writing:
    independent of the writer's checks, for tests."""
    info, out_info = source.tensor(src_name), output.tensor(out_name)
    expected_shape = tuple(reversed(info.shape)) if transpose else info.shape
    if out_info.nbytes != info.nbytes or out_info.shape != expected_shape:
        raise VerificationError(
            f"tensor '{out_name}' has shape {list(out_info.shape)}, expected {list(expected_shape)}", output.path
        )
    if not transpose or info.nbytes == 0:
        if source.read(src_name) != output.read(out_name):
            raise VerificationError(f"tensor '{out_name}' differs from its source '{src_name}'", output.path)
        return
    rows, cols = info.shape
    itemsize = ITEMSIZE[info.dtype]
    strip_rows = max(1, (16 << 20) // max(1, cols * itemsize))
    for r0 in range(0, rows, strip_rows):
        n = min(strip_rows, rows - r0)
        src = np.frombuffer(bytearray(n * cols * itemsize), dtype=UINT[itemsize]).reshape(n, cols)
        source.readinto(src_name, r0 * cols * itemsize, memoryview(src).cast("B"))
        got = np.empty((cols, n), dtype=UINT[itemsize])
        view = memoryview(got).cast("B")
        for c in range(cols):
            output.readinto(out_name, (c * rows + r0) * itemsize, view[c * n * itemsize : (c + 1) * n * itemsize])
        if not np.array_equal(got.T, src):
            raise VerificationError(f"tensor '{out_name}' is not the transpose of its source '{src_name}'", output.path)
