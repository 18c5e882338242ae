"""Rewards: rule verifiers, hidden-test grading, generative judge."""
