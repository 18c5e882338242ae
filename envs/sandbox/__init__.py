"""Sandboxes where agents' commands run: the backend-neutral protocol (`base`) and the
built-in backends by name. Backends are imported on use, so importing this package is
cheap and never pulls in a backend's host requirements."""

from envs.sandbox.base import (
                               ExecResult,
                               Sandbox,
                               SandboxCapabilities,
                               SandboxLimits,
                               SandboxRole,
                               SandboxSpec,
                               Snapshot,
                               build_sandbox_limits,
)

__all__ = ["ExecResult", "Sandbox", "SandboxCapabilities", "SandboxLimits",
           "SandboxRole", "SandboxSpec", "Snapshot", "build_sandbox_limits"]
