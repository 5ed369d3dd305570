"""What one format cannot hold, carried in the other's metadata under a `syncd.` prefix.

burnpack has param_ids, Burn-only dtypes, a data order, a metadata map and scalars; safetensors has a
string-to-string `__metadata__` and PyTorch-only tensors (BatchNorm `num_batches_tracked`) that a Burn model
has no slot for. Each is written as a JSON string value so it survives any safetensors or burnpack reader,
and read back strictly: a malformed carried value is a FormatError, never silently half-applied.

This module owns the protocol in both directions: `for_safetensors`/`for_burnpack`/`stamp` write it, `parse`
reads it.
"""

from __future__ import annotations

import base64
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from syncd.adapters import BURN, PYTORCH
from syncd.errors import FormatError
from syncd.formats import BURNPACK
from syncd.formats.burnpack import LAYOUT_ALIGNED, LAYOUT_PACKED, NAN_PREFIX, Scalar, nan_text
from syncd.formats.dtypes import ITEMSIZE, byte_length
from syncd.formats.shards import ShardLayout
from syncd.formats.table import CheckpointHeader, TensorInfo

PREFIX = "syncd."
SOURCE = "syncd.source"
LAYOUT = "syncd.layout"
PARAM_IDS = "syncd.param_ids"
DTYPES = "syncd.dtypes"
DATA_ORDER = "syncd.data_order"
BURN_METADATA = "syncd.burnpack_metadata"
BURN_LAYOUT = "syncd.burnpack_layout"
SCALARS = "syncd.scalars"
DROPPED = "syncd.dropped"
SAFETENSORS_METADATA = "syncd.safetensors_metadata"
# module path -> kind and why, for the kinds a naming convention alone decided: a wrong guess can be found
GUESSED = "syncd.guessed"
KINDS = "syncd.kinds"  # module path -> the kind it was converted as (the way back needs no map)
GAMMA_BETA = "syncd.gamma_beta"  # norms whose PyTorch source named their parameters gamma/beta (ESM's LayerNorm)
# a sharded set's layout, the names remap rules changed (final -> before), and a precision cast
SHARDS = "syncd.shards"
RENAMES = "syncd.renames"
PRECISION = "syncd.precision"

# Burn dtypes whose safetensors form loses what they are (docs/burn-format.md#dtypes): restored from DTYPES.
LOSSY_IN_SAFETENSORS = frozenset(["Flex32", "Bool", "Bool(U8)", "Bool(U32)"])
MAX_DROPPED_BYTES = 1 << 16  # carried tensors are counters and flags, never weights


@dataclass
class Carried:
    """Everything restored from a source file's `syncd.*` metadata."""

    layout: str | None = None
    param_ids: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    data_order: list[str] | None = None
    burn_metadata: dict[str, str] | None = None
    burn_layout: str | None = None
    scalars: dict[str, Scalar] = field(default_factory=dict)
    dropped: dict[str, tuple[str, tuple[int, ...], bytes]] = field(default_factory=dict)
    safetensors_metadata: dict[str, str] | None = None
    kinds: dict[str, str] = field(default_factory=dict)
    shards: ShardLayout | None = None
    renames: dict[str, str] = field(default_factory=dict)  # output name -> name before remapping
    precision: dict[str, Any] | None = None  # {"dtype": "F16", "tensors": [names cast, as written]}
    gamma_beta: frozenset[str] = frozenset()  # module paths: kept gamma/beta on the way back


def file_label(name: str) -> str:
    """A file name as metadata text: metadata must be valid UTF-8, file names need not be."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def own_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """The user's metadata, without what syncd carried."""
    return {k: v for k, v in metadata.items() if not k.startswith(PREFIX)}


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def encode_scalars(scalars: dict[str, Scalar]) -> str:
    return dumps({k: [s.kind, _scalar_text(s)] for k, s in scalars.items()})


def _scalar_text(scalar: Scalar) -> str:
    """Floats as hex: exact, -0.0 and inf included; a NaN by its bits, since `float.hex` gives its sign and
    payload as plain "nan"; bools as true/false."""
    if scalar.kind == "Float":
        value = float(scalar.value)
        return nan_text(value) if math.isnan(value) else value.hex()
    return str(scalar.value).lower() if scalar.kind == "Bool" else str(scalar.value)


def encode_dropped(dropped: dict[str, tuple[str, tuple[int, ...], bytes]]) -> str:
    return dumps(
        {
            k: {"dtype": d, "shape": list(s), "data": base64.b64encode(b).decode("ascii")}
            for k, (d, s, b) in dropped.items()
        }
    )


Dropped = dict[str, tuple[str, tuple[int, ...], bytes]]  # name -> (dtype, shape, bytes)
CARRIED_LAYOUTS = (PYTORCH, BURN)  # syncd.layout is written only for a decided layout, never "keep"


