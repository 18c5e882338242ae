"""Environments: sandbox backends and pool, tools, task formats."""
