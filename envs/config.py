"""The `envs` section of the recipe: tasks, sandboxes and tools. The trainer composes it
into the one schema (`trainer.run.config.SluiceConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from envs.knobs import knob, mapping_knob


@dataclass(frozen=True, slots=True)
class EnvsConfig:
    tasks: str = knob("", "Task source (required): a built-in set name (envs.tasks.BUILTIN_SETS) "
                      "or a JSONL/parquet path or a datasets folder.")
    task_format: Literal["auto", "toy", "code", "swe", "jsonl"] = knob(
        "auto", "How to read `tasks`; auto: from the name or file extension.")
    tools: dict[str, str] = mapping_knob(
        "Extra tools tasks may name, as name -> built-in name or import string "
        "'package.module:Class' (built with the trajectory's TrajectoryEnv); they join the "
        "built-ins (calculator, screenshot, bash, python, read_file, write_file, str_replace, "
        "run_tests, submit) and may replace one of them.")
    sandbox_backend: str = knob(
        "local", "Sandbox backend: a built-in name (envs.sandbox.backends: local: namespaces + "
        "rlimits + cgroups; container: podman/docker per task image) or an import string "
        "'package.module:Class' of a Sandbox class.")
    num_sandbox_workers: int = knob(1, "SandboxWorker actors in the sandbox pool.")
    cpus_per_sandbox_worker: float = knob(1.0, "Ray CPUs reserved per SandboxWorker.")
    sandboxes_per_worker: int = knob(64, "Most live sandboxes one worker owns.")
    sandbox_oversubscription: float = knob(
        1.3, "Trajectories in flight per sandbox of the pool (the seed's ~1.3: a trajectory "
        "spends part of its life generating, not in its sandbox); admission stops at "
        "num_sandbox_workers x sandboxes_per_worker x this, so no trajectory's own time "
        "budget is spent queueing for a sandbox.")
    num_warm_sandboxes: int = knob(8, "Pre-created generic sandboxes kept ready per worker.")
    exec_timeout_s: float = knob(30.0, "Default wall-clock limit of one sandboxed command.")
    memory_limit_mb: int = knob(1024, "Memory limit of one sandbox.")
    max_processes: int = knob(64, "Process limit of one sandbox.")
    max_output_bytes: int = knob(65_536, "Captured stdout+stderr per command (head and tail kept).")
    max_observation_tokens: int = knob(1024, "Tool output tokens shown to the model (truncated "
                                       "with a marker).")
    max_workspace_changes_mb: int = knob(64, "Cap on a trajectory's final workspace changes "
                                         "(files written vs the task source) handed to grading; "
                                         "over it the trajectory scores 0.")
