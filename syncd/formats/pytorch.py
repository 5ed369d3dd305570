"""PyTorch's own checkpoints (`torch.save`: `.pt`, `.pth`, `pytorch_model.bin`): a reader, without torch and
without running anything. Knows nothing of modules.

Since PyTorch 1.6 `torch.save` writes a zip (entries stored, never compressed) under one top directory:
`data.pkl`, a pickle of the saved object; `data/<key>`, one entry per storage, its raw bytes; `byteorder`
(absent in older files: little-endian); `version` and a few more. In the pickle, each tensor is a call
`torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks)` (or `_v3`,
which adds the dtype, for dtypes without a legacy storage class) whose storage is a persistent id
`('storage', <storage type>, key, location, numel)`.

`pickle.load` on such a file runs whatever callable the pickle names: a daemon unpickling what lands in a
watched directory would run anyone's code. So the pickle is read by our own interpreter of the pickle opcodes
(as PyTorch's `weights_only` unpickler and Burn's `burn-store/src/pytorch/pickle_reader.rs` do), not by a
`pickle.Unpickler` subclass: a subclass still runs the C unpickler's own machinery (`BUILD` calling
`__setstate__`, the copyreg extension registry, a memo array the C code grows to whatever index a `PUT`
names, which an index of 2^32 turns into a multi-gigabyte allocation), while here every opcode does only
what this module says, every global is looked up in an explicit table of names (nothing is imported), and
every object built is charged against a budget. What can be built: tensors, dicts, lists, tuples and plain
values (None, bools, ints, floats, text, bytes). An object of any other class (`args: Namespace` beside the
weights, as timm and torchvision's scripts save; a numpy scalar) is never created: it stands as a placeholder
holding what was pickled into it. Holding no tensor (beside the dict the tensors are taken from, or among
them), it is said not converted; holding tensors among them, or as the saved object itself, the file is
refused, naming its class.

The tensor table describes each tensor where its bytes lie in the file: a C-contiguous tensor is one window
of its storage's entry. A view (a transpose, a strided slice) or a tensor sharing bytes with an earlier one
(tied weights) is not a window: `is_window` says so, and `readinto` gathers its elements in C order, a
bounded piece at a time, so a converter writes it contiguous.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from syncd.errors import FormatError, IncompleteFileError
from syncd.formats.dtypes import ITEMSIZE
from syncd.formats.fileio import DECODE_BUDGET, TensorFileReader, pread_exact, preadinto_exact, text_width
from syncd.formats.pytorch_facts import NAME, ZIP_MAGIC
from syncd.formats.table import CheckpointHeader, TensorInfo

# Limits: those of the other readers where they mean the same thing (Burn's tensor count, the safetensors
# header's size for the pickle, the decode budget), and bounds no real checkpoint comes near.
MAX_TENSOR_COUNT = 100_000
# a storage per tensor at most, for the model and an optimizer's state beside it (Adam keeps three tensors per
# parameter: exp_avg, exp_avg_sq and its step), plus the archive's own records
MAX_ENTRIES = 4 * MAX_TENSOR_COUNT + 64
MAX_PICKLE_SIZE = 100_000_000
_WIDTH_CHECKED_ABOVE = 1 << 16  # a text's width is looked at past this length (most are a few bytes)
MAX_CENTRAL_DIRECTORY = 64 << 20
MAX_OPS = 20_000_000  # opcodes interpreted (each costs CPU time: this bounds it to seconds)
MAX_RANK = 64
MAX_DEPTH = 128  # nesting of the dicts tensors are looked for in (and of any value built)
MAX_VISITS = 4 * MAX_TENSOR_COUNT  # values looked at while looking for tensors (a pickle can share and cycle)
MAX_TEXT = 1 << 16
# Views can repeat a storage's bytes (`x.expand(...)`, stride 0): a file of a few KiB can stand for terabytes of
# values, which a format without strides must write out. Above this many bytes, values more than
# MAX_EXPANSION times the file are refused before a byte is written (a checkpoint's own repeats, tied weights
# and a few expanded buffers, stay far below it).
EXPANSION_FLOOR = 256 << 20
MAX_EXPANSION = 16
I64_LIMIT = 1 << 63  # a text line of the pickle (a GLOBAL's names, an INT)
USUAL_KEYS = ("state_dict", "model_state_dict", "model")  # where a training checkpoint keeps the weights

_GATHER_ELEMENTS = 1 << 18  # a view is gathered this many elements at a time
_GATHER_SPAN = 16 << 20  # bytes one read of a view may take
_GATHER_GAP = 4 << 10  # storage bytes skipped between two elements before a read is split (a pread costs
# about what copying a few KiB from the page cache does)

# ---------------------------------------------------------------------------------------------- dtypes

# legacy storage classes, each with its element type (None: torch saves it, neither format holds it)
_STORAGE_TYPES: dict[str, str | None] = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "Bool(Native)",
    "ComplexFloatStorage": "C64",
    "ComplexDoubleStorage": None,
    "QUInt8Storage": None,
    "QInt8Storage": None,
    "QInt32Storage": None,
    "QUInt4x2Storage": None,
    "QUInt2x4Storage": None,
}
# torch dtypes as `_rebuild_tensor_v3` names them
_DTYPES: dict[str, str | None] = {
    "float64": "F64",
    "double": "F64",
    "float32": "F32",
    "float": "F32",
    "float16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "long": "I64",
    "int32": "I32",
    "int": "I32",
    "int16": "I16",
    "short": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "Bool(Native)",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64",
    "cfloat": "C64",
    "float8_e4m3fnuz": None,
    "float8_e5m2fnuz": None,
    "complex128": None,
    "cdouble": None,
    "complex32": None,
    "chalf": None,
    "qint8": None,
    "quint8": None,
    "qint32": None,
    "quint4x2": None,
    "quint2x4": None,
}
_NO_FORM = "which neither safetensors nor burnpack can hold"


# ---------------------------------------------------------------------------------------------- the zip


@dataclass(frozen=True)
class ZipEntry:
    name: str
    data_start: int  # absolute offset of its bytes in the file
    size: int
    crc: int
    header_start: int


# torch.jit.save's archive holds the model's code (`<name>/code/__torch__/...`, compressed) and constants.pkl
# beside its data.pkl, which pickles TorchScript classes: a program, not a checkpoint of tensors
TORCHSCRIPT = (
    "a TorchScript archive (torch.jit.save), not a torch.save checkpoint: save the model's state_dict() with "
    "torch.save (torch.jit.load(path).state_dict() for this one)"
)


def is_torchscript_entry(name: str) -> bool:
    """An entry only TorchScript archives hold: the model's code, or its constants."""
    _, _, rest = name.partition("/")
    return rest.startswith("code/") or rest == "constants.pkl"


def _u16(raw: bytes, at: int) -> int:
    return int.from_bytes(raw[at : at + 2], "little")


def _u32(raw: bytes, at: int) -> int:
    return int.from_bytes(raw[at : at + 4], "little")


def _u64(raw: bytes, at: int) -> int:
    return int.from_bytes(raw[at : at + 8], "little")


