"""Helpers for the format tests: build valid and deliberately broken checkpoint files as real bytes.

The broken-file builders encode CBOR/JSON independently of syncd's own encoders (cbor2.dumps, json.dumps or
hand-written CBOR heads), so a test never checks the writer against itself. `run_isolated` runs a callable in a
forked child with an address-space limit and reports time and peak-memory growth, so a reader that believes
a file's absurd claims (and allocates them) or hangs fails the test instead of taking the machine down.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import select
import signal
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import cbor2

from syncd.formats.burnpack import MAGIC, Scalar, write_burnpack
from syncd.formats.fileio import TensorFileReader
from syncd.formats.safetensors import write_safetensors
from syncd.formats.table import TensorSpec

__all__ = ["Scalar", "bytes_spec"]


def bytes_spec(
    name: str, dtype: str, shape: Sequence[int], data: Any, param_id: int | None = None, raw_dtype: Any = None
) -> TensorSpec:
    """A spec for bytes already in memory."""
    view = memoryview(data).cast("B")
    return TensorSpec(name, dtype, tuple(shape), len(view), lambda sink: sink.write(view), param_id, raw_dtype)


# ------------------------------------------------------------------------------------------- raw CBOR


def cbor_head(major: int, arg: int) -> bytes:
    """A CBOR item head with the shortest argument encoding (RFC 8949 §3); `arg` may claim anything."""
    if arg < 24:
        return bytes([major << 5 | arg])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if arg < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | code]) + struct.pack(fmt, arg)
    raise ValueError(f"{arg} does not fit a CBOR head")


def cbor_text(text: str | bytes) -> bytes:
    """A CBOR text string; bytes are emitted as they are (so they may be invalid UTF-8)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return cbor_head(3, len(raw)) + raw


def descriptor(dtype: Any, shape: Sequence[int], start: int, end: int, param_id: int | None = None) -> dict:
    desc: dict[str, Any] = {"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]}
    if param_id is not None:
        desc["param_id"] = param_id
    return desc


# ------------------------------------------------------------------------------------------- burnpack


def bpk_bytes(
    tensors: dict[str, Any] | None = None,
    data: bytes = b"",
    *,
    metadata: dict[str, str] | None = None,
    meta_raw: bytes | None = None,
    meta_size: int | None = None,
    magic: int = MAGIC,
    version: int = 1,
    aligned: bool = True,
) -> bytes:
    """A burnpack file: header, CBOR metadata (cbor2, or `meta_raw` verbatim), zero padding, then `data`.

    `meta_size` overrides the size field (to lie about it); `aligned=False` gives the Burn 0.19 layout."""
    if meta_raw is None:
        doc: dict[str, Any] = {"tensors": tensors or {}}
        if metadata:
            doc["metadata"] = metadata
        meta_raw = cbor2.dumps(doc)
    size = len(meta_raw) if meta_size is None else meta_size
    head = struct.pack("<IHI", magic, version, size) + meta_raw
    padding = -len(head) % 256 if aligned else 0
    return head + bytes(padding) + data


def bpk_data_start(blob: bytes) -> int:
    """Where the aligned data section of a burnpack blob starts."""
    (size,) = struct.unpack_from("<I", blob, 6)
    return -(10 + size) // 256 * -256


def write_bpk(path: Path, specs: Sequence[TensorSpec], **kwargs: Any) -> bytes:
    """Write with syncd's writer to a fresh file and return the bytes on disk."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_burnpack(fd, specs, **kwargs)
    finally:
        os.close(fd)
    return path.read_bytes()


def write_st(path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_safetensors(fd, specs, metadata)
    finally:
        os.close(fd)
    return path.read_bytes()


def specs_from_reader(reader: TensorFileReader) -> list[TensorSpec]:
    """The reader's tensors as writer specs, in data order, streaming each one's bytes from the source."""

    def filler(name: str) -> Callable[[Any], None]:
        def fill(sink: Any) -> None:
            for piece in reader.iter_chunks(name, chunk_size=4096):
                sink.write(piece)

        return fill

    return [
        TensorSpec(t.name, t.dtype, t.shape, t.nbytes, filler(t.name), t.param_id, t.raw_dtype) for t in reader.tensors
    ]


# ------------------------------------------------------------------------------------------- safetensors


def st_bytes(header: dict | bytes, data: bytes = b"", *, header_len: int | None = None, pad: bool = True) -> bytes:
    """A safetensors file: u64 LE length, the header (JSON-encoded if a dict, else verbatim), then `data`."""
    text = json.dumps(header, separators=(",", ":")).encode() if isinstance(header, dict) else header
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if header_len is None else header_len) + text + data


def st_entry(dtype: str, shape: Sequence[int], start: int, end: int) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]}


# ------------------------------------------------------------------------------------------- isolation


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def run_isolated(func: Callable[[], Any], *, headroom: int = 512 << 20, timeout: float = 30.0) -> dict[str, Any]:
    """Run `func` in a forked child whose address space may grow by at most `headroom` bytes.

    Returns {"result" or "error": ..., "elapsed": seconds, "rss_growth": bytes}; an exception comes back as
    "error_type" (its class name) and "error" (its str, message, path and tensor). A child still running
    after `timeout` is killed (by its pid) and reported as {"hung": True}."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        report: dict[str, Any] = {}
        try:
            resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + headroom, resource.RLIM_INFINITY))
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            start = time.monotonic()
            try:
                report["result"] = func()
            except BaseException as exc:  # reported to the parent, which asserts on it
                report["error_type"] = type(exc).__name__
                report["traceback"] = traceback.format_exc()
                report["error"] = {
                    "str": str(exc),
                    "message": getattr(exc, "message", None),
                    "path": getattr(exc, "path", None),
                    "tensor": getattr(exc, "tensor", None),
                }
            report["elapsed"] = time.monotonic() - start
            report["rss_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
            payload = pickle.dumps(report)
        except BaseException:
            payload = pickle.dumps({"error_type": "harness", "traceback": traceback.format_exc()})
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    hung = False
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([pipe], [], [], remaining)[0]:
                hung = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = pipe.read(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    if hung:
        return {"hung": True}
    return pickle.loads(b"".join(chunks))
