"""The one plug-in resolver: a plug-in point names its implementation by a short built-in
name or an import string `package.module:Attr`, resolved once at start-up.

Each plug-in point owns its table of built-ins, beside its Protocol and its contract check,
in the package the point belongs to, so every built-in name stays inside that package:

    agent loop       rollout.agent_loop          AGENT_LOOPS, check_agent_loop
    reward fn        reward.base                 REWARD_FNS, check_reward_fn
    tool             envs.tools.base             TOOLS, check_tool_class (load_tool_class)
    sandbox backend  envs.sandbox.backends       SANDBOX_BACKENDS, load_sandbox_backend
    train backend    trainer.train.backends      TRAIN_BACKENDS, load_train_backend
    warm start       trainer.run.warm_start      WARM_STARTS (none), load_warm_start
    task set         envs.tasks                  BUILTIN_SETS (names only: no import strings)

Start-up validation (trainer.run.validate) runs each point's check on what a recipe and
its task rows name, and lists every problem before anything starts.

This module is the bottom layer with `envs.types` and `envs.knobs`: it knows no plug-in
point and imports nothing from the project.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass

_IMPORT_STRING = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_NAME = re.compile(r"^[A-Za-z_]\w*$")


def is_import_string(value: str) -> bool:
    """True for `package.module:Attr` plug-in references."""
    return bool(_IMPORT_STRING.match(value))


def check_reference(kind: str, value: str) -> str | None:
    """None if `value` has the shape of a plug-in reference (a bare name or an import
    string), else the problem. For the bottom layer, which cannot know any built-ins."""
    if _NAME.match(value) or is_import_string(value):
        return None
    return f"{kind} {value!r} is neither a built-in name nor an import string 'package.module:Class'"


@dataclass(frozen=True, slots=True)
class PluginPoint:
    """One plug-in point: what messages call it, the recipe key that names it, and its
    built-ins (short name -> import string inside the owning package)."""

    kind: str  # e.g. "agent loop"
    key: str  # where a user names it, e.g. "agent.loop (or a task's agent_loop)"
    builtins: Mapping[str, str]

    def import_string(self, value: str) -> str:
        """The import string `value` stands for: a built-in name's, or `value` itself."""
        return self.builtins.get(value, value)

    def check_name(self, value: str) -> str | None:
        """None if `value` is a built-in name or a well-formed import string, else the
        problem; imports nothing (for config checks)."""
        if value in self.builtins or is_import_string(value):
            return None
        return f"{self.kind} {value!r} is neither a built-in nor an import string{self._known(value)}"

    def resolve(self, value: str) -> object:
        """The object a built-in name or `package.module:Attr` names. ValueError says what
        is wrong, the closest built-in names and the key to set."""
        problem = self.check_name(value)
        if problem is not None:
            raise ValueError(problem)
        module_name, attr = self.import_string(value).split(":")
        try:
            obj: object = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{self.kind} {value!r}: cannot import {module_name!r} ({exc})"
                             f"{self._known(value)}") from exc
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"{self.kind} {value!r}: {module_name} has no attribute "
                                 f"{attr!r}{self._known(value)}")
            obj = getattr(obj, part)
        return obj

    def _known(self, value: str) -> str:
        """The message tail: the closest built-in (name or import string) and what the key
        takes."""
        close = difflib.get_close_matches(value, [*self.builtins, *self.builtins.values()],
                                          n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        listed = f"a built-in ({', '.join(self.builtins)}) or " if self.builtins else ""
        return f"{hint}; {self.key} takes {listed}an import string 'package.module:Class'"


def signature_problem(func: object, params: tuple[str, ...]) -> str | None:
    """None when `func` accepts len(params) positional arguments, else a message suffix
    such as "(self, task) must accept (self, task, ctx)". For contract checks."""
    try:
        sig = inspect.signature(func)  # type: ignore[arg-type]  # any callable; TypeError below
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return None
    try:
        sig.bind(*params)
    except TypeError:
        return f"{sig} must accept ({', '.join(params)})"
    return None