class _Zip:
    """The entries of a zip whose entries are all stored (PyTorch never compresses): names, where each
    entry's bytes lie, sizes; checked against each other and the file, nothing decompressed."""

    def __init__(self, fd: int, size: int, path: str) -> None:
        self.fd, self.size, self.path = fd, size, path
        cd_offset, cd_size, count = self._end_record()
        if count > MAX_ENTRIES:
            raise self._fail(f"zip has {count} entries, more than the {MAX_ENTRIES} a checkpoint may have")
        if cd_size > MAX_CENTRAL_DIRECTORY:
            raise self._fail(f"zip directory of {cd_size} bytes exceeds the limit of {MAX_CENTRAL_DIRECTORY}")
        if cd_offset + cd_size > size:
            raise IncompleteFileError("zip directory runs past the end of the file: truncated?", path)
        raw = pread_exact(fd, cd_size, cd_offset, path, "zip directory")
        self.entries = self._directory(raw, count, cd_offset)
        self.by_name = {entry.name: entry for entry in self.entries}

    def _fail(self, message: str) -> FormatError:
        return FormatError(message, self.path)

    def _end_record(self) -> tuple[int, int, int]:
        """(directory offset, directory size, entry count) from the end-of-directory record (ZIP64's if any)."""
        tail_size = min(self.size, 22 + 0xFFFF)
        tail = pread_exact(self.fd, tail_size, self.size - tail_size, self.path, "zip end record")
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + 22 > len(tail):
            raise IncompleteFileError("zip has no end record: truncated, or still being written", self.path)
        count, cd_size, cd_offset = _u16(tail, at + 10), _u32(tail, at + 12), _u32(tail, at + 16)
        if _u16(tail, at + 4) or _u16(tail, at + 6):
            raise self._fail("zip spans several disks")
        if 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_offset):
            locator_at = self.size - tail_size + at - 20
            if locator_at < 0:
                raise self._fail("zip announces a ZIP64 record it does not have")
            locator = pread_exact(self.fd, 20, locator_at, self.path, "ZIP64 locator")
            if locator[:4] != b"PK\x06\x07":
                raise self._fail("zip announces a ZIP64 record it does not have")
            record_at = _u64(locator, 8)
            if record_at + 56 > self.size:
                raise self._fail("ZIP64 end record lies past the end of the file")
            record = pread_exact(self.fd, 56, record_at, self.path, "ZIP64 end record")
            if record[:4] != b"PK\x06\x06":
                raise self._fail("ZIP64 end record is not where its locator says")
            count, cd_size, cd_offset = _u64(record, 32), _u64(record, 40), _u64(record, 48)
        return cd_offset, cd_size, count

    def _directory(self, raw: bytes, count: int, cd_offset: int) -> list[ZipEntry]:
        entries: list[ZipEntry] = []
        at = 0
        for _ in range(count):
            if at + 46 > len(raw) or raw[at : at + 4] != b"PK\x01\x02":
                raise self._fail("zip directory is damaged (an entry header is not where expected)")
            flags, method, crc = _u16(raw, at + 8), _u16(raw, at + 10), _u32(raw, at + 16)
            csize, usize = _u32(raw, at + 20), _u32(raw, at + 24)
            name_len, extra_len, comment_len = _u16(raw, at + 28), _u16(raw, at + 30), _u16(raw, at + 32)
            local = _u32(raw, at + 42)
            end = at + 46 + name_len + extra_len + comment_len
            if end > len(raw):
                raise self._fail("zip directory is damaged (an entry runs past its end)")
            name = raw[at + 46 : at + 46 + name_len].decode("utf-8", "replace")
            extra = raw[at + 46 + name_len : at + 46 + name_len + extra_len]
            usize, csize, local = _zip64_sizes(extra, usize, csize, local)
            if flags & 1:
                raise FormatError(f"zip entry {name!r} is encrypted", self.path)
            if is_torchscript_entry(name):
                raise FormatError(TORCHSCRIPT, self.path)
            if method != 0:
                raise FormatError(
                    f"zip entry {name!r} is compressed (method {method}); torch.save stores entries uncompressed, "
                    "and syncd reads only such files",
                    self.path,
                )
            if csize != usize:
                raise FormatError(f"zip entry {name!r} declares {csize} stored bytes for {usize}", self.path)
            entries.append(self._locate(name, local, usize, crc, cd_offset))
            at = end
        self._check_disjoint(entries, cd_offset)
        return entries

    def _locate(self, name: str, local: int, size: int, crc: int, cd_offset: int) -> ZipEntry:
        """Where the entry's bytes start, from its local header, which must agree with the directory."""
        if local + 30 > cd_offset:
            raise FormatError(f"zip entry {name!r} lies outside the archive", self.path)
        head = pread_exact(self.fd, 30, local, self.path, "zip entry header")
        if head[:4] != b"PK\x03\x04":
            raise FormatError(f"zip entry {name!r} has no local header where the directory says", self.path)
        name_len, extra_len = _u16(head, 26), _u16(head, 28)
        local_name = pread_exact(self.fd, name_len, local + 30, self.path, "zip entry name")
        if local_name.decode("utf-8", "replace") != name or _u16(head, 8) != 0:
            raise FormatError(f"zip entry {name!r}: its local header disagrees with the directory", self.path)
        local_size = _u32(head, 22)
        if not (_u16(head, 6) & 8) and local_size not in (size, 0xFFFFFFFF):
            raise FormatError(
                f"zip entry {name!r} is {local_size} bytes in its header, {size} in the directory", self.path
            )
        start = local + 30 + name_len + extra_len
        if start + size > cd_offset:
            raise FormatError(f"zip entry {name!r} ({size} bytes) runs past the archive's data", self.path)
        return ZipEntry(name, start, size, crc, local)

    def _check_disjoint(self, entries: list[ZipEntry], cd_offset: int) -> None:
        seen: set[str] = set()
        cursor = 0
        for entry in sorted(entries, key=lambda e: e.header_start):
            if entry.name in seen:
                raise FormatError(f"zip holds entry {entry.name!r} twice", self.path)
            seen.add(entry.name)
            if entry.header_start < cursor:
                raise FormatError(f"zip entry {entry.name!r} overlaps the entry before it", self.path)
            cursor = entry.data_start + entry.size

    def read(self, entry: ZipEntry, limit: int) -> bytes:
        if entry.size > limit:
            raise FormatError(f"{entry.name} is {entry.size} bytes, more than the {limit} allowed", self.path)
        data = pread_exact(self.fd, entry.size, entry.data_start, self.path, entry.name)
        # 0: none computed, as torch writes with torch.utils.serialization.config.save.compute_crc32 off (and
        # reads back, checking no CRC of its own)
        if entry.crc and zlib.crc32(data) != entry.crc:
            raise FormatError(f"{entry.name} does not match its CRC: damaged", self.path)
        return data