def for_safetensors(
    header: CheckpointHeader, tensors: list[TensorInfo], carried: Carried, target_of: dict[str, str], layout: str
) -> dict[str, str]:
    """The `__metadata__` of a safetensors output (before `stamp`). `target_of`: source name -> output name;
    `layout`: the output's tensor layout."""
    if header.format != BURNPACK:  # safetensors, or a PyTorch checkpoint (whose only metadata is format: pt)
        metadata = own_metadata(header.metadata)
    else:
        metadata = dict(carried.safetensors_metadata or {})
        metadata.update(_burnpack_facts(header, tensors, target_of))
        if carried.dropped and layout != PYTORCH:
            # only a PyTorch-layout file takes the counters back; a Burn-layout one carries them further
            metadata[DROPPED] = encode_dropped(carried.dropped)
    if layout == PYTORCH:
        metadata["format"] = "pt"  # what Hugging Face loaders require of a PyTorch-layout file
    return metadata


def _burnpack_facts(header: CheckpointHeader, tensors: list[TensorInfo], target_of: dict[str, str]) -> dict[str, str]:
    """What a burnpack source has and safetensors cannot hold, keyed by output names."""
    facts = {}
    burn_metadata = own_metadata(header.metadata)
    if burn_metadata:
        facts[BURN_METADATA] = dumps(burn_metadata)
    if header.scalars:
        facts[SCALARS] = encode_scalars(header.scalars)
    if header.facts.get("layout") != LAYOUT_ALIGNED:
        facts[BURN_LAYOUT] = header.facts["layout"]
    kept = [t for t in tensors if t.name in target_of]
    ids = {target_of[t.name]: str(t.param_id) for t in kept if t.param_id is not None}
    if ids:
        facts[PARAM_IDS] = dumps(ids)
    dtypes = {target_of[t.name]: t.dtype for t in kept if t.dtype in LOSSY_IN_SAFETENSORS}
    if dtypes:
        facts[DTYPES] = dumps(dtypes)
    facts[DATA_ORDER] = dumps([target_of[t.name] for t in kept])
    return facts


def for_burnpack(
    header: CheckpointHeader, carried: Carried, dropped: Dropped, layout: str
) -> tuple[dict[str, str], dict[str, Scalar]]:
    """The metadata and scalars of a burnpack output (before `stamp`). `dropped`: source tensors with no Burn
    slot, to be carried; `layout`: the output's tensor layout."""
    if header.format == BURNPACK:
        # what a .bpk carried (PyTorch tensors Burn has no slot for: a BatchNorm's counter) is passed on; it
        # was left behind, and the way back from the new file started the counter at 0
        metadata = own_metadata(header.metadata)
        if carried.dropped or dropped:
            metadata[DROPPED] = encode_dropped({**carried.dropped, **dropped})
        return metadata, dict(header.scalars)
    metadata = dict(carried.burn_metadata or {})
    own = own_metadata(header.metadata)
    if own.get("format") == "pt" and layout == BURN:
        del own["format"]  # the way back to PyTorch layout adds it again; a keep round trip must not lose it
    if own:
        metadata[SAFETENSORS_METADATA] = dumps(own)
    everything_dropped = {**carried.dropped, **dropped}
    if everything_dropped:
        metadata[DROPPED] = encode_dropped(everything_dropped)
    return metadata, dict(carried.scalars)


def store_facts(
    metadata: dict[str, str],
    shards: ShardLayout | None,
    renames: dict[str, str],
    cast: list[str],
    cast_dtype: str | None,
    carried: Carried,
) -> None:
    """Carry what the way back needs to undo: the layout of the sharded set a .bpk came from, the
    names remapping changed, and which tensors were cast down (the record passes on until they are cast
    back to F32)."""
    if shards is not None:
        metadata[SHARDS] = dumps(shards.to_json())
    if renames:
        metadata[RENAMES] = dumps(renames)
    if cast and cast_dtype in ("F16", "BF16"):
        metadata[PRECISION] = dumps({"dtype": cast_dtype, "tensors": cast})
    elif carried.precision is not None and not cast:
        metadata[PRECISION] = dumps(carried.precision)


def stamp(metadata: dict[str, str], layout: str, source_name: str, hash_key: str, source_hash: str) -> None:
    """What every output records: its tensor layout when decided, its source's name and hash (`hash_key`:
    syncd.source_xxh3_128, or syncd.source_sha256 by choice; see hashing.py)."""
    if layout in CARRIED_LAYOUTS:
        metadata[LAYOUT] = layout
    metadata[SOURCE] = file_label(source_name)
    metadata[hash_key] = source_hash


def parse(metadata: dict[str, str], path: str) -> Carried:
    carried = Carried()
    try:
        _parse_into(carried, metadata)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:  # OverflowError: float.fromhex
        raise FormatError(f"malformed syncd metadata: {exc}", path) from None
    return carried


def _json(metadata: dict[str, str], key: str) -> Any:
    if key not in metadata:
        return None
    try:
        value = json.loads(metadata[key])
        # a \ud800 escape decodes to a lone surrogate, which no writer can encode: refuse it here
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ValueError(f"{key} is nested too deeply") from None
    except UnicodeEncodeError:
        raise ValueError(f"{key} holds an escaped lone surrogate, which is not Unicode text") from None
    return value


