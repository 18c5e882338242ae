"""The Tool protocol: a tool is built once per trajectory as `cls(env)` (the trajectory's
`envs.trajectory_env.TrajectoryEnv`), executed any number of times, and needs no
lifecycle of its own: the environment owns the sandbox lease and releases it once.

A tool describes itself with an OpenAI function schema (what the chat template shows the
model). `execute` returns a ToolResult; raising is allowed, the agent loop turns the
exception into an error observation, but expected failures should come back as results
with `is_error=True` and a message the model can act on. A tool class that works in the
trajectory's sandbox sets `needs_sandbox = True`; the environment then opens one (once,
for all its tools) before the first turn and reaches it as `env.sandbox`.

Tools that block (CPU-bound work, blocking I/O) must not run on the event loop: they
would stall every trajectory of their worker, and no timeout could fire. Either write
`execute` with `await asyncio.to_thread(...)` around such work, or set the class attribute
`blocking = True`: the agent loop then runs `execute` on a thread with its own event loop
(the tool timeout holds; the thread finishes on its own). A worker notices a blocked loop
and names the tools that were executing (rollout/event_loop_stalls). `check_tool_class`
checks the contract any tool class must meet without building it; `TOOLS` holds the
built-in tools by name, and recipes add or replace tools by import string (`envs.tools`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from envs.plugins import PluginPoint, signature_problem
from envs.types import Content, Image, JsonObject, JsonValue

if TYPE_CHECKING:
    from envs.trajectory_env import TrajectoryEnv


@dataclass(frozen=True, slots=True)
class ToolResult:
    text: str  # the observation shown to the model
    is_error: bool = False
    ends_trajectory: bool = False  # e.g. `submit`: the trajectory finishes after this turn
    # Images shown after the text (a screenshot): the observation's content is then the
    # text and these images, in order; a vision-language model's processor expands each.
    images: tuple[Image, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "images", tuple(self.images))  # frozen: a list is normalised once, here
        bad = [type(i).__name__ for i in self.images if not isinstance(i, Image)]
        if bad:
            raise ValueError(f"ToolResult.images must be envs.types.Image values (Image.from_pil(picture) "
                             f"makes one), got {bad}")

    @property
    def content(self) -> Content:
        """The observation message's content: the text alone, or the text then the images."""
        return (self.text, *self.images) if self.images else self.text


class Tool(Protocol):
    """One trajectory's instance of a tool."""

    name: str

    @property
    def schema(self) -> Mapping[str, JsonValue]:
        """OpenAI function schema: {"type": "function", "function": {name, description, parameters}}."""
        ...

    async def execute(self, arguments: JsonObject) -> ToolResult: ...


# Builds one trajectory's instance of a tool from that trajectory's environment.
ToolClass = Callable[["TrajectoryEnv"], Tool]


def needs_sandbox(tool_class: ToolClass) -> bool:
    """Whether tools of this class work in the trajectory's sandbox."""
    return bool(getattr(tool_class, "needs_sandbox", False))


# The tool plug-in point: the built-in tools by the name tasks call them.
TOOLS = PluginPoint("tool", "envs.tools.<name>", {
    "calculator": "envs.tools.calculator:CalculatorTool",
    "screenshot": "envs.tools.screenshot:ScreenshotTool",
    "bash": "envs.tools.sandbox_tools:BashTool",
    "python": "envs.tools.sandbox_tools:PythonTool",
    "read_file": "envs.tools.sandbox_tools:ReadFileTool",
    "write_file": "envs.tools.sandbox_tools:WriteFileTool",
    "str_replace": "envs.tools.sandbox_tools:StrReplaceTool",
    "run_tests": "envs.tools.sandbox_tools:RunTestsTool",
    "submit": "envs.tools.sandbox_tools:SubmitTool",
})


def check_tool_class(name: str, tool_class: Any) -> None:  # Any: a user's object, checked here
    """The tool contract, checked without building the tool: a class (or factory) built as
    `cls(env)`, with a string `name`, a function `schema` and `async def execute(self,
    arguments)`. ValueError says what is missing."""
    import inspect

    if not callable(tool_class):
        raise ValueError(f"tool {name!r}: {tool_class!r} is not a class or factory")
    if inspect.isclass(tool_class):
        if not isinstance(getattr(tool_class, "name", None), str):
            raise ValueError(f"tool {name!r}: {tool_class.__name__} needs a class attribute "
                             "`name` (the name the model calls)")
        schema = getattr(tool_class, "schema", None)
        if not isinstance(schema, Mapping) or schema.get("type") != "function":
            raise ValueError(f"tool {name!r}: {tool_class.__name__}.schema must be an OpenAI "
                             "function schema (envs.tools.base.function_schema builds one)")
        execute = getattr(tool_class, "execute", None)
        if not inspect.iscoroutinefunction(execute):
            raise ValueError(f"tool {name!r}: {tool_class.__name__} needs "
                             "`async def execute(self, arguments) -> ToolResult`")
        problem = signature_problem(execute, ("self", "arguments"))
        if problem:
            raise ValueError(f"tool {name!r}: {tool_class.__name__}.execute{problem}")
    problem = signature_problem(tool_class, ("env",))
    if problem:
        raise ValueError(f"tool {name!r}: {getattr(tool_class, '__name__', tool_class)}{problem} "
                         "(tools are built as cls(env))")


def load_tool_class(name: str, ref: str) -> ToolClass:
    """The tool class `ref` (a built-in tool name or an import string) names, checked
    against the tool contract; ValueError says what is wrong."""
    tool_class = TOOLS.resolve(ref)
    check_tool_class(name, tool_class)
    return tool_class  # type: ignore[return-value]  # checked just above


def function_schema(name: str, description: str, properties: Mapping[str, JsonValue],
                    required: tuple[str, ...] = ()) -> dict[str, JsonValue]:
    """An OpenAI function schema with a closed set of arguments."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": dict(properties),
                       "required": list(required), "additionalProperties": False}}}
