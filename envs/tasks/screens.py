"""`toy_screens`: a toy visual task set for vision-language models. Each task asks what
colour the square on a screen is; `reward.rules:ExactMatch` checks the colour the agent
answers ('Answer: <colour>') against `Task.answer`.

The screen of a task is drawn from its id by the `screenshot` tool's own function
(envs.tools.screenshot.screen_for_task), so the answer here is what the tool would show.
Most tasks ask the agent to take the screenshot (the image arrives in an observation);
IN_PROMPT_FRACTION of them show the screen in the user message itself, so both paths of
an image into the model are exercised. Both kinds offer the `screenshot` tool.

Generated deterministically from a seed (its own `random.Random`), like toy_arithmetic;
`toy_screens_heldout` is the same distribution from another seed, minus every screen of the
default training set.
"""

from __future__ import annotations

import random
from collections.abc import Set

from envs.tasks.toy import HELDOUT_SUFFIX
from envs.tools.screenshot import COLOURS, Screen, screen_for_task
from envs.types import Message, Task

SET_NAME = "toy_screens"
HELDOUT_SET_NAME = SET_NAME + HELDOUT_SUFFIX
DEFAULT_NUM_TASKS = 256
DEFAULT_SEED = 0
HELDOUT_SEED = 1
IN_PROMPT_FRACTION = 0.25
TOOLS = ("screenshot",)
_CHOICES = ", ".join(list(COLOURS)[:-1]) + f" or {list(COLOURS)[-1]}"
SYSTEM_PROMPT = "You are an assistant that looks at a computer screen. The screenshot tool shows it to you."
TOOL_PROMPT = (f"What colour is the square on the screen? Take a screenshot with the `screenshot` tool, "
               f"then reply 'Answer: <colour>' ({_CHOICES}).")
IMAGE_PROMPT = ("Here is the screen:", f"What colour is the square on it? Reply 'Answer: <colour>' ({_CHOICES}).")


def screen_task(task_id: str, image_in_prompt: bool) -> Task:
    """The task `task_id`: its screen (screen_for_task) in the user message when
    `image_in_prompt`, else behind the `screenshot` tool."""
    screen = screen_for_task(task_id)
    before, after = IMAGE_PROMPT
    user = Message("user", (before, screen.to_image(), after)) if image_in_prompt \
        else Message("user", TOOL_PROMPT)
    return Task(id=task_id, messages=(Message("system", SYSTEM_PROMPT), user), tools=TOOLS,
                answer=screen.colour, reward_fn="reward.rules:ExactMatch")


def build_toy_screens(num_tasks: int = DEFAULT_NUM_TASKS, seed: int = DEFAULT_SEED,
                      name: str = SET_NAME) -> list[Task]:
    """`num_tasks` tasks, the same ones for the same seed (ids `<name>/<seed>/<i>`)."""
    return _build_set(name, num_tasks, seed)


def build_toy_screens_heldout(num_tasks: int = DEFAULT_NUM_TASKS) -> list[Task]:
    """`num_tasks` tasks whose screens differ from every screen of the default training set."""
    training = {screen_for_task(t.id) for t in build_toy_screens()}
    return _build_set(HELDOUT_SET_NAME, num_tasks, HELDOUT_SEED, training)


def _build_set(name: str, num_tasks: int, seed: int, exclude: Set[Screen] = frozenset()) -> list[Task]:
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    rng = random.Random(seed)
    tasks: list[Task] = []
    candidate = 0
    while len(tasks) < num_tasks:
        # The id is the candidate's number, so a skipped screen leaves a gap: the id alone
        # must give the tool the screen the answer was read from.
        task_id = f"{name}/{seed}/{candidate}"
        candidate += 1
        in_prompt = rng.random() < IN_PROMPT_FRACTION
        if screen_for_task(task_id) not in exclude:
            tasks.append(screen_task(task_id, in_prompt))
    return tasks
