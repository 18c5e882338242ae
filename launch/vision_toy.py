"""The vision toy's warm start (`model.warm_start: launch.vision_toy:screens_warm_start`,
recipes/vision_toy.yaml): a short supervised pass (trainer.train.sft) of the tiny
vision-language model on demonstrations of the toy_screens tasks, cached under the cache
root like the quickstart's (launch.quickstart), so that GRPO starts from a policy that
takes screenshots and answers 'Answer: <colour>'.

The demonstrations are toy_screens tasks from another seed than the RL set and its held-out
twin; their screens are drawn by the tool's own function, and a screenshot's observation is
exactly what the `screenshot` tool returns. All of them look at the screen (take the
screenshot, unless the screen is already in the prompt), then answer; two kinds, like the
uneven data real agents are warm-started on:
- careful: the colour of the square;
- sloppy (SLOPPY_FRACTION): a random colour, whatever the screen shows.
So the warm-started model sometimes answers without regard to what it saw, which earns a
reward one time in four: RL has to learn to name the colour it sees. Every trajectory of a
policy that follows the demonstrations holds at least one image.

Measured (recipes/vision_toy.yaml's 200 steps, 5.4 min on 2 shared cores): on 48 held-out
screens, the right colour is the likeliest answer (teacher-forced) for 14 before and 46
after (all 32 screenshots, 14 of 16 screens in the prompt); sampled, the held-out reward is
then ~0.6-0.65, the careful 70% reading right and the sloppy 30% right one time in four.

Like the quickstart's, most demonstrations drop the system prompt and tool schemas: the long
static prefix costs compute and teaches nothing the user turn does not.
"""

from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING

from envs.tasks.screens import SET_NAME, build_toy_screens
from envs.tools.screenshot import COLOURS, ScreenshotTool, screenshot_result
from envs.types import Message, Task, ToolCall
from launch.quickstart import supervised_warm_start

if TYPE_CHECKING:
    from trainer.run.config import SluiceConfig
    from trainer.train.sft import Demonstration

log = logging.getLogger(__name__)

DEMO_SEED = 1_000_003  # never the RL tasks' seed (0) nor the held-out one (1)
NUM_DEMOS = 1024
FULL_PROMPT_FRACTION = 0.1  # demonstrations that keep the system prompt and tool schema
SLOPPY_FRACTION = 0.3  # demonstrations that answer a random colour after looking
SFT_BATCH_SIZE = 16  # the sequences are ~100-500 tokens; 32 doubled the step time for no gain seen


def screen_demonstration(task: Task, guess: str | None = None) -> Demonstration:
    """Take the screenshot unless the prompt shows the screen, then answer its colour
    (careful, `guess` None) or `guess` (sloppy)."""
    from trainer.train.sft import Demonstration  # torch: only when demonstrations are made

    if task.answer not in COLOURS or task.messages[-1].role != "user":
        raise ValueError(f"task {task.id!r} is not a toy_screens task (answer {task.answer!r})")
    looks = () if task.messages[-1].images else (
        Message("assistant", "", tool_calls=(ToolCall("screenshot", {}),)),
        Message("tool", screenshot_result(task.id).content, name="screenshot"))
    answer = Message("assistant", f"Answer: {task.answer if guess is None else guess}")
    return Demonstration((*task.messages, *looks, answer), tools=(ScreenshotTool.schema,))


def build_demonstrations(num_demos: int = NUM_DEMOS, seed: int = DEMO_SEED) -> list[Demonstration]:
    """`num_demos` demonstrations (the same for the same seed), SLOPPY_FRACTION of them
    sloppy and all but FULL_PROMPT_FRACTION without the system prompt and tool schema."""
    from trainer.train.sft import Demonstration

    rng = random.Random(seed)
    demos = []
    for task in build_toy_screens(num_demos, seed):
        guess = rng.choice(sorted(COLOURS)) if rng.random() < SLOPPY_FRACTION else None
        demo = screen_demonstration(task, guess)
        if rng.random() >= FULL_PROMPT_FRACTION:
            demo = Demonstration(tuple(m for m in demo.messages if m.role != "system"), ())
        demos.append(demo)
    return demos


def images_key(demos: list[Demonstration]) -> str:
    """Digest of every image the demonstrations show: the SFT cache key renders an image as
    a placeholder only, and a change in how screens are drawn must retrain."""
    digest = hashlib.sha256()
    for demo in demos:
        for message in demo.messages:
            for image in message.images:
                digest.update(image.data)
    return digest.hexdigest()[:8]


def warm_start_model(base_path: str | Path, *, steps: int, cache_root: Path) -> Path:
    """The vision-language model `base_path` after `steps` supervised steps on toy_screens
    demonstrations (cached)."""
    demos = build_demonstrations()
    return supervised_warm_start(base_path, demos, SET_NAME, steps=steps, batch_size=SFT_BATCH_SIZE,
                                 cache_root=cache_root, key_suffix=f"-{images_key(demos)}")


def screens_warm_start(base_path: Path, cfg: SluiceConfig) -> Path:
    """The `model.warm_start` plug-in: `model.warm_start_steps` supervised steps on toy_screens
    demonstrations, whatever `envs.tasks` is (a user's own visual tasks start from a model
    that takes screenshots and answers 'Answer: <...>')."""
    from envs.cache import default_cache_dir

    if cfg.envs.tasks != SET_NAME:
        log.info("warm start: the demonstrations are %s's (screenshots, 'Answer: <colour>'); RL "
                 "then trains on envs.tasks=%r", SET_NAME, cfg.envs.tasks)
    return warm_start_model(base_path, steps=cfg.model.warm_start_steps,
                            cache_root=default_cache_dir() / "models")
