"""One finding of the doctor's: what was checked, whether it holds, and what to do if not."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Check:
    ok: bool
    what: str  # e.g. "pool rollout", "image swe/x:1", "model.path"
    detail: str  # what was found, or what is missing and how to fix it
