"""The toy visual tasks (envs.tasks.screens): deterministic sets, a held-out twin that shares
no screen with training, the `screenshot` tool showing the task's screen (read back pixel by
pixel, drawn from the id, never from the answer), the rule reward on colour answers, and the
warm start's demonstrations (launch.vision_toy)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from envs.tasks import load_tasks
from envs.tasks.screens import IN_PROMPT_FRACTION, SYSTEM_PROMPT, TOOL_PROMPT, build_toy_screens
from envs.tools.base import load_tool_class
from envs.tools.screenshot import (BACKGROUND, COLOURS, OBSERVATION_TEXT, SCREEN_WIDTHS, TITLE_BAR,
                                   TITLE_BAR_PIXELS, Screen, screen_for_task, screenshot_result)
from envs.trajectory_env import EnvBuilder, load_tool_classes
from envs.types import Image, Message, ToolCall, Trajectory
from launch.vision_toy import DEMO_SEED, FULL_PROMPT_FRACTION, SLOPPY_FRACTION, build_demonstrations
from reward.base import RewardContext, load_reward_fn


def pixels(image: Image) -> np.ndarray:
    return np.asarray(image.to_pil())  # (height, width, 3) uint8


def assert_shows(image: Image, screen: Screen) -> None:
    """The decoded PNG is exactly `screen`: title bar, the square in its colour, white elsewhere."""
    rgb = pixels(image)
    assert rgb.shape == (screen.height, screen.width, 3)
    expected = np.empty_like(rgb)
    expected[:] = BACKGROUND
    expected[:TITLE_BAR_PIXELS] = TITLE_BAR
    expected[screen.top:screen.top + screen.side, screen.left:screen.left + screen.side] = COLOURS[screen.colour]
    np.testing.assert_array_equal(rgb, expected)


def test_sets_are_deterministic_with_both_image_paths_and_every_colour() -> None:
    tasks = load_tasks("toy_screens")
    assert tasks == load_tasks("toy_screens") == build_toy_screens()  # images compare by their bytes
    assert len({t.id for t in tasks}) == len(tasks) == 256
    assert {t.tools for t in tasks} == {("screenshot",)}
    assert {t.reward_fn for t in tasks} == {"reward.rules:ExactMatch"}
    assert min(Counter(t.answer for t in tasks).values()) > 40  # 4 colours, none rare
    in_prompt = [t for t in tasks if t.messages[-1].images]
    assert abs(len(in_prompt) / len(tasks) - IN_PROMPT_FRACTION) < 0.08
    for task in tasks:
        system, user = task.messages
        assert system == Message("system", SYSTEM_PROMPT)
        screen = screen_for_task(task.id)
        assert task.answer == screen.colour and screen.width in SCREEN_WIDTHS and screen.width == 2 * screen.height
        if user.images:
            (image,) = user.images
            assert_shows(image, screen)
        else:
            assert user.content == TOOL_PROMPT
    # Another seed, other screens.
    assert {screen_for_task(t.id) for t in build_toy_screens(64, seed=5)}.isdisjoint(
        {screen_for_task(t.id) for t in tasks})


def test_heldout_set_shares_no_screen_with_training() -> None:
    train = {screen_for_task(t.id) for t in load_tasks("toy_screens")}
    heldout = load_tasks("toy_screens_heldout")
    assert len(heldout) == 256 and heldout == load_tasks("toy_screens_heldout")
    assert all(t.id.startswith("toy_screens_heldout/") for t in heldout)
    assert not train & {screen_for_task(t.id) for t in heldout}
    assert {t.answer for t in heldout} == set(COLOURS)


def test_a_set_skips_excluded_screens_and_keeps_ids_pointing_at_theirs() -> None:
    from envs.tasks.screens import _build_set

    first = build_toy_screens(3, seed=7, name="x")
    kept = _build_set("x", 3, 7, exclude={screen_for_task(first[1].id)})
    assert [t.id for t in kept] == ["x/7/0", "x/7/2", "x/7/3"]  # the id keeps the candidate's number


async def test_screenshot_tool_shows_the_screen_of_the_task_id_not_its_answer() -> None:
    load_tool_class("screenshot", "screenshot")  # the built-in meets the tool contract
    builder = EnvBuilder(load_tool_classes())  # no sandbox provider: screenshot needs none
    for task in load_tasks("toy_screens")[:24]:
        env = builder.build(dataclasses.replace(task, answer=None))  # the tool cannot read it
        await env.open()
        result = await env.tools["screenshot"].execute({})
        await env.release()
        assert (result.text, result.is_error, result.ends_trajectory) == (OBSERVATION_TEXT, False, False)
        (image,) = result.images
        assert image.media_type == "image/png" and image.data.startswith(b"\x89PNG")
        assert_shows(image, screen_for_task(task.id))
        # The square's pixels, read back, are the answer's colour and cover its area.
        rgb = pixels(image)
        assert (rgb == COLOURS[task.answer]).all(axis=-1).sum() == screen_for_task(task.id).side ** 2
        assert result.content == (OBSERVATION_TEXT, image)
        if task.messages[-1].images:  # the prompt's screen is the tool's screen
            assert task.messages[-1].images == (image,)


def test_a_screenshot_costs_57_ids_with_the_tiny_vl_processor() -> None:
    """Why screens are 2:1 (envs.tools.screenshot): the processor resizes the longest edge to
    224 px, so a 2:1 screen is 2 tiles + the whole image; a square one would be 4 + 1 (94 ids)."""
    from transformers import AutoProcessor

    from rollout.vision import ImageExpander
    from trainer.run.tiny_vl_model import ensure_tiny_vl_model

    expander = ImageExpander(AutoProcessor.from_pretrained(ensure_tiny_vl_model()))
    for width in SCREEN_WIDTHS:
        screen = next(s for s in map(screen_for_task, map(str, range(100))) if s.width == width)
        run, inputs = expander.process(screen.to_image())
        assert (len(run), run.count(expander.image_token_id)) == (57, 48)
        assert inputs["pixel_values"].shape == (3, 3, 112, 112)
    square, _ = expander.process(Image.from_pil(Screen(96, 96, "red", 0, 10, 20).render()))
    assert len(square) == 94


def test_the_shipped_recipe_validates_clean() -> None:
    from trainer.run.recipe import load_config
    from trainer.run.validate import validate_run

    cfg = load_config("vision_toy.yaml")
    assert (cfg.model.path, cfg.envs.tasks, cfg.eval.tasks) == ("tiny-vl", "toy_screens", "toy_screens_heldout")
    assert validate_run(cfg) == []


def test_screen_rejects_a_square_off_screen_or_an_unknown_colour() -> None:
    with pytest.raises(ValueError, match="must be one of red, green, blue, yellow"):
        Screen(128, 64, "purple", 0, 10, 20)
    with pytest.raises(ValueError, match="inside the 128x64 screen, below its title bar"):
        Screen(128, 64, "red", 120, 10, 20)
    with pytest.raises(ValueError, match="below its title bar"):
        Screen(128, 64, "red", 0, 2, 20)


@pytest.mark.parametrize("text, reward", [
    ("Answer: red", 1.0), ("answer: Red.", 1.0), ("The answer is RED", 1.0),
    ("Answer: blue", 0.0), ("Answer: red or blue", 0.0),  # hedging earns nothing
    ("It is red.", 0.0),  # no 'Answer:' and no number: no final answer
    ('<tool_call>{"name": "screenshot", "arguments": {}}</tool_call>', 0.0),
])
async def test_exact_match_scores_colour_answers(text: str, reward: float) -> None:
    task = next(t for t in load_tasks("toy_screens") if t.answer == "red")
    fn = load_reward_fn(task.reward_fn or "")
    trajectory = Trajectory(task_id=task.id, group_id="g", index=0, prompt_ids=[1], response_ids=[2],
                            response_mask=[1], logprobs=[-0.1], versions=[0], termination="finished")
    assert (await fn(trajectory, task, RewardContext(final_text=text))).reward == reward


def test_demonstrations_look_then_answer_what_they_saw_or_a_random_colour() -> None:
    demos = build_demonstrations(num_demos=400)
    tasks = build_toy_screens(400, seed=DEMO_SEED)  # the demonstrations' tasks, in order
    kinds: Counter[str] = Counter()
    for demo, task in zip(demos, tasks, strict=True):
        has_system = demo.messages[0].role == "system"
        kinds["full prompt"] += has_system
        assert bool(demo.tools) == has_system  # the schema goes with the system prompt
        assert demo.messages[:2 if has_system else 1] == task.messages[-2 if has_system else -1:]
        user, *turns = demo.messages[1:] if has_system else demo.messages
        answer = turns[-1]
        assert answer.role == "assistant" and answer.text.removeprefix("Answer: ") in COLOURS
        colour = answer.text.removeprefix("Answer: ")
        if user.images:  # the screen is in the prompt: answered at once
            assert len(turns) == 1
            seen = user.images[0]
        else:  # took the screenshot the tool returns, then answered
            call, observation, _ = turns
            assert call.tool_calls == (ToolCall("screenshot", {}),)
            assert observation == Message("tool", screenshot_result(task.id).content, name="screenshot")
            (seen,) = observation.images
        shown = [c for c, rgb in COLOURS.items() if (pixels(seen) == rgb).all(axis=-1).any()]
        assert shown == [task.answer]  # the image the demonstration saw shows the answer
        kinds["wrong"] += colour != task.answer
    assert abs(kinds["full prompt"] / len(demos) - FULL_PROMPT_FRACTION) < 0.05
    # Sloppy answers (a random colour, right one time in four) are the only wrong ones.
    assert abs(kinds["wrong"] / len(demos) - SLOPPY_FRACTION * 0.75) < 0.07
