"""GatewayAgentLoop: an AgentLoop that runs a black-box harness (an in-process coroutine
or a subprocess on the worker) against its own gateway session and turns what the
gateway recorded into the trajectory.

The loop serves one gateway (rollout.gateway) per worker, started on first use on the
worker's event loop with the worker's router, turn gate and continuity builder. Each
run opens a session, hands the harness its endpoint (base URLs, session token, model
name), waits for the harness (bounded by `harness_timeout_s`; the worker's
agent.trajectory_timeout_s bounds it too and then salvages the open segment, which the
loop keeps on `ctx.recorder`), then closes the session.

One session may yield several segments (the harness rewrote its history). Each segment
that ends because a new one starts goes onto `ctx.segments`; `run` returns the last one,
and the worker trains them all under the sample's one reward and group baseline. On a
trajectory timeout the worker salvages the open segment (`ctx.recorder`) and keeps the
earlier ones the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from envs.types import Task, TerminationReason, Trajectory
from rollout.gateway import Gateway, GatewayServer, GatewaySettings
from rollout.recorder import TrajectoryRecorder

if TYPE_CHECKING:
    from rollout.agent_loop import AgentContext

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HarnessEndpoint:
    """What a harness needs to reach its session."""

    openai_base_url: str  # .../sessions/<id>/v1 (an OpenAI client's base_url)
    anthropic_base_url: str  # .../sessions/<id> (an Anthropic client's base_url)
    api_key: str  # the session's token
    model: str

    def env(self) -> dict[str, str]:
        """The environment variables the official clients (and most harnesses) read."""
        return {"OPENAI_BASE_URL": self.openai_base_url, "OPENAI_API_KEY": self.api_key,
                "ANTHROPIC_BASE_URL": self.anthropic_base_url, "ANTHROPIC_API_KEY": self.api_key,
                "SLUICE_MODEL": self.model}


class GatewayAgentLoop:
    """Subclass and implement `run_harness` (or use `SubprocessHarnessLoop`)."""

    model_name = "policy"
    harness_timeout_s = 600.0

    def __init__(self) -> None:
        self._server: GatewayServer | None = None
        self._starting = asyncio.Lock()

    @property
    def server(self) -> GatewayServer | None:
        """This worker's gateway server, once a run has started it."""
        return self._server

    async def run_harness(self, task: Task, endpoint: HarnessEndpoint, ctx: "AgentContext") -> TerminationReason:
        """Drive the harness until it is done; return how the session ended."""
        raise NotImplementedError("subclass GatewayAgentLoop and implement run_harness")

    async def server_for(self, ctx: "AgentContext") -> GatewayServer:
        """This worker's gateway, started on first use on the worker's loop."""
        async with self._starting:
            if self._server is None:
                s = ctx.settings
                gateway = Gateway(ctx.router, ctx.gate, ctx.chat, ctx.tokenizer, GatewaySettings(
                    self.model_name, s.budgets, s.temperature, s.top_p, s.top_k, s.max_tool_calls_per_turn))
                server = GatewayServer(gateway)
                await server.start()
                self._server = server
        return self._server

    async def run(self, task: Task, ctx: "AgentContext") -> Trajectory:
        server = await self.server_for(ctx)
        gateway = server.gateway

        def keep_open_segment(rec: TrajectoryRecorder) -> None:
            # The segment a prefix break finished is trained with the sample; one without a
            # generation was dropped by the gateway (nothing to train) and has no result.
            previous = ctx.recorder
            if previous is not None and previous.result is not None:
                ctx.segments.append(previous.result)
            ctx.recorder = rec  # the open one: the worker salvages it on a timeout

        session = gateway.open_session(task.id, ctx.group_id, ctx.index, on_segment=keep_open_segment)
        base = server.session_url(session)
        endpoint = HarnessEndpoint(base + "/v1", base, session.token, self.model_name)
        reason, detail = TerminationReason.ERROR, "the harness was cancelled"
        try:
            reason = await asyncio.wait_for(self.run_harness(task, endpoint, ctx), self.harness_timeout_s)
            detail = ""
        except TimeoutError:
            reason, detail = TerminationReason.TIMEOUT, f"the harness ran over {self.harness_timeout_s:g} s"
        except Exception as exc:  # the harness failing is this trajectory's ending, not the worker's
            reason, detail = TerminationReason.ERROR, f"harness failed: {type(exc).__name__}: {exc}"
        finally:
            segments = gateway.close_session(session.id, reason, detail)
        if not segments:  # no generation: an error with no model token (nothing to train)
            rec = ctx.recorder or ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas or None))
            return rec.finish(TerminationReason.ERROR, detail or "the harness made no model request")
        ctx.segments[:] = segments[:-1]  # (the same, unless the open segment had no generation)
        return segments[-1]

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop()
            self._server = None


class SubprocessHarnessLoop(GatewayAgentLoop):
    """A harness command run as a subprocess on the worker, its endpoint in the
    environment (`HarnessEndpoint.env`) and the task's messages as JSON in SLUICE_TASK.
    Exit code 0 ends the session as finished; any other as error (stderr tail kept)."""

    command: Sequence[str] = ()

    async def run_harness(self, task: Task, endpoint: HarnessEndpoint, ctx: "AgentContext") -> TerminationReason:
        if not self.command:
            raise ValueError(f"{type(self).__name__}.command is empty: set the harness command")
        env = {**os.environ, **endpoint.env(),
               "SLUICE_TASK": json.dumps([m.to_template() for m in task.messages])}
        proc = await asyncio.create_subprocess_exec(*self.command, env=env, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            _, stderr = await proc.communicate()
        except BaseException:  # cancelled or timed out: the harness must not outlive its session
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"harness exited with {proc.returncode}: {stderr.decode(errors='replace')[-500:]}")
        return TerminationReason.FINISHED
