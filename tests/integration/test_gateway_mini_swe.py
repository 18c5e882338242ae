"""Real mini-swe-agent (pip `mini-swe-agent`, its own mini.yaml / mini_textbased.yaml
prompts, litellm `hosted_vllm/...`) trained through the gateway against the tiny model
on the real engine, on a bundled code task in real local sandboxes: every prompt the
engine saw is a prefix of its segment, the segment's logprobs and versions are the
engine's, the reward (hidden tests) is joined to the session; and its bash commands run
in the trajectory's sandbox (SandboxEnvironment), submission included.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import numpy as np
import pytest
import pytest_asyncio

from envs.pool import SandboxPool, load_sandbox_factory
from envs.tools.sandbox_tools import SandboxToolSettings
from envs.trajectory_env import EnvBuilder, load_tool_classes
from envs.types import TerminationReason
from reward.loop import RewardLoop
from rollout.agent_loop import LoopSettings
from rollout.chat import build_continuity_builder
from rollout.gateway.mini_swe import MiniSweAgentLoop, SandboxEnvironment
from rollout.recorder import Budgets
from rollout.router import Router
from rollout.worker import AgentLoopWorker

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the shared engine's loop

@pytest.fixture(scope="module")
def long_engine(shared_engine):
    """This worker's read-only engine (conftest.shared_engine)."""
    return shared_engine

SETTINGS = SandboxToolSettings(exec_timeout_s=10.0, max_observation_tokens=1500)


@pytest.fixture(scope="module", autouse=True)
def needs_bwrap():
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local sandbox backend needs root and bubblewrap")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def pool():
    pool = SandboxPool(load_sandbox_factory("local"), max_sandboxes=4, num_warm=0, snapshot_interval_s=30.0)
    yield pool
    await pool.close()


@pytest.fixture(scope="module")
def task():
    from envs.tasks import load_tasks

    return load_tasks("code_functions")[0]  # run_length_encode: a stub, visible and hidden tests


