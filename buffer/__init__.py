"""Replay buffer: terminal groups, staleness policy, batching."""
