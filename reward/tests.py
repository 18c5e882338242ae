"""Stable import string `reward.tests:HiddenTests` (task rows and recipes written before the
grading path became `reward.grading`); the code lives in reward.grading.hidden_tests."""

from reward.grading.hidden_tests import HiddenTests

__all__ = ["HiddenTests"]
