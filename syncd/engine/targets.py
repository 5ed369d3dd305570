"""What writing one target format takes, one small type per format: which dtypes it refuses, how a planned
tensor becomes a spec of that format, the output's metadata (the `syncd.*` protocol itself is carry.py's),
the layout of the output, and the format-specific checks of the read-back table.

convert.py runs the pipeline and knows no format; `TARGETS` maps a format name (registry.py) to its type.
Every method is given what it needs (the source, the facts it carried, the plan's values) and returns its
answer: a target keeps no state and changes nothing it is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any

from syncd.adapters import BURN, PYTORCH, AdapterPlan, PlanEntry
from syncd.engine import carry
from syncd.engine.source import Source
from syncd.errors import FormatError, UnsupportedError, VerificationError
from syncd.formats import BURNPACK, SAFETENSORS
from syncd.formats.burnpack import LAYOUT_ALIGNED, plan_burnpack
from syncd.formats.dtypes import DTYPE_TO_SAFETENSORS, byte_length
from syncd.formats.fileio import TensorFileReader
from syncd.formats.registry import BY_NAME, Format
from syncd.formats.safetensors import plan_safetensors
from syncd.formats.table import TensorInfo, TensorSpec

Fill = Callable[[Any], None]
_NAME = attrgetter("name")
_PARAM_ID = attrgetter("param_id")
_SOURCE, _DTYPE, _RAW_DTYPE = attrgetter("source"), attrgetter("dtype"), attrgetter("raw_dtype")


class Target(ABC):
    """The per-format half of a conversion. Subclasses set `format` and override what differs."""

    format: Format
    native_layout: str  # the tensor layout a file of this format is converted into (adapters: PYTORCH, BURN)
    missing_dtype = "has no form"  # "<format> has no form for <dtype>"

    def check_dtypes(self, tensors: list[TensorInfo], path: str) -> None:
        for info in tensors:
            if info.dtype not in self.format.dtypes:
                hint = " (quantized tensors stay in .bpk)" if info.dtype == "QFloat" else ""
                raise UnsupportedError(f"{self.missing_dtype} for {info.dtype} (tensor '{info.name}'){hint}", path)

    def order(self, entries: list[PlanEntry], carried: carry.Carried) -> list[PlanEntry]:
        """The output's data order (default: the source's)."""
        return entries

    def tensor_spec(self, source: Source, carried: carry.Carried, entry: PlanEntry, fill: Fill) -> TensorSpec:
        """The spec of a planned tensor, filled by `fill`."""
        return self.tensor_specs(source, carried, [entry], [fill])[0]

    def tensor_specs(
        self, source: Source, carried: carry.Carried, entries: Sequence[PlanEntry], fills: Sequence[Fill]
    ) -> list[TensorSpec]:
        """The spec of each planned tensor, filled by its fill: over a whole plan at once (once per tensor)."""
        infos = map(source.tensor, map(_SOURCE, entries))
        return [
            TensorSpec(entry.target, info.dtype, entry.shape, _nbytes(entry, info), fill)
            for entry, info, fill in zip(entries, infos, fills, strict=True)
        ]

    def extra_specs(
        self, source: Source, carried: carry.Carried, target_layout: str, taken: set[str], moved: dict[str, str]
    ) -> list[TensorSpec]:
        """Carried tensors written back besides the planned ones (`taken`: their names), for an output in
        `target_layout`: those the store options kept, under the names `moved` gives them (default: none)."""
        return []

    @abstractmethod
    def metadata(
        self, source: Source, carried: carry.Carried, plan: AdapterPlan, entries: list[PlanEntry]
    ) -> tuple[dict[str, str], dict[str, Any]]:
        """The output's metadata and scalars (before carry.stamp), with the facts it carries for the way back;
        `entries`: the plan's, in output order."""

    @abstractmethod
    def lay_out(
        self,
        source: Source,
        carried: carry.Carried,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        scalars: dict[str, Any],
    ) -> tuple[bytes, int, list[int]]:
        """Where everything goes: (the header bytes, the file size, the absolute start of each of `specs`).
        convert writes it all (write/planned.py)."""

    # a dtype as this format stores it, for comparing the written table with the plan (None: as it is named)
    stored_dtype: dict[str, str] | None = None

    def check_written(self, specs: list[TensorSpec], output: TensorFileReader, dest: str) -> None:
        """Format-specific checks of the read-back output, after the table and the tensors (default: none)."""
        return None


