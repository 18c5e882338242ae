"""Schema helpers every package's config section is written with: a field carries its
documentation where it is declared (`--help` shows it), and `iter_fields` walks a schema
as dotted keys. Bottom layer: imports nothing from the project."""

from __future__ import annotations

from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any


def knob(default: Any, doc: str) -> Any:
    """A config field with its documentation attached where it is declared."""
    return field(default=default, metadata={"doc": doc})


def mapping_knob(doc: str) -> Any:
    """A `dict[str, str]` config field, empty by default, documented like `knob`."""
    return field(default_factory=dict, metadata={"doc": doc})


def section(cls: type, doc: str) -> Any:
    """A nested config section; its own fields carry their docs."""
    return field(default_factory=cls, metadata={"doc": doc})


def iter_fields(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """All leaf fields of a schema class as (dotted key, dataclass Field), in order."""
    out: list[tuple[str, Any]] = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            out.extend(iter_fields(f.default_factory, key + "."))
        else:
            out.append((key, f))
    return out
