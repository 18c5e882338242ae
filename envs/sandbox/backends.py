"""The sandbox-backend plug-in point (`envs.sandbox_backend`): the built-in backends by name
and the contract check any backend class must pass before a run starts. Backends are
imported only when resolved, so naming `local` never imports the container backend.

The behavioural contract (create, exec under limits, files, snapshot, release) is proven
by tests/integration/test_sandbox_contract.py; this check is the start-up part of it.
"""

from __future__ import annotations

import inspect

from envs.plugins import PluginPoint, signature_problem
from envs.sandbox.base import Sandbox

SANDBOX_BACKENDS = PluginPoint("sandbox backend", "envs.sandbox_backend", {
    "local": "envs.sandbox.local:LocalSandbox",
    "container": "envs.sandbox.container:ContainerSandbox",
})


def load_sandbox_backend(name: str) -> type[Sandbox]:
    """The Sandbox class a built-in name or `package.module:Class` names, checked against
    the contract without creating a sandbox (also the start-up check); ValueError says
    what to change."""
    cls = SANDBOX_BACKENDS.resolve(name)
    create = getattr(cls, "create", None)
    if not inspect.isclass(cls) or not inspect.iscoroutinefunction(create):
        raise ValueError(f"sandbox backend {name!r} needs `async def create(cls, spec)` as a "
                         "classmethod (envs.sandbox.base.Sandbox); point envs.sandbox_backend "
                         "at a Sandbox class")
    problem = signature_problem(create, ("spec",))
    if problem:
        raise ValueError(f"sandbox backend {name!r}: create{problem}")
    return cls  # type: ignore[return-value]  # checked just above

