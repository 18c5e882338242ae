"""Moved: the shared types (Task, Trajectory, Message, ...) live in `envs.types`, and plug-ins
import them from the public API, `rollout.api`. This shim keeps last round's
`from rollout.types import Task` working for one more release, with a DeprecationWarning
(once) that names the new place."""

from __future__ import annotations

import warnings

from envs import types as _types

_warned = False


def __getattr__(name: str) -> object:
    global _warned
    value = getattr(_types, name)  # AttributeError: a name rollout.types never had
    if not _warned:
        _warned = True
        warnings.warn(f"rollout.types moved: import {name} from rollout.api (the public API; "
                      "the types live in envs.types); rollout.types goes in a later release",
                      DeprecationWarning, stacklevel=2)
    return value
