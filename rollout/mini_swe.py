"""Stable import strings `rollout.mini_swe:MiniSweAgentLoop` / `:MiniSweTextAgentLoop`
(recipes written before the gateway became a package); the code lives in
rollout.gateway.mini_swe."""

from rollout.gateway.mini_swe import MiniSweAgentLoop, MiniSweTextAgentLoop

__all__ = ["MiniSweAgentLoop", "MiniSweTextAgentLoop"]