def _parse_into(c: Carried, md: dict[str, str]) -> None:
    c.layout = md.get(LAYOUT)
    c.burn_layout = md.get(BURN_LAYOUT)
    if c.burn_layout not in (None, LAYOUT_ALIGNED, LAYOUT_PACKED):
        raise ValueError(f"{BURN_LAYOUT} is {c.burn_layout[:40]!r}, not aligned or packed")
    ids = _json(md, PARAM_IDS) or {}
    c.param_ids = {str(k): _u64(v) for k, v in ids.items()}
    c.dtypes = {str(k): _burn_dtype(v) for k, v in (_json(md, DTYPES) or {}).items()}
    order = _json(md, DATA_ORDER)
    if order is not None:
        if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
            raise ValueError(f"{DATA_ORDER} is not a list of names")
        c.data_order = order
    c.burn_metadata = _text_map(_json(md, BURN_METADATA), BURN_METADATA)
    c.safetensors_metadata = _text_map(_json(md, SAFETENSORS_METADATA), SAFETENSORS_METADATA)
    c.scalars = {str(k): _scalar(v) for k, v in (_json(md, SCALARS) or {}).items()}
    c.dropped = {str(k): _dropped(v) for k, v in (_json(md, DROPPED) or {}).items()}
    c.kinds = _kinds(_json(md, KINDS))
    c.gamma_beta = _paths(_json(md, GAMMA_BETA))
    shards = _json(md, SHARDS)
    c.shards = None if shards is None else ShardLayout.from_json(shards)
    c.renames = _text_map(_json(md, RENAMES), RENAMES) or {}
    c.precision = _precision(_json(md, PRECISION))


def record_kinds(metadata: dict[str, str], layout: str, kinds: dict[str, str]) -> None:
    """The module kinds a conversion between layouts decided (undecided modules are left out: nothing was
    decided for them), so that the way back needs no module map."""
    decided = {path: kind for path, kind in kinds.items() if kind != "Unknown"}
    if layout in CARRIED_LAYOUTS and decided:
        metadata[KINDS] = dumps(decided)


def record_gamma_beta(metadata: dict[str, str], paths: frozenset[str]) -> None:
    """The norms a PyTorch file named `gamma`/`beta` (not `weight`/`bias`): the way back names them so again,
    and the round trip gives the same file."""
    if paths:
        metadata[GAMMA_BETA] = dumps(sorted(paths))


def _paths(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(path, str) for path in value):
        raise ValueError(f"{GAMMA_BETA} is not a list of module paths")
    return frozenset(value)


def record_guesses(metadata: dict[str, str], guessed: dict[str, str]) -> None:
    """The kinds a naming convention alone decided, with why, in the output itself (also in the sync log)."""
    if guessed:
        metadata[GUESSED] = dumps(guessed)


def _kinds(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{KINDS} is not a map of module path to kind")
    return value


def _precision(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("dtype") not in ("F16", "BF16"):
        raise ValueError(f"{PRECISION} is not {{dtype, tensors}}")
    tensors = value.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError(f"{PRECISION} is not {{dtype, tensors}}")
    if not all(isinstance(name, str) for name in tensors):
        raise ValueError(f"{PRECISION} tensors are not names")
    return value


def _u64(value: Any) -> int:
    number = int(value)
    if not 0 <= number < 1 << 64:
        raise ValueError(f"param_id {value} is out of range")
    return number


def _burn_dtype(value: Any) -> str:
    if value not in LOSSY_IN_SAFETENSORS:
        raise ValueError(f"unexpected carried dtype {value!r}")
    return value


def _text_map(value: Any, key: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{key} is not a map of text")
    return value


def _scalar(value: Any) -> Scalar:
    kind, text = value
    if kind == "Float":
        return Scalar(kind, _float_from_text(text))
    if kind == "Bool":
        if text not in ("true", "false"):
            raise ValueError(f"bad Bool scalar {text!r}")
        return Scalar(kind, text == "true")
    if kind in ("Int", "UInt"):
        return Scalar(kind, int(text))
    raise ValueError(f"unknown scalar kind {kind!r}")


def _float_from_text(text: str) -> float:
    if not text.startswith(NAN_PREFIX):
        return float.fromhex(text)  # "nan" too, as syncd wrote a NaN before it kept the bits
    bits = bytes.fromhex(text[len(NAN_PREFIX) :])
    value = struct.unpack(">d", bits)[0] if len(bits) == 8 else 0.0
    if not math.isnan(value):
        raise ValueError(f"bad NaN scalar {text[:40]!r}")
    return float(value)


def _dropped(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    dtype, shape = value["dtype"], tuple(int(d) for d in value["shape"])
    data = base64.b64decode(value["data"], validate=True)
    fits = dtype in ITEMSIZE and all(d >= 0 for d in shape) and byte_length(dtype, shape) == len(data)
    if not fits or len(data) > MAX_DROPPED_BYTES:
        raise ValueError(f"carried tensor of dtype {dtype} and shape {list(shape)} does not match its data")
    return dtype, shape, data
