"""The quickstart's warm start (`model.warm_start: launch.quickstart:toy_warm_start`): a
short supervised pass (trainer.train.sft) on synthetic demonstrations of the toy arithmetic
tasks (whatever `envs.tasks` is: a user's own tasks on the tiny model get the same
warm-started model); the result is cached under the cache root. It lives with the
quickstart, not in the trainer core: the trainer only calls whatever `model.warm_start`
names.

Without it the tiny model starts from random weights, never calls a tool and never gets
a reward, so GRPO has no signal. The demonstrations are generated from another seed than
the RL tasks and their held-out twin, but the easy set's space is small (~28k questions):
about 15% of the RL and held-out questions also occur among them. All call the `python` tool
and answering from its output (rendered exactly as the real tool renders it), of two
kinds, like the uneven data real agents are warm-started on:
- careful: print(<the whole expression>), then 'Answer: <its value>';
- sloppy (SLOPPY_FRACTION): print(<the first number only>), then 'Answer: <that number>'.
So the warm-started model sometimes makes the sloppy call, which never earns a reward:
RL has a clear thing to learn (pass the whole expression) on top of a finer one (copy
the expression and the result without a slip). Both kinds copy digits from the context,
so the copying the careful branch needs is trained by every demonstration. (Measured:
mixing in replies computed "in the head", without the tool, taught the tiny model to
compute the digits after 'Answer:' from the question; held-out reward fell to 0.0-0.02.)

Most demonstrations are shortened to the user turn without the system prompt: the long
static prefix costs compute and teaches nothing (measured: 300 steps reach 87% exact
copies on held-out questions with the full prompt; full-length demonstrations 0-2.5%).

    python -m launch.quickstart model

prints the folder of that warm-started tiny model (a Hugging Face folder that calls the
`python` tool and answers `Answer: <n>`), building it first where it is missing, as the
quickstart does: a model for gateway and loop experiments (docs/gateway.md).
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from envs.cache import build_lock
from envs.progress import FirstUse
from envs.sandbox.base import ExecResult
from envs.tasks.toy import PROMPT, build_toy_arithmetic, build_toy_arithmetic_easy
from envs.tools.sandbox_tools import PythonTool, render_exec_result
from envs.types import Message, Task, ToolCall

if TYPE_CHECKING:
    from trainer.run.config import SluiceConfig
    from trainer.train.sft import Demonstration

log = logging.getLogger(__name__)

_EXPRESSION = re.compile(re.escape(PROMPT).replace(re.escape("{expression}"), "(?P<expr>.+)"))
DEMO_SEED = 1_000_003  # never the RL tasks' seed
NUM_DEMOS = 4096
FULL_PROMPT_FRACTION = 0.1  # demonstrations that keep the system prompt and tool schemas
SLOPPY_FRACTION = 0.5  # demonstrations that pass only the first number to the tool
BUILDERS = {"toy_arithmetic": build_toy_arithmetic, "toy_arithmetic_easy": build_toy_arithmetic_easy}
DEFAULT_DEMOS = "toy_arithmetic_easy"  # the demonstrations for any other envs.tasks


def toy_demonstration(task: Task, max_observation_tokens: int, count_tokens=None,
                      sloppy: bool = False) -> Demonstration:
    """Call `python` with print(expression) (sloppy: print(its first number)), read the
    result, answer 'Answer: <n>' with the number the tool printed."""
    from trainer.train.sft import Demonstration  # torch: only when demonstrations are made

    match = _EXPRESSION.fullmatch(task.messages[-1].text)
    if match is None or task.answer is None:
        raise ValueError(f"task {task.id!r} is not a toy_arithmetic task")
    printed, value = match["expr"], task.answer
    if sloppy:
        printed = value = printed.split(" ", 1)[0].lstrip("(")
    observation = render_exec_result(
        ExecResult(exit_code=0, stdout=f"{value}\n", stderr="", timed_out=False,
                   oom_killed=False, output_truncated=False, duration_s=0.0),
        timeout_s=30.0, max_tokens=max_observation_tokens,
        **({"count_tokens": count_tokens} if count_tokens else {}))
    messages = (*task.messages,
                Message("assistant", "", tool_calls=(ToolCall("python", {"code": f"print({printed})"}),)),
                Message("tool", observation, name="python"),
                Message("assistant", f"Answer: {value}"))
    return Demonstration(messages, tools=(PythonTool.schema,))


def build_demonstrations(task_set: str, max_observation_tokens: int, count_tokens=None
                         ) -> list[Demonstration]:
    from trainer.train.sft import Demonstration

    if task_set not in BUILDERS:
        raise ValueError(f"model.warm_start_steps has demonstrations only for envs.tasks in "
                         f"{sorted(BUILDERS)}; set model.warm_start_steps=0")
    rng = random.Random(DEMO_SEED)
    demos = []
    for task in BUILDERS[task_set](NUM_DEMOS, DEMO_SEED):
        demo = toy_demonstration(task, max_observation_tokens, count_tokens,
                                 sloppy=rng.random() < SLOPPY_FRACTION)
        if rng.random() >= FULL_PROMPT_FRACTION:  # drop system prompt and tool schemas
            demo = Demonstration(tuple(m for m in demo.messages if m.role != "system"), ())
        demos.append(demo)
    return demos


def warm_start_model(base_path: str | Path, task_set: str, *, steps: int,
                     max_observation_tokens: int, cache_root: Path) -> Path:
    """The base model after `steps` supervised steps on toy demonstrations (cached)."""
    from rollout.chat import load_tokenizer

    tokenizer = load_tokenizer(base_path)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    demos = build_demonstrations(task_set, max_observation_tokens, count)
    return supervised_warm_start(base_path, demos, task_set, steps=steps, batch_size=32, cache_root=cache_root)


def supervised_warm_start(base_path: str | Path, demos: list[Demonstration], what: str, *, steps: int,
                          batch_size: int, cache_root: Path, key_suffix: str = "") -> Path:
    """`base_path` after `steps` supervised steps on `demos` (demonstrations of `what`),
    cached under `cache_root` by the demonstrations, the model and the steps (`key_suffix`:
    what else the result depends on, e.g. the images the demonstrations show); images in
    the demonstrations go through the model's processor as in a run."""
    from rollout.chat import build_continuity_builder, load_tokenizer
    from rollout.vision import load_image_expander
    from trainer.train.sft import build_sft_example, demonstrations_key, run_sft

    out = cache_root / f"warm-{demonstrations_key(base_path, demos, steps)}{key_suffix}"
    with build_lock(out):  # concurrent runs: one trains, the others wait and reuse it
        if (out / "config.json").is_file():
            return out
        with FirstUse(f"the warm start of {Path(base_path).name} ({len(demos)} demonstrations of "
                      f"{what})", out, total=steps) as progress:
            tokenizer = load_tokenizer(base_path)
            chat = build_continuity_builder(tokenizer, "auto", images=load_image_expander(base_path))
            examples = [build_sft_example(tokenizer, chat, d) for d in demos]
            result = run_sft(base_path, out, examples, steps=steps, batch_size=batch_size,
                             on_step=progress.advance)
    log.info("warm start: loss %.3f -> %.3f in %.1fs", result.first_loss, result.last_loss,
             result.seconds)
    return out


