"""`syncd inspect`: what a checkpoint holds, as an aligned table or one JSON document."""

from __future__ import annotations

import json
import math
import os
from typing import Any, TextIO

from syncd.errors import one_line
from syncd.formats import open_checkpoint
from syncd.formats.burnpack import nan_text
from syncd.formats.fileio import TensorFileReader
from syncd.formats.shards import ShardedReader, is_set_index


def describe(path: str, with_hash: bool = False, top_level_key: str | None = None) -> dict[str, Any]:
    """A checkpoint's description; a sharded set's index (`*.safetensors.index.json`) describes the whole set,
    each tensor with the shard that holds it (its offset is within that shard). `top_level_key`: where a
    PyTorch checkpoint keeps its tensors."""
    reader: TensorFileReader | ShardedReader = (
        ShardedReader(path) if is_set_index(path) else open_checkpoint(path, top_level_key=top_level_key)
    )
    with reader:
        return _describe(reader, with_hash)


def _describe(reader: TensorFileReader | ShardedReader, with_hash: bool) -> dict[str, Any]:
    header = reader.header
    tensors = []
    for info in reader.tensors:
        row: dict[str, Any] = {
            "name": info.name,
            "dtype": info.dtype,
            "shape": list(info.shape),
            "bytes": info.nbytes,
            # decimal strings: param_ids use the full u64 range, which JSON numbers do not hold exactly
            "param_id": None if info.param_id is None else str(info.param_id),
            "offset": info.offset,
        }
        if isinstance(reader, ShardedReader):
            row["shard"] = os.path.basename(reader.reader_for(info.name).path)
        if with_hash:
            row["sha256"] = _tensor_sha256(reader, info.name)
        tensors.append(row)
    return {
        "path": header.path,
        "format": header.format,
        "file_size": header.file_size,
        "header": header.facts | {"tensor_count": len(tensors)} | _index_facts(reader),
        "metadata": header.metadata,
        "scalars": {name: {s.kind: _scalar_value(s.value)} for name, s in header.scalars.items()},
        "tensors": tensors,
    }


def _scalar_value(value: Any) -> Any:
    """A scalar as JSON holds it: a float that is not finite as text ("inf", "-inf", a NaN's bits), which JSON
    has no number for (`Infinity` is no JSON: a reader of --json failed on it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return nan_text(value) if math.isnan(value) else str(value)
    return value


def _index_facts(reader: TensorFileReader | ShardedReader) -> dict[str, Any]:
    if not isinstance(reader, ShardedReader):
        return {}
    # what the index claims next to what the shards hold: loaders ignore total_size, so a wrong one is shown,
    # not refused
    return {"index_total_size": reader.index.total_size, "tensor_bytes": sum(t.nbytes for t in reader.tensors)}


def _tensor_sha256(reader: TensorFileReader | ShardedReader, name: str) -> str:
    import hashlib  # only for --hash

    sha = hashlib.sha256()
    for piece in reader.iter_chunks(name):
        sha.update(piece)
    return sha.hexdigest()


def print_json(doc: dict[str, Any], out: TextIO) -> None:
    json.dump(doc, out, indent=2, ensure_ascii=False, allow_nan=False)
    out.write("\n")


def print_table(doc: dict[str, Any], out: TextIO) -> None:
    facts = {k: v for k, v in doc["header"].items() if k not in ("tensor_key_order", "key_order")}
    out.write(f"{one_line(doc['path'])}: {doc['format']}, {doc['file_size']} bytes\n")
    for key, value in facts.items():
        out.write(f"  {key}: {one_line(value)}\n")
    for section in ("metadata", "scalars"):
        if doc[section]:
            out.write(f"{section}:\n")
            for key, value in doc[section].items():  # (a file's own text: shown, never acted on by the terminal)
                out.write(f"  {one_line(key)}: {one_line(value)}\n")
    columns = ["name", "dtype", "shape", "bytes", "param_id", "offset"]
    columns += [c for c in ("shard", "sha256") if doc["tensors"] and c in doc["tensors"][0]]
    rows = [[_cell(row[c]) for c in columns] for row in doc["tensors"]]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    numeric = {"bytes", "offset"}
    out.write(_line(columns, widths, numeric, columns) + "\n")
    for row in rows:
        out.write(_line(row, widths, numeric, columns) + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return one_line(value)
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _line(cells: list[str], widths: list[int], numeric: set[str], columns: list[str]) -> str:
    parts = [c.rjust(w) if col in numeric else c.ljust(w) for c, w, col in zip(cells, widths, columns, strict=True)]
    return "  ".join(parts).rstrip()
