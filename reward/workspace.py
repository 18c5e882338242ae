"""The agent's final workspace as grading receives it: WorkspaceChanges, the files it
wrote and deleted relative to the task's source folder.

The value type lives in `envs.types` (trajectories carry it from the worker to the
reward loop) and its builders in `envs.sandbox.changes` (they run in the sandbox pool,
next to the workspace); both are re-exported here for reward functions and tests.
Grading (reward.grading.prepare) applies the changes to a fresh copy of the task source and
never runs anything of the agent's sandbox.
"""

from __future__ import annotations

from envs.sandbox.changes import (MAX_CHANGED_BYTES, MAX_CHANGED_FILES, changes_from_dir,
                                  changes_from_snapshot)
from envs.types import WorkspaceChanges, clean_relative_path

__all__ = ["MAX_CHANGED_BYTES", "MAX_CHANGED_FILES", "WorkspaceChanges", "changes_from_dir",
           "changes_from_snapshot", "clean_relative_path"]