class BurnpackTarget(Target):
    format = BY_NAME[BURNPACK]
    native_layout = BURN
    missing_dtype = "Burn has no dtype"

    def order(self, entries: list[PlanEntry], carried: carry.Carried) -> list[PlanEntry]:
        """The carried order of the original burnpack when there is one, else the source's."""
        order = carried.data_order
        if not order:
            return entries
        rank = {name: i for i, name in enumerate(order)}
        return sorted(entries, key=lambda e: rank.get(carried_name(e), len(rank)))

    def tensor_specs(
        self, source: Source, carried: carry.Carried, entries: Sequence[PlanEntry], fills: Sequence[Fill]
    ) -> list[TensorSpec]:
        infos = list(map(source.tensor, map(_SOURCE, entries)))
        if source.header.format == BURNPACK or not carried.dtypes:  # (_burn_dtype's plain cases, in C)
            raws = map(_RAW_DTYPE, infos) if source.header.format == BURNPACK else repeat(None)
            dtypes: Iterable[tuple[str, Any]] = zip(map(_DTYPE, infos), raws, strict=False)  # raws: repeat()
        else:
            dtypes = [_burn_dtype(source, carried, info) for info in infos]
        ids, specs = carried.param_ids, []
        for entry, info, fill, (dtype, raw) in zip(entries, infos, fills, dtypes, strict=True):
            if entry.rows is None and not entry.parts:  # one whole source tensor (most entries)
                own, nbytes = info.param_id, info.nbytes
            else:  # a piece is not its packed source
                own, nbytes = None, _nbytes(entry, info)
            param_id = own if own is not None or not ids else ids.get(carried_name(entry))
            specs.append(TensorSpec(entry.target, dtype, entry.shape, nbytes, fill, param_id, raw))
        return specs

    def metadata(
        self, source: Source, carried: carry.Carried, plan: AdapterPlan, entries: list[PlanEntry]
    ) -> tuple[dict[str, str], dict[str, Any]]:
        dropped = _dropped_tensors(source, plan.dropped, carried.renames)
        return carry.for_burnpack(source.header, carried, dropped, plan.target_layout)

    def lay_out(
        self,
        source: Source,
        carried: carry.Carried,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        scalars: dict[str, Any],
    ) -> tuple[bytes, int, list[int]]:
        plan = plan_burnpack(specs, metadata, scalars, _data_layout(source, carried))
        return plan.header, plan.file_size, [plan.data_start + start for start in plan.starts]

    def check_written(self, specs: list[TensorSpec], output: TensorFileReader, dest: str) -> None:
        ids = dict(zip(map(_NAME, specs), map(_PARAM_ID, specs), strict=True))
        # each written tensor's planned id against the one read back, both lists built in C (once per tensor)
        if list(map(ids.__getitem__, map(_NAME, output.tensors))) != list(map(_PARAM_ID, output.tensors)):
            raise VerificationError("param_ids differ after writing", dest)


