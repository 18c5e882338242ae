"""Schema helpers every package's config section is written with: a field carries its
documentation where it is declared (`--help` shows it), and `iter_fields` walks a schema
as dotted keys. Bottom layer: imports nothing from the project."""

from __future__ import annotations

from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import TypeVar

T = TypeVar("T")
V = TypeVar("V")


def knob(default: T, doc: str) -> T:
    """A config field with its documentation attached where it is declared."""
    return field(default=default, metadata={"doc": doc})


def mapping_knob(doc: str) -> dict[str, V]:
    """A mapping config field (`dict[str, str]` mostly), empty by default, documented like
    `knob`; the value type is the annotation's."""
    return field(default_factory=dict, metadata={"doc": doc})


def section(cls: type[T], doc: str) -> T:
    """A nested config section; its own fields carry their docs."""
    return field(default_factory=cls, metadata={"doc": doc})


def iter_fields(cls: type, prefix: str = "") -> list[tuple[str, Field[object]]]:
    """All leaf fields of a schema class as (dotted key, dataclass Field), in order."""
    out: list[tuple[str, Field[object]]] = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        factory = f.default_factory
        if isinstance(factory, type) and is_dataclass(factory):
            out.extend(iter_fields(factory, key + "."))
        else:
            out.append((key, f))
    return out


def field_default(f: Field[object]) -> object:
    """The value a schema field takes when a recipe leaves it out."""
    if f.default_factory is not MISSING:
        return f.default_factory()
    assert f.default is not MISSING, f"config field {f.name} has no default"
    return f.default
