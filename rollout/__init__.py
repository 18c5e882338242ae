"""Rollout: core types, vLLM engines, router, agent loops, token continuity, workers."""