def _zip64_sizes(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    """The 64-bit values a ZIP64 extra field holds for the 32-bit fields set to 0xFFFFFFFF, in that order."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = _u16(extra, at), _u16(extra, at + 2)
        if tag == 1:
            field_at = at + 4
            values = []
            for value in (usize, csize, local):
                if value == 0xFFFFFFFF and field_at + 8 <= at + 4 + length:
                    value = _u64(extra, field_at)
                    field_at += 8
                values.append(value)
            return values[0], values[1], values[2]
        at += 4 + length
    return usize, csize, local


# ---------------------------------------------------------------------------------------------- the pickle


@dataclass(frozen=True)
class _Global:
    """A name the pickle may use: what it is to us. Nothing is imported."""

    module: str
    name: str
    role: str  # "dict" | "rebuild" | "parameter" | "from_type" | "bytes" | "storage" | "dtype" | "type"
    dtype: str | None = None


def _globals() -> dict[tuple[str, str], _Global]:
    table = {
        ("collections", "OrderedDict"): _Global("collections", "OrderedDict", "dict"),
        ("torch._utils", "_rebuild_tensor_v2"): _Global("torch._utils", "_rebuild_tensor_v2", "rebuild"),
        ("torch._utils", "_rebuild_tensor_v3"): _Global("torch._utils", "_rebuild_tensor_v3", "rebuild"),
        ("torch._utils", "_rebuild_parameter"): _Global("torch._utils", "_rebuild_parameter", "parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"): _Global(
            "torch._utils", "_rebuild_parameter_with_state", "parameter"
        ),
        ("torch._tensor", "_rebuild_from_type_v2"): _Global("torch._tensor", "_rebuild_from_type_v2", "from_type"),
        # pickle protocol 2 (torch.save's default) writes a bytes value as _codecs.encode(text, "latin1")
        ("_codecs", "encode"): _Global("_codecs", "encode", "bytes"),
        ("torch._tensor", "Tensor"): _Global("torch._tensor", "Tensor", "type"),
        ("torch", "Tensor"): _Global("torch", "Tensor", "type"),
        ("torch.nn.parameter", "Parameter"): _Global("torch.nn.parameter", "Parameter", "type"),
        ("torch.storage", "UntypedStorage"): _Global("torch.storage", "UntypedStorage", "storage", "U8"),
        ("torch", "UntypedStorage"): _Global("torch", "UntypedStorage", "storage", "U8"),
    }
    for name, dtype in _STORAGE_TYPES.items():
        table["torch", name] = _Global("torch", name, "storage", dtype)
    for name, dtype in _DTYPES.items():
        table["torch", name] = _Global("torch", name, "dtype", dtype)
    return table


_ALLOWED = _globals()


@dataclass
class _Storage:
    key: str
    dtype: str | None  # None: an UntypedStorage (the tensor's dtype says what it holds)
    type_name: str
    entry: ZipEntry


@dataclass
class _Tensor:
    storage: _Storage
    dtype: str
    offset: int  # in elements
    shape: tuple[int, ...]
    strides: tuple[int, ...]


class _Foreign:
    """A global outside the table (a class, a function): looked up by name only, never imported."""

    __slots__ = ("shown",)

    def __init__(self, shown: str) -> None:
        self.shown = shown

    @property
    def makes_arrays(self) -> bool:
        """A maker of tensors or arrays syncd does not read (a meta tensor, a quantized or nested one, a numpy
        array): what it makes counts as a tensor, so it is refused among the weights, never left out."""
        if self.shown.startswith("torch."):
            return "._rebuild" in self.shown
        return self.shown.startswith("numpy.") and self.shown.rpartition(".")[2] in _NUMPY_ARRAY_MAKERS


# how numpy pickles an array: an ndarray (any protocol), a read-only one at protocol 5, a masked one
_NUMPY_ARRAY_MAKERS = frozenset({"_reconstruct", "_frombuffer", "_mareconstruct"})


class _Object:
    """What a pickle builds by calling a _Foreign (REDUCE, NEWOBJ), never made: the class's name and what was
    pickled into it (arguments, state, items), kept so the tensors in it can be counted."""

    __slots__ = ("array", "parts", "shown")

    def __init__(self, maker: _Foreign, first: Any) -> None:
        self.shown, self.array, self.parts = maker.shown, maker.makes_arrays, [first]


def refused_global(shown: str) -> str:
    return (
        f"data.pkl: refuses the global {shown!r}: only tensors, containers and plain values are read (nothing is run)"
    )


class _Mark:
    """The MARK opcode's place on the stack."""


_MARK = _Mark()


@dataclass
class _Budget:
    """What building the pickle's objects may cost, in bytes of Python objects, charged as they are made."""

    left: int = DECODE_BUDGET
    path: str = ""

    def charge(self, cost: int) -> None:
        self.left -= cost
        if self.left < 0:
            raise FormatError(
                f"data.pkl builds more than {DECODE_BUDGET >> 20} MiB of objects: not a checkpoint's pickle", self.path
            )


class _Interpreter:
    """The pickle opcodes a checkpoint uses, each doing only what is written here."""

    def __init__(self, data: bytes, path: str, storage: Callable[[Any], _Storage]) -> None:
        self.raw = data  # indexed for one-byte arguments and opcodes
        self.data = memoryview(data)  # sliced for longer ones, without copying
        self.end = len(data)
        self.pos = 0
        self.path = path
        self.storage = storage
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.foreign: dict[str, _Foreign] = {}  # the placeholder of each global outside the table
        self.budget = _Budget(path=path)

    def fail(self, message: str) -> FormatError:
        return FormatError(f"data.pkl: {message}", self.path)

    # -- reading the stream

    def take(self, n: int) -> memoryview:
        pos = self.pos
        if n < 0 or pos + n > self.end:
            raise self.fail(f"ends inside an opcode's argument at byte {pos}")
        self.pos = pos + n
        return self.data[pos : pos + n]

    def byte(self) -> int:
        """A one-byte argument (the commonest: BINPUT, BINGET, BININT1)."""
        pos = self.pos
        if pos >= self.end:
            raise self.fail(f"ends inside an opcode's argument at byte {pos}")
        self.pos = pos + 1
        return self.raw[pos]

    def line(self) -> str:
        # found in the pickle itself, bounded: a copy of MAX_TEXT bytes per text opcode made a pickle of
        # millions of them take half a minute to refuse
        found = self.raw.find(b"\n", self.pos, self.pos + MAX_TEXT)
        end = found - self.pos if found >= 0 else -1
        if end < 0:
            raise self.fail(f"a text argument at byte {self.pos} has no end")
        text = bytes(self.take(end + 1)[:-1])
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"a text argument at byte {self.pos} is not UTF-8") from None

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def text(self, n: int) -> str:
        raw = self.take(n)  # first: a length past the end of the pickle is that, not a large string
        # CPython keeps a str at its widest character's width: one emoji makes 90 MB of ASCII 360 MB
        width = text_width(self.raw, self.pos - n, self.pos) if n > _WIDTH_CHECKED_ABOVE else 1
        self.budget.charge(56 + n * width)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"a string at byte {self.pos} is not UTF-8") from None

    # -- the stack

    def push(self, value: Any, cost: int = 8) -> None:
        budget = self.budget
        budget.left -= cost
        if budget.left < 0:
            budget.charge(0)  # raises, saying so
        self.stack.append(value)

    def pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) == self.marks[-1]):
            raise self.fail(f"pops an empty stack at byte {self.pos}")
        value = self.stack.pop()
        if value is _MARK:
            raise self.fail(f"pops a MARK as a value at byte {self.pos}")
        return value

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise self.fail(f"no MARK to pop to at byte {self.pos}")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at - 1 :]  # the items and the mark itself
        return items

    def top(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise self.fail(f"needs a value on the stack at byte {self.pos}")
        return self.stack[-1]

    # -- the loop

    def run(self) -> Any:
        ops, raw, end = _OPS, self.raw, self.end
        for _ in range(MAX_OPS):
            pos = self.pos
            if pos >= end:
                raise self.fail("ends without a STOP opcode (truncated or not a pickle)")
            code = raw[pos]
            self.pos = pos + 1
            if code == 0x2E:  # STOP
                if len(self.stack) != 1 or self.marks:
                    raise self.fail("stops with an unbalanced stack")
                return self.stack[0]
            op = ops.get(code)
            if op is None:
                raise self.fail(f"opcode {bytes([code])!r} at byte {pos} is not one a checkpoint uses")
            op(self)
        raise self.fail(f"more than {MAX_OPS} opcodes: not a checkpoint's pickle")


def _op_mark(p: _Interpreter) -> None:
    p.push(_MARK)
    p.marks.append(len(p.stack))
    if len(p.marks) > 10 * MAX_DEPTH:
        raise p.fail(f"nests more than {10 * MAX_DEPTH} MARKs")


def _op_proto(p: _Interpreter) -> None:
    if p.uint(1) > 5:
        raise p.fail("uses a pickle protocol newer than 5")


def _op_frame(p: _Interpreter) -> None:
    p.take(8)


def _op_global(p: _Interpreter) -> None:
    module, name = p.line(), p.line()
    p.push(_lookup(p, module, name))


def _op_stack_global(p: _Interpreter) -> None:
    name, module = p.pop(), p.pop()
    if not isinstance(module, str) or not isinstance(name, str):
        raise p.fail("STACK_GLOBAL needs two strings")
    p.push(_lookup(p, module, name))


def _lookup(p: _Interpreter, module: str, name: str) -> _Global | _Foreign:
    found = _ALLOWED.get((module, name))
    if found is not None:
        return found
    # cut before joined (two memoized texts of megabytes made a copy at every STACK_GLOBAL), and one
    # placeholder per name however often it is named
    shown = f"{module[:100]}.{name[:100]}"
    foreign = p.foreign.get(shown)
    if foreign is None:
        p.budget.charge(len(shown) + 100)
        foreign = p.foreign[shown] = _Foreign(shown)
    return foreign


def _op_put(p: _Interpreter, index: int) -> None:
    p.budget.charge(100)
    stack = p.stack
    if not stack or stack[-1] is _MARK:
        raise p.fail(f"needs a value on the stack at byte {p.pos}")
    p.memo[index] = stack[-1]


def _op_get(p: _Interpreter, index: int) -> None:
    value = p.memo.get(index, _MARK)
    if value is _MARK:
        raise p.fail(f"reads memo slot {index}, never written")
    p.push(value)


def _op_reduce(p: _Interpreter) -> None:
    args, func = p.pop(), p.pop()
    if isinstance(func, _Foreign) and isinstance(args, tuple):
        p.push(_Object(func, args), _OBJECT_COST)  # never called
        return
    if not isinstance(func, _Global) or not isinstance(args, tuple):
        raise p.fail(f"calls something that is not a permitted function at byte {p.pos}")
    p.push(_call(p, func, args), _OBJECT_COST)


# what a tensor or a placeholder takes in memory (about 120-130 bytes each, measured with tracemalloc; 64 let
# a pickle of 2 million of them take twice its budget)
_OBJECT_COST = 128


def _op_newobj(p: _Interpreter) -> None:
    args, cls = p.pop(), p.pop()
    if isinstance(cls, _Foreign) and isinstance(args, tuple):
        p.push(_Object(cls, args), _OBJECT_COST)  # never made
        return
    if not (isinstance(cls, _Global) and cls.role == "dict" and args == ()):
        raise p.fail(f"creates an object other than a dict at byte {p.pos}")
    p.push({}, 64)


def _op_build(p: _Interpreter) -> None:
    state = p.pop()  # an OrderedDict's attributes (`_metadata`), a Parameter's: not applied
    target = p.top()
    if isinstance(target, _Object):
        target.parts.append(state)
        return
    if not isinstance(target, dict | _Tensor):
        raise p.fail(f"BUILD applies a state to a {type(target).__name__} at byte {p.pos}")


def _op_persid(p: _Interpreter, pid: Any) -> None:
    p.push(p.storage(pid), 64)


def _op_setitems(p: _Interpreter) -> None:
    items = p.pop_mark()
    target = p.top()
    if isinstance(target, _Object):  # (a dict of a class of its own: an OrderedDict subclass, a defaultdict)
        p.budget.charge(50 * len(items))
        target.parts.append(tuple(items))
        return
    if not isinstance(target, dict) or len(items) % 2:
        raise p.fail(f"SETITEMS on a {type(target).__name__} at byte {p.pos}")
    p.budget.charge(50 * len(items))
    for key, value in zip(items[::2], items[1::2], strict=True):
        _setitem(p, target, key, value)


def _setitem(p: _Interpreter, target: dict, key: Any, value: Any) -> None:
    # plain keys only: hashing a tuple nested a million deep recurses in C until the process crashes
    if not isinstance(key, str | int | float | bytes):
        raise p.fail(f"a dict key of type {type(key).__name__}")
    target[key] = value


def _op_setitem(p: _Interpreter) -> None:
    value, key = p.pop(), p.pop()
    target = p.top()
    if isinstance(target, _Object):
        p.budget.charge(100)
        target.parts.append((key, value))
        return
    if not isinstance(target, dict):
        raise p.fail(f"SETITEM on a {type(target).__name__} at byte {p.pos}")
    p.budget.charge(100)
    _setitem(p, target, key, value)


def _op_appends(p: _Interpreter) -> None:
    items = p.pop_mark()
    target = p.top()
    if isinstance(target, _Object):
        p.budget.charge(8 * len(items))
        target.parts.append(tuple(items))
        return
    if not isinstance(target, list):
        raise p.fail(f"APPENDS on a {type(target).__name__} at byte {p.pos}")
    p.budget.charge(8 * len(items))
    target.extend(items)


def _op_append(p: _Interpreter) -> None:
    value = p.pop()
    target = p.top()
    if isinstance(target, _Object):
        p.budget.charge(8)
        target.parts.append(value)
        return
    if not isinstance(target, list):
        raise p.fail(f"APPEND on a {type(target).__name__} at byte {p.pos}")
    p.budget.charge(8)
    target.append(value)


def _op_dict(p: _Interpreter) -> None:
    items = p.pop_mark()
    if len(items) % 2:
        raise p.fail("DICT with an odd number of items")
    result: dict = {}
    for key, value in zip(items[::2], items[1::2], strict=True):
        _setitem(p, result, key, value)
    p.push(result, 64 + 50 * len(items))


def _op_tuple(p: _Interpreter) -> None:
    items = p.pop_mark()
    p.push(tuple(items), 56 + 8 * len(items))


def _op_tuple_n(n: int) -> Callable[[_Interpreter], None]:
    def op(p: _Interpreter) -> None:
        items = [p.pop() for _ in range(n)]
        p.push(tuple(reversed(items)), 56 + 8 * n)

    return op


def _op_list(p: _Interpreter) -> None:
    items = p.pop_mark()
    p.push(items, 56 + 8 * len(items))


def _op_int_text(p: _Interpreter) -> None:
    text = p.line()
    if text in ("00", "01"):
        p.push(text == "01")
        return
    p.push(_parse_int(p, text), 32)


def _op_long_text(p: _Interpreter) -> None:
    p.push(_parse_int(p, p.line().removesuffix("L")), 32)


def _parse_int(p: _Interpreter, text: str) -> int:
    if len(text) > 40:
        raise p.fail("an integer of more than 40 digits")
    try:
        return int(text)
    except ValueError:
        raise p.fail(f"{text[:40]!r} is not an integer") from None


def _op_long(p: _Interpreter, width: int) -> None:
    n = p.uint(width)
    if n > 16:
        raise p.fail(f"an integer of {n} bytes")
    p.push(int.from_bytes(p.take(n), "little", signed=True), 32)


def _op_float_text(p: _Interpreter) -> None:
    try:
        p.push(float(p.line()), 24)
    except ValueError:
        raise p.fail("a FLOAT that is not a number") from None


def _op_bytes(p: _Interpreter, width: int) -> None:
    n = p.uint(width)
    raw = p.take(n)
    p.budget.charge(33 + n)
    p.push(bytes(raw))


def _op_pop_mark(p: _Interpreter) -> None:
    p.pop_mark()


def _op_dup(p: _Interpreter) -> None:
    p.push(p.top())


def _build_ops() -> dict[int, Callable[[_Interpreter], None]]:
    def c(ch: str) -> int:
        return ord(ch)

    ops: dict[int, Callable[[_Interpreter], None]] = {
        c("("): _op_mark,
        0x80: _op_proto,
        0x95: _op_frame,
        c("c"): _op_global,
        0x93: _op_stack_global,
        c("0"): lambda p: p.pop(),
        c("1"): _op_pop_mark,
        c("2"): _op_dup,
        c("N"): lambda p: p.push(None),
        0x88: lambda p: p.push(True),
        0x89: lambda p: p.push(False),
        c("J"): lambda p: p.push(int.from_bytes(p.take(4), "little", signed=True), 32),
        c("K"): lambda p: p.push(p.byte()),
        c("M"): lambda p: p.push(p.uint(2), 32),
        c("I"): _op_int_text,
        c("L"): _op_long_text,
        0x8A: lambda p: _op_long(p, 1),
        0x8B: lambda p: _op_long(p, 4),
        c("G"): lambda p: p.push(struct.unpack(">d", p.take(8))[0], 24),
        c("F"): _op_float_text,
        c("X"): lambda p: p.push(p.text(p.uint(4))),
        0x8C: lambda p: p.push(p.text(p.uint(1))),
        0x8D: lambda p: p.push(p.text(p.uint(8))),
        c("B"): lambda p: _op_bytes(p, 4),
        c("C"): lambda p: _op_bytes(p, 1),
        0x8E: lambda p: _op_bytes(p, 8),
        c("}"): lambda p: p.push({}, 64),
        c("d"): _op_dict,
        c("]"): lambda p: p.push([], 56),
        c("l"): _op_list,
        c(")"): lambda p: p.push((), 8),
        c("t"): _op_tuple,
        0x85: _op_tuple_n(1),
        0x86: _op_tuple_n(2),
        0x87: _op_tuple_n(3),
        c("a"): _op_append,
        c("e"): _op_appends,
        c("s"): _op_setitem,
        c("u"): _op_setitems,
        c("R"): _op_reduce,
        0x81: _op_newobj,
        c("b"): _op_build,
        c("Q"): lambda p: _op_persid(p, p.pop()),
        c("P"): lambda p: _op_persid(p, p.line()),
        c("p"): lambda p: _op_put(p, _parse_int(p, p.line())),
        c("q"): lambda p: _op_put(p, p.byte()),
        c("r"): lambda p: _op_put(p, p.uint(4)),
        0x94: lambda p: _op_put(p, len(p.memo)),
        c("g"): lambda p: _op_get(p, _parse_int(p, p.line())),
        c("h"): lambda p: _op_get(p, p.byte()),
        c("j"): lambda p: _op_get(p, p.uint(4)),
    }
    return ops


_OPS = _build_ops()


# ---------------------------------------------------------------------------------------------- calls


def _call(p: _Interpreter, func: _Global, args: tuple) -> Any:
    if func.role == "dict":
        if args not in ((), ([],)):
            raise p.fail("OrderedDict called with items (a checkpoint's pickle adds them with SETITEMS)")
        return {}
    if func.role == "rebuild":
        return _rebuild_tensor(p, func, args)
    if func.role == "parameter":
        if not args or not isinstance(args[0], _Tensor):
            raise p.fail(f"{func.name} is given no tensor")
        return args[0]
    if func.role == "from_type":
        # _rebuild_from_type_v2(func, new_type, args, state): a tensor (sub)class rebuilt by `func(*args)`
        if len(args) != 4 or not isinstance(args[0], _Global) or not isinstance(args[2], tuple):
            raise p.fail("_rebuild_from_type_v2 with unexpected arguments")
        if not isinstance(args[1], _Global) or args[1].role != "type":
            raise p.fail("_rebuild_from_type_v2 of a type other than a tensor")
        if args[0].role not in ("rebuild", "parameter"):
            raise p.fail("_rebuild_from_type_v2 calls something other than a tensor rebuild")
        return _call(p, args[0], args[2])
    if func.role == "bytes":
        # (what torch.load's weights_only unpickler allows too: latin-1 text back to its bytes, nothing else)
        if len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
            raise p.fail("_codecs.encode with arguments other than a text and 'latin1'")
        p.budget.charge(len(args[0]))  # a copy each call: one memoized text encoded a million times
        try:
            return args[0].encode("latin-1")
        except UnicodeEncodeError:
            raise p.fail("_codecs.encode of a text that is not latin-1") from None
    raise p.fail(f"calls {func.module}.{func.name}, which is not a function")


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _rebuild_tensor(p: _Interpreter, func: _Global, args: tuple) -> _Tensor:
    """_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]) and _v3, which
    puts the dtype after the hooks."""
    v3 = func.name == "_rebuild_tensor_v3"
    if len(args) < (7 if v3 else 6) or not isinstance(args[0], _Storage):
        raise p.fail(f"{func.name} with unexpected arguments")
    storage, offset, shape, strides = args[0], args[1], args[2], args[3]
    if not isinstance(offset, int) or isinstance(offset, bool) or not _ints(shape) or not _ints(strides):
        raise p.fail(f"{func.name}: offset, size and stride must be integers")
    if len(shape) != len(strides) or len(shape) > MAX_RANK:
        raise p.fail(f"{func.name}: a size of rank {len(shape)} with strides of rank {len(strides)}")
    if offset < 0 or any(d < 0 for d in shape) or any(s < 0 for s in strides):
        raise p.fail(f"{func.name}: a negative offset, size or stride")
    if max((offset, *shape, *strides)) >= I64_LIMIT:  # torch's are int64
        raise p.fail(f"{func.name}: an offset, size or stride of 2^63 or more")
    if v3:
        token = args[6]
        if not isinstance(token, _Global) or token.role != "dtype":
            raise p.fail("_rebuild_tensor_v3 without a dtype")
        if token.dtype is None:
            raise p.fail(f"a tensor of dtype torch.{token.name}, {_NO_FORM}")
        dtype = token.dtype
    else:
        if storage.dtype is None:
            raise p.fail("_rebuild_tensor_v2 over an untyped storage")
        dtype = storage.dtype
    _refuse_lazy_views(p, func, args[7 if v3 else 6 :])
    return _Tensor(storage, dtype, offset, tuple(shape), tuple(strides))


def _refuse_lazy_views(p: _Interpreter, func: _Global, rest: tuple) -> None:
    """The argument after the dtype (v3) or the hooks (v2) is torch's tensor metadata, saved only where it says
    something (`torch._utils.get_tensor_metadata`): `conj` or `neg` makes the stored bytes mean their conjugate
    or negation (`x.conj()`, `x.conj().imag`), which a checkpoint of stored bytes cannot say. Refused: the bytes
    alone would be silently wrong tensors."""
    if not rest or rest[0] is None:
        return
    metadata = rest[0]
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise p.fail(f"{func.name} with unexpected tensor metadata")
    flags = sorted(key for key, value in metadata.items() if value)
    if flags:
        raise p.fail(
            f"a tensor saved as a lazy view ({', '.join(flags)}): its stored bytes are not its values; "
            "save it resolved (x.resolve_conj().resolve_neg(), or x.clone())"
        )


# ---------------------------------------------------------------------------------------------- the reader


@dataclass(frozen=True)
class _View:
    """Where a tensor's elements lie: element (i, j, ...) at storage_start + (offset + i*s0 + j*s1...)*itemsize."""

    storage_start: int  # absolute offset of the storage's first byte
    offset: int  # of element 0, in elements
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    def oriented(self, rows: tuple[int, int] | None, transpose: bool) -> _View:
        """Rows r0:r1 of the first dimension, and/or the transpose of a 2-D tensor, as a view of its own."""
        offset, shape, strides = self.offset, self.shape, self.strides
        if rows is not None:
            offset += rows[0] * strides[0]
            shape = (rows[1] - rows[0], *shape[1:])
        if transpose:
            shape, strides = shape[::-1], strides[::-1]
        return replace(self, offset=offset, shape=shape, strides=strides)

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass
class Found:
    """The tensors found in the pickled object, by name, and what was not taken."""

    tensors: dict[str, _Tensor] = field(default_factory=dict)
    taken: str | None = None  # the top-level key the tensors were taken from
    taken_by: str = ""  # "asked" | "usual key"
    left: list[str] = field(default_factory=list)  # what was not converted, each as `key (what)`
    visits: int = 0

    def visit(self, path: str) -> None:
        self.visits += 1
        if self.visits > MAX_VISITS:
            raise FormatError(f"more than {MAX_VISITS} values to look through for tensors", path)


class PytorchReader(TensorFileReader):
    """A `torch.save` zip checkpoint: its tensors, read without running its pickle.

    `top_level_key`: take the tensors under this key of the saved dict (Burn's `with_top_level_key`); without
    it, a dict whose tensors sit under exactly one of USUAL_KEYS is read from there.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        within: str | os.PathLike[str] | None = None,
        top_level_key: str | None = None,
    ) -> None:
        self.top_level_key = top_level_key
        self._views: dict[str, _View] = {}  # every tensor's elements, by strides
        self._gathered: set[str] = set()  # those that are not one window of the file
        super().__init__(path, within)

    def _parse(self) -> None:
        head = pread_exact(self.fd, min(4, self.file_size), 0, self.path, "header")
        if head != ZIP_MAGIC:
            if head[:1] == b"\x80":
                raise legacy_error(self.path)
            raise FormatError("not a torch.save zip checkpoint", self.path)
        archive = _Zip(self.fd, self.file_size, self.path)
        prefix = self._prefix(archive)
        self._check_byteorder(archive, prefix)
        pickle = archive.read(archive.by_name[f"{prefix}data.pkl"], MAX_PICKLE_SIZE)
        storages: dict[str, _Storage] = {}

        def storage(pid: Any) -> _Storage:
            return self._storage(pid, archive, prefix, storages)

        root = _Interpreter(pickle, self.path, storage).run()
        found = find_tensors(root, self.top_level_key, self.path)
        self._table(found)
        facts: dict[str, Any] = {
            "archive": prefix.rstrip("/"),
            "pickle_size": len(pickle),
            "views": len(self._gathered),
        }
        if found.taken is not None:
            facts["top_level_key"] = found.taken
            facts["top_level_key_by"] = found.taken_by
        if found.left:
            facts["left"] = found.left
        self.header = CheckpointHeader(
            format=NAME, path=self.path, file_size=self.file_size, metadata={"format": "pt"}, facts=facts
        )

    def _prefix(self, archive: _Zip) -> str:
        """The archive's top directory (`archive/`, or the saved file's stem): the one holding data.pkl."""
        pickles = [e.name for e in archive.entries if e.name.endswith("/data.pkl") and e.name.count("/") == 1]
        if len(pickles) != 1:
            what = "no data.pkl" if not pickles else f"{len(pickles)} data.pkl entries"
            raise FormatError(f"a zip with {what}: not a torch.save checkpoint", self.path)
        return pickles[0].removesuffix("data.pkl")

    def _check_byteorder(self, archive: _Zip, prefix: str) -> None:
        entry = archive.by_name.get(f"{prefix}byteorder")
        if entry is None:  # files written before the record existed are little-endian
            return
        order = archive.read(entry, 16)
        if order != b"little":
            shown = order.decode("ascii", "replace")
            raise FormatError(f"saved with byteorder {shown!r}: only little-endian checkpoints are read", self.path)

    def _storage(self, pid: Any, archive: _Zip, prefix: str, storages: dict[str, _Storage]) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise FormatError("data.pkl: a persistent id that is not a storage", self.path)
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _Global) or kind.role != "storage" or not isinstance(key, str):
            raise FormatError("data.pkl: a storage of no known storage type", self.path)
        if kind.dtype is None:
            raise FormatError(f"data.pkl: a torch.{kind.name}, {_NO_FORM}", self.path)
        if not isinstance(numel, int) or numel < 0:
            raise FormatError(f"data.pkl: storage {key!r} has no valid size", self.path)
        known = storages.get(key)
        if known is not None:
            if known.type_name != kind.name:
                raise FormatError(f"data.pkl: storage {key!r} is given two types", self.path)
            return known
        entry = archive.by_name.get(f"{prefix}data/{key}")
        if entry is None:
            raise FormatError(f"data.pkl names storage {key!r}, which the archive does not hold", self.path)
        itemsize = 1 if kind.role == "storage" and kind.name == "UntypedStorage" else ITEMSIZE[kind.dtype]
        if numel * itemsize > entry.size:
            raise FormatError(
                f"storage {key!r} holds {entry.size} bytes, fewer than its {numel} elements need", self.path
            )
        dtype = None if kind.name == "UntypedStorage" else kind.dtype
        storages[key] = _Storage(key, dtype, kind.name, entry)
        return storages[key]

    def _table(self, found: Found) -> None:
        if len(found.tensors) > MAX_TENSOR_COUNT:
            raise FormatError(
                f"File contains {len(found.tensors)} tensors, exceeding maximum of {MAX_TENSOR_COUNT}", self.path
            )
        infos: list[TensorInfo] = []
        for name, tensor in found.tensors.items():
            itemsize = ITEMSIZE[tensor.dtype]
            numel = 1
            for dim in tensor.shape:
                numel *= dim
            last = tensor.offset + sum((d - 1) * s for d, s in zip(tensor.shape, tensor.strides, strict=True) if d)
            if numel and (last + 1) * itemsize > tensor.storage.entry.size:
                raise FormatError(
                    f"its storage holds {tensor.storage.entry.size} bytes, fewer than the tensor reaches "
                    f"({(last + 1) * itemsize})",
                    self.path,
                    name,
                )
            start = tensor.storage.entry.data_start + tensor.offset * itemsize
            infos.append(TensorInfo(name, tensor.dtype, tensor.shape, start, numel * itemsize, None, tensor.dtype))
            self._views[name] = _View(
                tensor.storage.entry.data_start, tensor.offset, tensor.shape, tensor.strides, itemsize
            )
            if not numel or not _c_contiguous(tensor.shape, tensor.strides):  # an empty one: gathers nothing
                self._gathered.add(name)
        self._check_expansion(infos)
        self._index(infos)
        # a window overlapping one before it (tied or overlapping slices) is read as a view: a converter
        # moving windows in file order takes each byte once
        end = -1
        for info in self.tensors:
            if info.name in self._gathered:
                continue
            if info.offset < end:
                self._gathered.add(info.name)
            else:
                end = info.offset + info.nbytes

    def _check_expansion(self, infos: list[TensorInfo]) -> None:
        total = sum(info.nbytes for info in infos)
        if total <= EXPANSION_FLOOR or total <= MAX_EXPANSION * self.file_size:
            return
        largest = max(infos, key=lambda info: info.nbytes)
        raise FormatError(
            f"its tensors stand for {total} bytes of values, {total // max(self.file_size, 1)}x the file's size: "
            f"expanded views (tensor '{largest.name}' alone: {largest.nbytes} bytes), which would be written out; "
            "save them cloned (x.clone()) if that is meant",
            self.path,
        )

    def is_window(self, name: str) -> bool:
        return name not in self._gathered

    def all_windows(self) -> bool:
        return not self._gathered

    def read(self, name: str) -> bytes:
        info = self.tensor(name)
        buf = bytearray(info.nbytes)
        self.readinto(name, 0, memoryview(buf))
        return bytes(buf)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        if name not in self._gathered:
            super().readinto(name, offset, buf)
            return
        self.gather_into(name, offset, buf)

    def gather_into(
        self, name: str, offset: int, buf: memoryview, rows: tuple[int, int] | None = None, transpose: bool = False
    ) -> None:
        """Bytes offset:offset+len(buf) of the tensor (or of rows r0:r1 of it, and/or of its 2-D transpose) laid
        out in C order: what a converter writes, gathered straight from the storage in that order."""
        self.tensor(name)  # a name the file does not hold fails here, as for any reader
        base = self._views[name]
        if (rows is not None and not (base.shape and 0 <= rows[0] <= rows[1] <= base.shape[0])) or (
            transpose and len(base.shape) != 2
        ):
            raise FormatError(f"tensor '{name}' {list(base.shape)} has no such rows or transpose", self.path)
        view = base.oriented(rows, transpose)
        if offset < 0 or offset + len(buf) > view.numel * view.itemsize:
            raise FormatError(f"read past the end of tensor '{name}'", self.path)
        item = view.itemsize
        first, last = offset // item, -(-(offset + len(buf)) // item)
        if first * item == offset and last * item == offset + len(buf):
            self._gather(view, name, first, last, buf)
            return
        whole = bytearray((last - first) * item)
        self._gather(view, name, first, last, memoryview(whole))
        buf[:] = whole[offset - first * item : offset - first * item + len(buf)]

    def iter_chunks(self, name: str, chunk_size: int = 8 << 20) -> Iterator[memoryview]:
        if name not in self._gathered:
            yield from super().iter_chunks(name, chunk_size)
            return
        nbytes = self.tensor(name).nbytes
        for done in range(0, nbytes, chunk_size):  # (the gathered ones)
            buf = memoryview(bytearray(min(chunk_size, nbytes - done)))
            self.readinto(name, done, buf)
            yield buf

    def _gather(self, view: _View, name: str, first: int, last: int, out: memoryview) -> None:
        """Elements first:last of the view, in C order, into `out`: a bounded number at a time, each piece
        read as few spans of the storage as the gaps between its elements allow."""
        if _c_contiguous(view.shape, view.strides):  # e.g. a transposed view read transposed: one window
            at = view.storage_start + (view.offset + first) * view.itemsize
            preadinto_exact(self.fd, out, at, self.path, f"tensor '{name}'")
            return
        import numpy as np  # here: reading a table (`syncd inspect`) does not need numpy

        dtype = np.dtype(f"<u{view.itemsize}")
        target = np.frombuffer(out, dtype=dtype)
        strides = np.array(view.strides, dtype=np.int64)
        for start in range(first, last, _GATHER_ELEMENTS):
            stop = min(last, start + _GATHER_ELEMENTS)
            where = np.full(stop - start, view.offset, dtype=np.int64)
            if view.shape:
                index = np.unravel_index(np.arange(start, stop, dtype=np.int64), view.shape)
                for axis, stride in zip(index, strides, strict=True):
                    where += axis.astype(np.int64) * stride
            order = np.argsort(where, kind="stable")  # the storage read in its own order
            ranked = where[order]
            piece = target[start - first : stop - first]
            for group in _groups(_spans(ranked, view.itemsize), ranked, view.itemsize):
                self._gather_group(view, name, group, ranked, order, piece)

    def _gather_group(
        self, view: _View, name: str, spans: list[tuple[int, int]], ranked: Any, order: Any, piece: Any
    ) -> None:
        """Read `spans` (runs of the sorted offsets `ranked`, together at most _GATHER_SPAN bytes) into one
        buffer, one read each, then place all their elements at once (per-span numpy work would dominate)."""
        import numpy as np

        item = view.itemsize
        bounds = np.array(spans, dtype=np.int64)
        lows, highs = ranked[bounds[:, 0]], ranked[bounds[:, 1] - 1]
        sizes = (highs - lows + 1) * item
        bases = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        blob = memoryview(bytearray(int(sizes.sum())))
        for low, size, base in zip(lows.tolist(), sizes.tolist(), bases.tolist(), strict=True):
            preadinto_exact(self.fd, blob[base : base + size], view.storage_start + low * item, self.path, name)
        a, b = spans[0][0], spans[-1][1]
        which = np.repeat(np.arange(len(spans)), bounds[:, 1] - bounds[:, 0])
        positions = (ranked[a:b] - lows[which]) + bases[which] // item
        piece[order[a:b]] = np.frombuffer(blob, dtype=piece.dtype)[positions]


def legacy_error(path: str) -> FormatError:
    """The one line for a torch.save file in the format before the zip (a bare pickle stream)."""
    return FormatError(
        "a torch.save file in the legacy format (PyTorch < 1.6, or _use_new_zipfile_serialization=False), which "
        "syncd does not read: re-save it with a current torch (the zip format) to convert it",
        path,
    )


def _spans(ranked: Any, itemsize: int) -> list[tuple[int, int]]:
    """Cut sorted element offsets into runs read at once: a gap over _GATHER_GAP bytes or a run over
    _GATHER_SPAN bytes starts a new one."""
    import numpy as np

    if not len(ranked):
        return []
    breaks = np.flatnonzero(np.diff(ranked) * itemsize > _GATHER_GAP) + 1
    spans: list[tuple[int, int]] = []
    bounds = [0, *breaks.tolist(), len(ranked)]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        while (int(ranked[b - 1]) - int(ranked[a]) + 1) * itemsize > _GATHER_SPAN:
            cut = a + int(np.searchsorted(ranked[a:b], ranked[a] + _GATHER_SPAN // itemsize))
            spans.append((a, cut))
            a = cut
        spans.append((a, b))
    return spans


def _groups(spans: list[tuple[int, int]], ranked: Any, itemsize: int) -> Iterator[list[tuple[int, int]]]:
    """Consecutive spans whose bytes together stay within _GATHER_SPAN (a span is at most that on its own)."""
    group: list[tuple[int, int]] = []
    total = 0
    for a, b in spans:
        size = (int(ranked[b - 1]) - int(ranked[a]) + 1) * itemsize
        if group and total + size > _GATHER_SPAN:
            yield group
            group, total = [], 0
        group.append((a, b))
        total += size
    if group:
        yield group


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


# ---------------------------------------------------------------------------------------------- finding tensors


def find_tensors(root: Any, top_level_key: str | None, path: str) -> Found:
    """The tensors of the saved object, named by their dict keys joined with '.' (as Burn's PytorchStore);
    with `top_level_key`, those under that key; without, those under the one usual key that holds them."""
    found = Found()
    if isinstance(root, _Object | _Foreign):  # a whole pickled model, or a payload
        raise FormatError(refused_global(root.shown), path)
    if isinstance(root, _Tensor):
        raise FormatError("holds a single tensor, not a dict of named tensors", path)
    if not isinstance(root, dict):
        raise FormatError(f"holds a {_kind(root)}, not a dict of tensors (a whole pickled model is not read)", path)
    if top_level_key is not None:
        if not isinstance(root.get(top_level_key), dict):
            keys = ", ".join(_shown(k) for k in list(root)[:10])
            what = "is not a dict" if top_level_key in root else "is not"
            raise FormatError(f"top-level key {top_level_key!r} {what} in this file (its keys: {keys})", path)
        found.taken, found.taken_by = top_level_key, "asked"
    else:
        holding = [k for k in USUAL_KEYS if isinstance(root.get(k), dict) and _count_tensors(root[k], found, path)]
        if len(holding) == 1:
            found.taken, found.taken_by = holding[0], "usual key"
    if found.taken is not None:
        for key, value in root.items():
            if key != found.taken:
                found.left.append(_left(key, value, found, path))
        _collect(root[found.taken], "", found, path, 1)
    else:
        _collect(root, "", found, path, 1)
    if not found.tensors:
        raise FormatError("holds no tensors under string keys", path)
    return found


def _collect(node: dict, prefix: str, found: Found, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise FormatError(f"dicts nested more than {MAX_DEPTH} deep", path)
    for key, value in node.items():
        found.visit(path)
        name = f"{prefix}{key}" if isinstance(key, str | int) and not isinstance(key, bool) else None
        if name is None:  # (named under its dict, as the other keys are)
            found.left.append(_left(f"{prefix}{_shown(key, quoted=False)}", value, found, path))
        elif isinstance(value, _Tensor):
            if name in found.tensors:
                raise FormatError(f"two entries make the tensor name {name!r}", path)
            found.tensors[name] = value
        elif isinstance(value, dict):
            _collect(value, f"{name}.", found, path, depth + 1)
        elif isinstance(value, _Object | _Foreign):
            # holding tensors (a tensor subclass, a module of its own, an array), what it holds is not read, and
            # leaving it out would be a model short of a weight; holding none (a torch.Size, a Namespace), it is
            # said not converted, at any depth
            if _count_tensors(value, found, path):
                raise FormatError(refused_global(value.shown), path)
            found.left.append(_left(name, value, found, path))
        elif prefix == "" or _count_tensors(value, found, path):
            # what is not converted is said: every top-level value, and tensors deeper down in a list or
            # tuple (`encoder.layers: [t, t]`; Burn's store reads dicts only), by their full name
            found.left.append(_left(name if name is not None else key, value, found, path))


def _left(key: Any, value: Any, found: Found, path: str) -> str:
    count = _count_tensors(value, found, path)
    what = f"{count} tensors" if count else _kind(value)
    return f"{_shown(key, quoted=False)} ({what})"


def _shown(key: Any, quoted: bool = True) -> str:
    """A dict key for a message, short whatever its size (a key may be megabytes of text or bytes)."""
    if isinstance(key, str):
        return repr(key[:60]) if quoted else key[:60]
    if isinstance(key, bytes):
        return repr(key[:60])
    return repr(key)[:60]


def _count_tensors(value: Any, found: Found, path: str) -> int:
    """Tensors anywhere inside `value` (lists and tuples included); bounded in depth and in values looked at,
    since a pickle can share and cycle."""
    count = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        found.visit(path)
        if depth > MAX_DEPTH:
            raise FormatError(f"values nested more than {MAX_DEPTH} deep", path)
        # (a storage in an object, an object an array maker made: a tensor syncd cannot build)
        if isinstance(item, _Tensor | _Storage) or (isinstance(item, _Object) and item.array):
            count += 1
        elif isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, _Object):
            stack.extend((v, depth + 1) for v in item.parts)
    return count


def _kind(value: Any) -> str:
    if isinstance(value, _Tensor):
        return "a tensor"
    if isinstance(value, _Object):
        return value.shown
    if isinstance(value, _Foreign):
        return f"class {value.shown}"
    if isinstance(value, _Global):  # a torch.dtype, a storage type, saved as a value
        return f"{value.module}.{value.name}"
    if isinstance(value, bool | int | float):
        return f"{type(value).__name__} {value!r}"[:60]
    return type(value).__name__
