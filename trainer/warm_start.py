"""Warm start for the quickstart: demonstrations of the toy arithmetic task solved with
the `python` tool in the exact format the real tool answers in, then a short supervised
pass (trainer.sft). The result is cached next to the base model and reused.

Without it the tiny model starts from random weights, never calls a tool and never gets
a reward, so GRPO has no signal; with it the policy starts at a non-zero success rate.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from envs.sandbox.base import ExecResult
from envs.tasks.toy import PROMPT
from envs.tools.sandbox_tools import PythonTool, render_exec_result
from rollout.types import Message, Task, ToolCall
from trainer.sft import Demonstration, build_sft_example, demonstrations_key, run_sft

log = logging.getLogger(__name__)

_EXPRESSION = re.compile(re.escape(PROMPT).replace(re.escape("{expression}"), "(?P<expr>.+)"))


def toy_demonstration(task: Task, max_observation_tokens: int, count_tokens=None) -> Demonstration:
    """Call `python` with print(expression), read the result, answer 'Answer: <n>'."""
    match = _EXPRESSION.fullmatch(task.messages[-1].content)
    if match is None or task.answer is None:
        raise ValueError(f"task {task.id!r} is not a toy_arithmetic task")
    code = f"print({match['expr']})"
    observation = render_exec_result(
        ExecResult(exit_code=0, stdout=f"{task.answer}\n", stderr="", timed_out=False,
                   oom_killed=False, output_truncated=False, duration_s=0.0),
        timeout_s=30.0, max_tokens=max_observation_tokens,
        **({"count_tokens": count_tokens} if count_tokens else {}))
    messages = (*task.messages,
                Message("assistant", "", tool_calls=(ToolCall("python", {"code": code}),)),
                Message("tool", observation, name="python"),
                Message("assistant", f"Answer: {task.answer}"))
    return Demonstration(messages, tools=(PythonTool.schema,))


def warm_start_model(base_path: str | Path, tasks: list[Task], *, steps: int,
                     max_observation_tokens: int, cache_root: Path) -> Path:
    """The base model after `steps` supervised steps on toy demonstrations (cached)."""
    from transformers import AutoTokenizer

    from rollout.chat import build_continuity_builder

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    demos = [toy_demonstration(t, max_observation_tokens, count) for t in tasks]
    out = cache_root / f"warm-{demonstrations_key(base_path, demos, steps)}"
    if (out / "config.json").is_file():
        return out
    chat = build_continuity_builder(tokenizer, "auto")
    examples = [build_sft_example(tokenizer, chat, d) for d in demos]
    result = run_sft(base_path, out, examples, steps=steps)
    log.info("warm start: loss %.3f -> %.3f in %.1fs", result.first_loss, result.last_loss,
             result.seconds)
    return out