class RecordingEngine:
    """The real engine, with every (request id, prompt, output) it served kept."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    async def generate(self, request_id, prompt_ids, sampling):
        out = await self.engine.generate(request_id, prompt_ids, sampling)
        self.calls.append((request_id, [int(i) for i in prompt_ids], out))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


class TinyMiniSwe(MiniSweAgentLoop):
    model_name = "tiny"
    step_limit = 3


class TinyMiniSweText(TinyMiniSwe):
    config_name = "mini_textbased.yaml"
    textbased = True


def make_worker(engine, tiny_model_path, pool, loop: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    recording = RecordingEngine(engine)
    settings = LoopSettings(budgets=Budgets(4096, 600, 48), max_turns=3, max_tool_calls_per_turn=2,
                            tool_timeout_s=10)
    worker = AgentLoopWorker(
        default_loop=loop, settings=settings, chat=build_continuity_builder(tokenizer, "tiny"),
        tokenizer=tokenizer, router=Router({"e0": recording}),
        envs=EnvBuilder(load_tool_classes(), pool, SETTINGS),
        rewards=RewardLoop("reward.grading.hidden_tests:HiddenTests", tokenizer.decode, timeout_s=60.0, max_concurrency=2,
                           create_sandbox=load_sandbox_factory("local")),
        trajectory_timeout_s=120)
    return worker, recording, tokenizer


TRANSCRIPTS: dict[str, list] = {}  # what mini-swe-agent did, dumped for the docs with SLUICE_MINI_SWE_TRANSCRIPT


def model_replies(messages) -> list[str]:
    """The model's replies as mini-swe-agent kept them: assistant messages, and the raw
    response it keeps on the format-error message that replaces a malformed reply."""
    out = []
    for m in messages:
        response = m.get("extra", {}).get("response")
        if m["role"] == "assistant":
            out.append(m.get("content") or "")
        elif isinstance(response, dict):
            out.append(response["choices"][0]["message"].get("content") or "")
    return out


@pytest.fixture(scope="module", autouse=True)
def dump_transcripts():
    yield
    path = os.environ.get("SLUICE_MINI_SWE_TRANSCRIPT")
    if path:
        import json

        with open(path, "w") as f:
            json.dump({k: [{"role": m["role"], "content": m.get("content"),
                            "tool_calls": m.get("tool_calls"), "exit": m.get("extra", {}).get("exit_status")}
                           for m in v] for k, v in TRANSCRIPTS.items()}, f, indent=1, default=str)


def assert_exact(segments, calls):
    """Every prompt the engine saw for this sample is a prefix of one of its segments, in
    order; each segment's mask-1 tokens are exactly its calls' sampled ids, logprobs and
    versions."""
    i = 0
    for segment in segments:
        full = segment.input_ids().tolist()
        mine = []
        while i < len(calls) and full[:len(calls[i][0])] == calls[i][0]:
            mine.append(calls[i])
            i += 1
        assert mine and mine[0][0] == segment.prompt_ids.tolist()
        model = segment.response_mask == 1
        assert segment.response_ids[model].tolist() == np.concatenate([o.token_ids for _, o in mine]).tolist()
        assert np.array_equal(segment.logprobs[model], np.concatenate([o.logprobs for _, o in mine]))
        assert np.array_equal(segment.versions[model], np.concatenate([o.versions for _, o in mine]))
    assert i == len(calls), "an engine call is in no segment"


@pytest.mark.parametrize("loop", ["TinyMiniSwe", "TinyMiniSweText"])
async def test_mini_swe_agent_through_the_gateway_is_exact_and_scored(long_engine, tiny_model_path, pool, task,
                                                                      loop):
    worker, recording, tokenizer = make_worker(long_engine, tiny_model_path, pool, f"{__name__}:{loop}")
    group = await worker.run_group(task, "ms", 2)
    harness = worker.loop_for(task)
    for index in range(2):
        segments = [t for t in group.trajectories if t.index == index]
        calls = [(p, o) for rid, p, o in recording.calls if rid.startswith(f"ms/{index}#")]
        assert 1 <= len(calls) <= 3  # step_limit 3 (or mini-swe-agent's 3 format errors)
        assert_exact(segments, calls)
        run = harness.runs[f"ms/{index}"]
        # What mini-swe-agent holds as the model's replies is what the gateway returned for
        # exactly these sampled ids (decoded by the gateway; the tool parser finds no call).
        replies = model_replies(run.messages)
        assert len(replies) == len(calls)
        for reply, (_, out) in zip(replies, calls):
            assert reply.strip() in tokenizer.decode(out.token_ids.tolist())
        TRANSCRIPTS[f"{loop}/{index}"] = run.messages
        assert task.messages[-1].content[:60] in run.messages[1]["content"]  # its own instance template
        # mini-swe-agent keeps a malformed reply out of its history (only its format-error
        # message goes back): the next request rewrites the history, a new exact segment.
        dropped = [m for m in run.messages[:-1] if m.get("extra", {}).get("interrupt_type") == "FormatError"]
        assert len(segments) == 1 + len(dropped[:len(calls) - 1])
        rewards = {t.reward for t in segments}
        assert rewards == {0.0}  # the stub is graded by the task's hidden tests: one reward per sample
        assert {t.termination for t in segments} == {segments[-1].termination}
        assert segments[-1].termination in (TerminationReason.FINISHED, TerminationReason.MAX_TURNS), \
            segments[-1].termination_detail
        assert "fail_to_pass_frac" in segments[-1].reward_components
    stats = worker.stats().gateway
    assert stats.num_sessions == 2 and stats.num_segments == len(group.trajectories)
    assert stats.num_prefix_breaks == len(group.trajectories) - 2
    assert stats.num_reencoded_tokens == sum(len(t.prompt_ids) for t in group.trajectories if t.segment > 0)
    await harness.close()


async def test_mini_swe_agent_commands_run_in_the_trajectorys_sandbox(pool, task):
    """mini-swe-agent's own execute_actions (what it runs after each model reply) on our
    environment: the command runs in this trajectory's sandbox, its observation is
    rendered by mini-swe-agent's template, the submit marker ends the run, and the
    workspace the agent changed is what grading gets."""
    from minisweagent.exceptions import Submitted

    from rollout.gateway.loop import HarnessEndpoint

    env = EnvBuilder(load_tool_classes(), pool, SETTINGS).build(task)
    await env.open()
    try:
        sandbox_env = SandboxEnvironment(env.sandbox, asyncio.get_running_loop(), timeout_s=10)
        agent = TinyMiniSwe().build_agent(HarnessEndpoint("http://127.0.0.1:9/v1", "", "k", "tiny"),
                                          sandbox_env, step_limit=3)
        module = task.messages[-1].content.split("/workspace/")[1].split(",")[0]
        message = {"role": "assistant", "content": "",
                   "extra": {"actions": [{"command": f"echo made-by-mini > made.txt; pwd; ls {module}",
                                          "tool_call_id": "call_1"}]}}
        (obs,) = await asyncio.to_thread(agent.execute_actions, message)
        assert obs["role"] == "tool" and obs["tool_call_id"] == "call_1"
        assert "/workspace" in obs["content"] and module in obs["content"] and '"returncode": 0' in obs["content"]
        submit = {"extra": {"actions": [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo done",
                                         "tool_call_id": "call_2"}]}}
        with pytest.raises(Submitted):
            await asyncio.to_thread(agent.execute_actions, submit)
        assert sandbox_env.num_executed == 2
    finally:
        changes = await env.release()
    assert changes.written.get("made.txt") == b"made-by-mini\n"
