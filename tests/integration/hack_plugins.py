"""The scripted hacking policy of test_multinode.py (not a test; its cluster_plugins loop
uses it), importable by the run's Ray workers (the test puts this folder on their
PYTHONPATH): by its index in the group, a trajectory solves the code task honestly or
attempts one reward hack; `files_for` says what it writes."""

from __future__ import annotations

from hack_payloads import FORCEPASS, PATCH_RUNNER, PROXY

from envs.tasks.code import spec_by_name

# Index in the group -> (what the policy tries, the files it writes).
BEHAVIOURS = ("honest", "patched_runner", "runner_config", "shadow_module")


def files_for(behaviour: str, task_id: str) -> dict[str, str]:
    spec = spec_by_name(task_id)
    if behaviour == "honest":
        return {spec.module: spec.reference}
    if behaviour == "patched_runner":  # the runner patched from the module under test
        return {spec.module: PATCH_RUNNER + spec.stub}
    if behaviour == "runner_config":  # a conftest and a pytest.toml that force passes
        return {"conftest.py": FORCEPASS, "pytest.toml": "[pytest]\naddopts = ['-p', 'force']\n",
                "force.py": FORCEPASS}
    return {"difflib.py": PROXY}  # a stdlib module pytest imports lazily, standing in

