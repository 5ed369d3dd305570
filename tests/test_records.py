"""cheap_init: a frozen dataclass built through it is the dataclass's own value, only built faster."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest

from syncd.formats.table import TensorInfo, tensor_info
from syncd.records import cheap_init


@dataclass(frozen=True)
class Plain:
    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    parts: tuple[str, ...] = ()


@cheap_init
@dataclass(frozen=True)
class Cheap:
    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    parts: tuple[str, ...] = ()


def test_fields_and_defaults_are_the_dataclass_ones() -> None:
    for args, kwargs in [
        (("a", (2, 3)), {}),
        (("a", (2, 3), (0, 1)), {"parts": ("x",)}),
        ((), {"name": "b", "shape": ()}),
    ]:
        cheap, plain = Cheap(*args, **kwargs), Plain(*args, **kwargs)
        assert dataclasses.astuple(cheap) == dataclasses.astuple(plain)
        assert repr(cheap).removeprefix("Cheap") == repr(plain).removeprefix("Plain")


def test_value_semantics_are_kept() -> None:
    a, b = Cheap("a", (1,)), Cheap("a", (1,))
    assert a == b and hash(a) == hash(b) and a != Cheap("a", (2,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "z"  # type: ignore[misc]
    assert dataclasses.replace(a, rows=(0, 1)) == Cheap("a", (1,), (0, 1))
    assert pickle.loads(pickle.dumps(a)) == a


def test_arguments_are_checked_as_python_checks_them() -> None:
    with pytest.raises(TypeError):
        Cheap("a")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Cheap("a", (1,), nope=1)  # type: ignore[call-arg]


def test_a_table_entry_built_without_a_frame_is_the_constructor_s_value() -> None:
    info = TensorInfo("w", "F32", (2,), 8, 8)
    assert (info.param_id, info.raw_dtype) == (None, None)
    fast = tensor_info(("w", "F32", (2,), 8, 8, None, None))
    assert type(fast) is TensorInfo and fast == info and hash(fast) == hash(info)
    assert (fast.name, fast.shape, fast.offset, fast.nbytes) == ("w", (2,), 8, 8)
    assert pickle.loads(pickle.dumps(fast)) == info


def test_refuses_what_it_would_build_differently() -> None:
    with pytest.raises(TypeError, match="plain fields"):

        @cheap_init
        @dataclass(frozen=True)
        class WithFactory:
            items: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match="__post_init__"):

        @cheap_init
        @dataclass(frozen=True)
        class WithPostInit:
            x: int

            def __post_init__(self) -> None:
                pass

    with pytest.raises(TypeError, match="frozen"):

        @cheap_init
        @dataclass
        class NotFrozen:
            x: int
