"""Start-up validation, shared by `--dry-run` and the real run: everything a recipe names
is loaded and checked before anything starts, and every problem is listed at once.

    validate_run(cfg) -> ["agent.loop: ...", "envs.tasks: data/t.jsonl row 3, ...", ...]

Checked: every plug-in (agent.loop, reward.fn, model.warm_start, envs.sandbox_backend,
train.backend, each envs.tools entry, and the agent_loop / reward_fn a task row names) is
imported with the loaders the run itself uses and held against its Protocol by the
contract check of its plug-in point (which lives with the point's package), without
being run; every
row of envs.tasks and eval.tasks is read; every tool a task names resolves to a built-in
or an envs.tools entry; the model folder (and the judge's) has a config, weights and a
tokenizer whose chat template renders; the run's own start-up checks run as it runs them
(the chat family, its parsers and keep_thinking against the policy's template,
rollout.template_check). Nothing here writes to the run folder; the
only disk writes are caches a run would fill anyway (the tiny model, SWE repository
snapshots). A dry run does not build a built-in task set whose first build takes minutes
(envs.tasks.SLOW_SETS): it warns that the first run will, and roughly how long that takes.

The tokenizer is loaded as a fast tokenizer (`tokenizer.json`) through transformers
without torch; folders without `tokenizer.json` fall back to AutoTokenizer. The template
check imports vLLM's parser registry (~8 s here, as at a real start), so it runs last and
only when every other check passed; Ray, DeepSpeed and wandb stay out of `--dry-run`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from envs.sandbox.backends import load_sandbox_backend
from envs.tasks import BUILTIN_SETS, read_tasks, unbuilt_set_note
from envs.tools.base import TOOLS, load_tool_class
from envs.types import Task
from rollout.agent_loop import check_agent_loop
from rollout.reward_plugins import check_reward_fn
from trainer.run.config import SluiceConfig
from trainer.run.local_models import LOCAL_MODELS_HELP, local_model_folder
from trainer.run.warm_start import load_warm_start
from trainer.train.backends import load_train_backend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
PluginKind = Literal["agent loop", "reward fn", "tool", "sandbox backend", "warm start",
                     "train backend"]

MAX_ROW_PROBLEMS = 20  # per task source; a file with thousands of bad rows lists this many
MAX_TASK_IDS = 3  # task ids named in one problem (then "and N more")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
_TEMPLATE_PROBE = [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "What is 2 + 2?"}]
_TOOL_PROBE = {"type": "function", "function": {
    "name": "python", "description": "Run Python code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}


def validate_run(cfg: SluiceConfig, *, build_task_sets: bool = True) -> list[str]:
    """Every problem that would stop the run configured by `cfg`, one line each, each
    naming the key, file or task to change; [] when the run can start. Without
    `build_task_sets` (a dry run), a built-in task set whose first build takes minutes
    and is not built yet is not built: a warning says so and how long the run will take."""
    problems: list[str] = []
    problems += _plugin_problems("agent.loop", "agent loop", cfg.agent.loop)
    problems += _plugin_problems("reward.fn", "reward fn", cfg.reward.fn)
    if cfg.model.warm_start is not None:
        problems += _plugin_problems("model.warm_start", "warm start", cfg.model.warm_start)
    problems += _plugin_problems("envs.sandbox_backend", "sandbox backend",
                                 cfg.envs.sandbox_backend)
    problems += _plugin_problems("train.backend", "train backend", cfg.train.backend)
    tool_names = set(TOOLS.builtins) | set(cfg.envs.tools)
    for name, ref in cfg.envs.tools.items():
        problems += _plugin_problems(f"envs.tools.{name}", "tool", ref, name=name)

    if not cfg.envs.tasks:
        problems.append(f"envs.tasks: is required: a built-in set ({', '.join(BUILTIN_SETS)}), "
                        "a task file (.jsonl, .parquet) or a datasets folder")
    sources = [("envs.tasks", cfg.envs.tasks, cfg.envs.task_format)] if cfg.envs.tasks else []
    if cfg.eval.tasks is not None:
        sources.append(("eval.tasks", cfg.eval.tasks, "auto"))  # as the run reads it
    checked = {("agent loop", cfg.agent.loop), ("reward fn", cfg.reward.fn)}
    for key, source, fmt in sources:
        note = None if build_task_sets else unbuilt_set_note(source)
        if note is not None:
            log.warning("%s: %s", key, note)
            continue
        try:
            tasks, task_problems = read_tasks(source, fmt, max_problems=MAX_ROW_PROBLEMS)
        except Exception as exc:  # a broken task builder must not hide the other problems
            tasks, task_problems = [], [f"reading {source!r} raised {_describe(exc)}"]
        problems += [f"{key}: {p}" for p in task_problems]
        if len(task_problems) >= MAX_ROW_PROBLEMS:
            problems.append(f"{key}: stopped after {MAX_ROW_PROBLEMS} problems in {source!r}; "
                            "fix these and validate again")
        problems += _task_tool_problems(key, tasks, tool_names)
        problems += _task_plugin_problems(key, tasks, checked)

    problems += _model_problems("model.path", cfg.model.path)
    if cfg.reward.judge.enabled:
        problems += _model_problems("reward.judge.model_path", cfg.reward.judge.model_path)
    # Last and only when the rest passed: it imports vLLM's parsers (seconds), and a
    # misspelled plug-in should not wait for that.
    return problems or _chat_problems(cfg)


# --- plug-ins ----------------------------------------------------------------------------

def _plugin_problems(key: str, kind: PluginKind, value: str, *, name: str = "") -> list[str]:
    problem = check_plugin(kind, value, name=name)
    return [] if problem is None else [f"{key}: {problem}"]


def check_plugin(kind: PluginKind, value: str, *, name: str = "") -> str | None:
    """None if `value` resolves to an object that passes the contract check of the plug-in
    point `kind`, else what is wrong. Agent loops and reward fns are built (as the run
    builds them: no arguments); tools, warm starts and backends are only inspected."""
    try:
        _CHECKS[kind](value, name)
    except ValueError as exc:  # the contract checks' own messages say what to change
        return str(exc)
    except Exception as exc:  # the user's module raised while importing or building
        return f"{kind} {value!r} raised {_describe(exc)} while loading; fix that module"
    return None


# Each plug-in point's contract check, from the package that owns the point.
_CHECKS: dict[PluginKind, Callable[[str, str], object]] = {
    "agent loop": lambda value, _: check_agent_loop(value),
    "reward fn": lambda value, _: check_reward_fn(value),
    "tool": lambda value, name: load_tool_class(name or value, value),
    "warm start": lambda value, _: load_warm_start(value),
    "sandbox backend": lambda value, _: load_sandbox_backend(value),
    "train backend": lambda value, _: load_train_backend(value)}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}:{exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


# --- tasks -------------------------------------------------------------------------------

def _ids(tasks: list[Task]) -> str:
    shown = ", ".join(repr(t.id) for t in tasks[:MAX_TASK_IDS])
    more = len(tasks) - MAX_TASK_IDS
    return shown + (f" and {more} more" if more > 0 else "")


def _task_tool_problems(key: str, tasks: list[Task], tool_names: set[str]) -> list[str]:
    unknown: dict[str, list[Task]] = {}
    for task in tasks:
        for tool in task.tools:
            if tool not in tool_names:
                unknown.setdefault(tool, []).append(task)
    return [f"{key}: task {_ids(named)} names tool {tool!r}, which is neither a built-in "
            f"({', '.join(TOOLS.builtins)}) nor in envs.tools; add "
            f"envs.tools.{tool}=package.module:Class to the recipe or fix the task's 'tools'"
            for tool, named in unknown.items()]


def _task_plugin_problems(key: str, tasks: list[Task], checked: set[tuple[str, str]]) -> list[str]:
    """The agent loops and reward fns the rows name, each checked once per run."""
    named: dict[tuple[PluginKind, str], list[Task]] = {}
    for task in tasks:
        if task.agent_loop is not None:
            named.setdefault(("agent loop", task.agent_loop), []).append(task)
        if task.reward_fn is not None:
            named.setdefault(("reward fn", task.reward_fn), []).append(task)
    out = []
    for (kind, value), by in named.items():
        if (kind, value) in checked:
            continue
        checked.add((kind, value))
        problem = check_plugin(kind, value)
        if problem is not None:
            field = "agent_loop" if kind == "agent loop" else "reward_fn"
            out.append(f"{key}: task {_ids(by)} {field}: {problem}")
    return out


# --- model -------------------------------------------------------------------------------

def _model_problems(key: str, path: str) -> list[str]:
    folder = _model_folder(path)
    if not folder.is_dir():
        return [f"{key}: {path!r} is not a folder; give a Hugging Face model folder "
                f"(config.json, weights, tokenizer) or {LOCAL_MODELS_HELP}"]
    out = []
    config = folder / "config.json"
    try:
        if "model_type" not in json.loads(config.read_text()):
            out.append(f"{key}: {config} has no 'model_type'; it is not a Hugging Face model config")
    except FileNotFoundError:
        out.append(f"{key}: {folder} has no config.json; save the model with save_pretrained()")
    except (OSError, ValueError) as exc:
        out.append(f"{key}: {config} is not readable JSON ({exc})")
    if not any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS):
        out.append(f"{key}: {folder} holds no weights (*.safetensors or *.bin)")
    out += _tokenizer_problems(key, folder)
    return out


def _model_folder(path: str) -> Path:
    # A local test model is built once into the cache: what the run uses.
    return local_model_folder(path) or Path(path).expanduser()


def _load_tokenizer(folder: Path) -> "PreTrainedTokenizerBase | None":
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast  # light: no torch

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _chat_problems(cfg: SluiceConfig) -> list[str]:
    """The run's start-up self-check of agent.chat_family, its parsers and keep_thinking
    against the policy's chat template (rollout.template_check), as the run does it."""
    from rollout.template_check import check_template

    from rollout.vision import load_image_expander

    a = cfg.agent
    folder = _model_folder(cfg.model.path)
    tokenizer = _load_tokenizer(folder)
    if tokenizer is None:  # _tokenizer_problems said so already
        return []
    try:
        check_template(tokenizer, a.chat_family, a.keep_thinking, tool_parser=a.tool_parser,
                       reasoning_parser=a.reasoning_parser, images=load_image_expander(folder))
    except ValueError as exc:  # its message names the knob to change
        return [f"agent.chat_family: {exc}"]
    return []


def _tokenizer_problems(key: str, folder: Path) -> list[str]:
    try:
        tokenizer = _load_tokenizer(folder)
    except Exception as exc:  # transformers raises many kinds for a broken folder
        return [f"{key}: the tokenizer in {folder} does not load ({_describe(exc)})"]
    if tokenizer is None:
        return [f"{key}: {folder} holds no tokenizer; add its tokenizer files"]
    if not tokenizer.chat_template:
        return [f"{key}: the tokenizer in {folder} has no chat template; add "
                "chat_template.jinja (or 'chat_template' in tokenizer_config.json)"]
    try:
        tokenizer.apply_chat_template(_TEMPLATE_PROBE, tools=[_TOOL_PROBE], tokenize=False,
                                      add_generation_prompt=True)
    except Exception as exc:  # a template error surfaces as whatever jinja raises
        return [f"{key}: the chat template in {folder} fails to render a system + user "
                f"conversation with one tool ({_describe(exc)})"]
    return []


def format_problems(problems: list[str]) -> str:
    """The list as printed by trainer.main."""
    head = f"{len(problems)} problem{'s' if len(problems) != 1 else ''} before start:"
    return "\n".join([head, *(f"  - {p}" for p in problems)])
