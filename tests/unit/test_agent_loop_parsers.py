"""The tool agent loop under every supported family's vLLM parsers, against a fake
engine that writes what a model trained on the family's real template writes: a good
call, a broken call, a call to a tool that does not exist, a call cut by the length
limit, then an answer. No turn raises; each failure is an observation the model reads,
and the per-turn statuses add up to the rollout/tool_parse counts.

The real templates come from the installed trl (tests/chat_families.py); the parsers are
vLLM's, imported on first use. The real engine runs the loop in tests/integration.
"""

from __future__ import annotations

import asyncio
import numpy as np
import pytest

from chat_families import SUPPORTED, EchoTool, TemplateCase, tokenizer_for
from envs.trajectory_env import EnvBuilder
from envs.types import Message, Task, TerminationReason, ToolCall
from reward.loop import RewardLoop
from rollout.agent_loop import LoopSettings
from rollout.chat import FAMILIES, build_continuity_builder
from rollout.engine import TokenOutput
from rollout.recorder import Budgets
from rollout.router import Router
from rollout.template_check import generation_text
from rollout.tool_parser import tool_parse_counts
from rollout.worker import AgentLoopWorker

TOOL_CASES = [c for c in SUPPORTED if FAMILIES[c.family].has_tools]
TASK = Task("t0", (Message("system", "Use tools."), Message("user", "Repeat hi, then answer.")),
            tools=("echo",), answer="done")


class FakeScriptedEngine:
    """A fake engine: the k-th generation of every session is script[k] (text), followed
    by the family's stop token unless the entry is cut by length (LENGTH: prefix)."""

    def __init__(self, tokenizer, script: list[str], stop_id: int) -> None:
        self.tokenizer, self.script, self.stop_id = tokenizer, script, stop_id
        self.prompts: dict[str, list[np.ndarray]] = {}

    async def generate(self, request_id, prompt_ids, sampling):
        session = request_id.split("#")[0]
        self.prompts.setdefault(session, []).append(np.array(prompt_ids))
        text = self.script[min(len(self.prompts[session]), len(self.script)) - 1]
        cut = text.startswith("LENGTH:")
        ids = self.tokenizer.encode(text.removeprefix("LENGTH:"), add_special_tokens=False)
        ids = ids if cut else ids + [self.stop_id]
        n = len(ids)
        await asyncio.sleep(0)
        return TokenOutput(np.array(ids, np.int32), np.full(n, -0.5, np.float32), np.zeros(n, np.int32),
                           "length" if cut else "stop", len(prompt_ids), 0)


def script_for(builder, tokenizer) -> tuple[list[str], list[set[str]]]:
    """The family's own rendering of each turn, and the statuses each may get."""
    family = builder.family
    think = family.thinking != "none" and not builder.prompt_closes_thinking()
    history = list(TASK.messages)
    tools = [EchoTool.schema]

    def turn(*calls: ToolCall, content: str = "") -> str:
        message = Message("assistant", content if family.content_with_calls or not calls else "",
                          calls, reasoning="I will use the tool." if think else None)
        return generation_text(builder, history, message, tools)

    good = turn(ToolCall("echo", {"text": "hi"}), content="Calling.")
    unknown = turn(ToolCall("browse", {"text": "x"}))
    marker = next(m for m in ("<tool_call>", "<|tool_call_start|>", '{"name"') if m in good)
    cut = good[:good.index("hi", good.index(marker)) + 1]  # inside the argument's value
    end_marker = {"<tool_call>": "</tool_call>", "<|tool_call_start|>": "<|tool_call_end|>"}.get(marker, "")
    broken = cut + "}}))'\"" + end_marker  # garbage where the arguments should end, then closed
    answer = turn(content="done")
    script = [good, broken, unknown, "LENGTH:" + cut, answer]
    refused = {"malformed_call", "malformed_arguments", "unclosed_block"}
    # Llama's JSON has no closing marker: a cut call is a broken one, not an unclosed block.
    # GLM's parser drops a call to a tool the request does not list: refused, not unknown.
    unknown_status = {"unknown_tool", "malformed_call"} if builder.tool_parser_name == "glm45" else {"unknown_tool"}
    statuses = [{"ok"}, refused, unknown_status, {"unclosed_block"} if end_marker else refused, {"no_call"}]
    return script, statuses


@pytest.mark.parametrize("case", TOOL_CASES, ids=[c.id for c in TOOL_CASES])
async def test_every_family_parser_turns_bad_calls_into_observations(case: TemplateCase, tiny_model_path):
    tokenizer = tokenizer_for(case, tiny_model_path)
    chat = build_continuity_builder(tokenizer, case.family)
    script, expected = script_for(chat, tokenizer)
    engine = FakeScriptedEngine(tokenizer, script, chat.end_of_turn_id)
    settings = LoopSettings(budgets=Budgets(4096, 3000, 400), max_turns=8, max_tool_calls_per_turn=2,
                            tool_timeout_s=5)
    worker = AgentLoopWorker(
        default_loop="rollout.agent_loop:ToolAgentLoop", settings=settings, chat=chat, tokenizer=tokenizer,
        router=Router({"e0": engine}), envs=EnvBuilder({"echo": EchoTool}),
        rewards=RewardLoop("exact_match", lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                           timeout_s=30.0, max_concurrency=4), trajectory_timeout_s=60)
    group = await worker.run_group(TASK, "g", 2)

    for traj in group.trajectories:
        assert traj.termination is TerminationReason.FINISHED, traj.termination_detail
        statuses = [t.tool_parse_status for t in traj.turns]
        assert len(statuses) == len(expected)
        for status, allowed in zip(statuses, expected):
            assert status in allowed, (statuses, script)
        observations = tokenizer.decode(traj.response_ids[traj.response_mask == 0].tolist())
        assert "echoed hi" in observations  # the good call ran
        assert "unknown tool 'browse'" in observations or chat.tool_parser_name == "glm45"
        # the broken and the cut call were explained (refused, or read and their arguments checked)
        assert observations.count("Tool call 1") + observations.count("Invalid arguments for tool") >= 2
        full = traj.input_ids()
        for sent in engine.prompts[f"{traj.group_id}/{traj.index}"]:
            assert np.array_equal(full[:len(sent)], sent)
    counts = tool_parse_counts(group.trajectories)
    assert counts["rollout/tool_parse/ok"] == 2
    assert counts["rollout/tool_parse/no_call"] == 2
    assert sum(counts.values()) == 2 * len(expected)
    assert worker.stats().end_reasons == {"finished": 2}
