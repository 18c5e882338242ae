"""The one plug-in resolver: every plug-in point (agent loop, reward fn, tool, sandbox
backend, warm start) names its implementation by a built-in name or an import string
`package.module:Attr`, resolved once at start-up.

This is the bottom layer with `envs.types` and `envs.knobs`: it imports nothing from the
project at module level. The built-in tables hold import strings, not objects, so naming
a built-in never creates an import edge between packages.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Literal

PluginKind = Literal["agent loop", "reward fn", "tool", "sandbox backend", "warm start"]

_IMPORT_STRING = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

# Every built-in, by plug-in point: short name -> import string. Recipes and task rows may
# use either form.
BUILTINS: dict[str, dict[str, str]] = {
    "agent loop": {
        "tool_agent": "rollout.agent_loop:ToolAgentLoop",
        "single_turn": "rollout.agent_loop:SingleTurnLoop",
    },
    "reward fn": {
        "exact_match": "reward.rules:ExactMatch",  # the final answer equals Task.answer
        "numeric_match": "reward.rules:NumericMatch",  # within tolerance of Task.answer
        "hidden_tests": "reward.grading.hidden_tests:HiddenTests",  # hidden / fail_to_pass / pass_to_pass pass
        "judge": "reward.judge:GenerativeJudge",  # the judge model's SCORE for the answer
    },
    "tool": {
        "calculator": "envs.tools.calculator:CalculatorTool",
        "bash": "envs.tools.sandbox_tools:BashTool",
        "python": "envs.tools.sandbox_tools:PythonTool",
        "read_file": "envs.tools.sandbox_tools:ReadFileTool",
        "write_file": "envs.tools.sandbox_tools:WriteFileTool",
        "str_replace": "envs.tools.sandbox_tools:StrReplaceTool",
        "run_tests": "envs.tools.sandbox_tools:RunTestsTool",
        "submit": "envs.tools.sandbox_tools:SubmitTool",
    },
    "sandbox backend": {
        "local": "envs.sandbox.local:LocalSandbox",
        "container": "envs.sandbox.container:ContainerSandbox",
    },
    "warm start": {
        "toy_demonstrations": "launch.quickstart:toy_warm_start",
    },
}


def is_import_string(value: str) -> bool:
    """True for `package.module:Attr` plug-in references."""
    return bool(_IMPORT_STRING.match(value))


def canonical_name(kind: PluginKind, value: str) -> str:
    """The import string `value` stands for: a built-in name's, or `value` itself."""
    return BUILTINS[kind].get(value, value)


def check_plugin_name(kind: PluginKind, value: str) -> str | None:
    """None if `value` is a built-in name or well-formed import string, else the problem
    (for config checks that must not import anything)."""
    if value in BUILTINS[kind] or is_import_string(value):
        return None
    return (f"{kind} {value!r} is neither a built-in ({', '.join(BUILTINS[kind])}) nor an "
            "import string 'package.module:Class'")


def resolve_plugin(kind: PluginKind, value: str) -> Any:
    """The object a built-in name or `package.module:Attr` names. ValueError says what is
    wrong and lists the built-ins of `kind`."""
    known = f"; built-ins: {', '.join(BUILTINS[kind])}"
    path = canonical_name(kind, value)
    if not is_import_string(path):
        raise ValueError(f"{kind} {value!r} is neither a built-in nor an import string "
                         f"'package.module:Class'{known}")
    module_name, attr = path.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{kind} {value!r}: cannot import {module_name!r} ({exc}){known}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {value!r}: {module_name} has no attribute {attr!r}{known}")
        obj = getattr(obj, part)
    return obj