class SafetensorsTarget(Target):
    format = BY_NAME[SAFETENSORS]
    native_layout = PYTORCH
    missing_dtype = "safetensors has no form"

    def extra_specs(
        self, source: Source, carried: carry.Carried, target_layout: str, taken: set[str], moved: dict[str, str]
    ) -> list[TensorSpec]:
        """PyTorch-only tensors dropped on the way to Burn (BatchNorm counters) come back on the way out."""
        if target_layout != PYTORCH:
            return []
        specs = []
        for kept_as, (dtype, shape, data) in carried.dropped.items():
            if kept_as not in moved:
                continue  # left out by the tensor filter
            name = moved[kept_as]  # where the remap rules moved it, with its module
            if name in taken:
                raise FormatError(f"carried tensor '{name}' collides with a converted tensor", source.path)
            specs.append(TensorSpec(name, dtype, shape, len(data), _bytes_fill(data)))
        return specs

    def metadata(
        self, source: Source, carried: carry.Carried, plan: AdapterPlan, entries: list[PlanEntry]
    ) -> tuple[dict[str, str], dict[str, Any]]:
        # a joined tensor's pieces keep their Burn names in the carried facts (data order, param ids), so the
        # way back gives each piece its own again
        target_of: dict[str, str] = {}
        for e in entries:
            if e.parts:
                target_of.update((name, name) for name in e.sources)
            else:  # (most entries: their one source, without building the list of their sources)
                target_of[e.source] = e.target
        return carry.for_safetensors(source.header, source.tensors, carried, target_of, plan.target_layout), {}

    def lay_out(
        self,
        source: Source,
        carried: carry.Carried,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        scalars: dict[str, Any],
    ) -> tuple[bytes, int, list[int]]:
        plan = plan_safetensors(specs, metadata)
        return plan.header, plan.file_size, plan.starts

    stored_dtype = DTYPE_TO_SAFETENSORS  # Flex32 is written as F32, the Bool stores as BOOL...


def _burn_dtype(source: Source, carried: carry.Carried, info: TensorInfo) -> tuple[str, Any]:
    """A burnpack source keeps its exact DType; a safetensors one gets back a Burn-only dtype it carried."""
    if source.header.format == BURNPACK:
        return info.dtype, info.raw_dtype
    restored = carried.dtypes.get(info.name)
    if restored is None:
        return info.dtype, None
    if DTYPE_TO_SAFETENSORS[restored] != DTYPE_TO_SAFETENSORS[info.dtype]:
        message = f"syncd metadata says {restored} but the tensor is {info.dtype}"
        raise FormatError(message, source.path, info.name)
    return restored, None


def _dropped_tensors(source: Source, names: list[str], renames: dict[str, str]) -> carry.Dropped:
    """Source tensors with no Burn slot, read to be carried in the output's metadata under their original names
    (`renames`: what the source carried, final -> original), as every carried tensor is: the way back gives the
    file's tensors their original names, and the carried ones join them there."""
    dropped = {}
    for name in names:
        info = source.tensor(name)
        if info.nbytes > carry.MAX_DROPPED_BYTES:
            raise UnsupportedError(f"tensor '{name}' has no Burn counterpart and is too large to carry", source.path)
        dropped[renames.get(name, name)] = (info.dtype, info.shape, source.read(name))
    return dropped


def _data_layout(source: Source, carried: carry.Carried) -> str:
    """aligned (Burn >= 0.20) or packed (0.19): a burnpack source's own, else the one it carried."""
    if source.header.format == BURNPACK:
        return source.header.facts["layout"]
    return carried.burn_layout or LAYOUT_ALIGNED


def carried_name(entry: PlanEntry) -> str:
    """The name the carried facts (syncd.data_order, syncd.param_ids) know an entry by: its source's, or for
    a piece split from a packed tensor its own (the Burn name it had before it was joined)."""
    return entry.target if entry.rows is not None else entry.source


def _nbytes(entry: PlanEntry, info: TensorInfo) -> int:
    """The output's byte size: its source's, unless it is a piece of it or made of pieces (the adapters split
    and join only dtypes with a fixed element size)."""
    if entry.rows is None and not entry.parts:  # is_piecewise, spelled out: it runs once per tensor
        return info.nbytes
    return byte_length(info.dtype, entry.shape) or 0


def _bytes_fill(data: bytes) -> Fill:
    return lambda sink: sink.write(data)


TARGETS: dict[str, type[Target]] = {target.format.name: target for target in (BurnpackTarget, SafetensorsTarget)}
