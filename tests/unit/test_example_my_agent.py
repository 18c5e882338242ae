"""The example package of docs/custom_agent.md (examples/my_agent): its recipe passes the
checks before start, and its tool, reward function and agent loop do what the guide says.
(The whole run is tests/integration/test_example_my_agent_run.py.)"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from envs.types import Message, Task, Trajectory
from examples.my_agent.loop import TurnBudgetLoop
from examples.my_agent.reward import ShopReward
from examples.my_agent.tools import PRICES, PriceTool
from reward.base import RewardContext
from rollout.agent_loop import ToolOutcome
from trainer.run.recipe import load_config
from trainer.run.validate import validate_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "my_agent"


def test_the_example_recipe_passes_the_checks_before_start(monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository root
    assert validate_run(load_config(str(EXAMPLE / "recipe.yaml"))) == []


def test_the_task_answers_follow_the_price_list():
    rows = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]
    assert len(rows) == 24
    for row in rows:
        words = row["prompt"].split()
        count, item = int(words[4]), words[5].removesuffix("s")
        assert row["answer"] == str(count * PRICES[item])
        assert row["tools"] == ["price", "calculator"]


@dataclass
class FakeEnv:
    """Stands in for a TrajectoryEnv: the tool reads only `task`."""

    task: Task = field(default_factory=lambda: Task("t", (Message("user", "hi"),)))


def test_price_tool_answers_and_refuses_unknown_items():
    tool = PriceTool(FakeEnv())
    assert asyncio.run(tool.execute({"item": "Mangos"})).text == "mango: 7 coins"
    missing = asyncio.run(tool.execute({"item": "kiwi"}))
    assert missing.is_error and "the shop sells apple, lemon, mango, melon, pear, plum" in missing.text


def trajectory() -> Trajectory:
    n = 4
    return Trajectory("t", "g", 0, np.arange(3), np.arange(n), np.ones(n, dtype=np.int8),
                      np.zeros(n), np.zeros(n, dtype=np.int64), "finished")


@pytest.mark.parametrize("text,reward,correct", [
    ("4 mangos cost 28 coins. Answer: 28", 1.0, 1.0),
    ("Answer: 27", 0.1, 0.0),
    ("twenty-eight", 0.0, 0.0),
])
def test_shop_reward(text, reward, correct):
    task = Task("t", (Message("user", "4 mangos?"),), answer="28")
    result = asyncio.run(ShopReward()(trajectory(), task, RewardContext(final_text=text)))
    assert result.reward == reward and result.components["correct"] == correct
    assert result.components["used_tools"] == 0.0  # no turns in this trajectory


@dataclass
class FakeContext:
    """Stands in for an AgentContext: the loop's hook reads settings, recorder, run_tools."""

    @dataclass
    class Settings:
        max_turns: int = 3

    @dataclass
    class Recorder:
        turns: list = field(default_factory=lambda: ["turn 1"])

    settings: Settings = field(default_factory=Settings)
    recorder: Recorder = field(default_factory=Recorder)

    async def run_tools(self, parsed: object) -> ToolOutcome:
        return ToolOutcome((Message("tool", "mango: 7 coins", name="price"),), 1, 0, 0, False, 0.1)


def test_turn_budget_loop_notes_the_turns_left_under_each_observation():
    outcome = asyncio.run(TurnBudgetLoop().run_tools(None, FakeContext()))  # type: ignore[arg-type]
    assert [m.content for m in outcome.messages] == ["mango: 7 coins\n[2 turns left]"]
    assert outcome.num_calls == 1 and outcome.messages[0].name == "price"
