"""mini-swe-agent (pip `mini-swe-agent`), trained through the gateway: its own agent,
prompts and model class (litellm, `hosted_vllm/<name>` pointed at the session's OpenAI
endpoint) drive the policy; its bash commands run in the trajectory's sandbox.

    MiniSweAgentLoop (GatewayAgentLoop)
        worker thread: minisweagent DefaultAgent(LitellmModel | LitellmTextbasedModel,
                                                 SandboxEnvironment).run(task text)
            model.query  --HTTP-->  gateway session  -->  router  -->  engine
            env.execute  --run_coroutine_threadsafe-->  ctx.env.sandbox.exec (this
                         trajectory's sandbox, on the worker's event loop)

mini-swe-agent is synchronous, so it runs in a thread of the worker; the gateway, the
router and the sandbox calls stay on the worker's event loop. Two modes, as
mini-swe-agent has them: tool calls (`MiniSweAgentLoop`, config `mini.yaml`, one `bash`
tool) and text-based (`MiniSweTextAgentLoop`, config `mini_textbased.yaml`, one
```mswea_bash_command block per reply). When the session closes (harness timeout, the
trajectory's budget) the gateway answers 404, which mini-swe-agent does not retry, so
the thread ends at its next model call. The task's sandbox tools (e.g. "bash") make the
worker open the sandbox; the agent reaches it only through `SandboxEnvironment`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envs.cache import default_cache_dir
from envs.types import Task, TerminationReason
from rollout.gateway.loop import GatewayAgentLoop, HarnessEndpoint

if TYPE_CHECKING:
    from envs.tools.sandbox_tools import SandboxSession
    from rollout.agent_loop import AgentContext

log = logging.getLogger(__name__)

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's own end signal


def configure_mini_swe_env() -> None:
    """mini-swe-agent and litellm read these at import: no first-run wizard, no banner,
    no network lookups of cost maps, no cost errors for a local model, no retries with
    4-60 s backoff on a request the gateway refused (it is the harness's own error)."""
    defaults = {"MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
                "MSWEA_GLOBAL_CONFIG_DIR": str(Path(default_cache_dir()) / "mini-swe-agent")}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


class SandboxEnvironment:
    """A mini-swe-agent Environment whose commands run in this trajectory's sandbox
    (`bash -c`, in the task's workdir); called from the agent's thread, executed on the
    worker's event loop. Output is mini-swe-agent's shape: output, returncode,
    exception_info; the submit marker ends the run as mini-swe-agent's own envs do."""

    def __init__(self, sandbox: "SandboxSession", loop: asyncio.AbstractEventLoop, *, timeout_s: float) -> None:
        from pydantic import BaseModel

        class Config(BaseModel):  # what mini-swe-agent templates and serialises
            cwd: str
            timeout: float

        self.sandbox, self.loop = sandbox, loop
        self.config = Config(cwd=sandbox.workdir, timeout=timeout_s)
        self.num_executed = 0

    def execute(self, action: Mapping[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = str(action.get("command", ""))
        if cwd:
            command = f"cd {shlex.quote(cwd)} && {command}"
        future = asyncio.run_coroutine_threadsafe(self.sandbox.exec(["bash", "-c", command]), self.loop)
        self.num_executed += 1
        try:
            # The sandbox enforces envs.exec_timeout_s; this bound only frees the thread.
            result = future.result(timeout=self.config.timeout + 30)
        except Exception as exc:  # the agent sees it as mini-swe-agent's envs report errors
            future.cancel()
            return {"output": "", "returncode": -1,
                    "exception_info": f"An error occurred while executing the command: {type(exc).__name__}: {exc}"}
        output = result.stdout + result.stderr
        out = {"output": output, "returncode": result.exit_code,
               "exception_info": f"the command timed out after {self.config.timeout:g} s" if result.timed_out else ""}
        lines = output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and result.exit_code == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})
        return out

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # mini.yaml's instance template names the platform; the sandbox runs Linux.
        return {**self.config.model_dump(), "system": "Linux", "release": "", "version": "",
                "machine": "x86_64", **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{__name__}.{type(self).__name__}"}}}


class MiniSweAgentLoop(GatewayAgentLoop):
    """mini-swe-agent in tool-call mode (its `mini.yaml`, the `bash` tool). Subclass and
    set the class attributes to change the config, the step limit or the mode."""

    model_name = "policy"
    config_name = "mini.yaml"  # a mini-swe-agent config (its built-ins or a path)
    textbased = False
    step_limit = 0  # model calls; 0: agent.max_turns
    harness_timeout_s = 600.0
    max_kept_runs = 256  # recent runs kept on `runs` (transcripts, tests), oldest dropped first

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[str, MiniSweRun] = {}  # "group_id/index" -> what mini-swe-agent did

    def _keep_run(self, session_id: str, run: "MiniSweRun") -> None:
        self.runs.pop(session_id, None)
        self.runs[session_id] = run
        while len(self.runs) > self.max_kept_runs:
            self.runs.pop(next(iter(self.runs)))

    def build_agent(self, endpoint: HarnessEndpoint, env: SandboxEnvironment, step_limit: int) -> Any:
        """mini-swe-agent's DefaultAgent on its own config, its model pointed at `endpoint`."""
        configure_mini_swe_env()
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.config import get_config_from_spec
        from minisweagent.models.litellm_model import LitellmModel
        from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

        import litellm

        litellm.suppress_debug_info = True  # no "Provider List" banners on the worker's stdout
        config = get_config_from_spec(self.config_name)
        # mini-swe-agent's YAML model config, passed through as its keyword arguments: any values.
        model_cfg: dict[str, Any] = {**config.get("model", {}), "model_name": f"hosted_vllm/{endpoint.model}",
                     "cost_tracking": "ignore_errors",
                     "model_kwargs": {**config.get("model", {}).get("model_kwargs", {}),
                                      "api_base": endpoint.openai_base_url, "api_key": endpoint.api_key,
                                      "drop_params": True}}
        model_cfg.pop("model_class", None)
        model = (LitellmTextbasedModel if self.textbased else LitellmModel)(**model_cfg)
        agent_cfg = {k: v for k, v in config.get("agent", {}).items() if k != "mode"}  # mode: the interactive CLI's
        agent_cfg.update(step_limit=step_limit, cost_limit=0.0, output_path=None)
        return DefaultAgent(model, env, **agent_cfg)

    async def run_harness(self, task: Task, endpoint: HarnessEndpoint, ctx: "AgentContext") -> TerminationReason:
        if ctx.env.sandbox is None:
            raise ValueError(f"task {task.id!r} has no sandbox: mini-swe-agent's commands need one; "
                             "give the task a sandbox tool (e.g. tools: [bash])")
        env = SandboxEnvironment(ctx.env.sandbox, asyncio.get_running_loop(),
                                 timeout_s=ctx.env.sandbox.settings.exec_timeout_s)
        agent = self.build_agent(endpoint, env, self.step_limit or ctx.settings.max_turns)
        text = "\n\n".join(m.text for m in task.messages if m.role == "user")
        try:
            result = await asyncio.to_thread(agent.run, text)
        finally:
            self._keep_run(ctx.session_id, MiniSweRun(list(agent.messages), {}, env.num_executed))
        self.runs[ctx.session_id].result.update(result)
        status = result.get("exit_status", "")
        log.debug("mini-swe-agent on %s: %s after %d commands", task.id, status, env.num_executed)
        if status == "Submitted":
            return TerminationReason.FINISHED
        if status == "LimitsExceeded":
            return TerminationReason.MAX_TURNS
        if status == "RepeatedFormatError":
            return TerminationReason.FINISHED  # the policy's own failure: scored, not an error
        raise RuntimeError(f"mini-swe-agent exited with {status or 'no status'}: "
                           f"{str(result.get('exception_str', ''))[:300]}")


class MiniSweTextAgentLoop(MiniSweAgentLoop):
    """mini-swe-agent in text-based mode (`mini_textbased.yaml`): one ```mswea_bash_command
    block per reply, no tool calls."""

    config_name = "mini_textbased.yaml"
    textbased = True


class MiniSweRun:
    """What the last mini-swe-agent run of a loop did (for transcripts and tests)."""

    def __init__(self, messages: list[dict[str, Any]], result: Mapping[str, Any], num_executed: int) -> None:
        self.messages, self.result, self.num_executed = messages, dict(result), num_executed
