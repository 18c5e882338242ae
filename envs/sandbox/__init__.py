"""Sandboxes where agents' commands run: the backend-neutral protocol (`base`) and the
built-in backends by name. Backends are imported on use, so importing this package is
cheap and never pulls in a backend's host requirements."""

from envs.sandbox.base import (
                               ExecResult,
                               Sandbox,
                               SandboxCapabilities,
                               SandboxLimits,
                               SandboxSpec,
                               Snapshot,
                               build_sandbox_limits,
)

# Built-in backends as import strings (`envs.sandbox_backend` in the recipe names one).
BUILTIN_BACKENDS = {"local": "envs.sandbox.local:LocalSandbox",
                    "container": "envs.sandbox.container:ContainerSandbox"}

__all__ = ["BUILTIN_BACKENDS", "ExecResult", "Sandbox", "SandboxCapabilities", "SandboxLimits",
           "SandboxSpec", "Snapshot", "build_sandbox_limits"]
