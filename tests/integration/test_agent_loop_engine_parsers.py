"""The tool agent loop on the real vLLM engine with the tiny model, under every vLLM tool
parser its tokenizer can carry: whatever the untrained model samples (markup fragments,
half calls, stray special tokens), no turn raises, every trajectory ends with a normal
reason, and each turn has a parse status that the rollout/tool_parse counts add up.
The statuses per family format are asserted in tests/unit/test_agent_loop_parsers.py.
"""

from __future__ import annotations

import logging
import pytest

from chat_families import EchoTool
from envs.trajectory_env import EnvBuilder
from envs.types import Message, Task, TerminationReason
from reward.loop import RewardLoop
from rollout.agent_loop import LoopSettings
from rollout.chat import build_continuity_builder
from rollout.recorder import Budgets
from rollout.router import Router
from rollout.tool_parser import PARSE_STATUSES, tool_parse_counts
from rollout.worker import AgentLoopWorker

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the shared engine's loop

@pytest.fixture(scope="module")
def engine(shared_engine):
    """This worker's read-only engine (conftest.shared_engine)."""
    return shared_engine

log = logging.getLogger(__name__)

# The parsers whose markers are plain text (or none) for the tiny model's ChatML tokenizer;
# the others need special tokens it does not have, and are refused at start-up for it.
PARSERS = ["hermes", "qwen3_coder", "glm45", "kimi_k2", "minimax_m2", "pythonic", "openai"]


@pytest.mark.parametrize("tool_parser", PARSERS)
async def test_the_tiny_model_under_each_parser_never_raises(engine, tokenizer, tool_parser):
    chat = build_continuity_builder(tokenizer, "tiny", tool_parser=tool_parser, reasoning_parser="none")
    settings = LoopSettings(budgets=Budgets(1024, 600, 48), max_turns=3, max_tool_calls_per_turn=2,
                            tool_timeout_s=5, temperature=1.0)
    worker = AgentLoopWorker(
        default_loop="rollout.agent_loop:ToolAgentLoop", settings=settings, chat=chat, tokenizer=tokenizer,
        router=Router({"e0": engine}), envs=EnvBuilder({"echo": EchoTool}),
        rewards=RewardLoop("exact_match", lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                           timeout_s=30.0, max_concurrency=8), trajectory_timeout_s=120)
    task = Task("t", (Message("system", "Use the echo tool."), Message("user", "Echo hi.")),
                tools=("echo",), answer="hi")
    groups = [await worker.run_group(task, f"{tool_parser}-{i}", 8) for i in range(2)]
    trajectories = [t for g in groups for t in g.trajectories]
    for t in trajectories:
        assert t.termination in (TerminationReason.FINISHED, TerminationReason.MAX_TURNS,
                                 TerminationReason.MAX_TOKENS), t.termination_detail
        assert all(turn.tool_parse_status in PARSE_STATUSES for turn in t.turns)
    counts = tool_parse_counts(trajectories)
    assert sum(counts.values()) == sum(len(t.turns) for t in trajectories) > 0
    log.info("tool_parser=%s: %s", tool_parser, {k.rsplit("/", 1)[1]: int(v) for k, v in counts.items() if v})
    assert "error" not in worker.stats().end_reasons
