"""Core data passed between stages: Task (with its GradingSpec) -> Trajectory (with Turns)
-> Group; and the agent's final WorkspaceChanges, which stay on the worker that grades them.
A message's content is text, or text and images (`Image`) in order; a trajectory keeps each
image it saw with the run of tokens it stands for (`TrajectoryImage`).

This module is the bottom layer with `envs.plugins` and `envs.knobs`: every package may
import it and it imports nothing else from the project. Per-token arrays are numpy arrays that share
one length, checked on construction.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any, Literal, TypeAlias

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from envs.plugins import check_reference

Role = Literal["system", "user", "assistant", "tool"]

NO_VERSION = -1  # version tag of tokens the model did not generate (mask 0)

# A JSON value as `json.loads` gives it: what crosses the JSON boundaries (tool-call
# arguments from the model, tool schemas, chat-template messages). Read by narrowing.
JsonValue: TypeAlias = "None | bool | int | float | str | Sequence[JsonValue] | Mapping[str, JsonValue]"
JsonObject: TypeAlias = "Mapping[str, JsonValue]"


class TerminationReason(str, enum.Enum):
    """Why a trajectory ended; every trajectory has exactly one."""

    FINISHED = "finished"  # the model stopped (no tool call / submitted)
    MAX_TURNS = "max_turns"  # agent.max_turns reached
    MAX_TOKENS = "max_tokens"  # agent.max_response_tokens reached
    CONTEXT_FULL = "context_full"  # the next prompt would exceed model.max_context_tokens
    TIMEOUT = "timeout"  # agent.trajectory_timeout_s reached
    ERROR = "error"  # an exception inside the trajectory; the message is kept
    DEADLINE = "deadline"  # cut unfinished by its group's deadline (buffer.group_deadline_s):
    # never trained, outside its group's baseline


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: JsonObject

    def to_template(self) -> dict[str, Any]:  # Any: chat templates' free-form dicts
        """The OpenAI-style shape chat templates expect."""
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass(frozen=True, slots=True)
class Image:
    """An image in a message (a screenshot a tool returns, a picture in a task's prompt): the
    encoded file as given (PNG, JPEG, ...), never decoded and re-encoded on its way to the
    engine, so that the engine and the trainer see the same pixels."""

    data: bytes
    media_type: str = "image/png"

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes) or not self.data:
            raise ValueError("Image.data must be the non-empty bytes of an encoded image (PNG, JPEG, ...)")
        if not self.media_type.startswith("image/"):
            raise ValueError(f"Image.media_type must be an image type such as 'image/png', got {self.media_type!r}")

    @classmethod
    def from_pil(cls, picture: Any) -> Image:  # Any: a PIL.Image.Image (PIL is imported on use)
        """A PIL image, encoded as PNG (lossless)."""
        import io

        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        return cls(buffer.getvalue(), "image/png")

    def to_pil(self) -> Any:  # Any: a PIL.Image.Image in RGB
        """The decoded image, in RGB (what image processors take); ValueError if it is not one."""
        import io

        from PIL import Image as PILImage, UnidentifiedImageError

        try:
            with PILImage.open(io.BytesIO(self.data)) as opened:
                return opened.convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"Image ({self.media_type}, {len(self.data)} bytes) cannot be decoded: {exc}") from exc

    def __repr__(self) -> str:  # never the bytes
        return f"Image({self.media_type}, {len(self.data)} bytes)"


# A message's content: text, or text and images in the order they are shown to the model.
Content: TypeAlias = "str | tuple[str | Image, ...]"


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message. `content` is text, or a sequence of text and `Image` parts (a
    tool's screenshot, a task's picture); `text` and `images` read either form."""

    role: Role
    content: Content
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None  # tool name, on role "tool"
    # The assistant's reasoning, apart from `content` (a reasoning parser separates the
    # two), so that a chat template re-renders or drops it the way the model was trained.
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message role must be system/user/assistant/tool, got {self.role!r}")
        if not isinstance(self.content, str):
            parts = tuple(self.content)  # frozen: a list of parts is normalised once, here
            bad = [type(p).__name__ for p in parts if not isinstance(p, (str, Image))]
            if bad:
                raise ValueError(f"message content parts must be text (str) or envs.types.Image, got {bad}")
            if self.role == "assistant" and any(isinstance(p, Image) for p in parts):
                raise ValueError("assistant messages hold text only: the model does not write images")
            object.__setattr__(self, "content", parts)
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning")

    @property
    def text(self) -> str:
        """The text of the content, its image parts left out."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p for p in self.content if isinstance(p, str))

    @property
    def images(self) -> tuple[Image, ...]:
        """The content's images, in order."""
        return () if isinstance(self.content, str) else tuple(p for p in self.content if isinstance(p, Image))

    def with_text(self, text: str) -> Content:
        """The content with `text` appended (after any images: a note below a screenshot)."""
        if isinstance(self.content, str):
            return self.content + text
        if self.content and isinstance(self.content[-1], str):
            return (*self.content[:-1], self.content[-1] + text)
        return (*self.content, text)

    def to_template(self) -> dict[str, Any]:  # Any: chat templates' free-form dicts
        """The message as chat templates read it; content with images becomes a list of
        OpenAI-style parts ({"type": "text", "text": ...} and {"type": "image"}), the shape
        vision-language templates render an image placeholder from."""
        content: Any = self.content if isinstance(self.content, str) else [
            {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in self.content]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning  # the key most templates read
        return out


# Where grading copies `GradingSpec.hidden_tests` inside the grading workspace; node ids of
# hidden tests in `GradingSpec.fail_to_pass` start with this folder
# (e.g. "_sluice_hidden/test_x.py::test_a").
HIDDEN_TESTS_DIR = "_sluice_hidden"


@dataclass(frozen=True, slots=True)
class GradingSpec:
    """How tests grade a task: what only test-based grading (reward.grading) reads; none
    of it ever enters the agent's sandbox.

    Tests are named by pytest node id ("path/to/test_file.py::Class::test_name[param]",
    the path relative to the workspace root). `fail_to_pass` tests must pass after the
    agent's change (they fail on the task's source); `pass_to_pass` tests pass before and
    must keep passing. Both run only in a fresh grading sandbox, after `test_patch` is
    applied and `hidden_tests` is copied to HIDDEN_TESTS_DIR there. The empty spec (the
    default of `Task.grading`) names no tests.
    """

    hidden_tests: str | None = None  # folder of grading tests, never inside the agent's sandbox
    # Unified diff (paths relative to the workspace root, git's a/ b/ prefixes) applied only
    # in the grading copy; it adds or updates tests.
    test_patch: str | None = None
    fail_to_pass: tuple[str, ...] = ()  # tests that must pass after the change
    pass_to_pass: tuple[str, ...] = ()  # tests that must keep passing
    # Tests graded by the repository's own runner instead of pytest node ids (SWE-bench's
    # django, sympy, ...): the command (run with bash in the workspace) and the name of
    # the `swebench` log parser that reads its output (e.g. "parse_log_django"); test ids
    # are then whatever that parser reports.
    test_command: str | None = None
    log_parser: str | None = None

    def __post_init__(self) -> None:
        for name in ("fail_to_pass", "pass_to_pass"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"{name} must be a sequence, not a string (wrap it: [{value!r}])")
            object.__setattr__(self, name, tuple(value))  # frozen: lists are normalised once, here
        if (self.test_command is None) != (self.log_parser is None):
            raise ValueError("test_command and log_parser go together (the runner's command "
                             "and the swebench parser of its output)")
        for name in ("fail_to_pass", "pass_to_pass"):
            ids = getattr(self, name)
            for node_id in ids:
                problem = (_node_id_problem(node_id) if self.log_parser is None
                           else "" if isinstance(node_id, str) and node_id else "is empty")
                if problem:
                    raise ValueError(f"{name} entry {node_id!r} {problem}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{name} lists a test twice; remove duplicates")
        both = set(self.fail_to_pass) & set(self.pass_to_pass)
        if both:
            raise ValueError(f"tests {sorted(both)} are in both fail_to_pass and pass_to_pass; "
                             "keep each in one list")
        if self.test_patch is not None and not self.test_patch.strip():
            raise ValueError("test_patch is empty; use None for no patch")

    @property
    def expected_tests(self) -> tuple[str, ...]:
        """`fail_to_pass` then `pass_to_pass`: every test the spec names."""
        return (*self.fail_to_pass, *self.pass_to_pass)


NO_GRADING = GradingSpec()  # the spec of a task graded by no tests


# The fields that moved from Task into GradingSpec: Task still takes them as keywords and
# reads them as attributes, with a DeprecationWarning, until sluice 0.3.
_MOVED_TO_GRADING = tuple(f.name for f in fields(GradingSpec))


def _moved_to_grading(name: str) -> property:
    """The deprecated read-only `Task.<name>`: `task.grading.<name>`, with a warning."""
    def read(task: Task) -> object:
        warnings.warn(f"Task.{name} is deprecated (removed in sluice 0.3): read "
                      f"task.grading.{name}", DeprecationWarning, stacklevel=2)
        return getattr(task.grading, name)
    return property(read, doc=f"Deprecated: `grading.{name}`.")


def _accept_moved_grading_keywords(cls: type[Task]) -> type[Task]:
    """Let the dataclass `__init__` of `cls` take the fields that moved to GradingSpec as
    keywords: they replace those fields of `grading` (the empty spec if none is given), so
    `Task(..., fail_to_pass=ids)` and `dataclasses.replace(task, fail_to_pass=ids)` work as
    before, with a DeprecationWarning naming the new spelling."""
    generated = cls.__init__

    # Any: the arguments go unchanged to the generated __init__, which checks them.
    @functools.wraps(generated)
    def __init__(self: Task, *args: Any, **kwargs: Any) -> None:
        moved = {name: kwargs.pop(name) for name in _MOVED_TO_GRADING if name in kwargs}
        if moved:
            given = ", ".join(f"{name}=..." for name in moved)
            warnings.warn(f"Task({given}) is deprecated (removed in sluice 0.3): write "
                          f"Task(..., grading=GradingSpec({given})) with envs.types.GradingSpec",
                          DeprecationWarning, stacklevel=2)
            base = kwargs.get("grading", NO_GRADING)
            if not isinstance(base, GradingSpec):
                raise ValueError(f"Task grading must be a GradingSpec, got {type(base).__name__}")
            kwargs["grading"] = dataclasses.replace(base, **moved)
        generated(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_accept_moved_grading_keywords
@dataclass(frozen=True, slots=True)
class Task:
    """One problem; a GRPO group runs it G times.

    Every task has an id and its initial messages; it may name its tools, a reference
    answer, and an agent loop or reward function of its own. A task whose agent works in
    a sandbox says where the workspace comes from (`source_dir`, or `image` + `workdir`)
    and which tests the agent may run (`visible_tests`). A task graded by tests carries
    them in `grading`; a task without tests keeps the empty GradingSpec.

    Fields after `agent_loop` are keyword-only. Deprecated until sluice 0.3: the grading
    fields as Task's own keywords and attributes (`Task(..., fail_to_pass=ids)`,
    `task.fail_to_pass`) work with a DeprecationWarning; write
    `Task(..., grading=GradingSpec(fail_to_pass=ids))` and `task.grading.fail_to_pass`.
    Old keywords given beside `grading=` replace those fields of it.
    """

    # What every task has
    id: str
    messages: tuple[Message, ...]  # the initial conversation (system + user)
    tools: tuple[str, ...] = ()  # tool names available to the agent
    answer: str | None = None  # reference answer for rule verifiers
    agent_loop: str | None = None  # import string overriding agent.loop for this task
    _: KW_ONLY
    reward_fn: str | None = None  # import string 'package.module:Class' overriding reward.fn
    # Where the agent works (tasks with a sandbox)
    source_dir: str | None = None  # folder a sandbox workspace is created from
    image: str | None = None  # container image, for container sandbox backends
    # Where `image` keeps the repository (SWE-bench/SWE-smith images: /testbed): the
    # workspace is seeded from it and appears there; None: /workspace (source_dir).
    workdir: str | None = None
    visible_tests: str | None = None  # folder of tests the agent may run (copied into its sandbox)
    # How tests grade it (read only by test-based grading)
    grading: GradingSpec = NO_GRADING

    # Deprecated aliases of the fields that moved to `grading` (removed in sluice 0.3).
    hidden_tests = _moved_to_grading("hidden_tests")
    test_patch = _moved_to_grading("test_patch")
    fail_to_pass = _moved_to_grading("fail_to_pass")
    pass_to_pass = _moved_to_grading("pass_to_pass")
    test_command = _moved_to_grading("test_command")
    log_parser = _moved_to_grading("log_parser")

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("Task.id must be a non-empty string")
        set_ = object.__setattr__  # frozen: sequences given as lists are normalised once, here
        for name in ("messages", "tools"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"task {self.id!r}: {name} must be a sequence, not a string "
                                 f"(wrap it: [{value!r}])")
            set_(self, name, tuple(value))
        if not self.messages:
            raise ValueError(f"task {self.id!r} has no messages")
        self._validate_workspace()
        # The shape only: the reward package owns the built-in names (checked at start-up).
        if self.reward_fn is not None and (problem := check_reference("reward fn", self.reward_fn)):
            raise ValueError(f"task {self.id!r}: reward_fn={self.reward_fn!r}: {problem}")

    def _validate_workspace(self) -> None:
        g = self.grading
        if not isinstance(g, GradingSpec):
            raise ValueError(f"task {self.id!r}: grading must be a GradingSpec "
                             f"(envs.types.GradingSpec), got {type(g).__name__}")
        if (g.test_patch or g.expected_tests) and not (self.source_dir or self.image or g.hidden_tests):
            raise ValueError(f"task {self.id!r} names tests but has no source_dir, image or "
                             "hidden_tests to run them in; add one")
        if self.workdir is not None and (self.image is None or not self.workdir.startswith("/")):
            raise ValueError(f"task {self.id!r}: workdir={self.workdir!r} is the absolute path "
                             "of the repository inside the task's image; it needs an image")


def _node_id_problem(node_id: object) -> str:
    """Why `node_id` is not a pytest node id relative to the workspace ('' if it is one)."""
    if not isinstance(node_id, str):
        return "is not a string"
    path, sep, name = node_id.partition("::")
    if not sep or not name:
        return "is not a pytest node id; write it as 'path/to/test_file.py::test_name'"
    if not path.endswith(".py") or path.startswith("/") or ".." in path.split("/"):
        return "must start with a relative path to a .py file inside the workspace"
    return ""


def clean_relative_path(path: str) -> str | None:
    """`path` normalised ('a/./b' -> 'a/b'), or None if it is absolute, empty, climbs out
    of the root, or holds a NUL or backslash."""
    if not path or "\0" in path or "\\" in path or path.startswith("/"):
        return None
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


@dataclass(frozen=True, slots=True)
class WorkspaceChanges:
    """The agent's final workspace relative to the task's source folder: files written
    (path -> content) and deleted. Built where the sandbox lives (envs.sandbox.changes),
    kept by the worker that ran the trajectory (never on the Trajectory, never sent to the
    driver) for the grading it does right there, applied to a fresh copy of the source
    by grading (reward.grading.prepare). A workspace that could not be captured, or whose
    changes are over the size cap, has a `problem` and no files; grading scores it 0."""

    written: Mapping[str, bytes] = field(default_factory=dict)
    deleted: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # entries not handed over (links, special files, bad names)
    problem: str = ""  # why the workspace was not captured ('' if it was)

    def __post_init__(self) -> None:
        written = dict(self.written)
        for path in [*written, *self.deleted]:
            if clean_relative_path(path) != path:
                raise ValueError(f"WorkspaceChanges path {path!r} is not a clean relative "
                                 "path; use forward slashes, no '..', no leading '/'")
        if self.problem and (written or self.deleted):
            raise ValueError("WorkspaceChanges with a problem carries no files")
        object.__setattr__(self, "written", written)
        object.__setattr__(self, "deleted", tuple(sorted(set(self.deleted))))
        object.__setattr__(self, "skipped", tuple(self.skipped))

    @property
    def num_bytes(self) -> int:
        return sum(len(v) for v in self.written.values())

    def __repr__(self) -> str:  # never the file contents: they can be megabytes
        return (f"WorkspaceChanges(written={len(self.written)} files/{self.num_bytes} bytes, "
                f"deleted={len(self.deleted)}, skipped={len(self.skipped)}, "
                f"problem={self.problem!r})")


@dataclass(frozen=True, slots=True)
class Turn:
    """One model turn, for metrics and transcripts; token positions index `response_ids`."""

    index: int
    prompt_tokens: int  # length of the ids sent to the engine
    response_start: int  # position of this turn's first generated token in response_ids
    num_generated: int
    num_observation: int  # tool/template tokens appended after the generation (mask 0)
    finish_reason: str  # engine's: stop, length, abort
    version: int  # weight version that produced the first token of the turn
    cached_prompt_tokens: int = 0  # prefix-cache hits reported by the engine
    num_tool_calls: int = 0
    num_tool_errors: int = 0  # timeouts included
    generate_s: float = 0.0
    tool_s: float = 0.0
    queue_s: float = 0.0  # time waiting at the turn gate (a sandbox wait is env/open_s_total, outside the budget)
    num_tool_timeouts: int = 0  # calls cut by agent.tool_timeout_s
    engine: str = ""  # the engine that generated it
    started_at: float = 0.0  # unix time the turn reached the turn gate (timelines)
    # What the tool parser made of this turn's output (rollout.tool_parser.ParseStatus):
    # ok, no_call, malformed_call, malformed_arguments, unknown_tool, unclosed_block, too_many.
    tool_parse_status: str = "no_call"
    tool_names: tuple[str, ...] = ()  # the tool of each call of the turn ("(malformed)": unreadable)
    failed_tool_names: tuple[str, ...] = ()  # the tool of each call that failed
    # Of cached_prompt_tokens, those whose KV an older weight version computed (served
    # under rollout.kv_after_push=reuse; 0 under recompute).
    stale_kv_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    generate_s: float = 0.0
    tool_s: float = 0.0
    queue_s: float = 0.0
    total_s: float = 0.0


def _array(values: ArrayLike, dtype: DTypeLike) -> np.ndarray:
    arr = np.asarray(values, dtype=dtype)
    if arr.ndim != 1:
        raise ValueError(f"per-token arrays are 1-D, got shape {arr.shape}")
    arr.flags.writeable = False  # trajectories are values: nobody edits them downstream
    return arr


@dataclass(frozen=True, slots=True, eq=False)
class TrajectoryImage:
    """One image of a trajectory, where it sits in the token sequence and what the vision
    encoder reads of it. The model's processor expanded the image into a run of `num_tokens`
    ids starting at `start` of `Trajectory.input_ids()` (all mask 0); the engine is sent
    `prompt_ids` in place of that run (the template's placeholder, which vLLM expands the
    same way) together with `image`; the trainer feeds `inputs` (the processor's arrays for
    this image: pixel values, their mask or grid sizes) to the vision encoder, so it never
    re-derives them."""

    start: int
    num_tokens: int
    image: Image
    prompt_ids: tuple[int, ...]
    inputs: Mapping[str, np.ndarray]
    num_image_tokens: int = 0  # of the run, the positions the encoder's features fill (accounts)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(map(int, self.prompt_ids)))
        object.__setattr__(self, "inputs", {k: np.asarray(v) for k, v in self.inputs.items()})
        if self.start < 0 or self.num_tokens < 1:
            raise ValueError(f"a trajectory image needs start >= 0 and num_tokens >= 1, got "
                             f"start={self.start}, num_tokens={self.num_tokens}")
        if not self.prompt_ids:
            raise ValueError("a trajectory image needs the ids the engine is sent in place of its run")
        if not 0 <= self.num_image_tokens <= self.num_tokens:
            raise ValueError(f"num_image_tokens={self.num_image_tokens} is outside the run of {self.num_tokens}")

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def shifted(self, offset: int) -> TrajectoryImage:
        """The same image `offset` positions later (a segment's run placed in a sequence)."""
        return dataclasses.replace(self, start=self.start + offset)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A terminal multi-turn rollout. response_* arrays hold model and environment tokens
    interleaved; mask 1 marks exactly the tokens the model sampled."""

    task_id: str
    group_id: str
    index: int  # position within its group
    prompt_ids: np.ndarray  # int32, the first prompt as rendered by the chat template
    response_ids: np.ndarray  # int32
    response_mask: np.ndarray  # int8, 1 = sampled by the model
    logprobs: np.ndarray  # float32 behaviour logprobs, 0 where mask is 0
    versions: np.ndarray  # int32 weight version per token, NO_VERSION where mask is 0
    termination: TerminationReason
    turns: tuple[Turn, ...] = ()
    termination_detail: str = ""  # e.g. the exception message for ERROR
    reward: float | None = None  # None until the reward loop scores it
    reward_components: Mapping[str, float] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    # Position of this trajectory within its session. A black-box harness that rewrites
    # its history (rollout.gateway.server) yields several exact segments for one sample: they
    # share `index`, the session's reward and its group baseline. 0 for ordinary loops.
    segment: int = 0
    # The images of input_ids(), in order of position (vision-language models); () for text.
    images: tuple[TrajectoryImage, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: inputs (lists or arrays) are normalised once, here
        for name, dtype in (("prompt_ids", np.int32), ("response_ids", np.int32),
                            ("response_mask", np.int8), ("logprobs", np.float32),
                            ("versions", np.int32)):
            set_(self, name, _array(getattr(self, name), dtype))
        set_(self, "termination", TerminationReason(self.termination))
        set_(self, "turns", tuple(self.turns))
        set_(self, "reward_components", dict(self.reward_components))
        set_(self, "images", tuple(self.images))
        self._validate()

    def _validate(self) -> None:
        n = len(self.response_ids)
        for name in ("response_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.task_id}/{self.group_id}/{self.index}: {name} "
                                 f"has {len(getattr(self, name))} entries, response_ids has {n}")
        if len(self.prompt_ids) == 0:
            raise ValueError(f"trajectory {self.task_id}/{self.index}: empty prompt_ids")
        model = self.response_mask == 1
        if not np.all(model | (self.response_mask == 0)):
            raise ValueError("response_mask holds values other than 0 and 1")
        if np.any(self.logprobs[~model] != 0.0):
            raise ValueError("logprobs must be 0 where response_mask is 0")
        if np.any(self.versions[~model] != NO_VERSION):
            raise ValueError(f"versions must be {NO_VERSION} where response_mask is 0")
        if np.any(self.versions[model] < 0):
            raise ValueError("every model token needs the weight version that produced it")
        if np.any(self.logprobs[model] > 0.0) or not np.all(np.isfinite(self.logprobs)):
            raise ValueError("behaviour logprobs must be finite and <= 0")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"reward must be finite, got {self.reward}")
        if self.segment < 0:
            raise ValueError(f"segment must be >= 0, got {self.segment}")
        self._validate_images()

    def _validate_images(self) -> None:
        end, p = 0, len(self.prompt_ids)
        total = p + len(self.response_ids)
        for image in self.images:
            if image.start < end or image.end > total:
                raise ValueError(f"trajectory {self.task_id}/{self.index}: image runs must be in order, "
                                 f"apart and inside the {total} ids; one covers [{image.start}, {image.end})")
            a, b = max(image.start - p, 0), max(image.end - p, 0)
            if np.any(self.response_mask[a:b] != 0):
                raise ValueError(f"trajectory {self.task_id}/{self.index}: image tokens are never sampled "
                                 "(mask 0 over every image run)")
            end = image.end

    @property
    def num_image_tokens(self) -> int:
        """Positions the vision encoder's features fill, over all images."""
        return sum(i.num_image_tokens for i in self.images)

    @property
    def num_model_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def oldest_version(self) -> int | None:
        """Version of the oldest model token; None if the model produced no token."""
        model = self.versions[self.response_mask == 1]
        return int(model.min()) if len(model) else None

    def staleness(self, trainer_version: int) -> int:
        """Trainer version minus the oldest token version (0 for no model tokens)."""
        oldest = self.oldest_version
        return 0 if oldest is None else trainer_version - oldest

    def input_ids(self) -> np.ndarray:
        """The full training sequence: exactly what the engine saw and produced."""
        return np.concatenate([self.prompt_ids, self.response_ids])

    def summary(self) -> dict[str, JsonValue]:
        """A JSON-friendly digest for transcripts and logs."""
        return {"task_id": self.task_id, "group_id": self.group_id, "index": self.index,
                "segment": self.segment, "termination": self.termination.value, "detail": self.termination_detail,
                "reward": self.reward, "turns": len(self.turns),
                "prompt_tokens": len(self.prompt_ids), "response_tokens": len(self.response_ids),
                "model_tokens": self.num_model_tokens, "images": len(self.images)}

    def __repr__(self) -> str:
        return f"Trajectory({json.dumps(self.summary())})"


@dataclass(frozen=True, slots=True)
class Group:
    """All terminal trajectories of the G samples (sessions) of one task; the unit the
    buffer holds and GRPO normalises. A sample is usually one trajectory; a black-box
    harness that rewrote its history gives several segments with the same `index`
    (segments 0..k-1, in order), which share the sample's reward: the baseline is taken
    over the G samples, never over rows."""

    task_id: str
    group_id: str
    trajectories: tuple[Trajectory, ...]

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ValueError(f"group {self.group_id} has no trajectories")
        for i, t in enumerate(self.trajectories):
            if (t.task_id, t.group_id) != (self.task_id, self.group_id):
                raise ValueError(f"trajectory {i} belongs to {t.task_id}/{t.group_id}, "
                                 f"not group {self.task_id}/{self.group_id}")
        segments: dict[int, list[int]] = {}
        for t in self.trajectories:
            segments.setdefault(t.index, []).append(t.segment)
        if sorted(segments) != list(range(len(segments))):
            raise ValueError(f"group {self.group_id}: trajectory indices must be 0..G-1")
        for index, seen in segments.items():
            if sorted(seen) != list(range(len(seen))):
                raise ValueError(f"group {self.group_id}: sample {index} has segments {sorted(seen)}; "
                                 "a sample's segments are numbered 0..k-1, each once")
        for index in segments:
            rewards = {t.reward for t in self.trajectories if t.index == index}
            if len(rewards) > 1:
                raise ValueError(f"group {self.group_id}: the segments of sample {index} carry "
                                 f"different rewards {sorted(rewards, key=str)}; they share one")

    @property
    def size(self) -> int:
        """Rows (trajectories, segments included); `num_samples` is G."""
        return len(self.trajectories)

    @property
    def num_samples(self) -> int:
        return len({t.index for t in self.trajectories})

    def rewards(self) -> np.ndarray:
        """float32 rewards_G, one per sample (index order); raises if one is not scored yet."""
        missing = sorted({t.index for t in self.trajectories if t.reward is None})
        if missing:
            raise ValueError(f"group {self.group_id}: trajectories {missing} have no reward yet")
        by_index = {t.index: t.reward for t in self.trajectories}
        return np.array([by_index[i] for i in range(len(by_index))], dtype=np.float32)

    def in_baseline(self) -> np.ndarray:
        """bool per sample (index order): False for a sample its group's deadline cut
        (TerminationReason.DEADLINE), which has no reward of its own: the GRPO baseline,
        the zero-variance check and the reward metrics are over the others."""
        cut = {t.index for t in self.trajectories if t.termination is TerminationReason.DEADLINE}
        return np.array([i not in cut for i in range(self.num_samples)], dtype=bool)

    def sample_of_rows(self) -> np.ndarray:
        """int64 per row: the sample (index into `rewards()`) each trajectory belongs to."""
        return np.array([t.index for t in self.trajectories], dtype=np.int64)

    def oldest_version(self) -> int | None:
        versions = [v for t in self.trajectories if (v := t.oldest_version) is not None]
        return min(versions) if versions else None
