"""GatewayAgentLoop: an AgentLoop that runs a black-box harness (an in-process coroutine
or a subprocess on the worker) against its own gateway session and turns what the
gateway recorded into the trajectory.

The loop serves one gateway (rollout.gateway.server) per worker, started on first use on the
worker's event loop with the worker's router, turn gate and continuity builder. Each
run opens a session, hands the harness its endpoint (base URLs, session token, model
name), waits for the harness (bounded by `harness_timeout_s`; the worker's
agent.trajectory_timeout_s bounds it too and then salvages the open segment, which the
loop keeps on `ctx.recorder`), then closes the session.

One session may yield several segments (the harness rewrote its history): `run`
returns the last one and leaves the earlier ones on `ctx.segments`; the worker trains
them all under the sample's one reward and group baseline. If the trajectory's timeout
cancels the run, the closed session's last segment is left as `ctx.recorder` for the
worker to salvage (ending `timeout`), the earlier ones on `ctx.segments` as well.

`num_gateway_processes` > 0 serves the sessions from that many gateway processes
(rollout.gateway.procs) instead of this worker's event loop; their generations still go
through this worker's turn gate and router. If a session's process dies, its harness is
stopped at once (its requests could only fail) and the session ends `error`; its segments
are rebuilt from the session's journal (rollout.gateway.journal), so the sample keeps what
the engine generated, and fails as a whole when a generation was in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from envs.types import Task, TerminationReason, Trajectory
from rollout.gateway.refusals import DEFAULT_MAX_BODY_BYTES
from rollout.gateway.server import Gateway, GatewayServer, GatewaySettings, GatewayStats
from rollout.gateway.procs import GatewayProcesses, SessionHandle

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


class _InProcessHost:
    """Sessions on a gateway served by this worker's event loop."""

    def __init__(self, server: GatewayServer) -> None:
        self.server = server

    async def open_session(self, task_id: str, group_id: str, index: int) -> SessionHandle:
        session = self.server.gateway.open_session(task_id, group_id, index)
        return SessionHandle(0, session.id, session.token, self.server.session_url(session))

    async def close_session(self, handle: SessionHandle, reason: TerminationReason,
                            detail: str = "") -> list[Trajectory]:
        return self.server.gateway.close_session(handle.id, reason, detail)

    async def session_lost(self, handle: SessionHandle) -> str:
        """Never returns: this gateway dies only with the worker."""
        return await asyncio.get_running_loop().create_future()

    def stats(self) -> GatewayStats:
        return self.server.gateway.stats()

    async def stop(self) -> None:
        await self.server.stop()


class SessionLost(Exception):
    """The session's gateway process died while its harness ran."""


class _ClosedSegment:
    """The last segment of a closed session, where the worker salvages an open recorder
    (`ctx.recorder.finish(reason, detail)`) when the trajectory's timeout cancelled it."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory

    def finish(self, reason: TerminationReason, detail: str = "") -> Trajectory:
        return dataclasses.replace(self.trajectory, termination=reason, termination_detail=detail)


class GatewayAgentLoop:
    """Subclass and implement `run_harness` (or use `SubprocessHarnessLoop`)."""

    model_name = "policy"
    harness_timeout_s = 600.0
    num_gateway_processes = 0  # 0: the gateway runs on the worker's event loop
    max_body_bytes = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413 (GatewaySettings)

    def __init__(self) -> None:
        self._host: _InProcessHost | GatewayProcesses | None = None
        self._starting = asyncio.Lock()

    @property
    def host(self) -> "_InProcessHost | GatewayProcesses | None":
        """Where this worker's sessions live, once a run has started it (`stats()`)."""
        return self._host

    @property
    def server(self) -> GatewayServer | None:
        """This worker's in-process gateway server, once a run has started it."""
        return self._host.server if isinstance(self._host, _InProcessHost) else None

    async def run_harness(self, task: Task, endpoint: HarnessEndpoint, ctx: "AgentContext") -> TerminationReason:
        """Drive the harness until it is done; return how the session ended."""
        raise NotImplementedError("subclass GatewayAgentLoop and implement run_harness")

    async def host_for(self, ctx: "AgentContext") -> "_InProcessHost | GatewayProcesses":
        """This worker's gateway (or gateway processes), started on first use on its loop."""
        async with self._starting:
            if self._host is None:
                s = ctx.settings
                settings = GatewaySettings(self.model_name, s.budgets, s.temperature, s.top_p, s.top_k,
                                           s.max_tool_calls_per_turn, max_body_bytes=self.max_body_bytes)
                host: _InProcessHost | GatewayProcesses
                if self.num_gateway_processes > 0:
                    procs = GatewayProcesses(ctx.router, ctx.gate, ctx.chat, settings, self.num_gateway_processes)
                    await procs.start()
                    host = procs
                else:
                    server = GatewayServer(Gateway(ctx.router, ctx.gate, ctx.chat, ctx.tokenizer, settings))
                    await server.start()
                    host = _InProcessHost(server)
                self._host = host
        return self._host

    async def run(self, task: Task, ctx: "AgentContext") -> Trajectory:
        host = await self.host_for(ctx)
        handle = await host.open_session(task.id, ctx.group_id, ctx.index)
        endpoint = HarnessEndpoint(handle.url + "/v1", handle.url, handle.token, self.model_name)
        reason, detail = TerminationReason.ERROR, "the harness was cancelled"
        try:
            reason = await self._harness_unless_lost(host, handle, task, endpoint, ctx)
            detail = ""
        except TimeoutError:
            reason, detail = TerminationReason.TIMEOUT, f"the harness ran over {self.harness_timeout_s:g} s"
        except SessionLost as exc:
            reason, detail = TerminationReason.ERROR, str(exc)
        except Exception as exc:  # the harness failing is this trajectory's ending, not the worker's
            reason, detail = TerminationReason.ERROR, f"harness failed: {type(exc).__name__}: {exc}"
        finally:
            segments = await host.close_session(handle, reason, detail)
            ctx.segments[:] = segments[:-1]
            if segments:  # what the worker salvages if this run was cancelled
                ctx.recorder = _ClosedSegment(segments[-1])  # type: ignore[assignment]  # duck-typed: finish()
        if not segments:  # no generation: an error with no model token (nothing to train)
            rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas or None))
            return rec.finish(TerminationReason.ERROR, detail or "the harness made no model request")
        return segments[-1]

    async def _harness_unless_lost(self, host: "_InProcessHost | GatewayProcesses", handle: SessionHandle,
                                   task: Task, endpoint: HarnessEndpoint, ctx: "AgentContext") -> TerminationReason:
        """The harness's ending (bounded by harness_timeout_s); SessionLost, the harness
        cancelled, if the session's gateway process dies first."""
        harness = asyncio.ensure_future(asyncio.wait_for(self.run_harness(task, endpoint, ctx),
                                                         self.harness_timeout_s))
        lost = asyncio.ensure_future(host.session_lost(handle))
        try:
            done, _ = await asyncio.wait((harness, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:  # on the way out, cancelled or not: neither outlives the session
            lost.cancel()
            if not harness.done():
                harness.cancel()
                await asyncio.gather(harness, return_exceptions=True)  # its clean-up runs (a subprocess killed)
        if harness in done:
            return harness.result()
        raise SessionLost(f"{lost.result()} while the harness ran: it was stopped")

    async def close(self) -> None:
        if self._host is not None:
            await self._host.stop()
            self._host = None


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
        finally:  # cancelled or timed out: the harness must not outlive its session
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"harness exited with {proc.returncode}: {stderr.decode(errors='replace')[-500:]}")
        return TerminationReason.FINISHED
