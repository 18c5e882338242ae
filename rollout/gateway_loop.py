"""Stable import string `rollout.gateway_loop:GatewayAgentLoop` / `:SubprocessHarnessLoop` (recipes written before the
gateway became a package); the code lives in rollout.gateway.loop."""

from rollout.gateway.loop import GatewayAgentLoop, SubprocessHarnessLoop

__all__ = ["GatewayAgentLoop", "SubprocessHarnessLoop"]