def toy_warm_start(base_path: Path, cfg: "SluiceConfig") -> Path:
    """The `model.warm_start` plug-in: `model.warm_start_steps` supervised steps on
    demonstrations of `envs.tasks` when it is a toy_arithmetic set, else of
    DEFAULT_DEMOS: a user's own tasks on the tiny model start from a model that knows the
    tool-call format and ends with 'Answer: <value>' (the same cached folder as the
    quickstart's), and RL goes on from there on their tasks and tools."""
    from envs.cache import default_cache_dir

    task_set = cfg.envs.tasks if cfg.envs.tasks in BUILDERS else DEFAULT_DEMOS
    if task_set != cfg.envs.tasks:
        log.info("warm start: envs.tasks=%r is not a toy_arithmetic set, so the demonstrations "
                 "are %s's (they teach the tool-call format and 'Answer: <value>'); RL then "
                 "trains on your tasks", cfg.envs.tasks, DEFAULT_DEMOS)
    return warm_start_model(base_path, task_set, steps=cfg.model.warm_start_steps,
                            max_observation_tokens=cfg.envs.max_observation_tokens,
                            cache_root=default_cache_dir() / "models")


QUICKSTART_RECIPE = "quickstart.yaml"


def quickstart_model() -> Path:
    """The quickstart's policy before RL: the tiny model after its warm start (both built
    into the cache where missing, saying so), resolved as the quickstart run resolves it."""
    from trainer.run.recipe import load_config
    from trainer.run.system import resolve_model

    return Path(resolve_model(load_config(QUICKSTART_RECIPE)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.quickstart",
                                     description="The quickstart's cached models.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("model", help="print the folder of the warm-started tiny model that "
                        "calls tools (built first where missing; progress on stderr)",
                        description="Print the folder of the quickstart's warm-started tiny "
                        "model (it calls the python tool and answers 'Answer: <n>'), building "
                        "the tiny model and its warm start first where they are missing.")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(quickstart_model())
    return 0


if __name__ == "__main__":
    sys.exit(main())
