"""The typed-record machinery: each annotation's check, worked out once per annotation,
takes and normalises what it took before, and names the same path in its errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
import pytest

from luced.ipc.typed import FrameError, Record


@dataclass(frozen=True)
class Item(Record):
    n: int
    x: int | float = 0
    y: float | int = 0.0
    mode: Literal["a", "b"] | str = "a"
    xs: tuple[int, ...] = ()
    pair: tuple[int, str] = (0, "")
    named: dict[str, int | float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Outer(Record):
    items: tuple[Item, ...]
    note: str | None = None


@dataclass(frozen=True)
class Sparse(Record):
    OMIT_DEFAULTS: ClassVar[bool] = True

    n: int
    scale: float = 0  # an int default: normalised to 0.0 as any int
    bias: float = 0.0
    items: tuple[Item, ...] = ()
    note: str | None = None


def test_defaults_stay_off_the_wire_of_a_record_that_omits_them() -> None:
    sparse = Sparse(n=1)
    assert type(sparse.scale) is float
    assert sparse.to_wire() == {"n": 1} and Sparse.from_wire({"n": 1}) == sparse
    assert Item(n=1).to_wire() == {
        "n": 1,
        "x": 0,
        "y": 0.0,
        "mode": "a",
        "xs": [],
        "pair": [0, ""],
        "named": {},
    }  # a record without OMIT_DEFAULTS sends every field
    given = Sparse(n=2, scale=0.0, bias=-0.0, items=(Item(n=3),), note="")
    wire = given.to_wire()
    assert wire == {"n": 2, "bias": -0.0, "items": [Item(n=3).to_wire()], "note": ""}
    back = Sparse.from_wire(wire)
    assert back == given and str(back.bias) == "-0.0"
    for bad, message in [
        ({"n": 1, "scale": "0"}, "Sparse: scale: expected float, got str '0'"),
        ({"n": 1, "items": [{"n": 1, "xs": [True]}]}, "items[0]: Item: xs[0]: expected int"),
        ({"scale": 1.0}, "Sparse: missing field(s) ['n']"),
    ]:
        with pytest.raises(FrameError) as info:
            Sparse.from_wire(bad)
        assert message in str(info.value)


def test_unions_take_the_first_arm_that_accepts() -> None:
    item = Item(n=1, x=3, y=3, mode="c", named={"t": 2, "u": 0.5, "v": None})
    assert type(item.x) is int and item.x == 3  # int | float: the int arm
    assert type(item.y) is float and item.y == 3.0  # float | int: the float arm takes ints
    assert item.mode == "c"
    assert item.named == {"t": 2, "u": 0.5, "v": None}
    assert type(item.named["t"]) is int
    assert type(Item(n=1, x=2.5).x) is float


def test_numpy_and_list_values_are_normalised() -> None:
    item = Item(n=np.int64(7), x=np.float32(1.5), xs=[1, np.int32(2)], pair=[3, "s"])
    assert type(item.n) is int and item.n == 7
    assert type(item.x) is float
    assert item.xs == (1, 2) and all(type(v) is int for v in item.xs)
    assert item.pair == (3, "s")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": True}, "Item: n: expected int, got bool True"),
        ({"n": 2**64}, f"Item: n: {2**64} is outside the 64-bit integer range"),
        ({"n": 1, "x": True}, "Item: x: expected int | float, got bool True"),
        ({"n": 1, "x": "1"}, "Item: x: expected int | float, got str '1'"),
        ({"n": 1, "xs": (1, "2")}, "Item: xs[1]: expected int, got str '2'"),
        ({"n": 1, "pair": (1,)}, "Item: pair: expected 2 items, got 1"),
        ({"n": 1, "named": {"t": "no"}}, "Item: named.t: expected int | float | None"),
        ({"n": 1, "named": {3: 1}}, "Item: named: keys must be strings, got 3"),
        ({"n": 1, "mode": 4}, "Item: mode: expected Union[Literal['a', 'b'], str], got int 4"),
    ],
)
def test_errors_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(FrameError, match=message.replace("[", r"\[").replace("|", r"\|")):
        Item(**kwargs)


def test_nested_records_from_the_wire() -> None:
    outer = Outer(items=(Item(n=1, xs=(2, 3)), Item(n=4, named={"k": 1.5})), note="hi")
    wire = outer.to_wire()
    assert wire["items"][0]["xs"] == [2, 3]
    assert Outer.from_wire(wire) == outer
    bad = {**wire, "items": [{**wire["items"][0], "n": "x"}]}
    with pytest.raises(FrameError, match=r"Outer: items\[0\]: Item: n: expected int"):
        Outer.from_wire(bad)
    with pytest.raises(FrameError, match=r"missing field\(s\) \['n'\]"):
        Item.from_wire({})
    with pytest.raises(FrameError, match=r"unknown field\(s\) \['z'\]"):
        Item.from_wire({"n": 1, "z": 2})
