"""Core types validate what later stages rely on: aligned per-token arrays, masks, versions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from envs.types import NO_VERSION, GradingSpec, Group, Message, Task, TerminationReason, ToolCall, Trajectory


def make_traj(index=0, reward=None, group_id="g0", **over):
    # prompt [1 2], model tokens 3 4 (version 0, 1), tool tokens 5 6, model token 7 (version 2)
    kw = dict(task_id="t0", group_id=group_id, index=index, prompt_ids=[1, 2],
              response_ids=[3, 4, 5, 6, 7], response_mask=[1, 1, 0, 0, 1],
              logprobs=[-0.5, -0.25, 0.0, 0.0, -1.0], versions=[0, 1, NO_VERSION, NO_VERSION, 2],
              termination="finished", reward=reward)
    kw.update(over)
    return Trajectory(**kw)


def test_trajectory_normalises_arrays_and_reports_versions():
    t = make_traj()
    assert t.response_ids.dtype == np.int32 and t.response_mask.dtype == np.int8
    assert t.termination is TerminationReason.FINISHED
    assert t.num_model_tokens == 3
    assert t.oldest_version == 0
    assert t.staleness(3) == 3
    assert t.input_ids().tolist() == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError):
        t.response_ids[0] = 9  # read-only: nobody edits a trajectory downstream


@pytest.mark.parametrize("over, message", [
    (dict(logprobs=[-0.5, -0.25, 0.0, 0.0]), "logprobs has 4 entries, response_ids has 5"),
    (dict(versions=[0, 1, 0]), "versions has 3 entries"),
    (dict(response_mask=[1, 2, 0, 0, 1]), "other than 0 and 1"),
    (dict(logprobs=[-0.5, -0.25, -0.1, 0.0, -1.0]), "logprobs must be 0 where"),
    (dict(versions=[0, 1, 0, NO_VERSION, 2]), "versions must be -1 where"),
    (dict(versions=[0, NO_VERSION, NO_VERSION, NO_VERSION, 2]), "needs the weight version"),
    (dict(logprobs=[0.5, -0.25, 0.0, 0.0, -1.0]), "finite and <= 0"),
    (dict(prompt_ids=[]), "empty prompt_ids"),
    (dict(termination="exploded"), "not a valid TerminationReason"),
    (dict(response_ids=[[3, 4, 5, 6, 7]]), "1-D"),
])
def test_trajectory_rejects_misaligned_or_inconsistent_arrays(over, message):
    with pytest.raises(ValueError, match=message):
        make_traj(**over)


def test_every_termination_reason_exists():
    assert {r.value for r in TerminationReason} == {
        "finished", "max_turns", "max_tokens", "context_full", "timeout", "error", "deadline"}


def test_group_checks_membership_and_rewards():
    g = Group("t0", "g0", (make_traj(0, 1.0), make_traj(1, 0.0)))
    assert g.size == 2 and g.rewards().tolist() == [1.0, 0.0]
    assert g.oldest_version() == 0
    with pytest.raises(ValueError, match="no reward yet"):
        Group("t0", "g0", (make_traj(0), make_traj(1, 0.0))).rewards()
    with pytest.raises(ValueError, match="belongs to"):
        Group("t0", "g0", (make_traj(0), make_traj(1, group_id="g1")))
    with pytest.raises(ValueError, match="0..G-1"):
        Group("t0", "g0", (make_traj(0), make_traj(2)))
    with pytest.raises(ValueError, match="sample 0 has segments"):  # the same row twice
        Group("t0", "g0", (make_traj(0), make_traj(0)))
    with pytest.raises(ValueError, match="no trajectories"):
        Group("t0", "g0", ())


def test_task_and_messages_validate():
    call = ToolCall("python", {"code": "print(1)"})
    msg = Message("assistant", "", tool_calls=(call,))
    assert msg.to_template()["tool_calls"][0]["function"]["name"] == "python"
    with pytest.raises(ValueError, match="only assistant"):
        Message("user", "hi", tool_calls=(call,))
    with pytest.raises(ValueError, match="role"):
        Message("robot", "hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no messages"):
        Task("t", ())
    with pytest.raises(ValueError, match="non-empty"):
        Task("", (Message("user", "hi"),))


def test_types_are_slotted():
    t = make_traj()
    with pytest.raises((AttributeError, TypeError)):
        t.extra = 1  # type: ignore[attr-defined]


def test_grading_fields_under_their_old_names_still_work_with_a_warning():
    # The shim of one release (envs.types.Task): the fields that moved to GradingSpec, as
    # Task keywords and attributes, give the same Task as the new spelling, and warn.
    msgs = (Message("user", "fix it"),)
    new = Task("t", msgs, source_dir="/src", grading=GradingSpec(
        test_patch="diff --git a/t.py b/t.py\n", fail_to_pass=("t.py::test_a",),
        pass_to_pass=("t.py::test_b",)))
    with pytest.warns(DeprecationWarning, match=r"grading=GradingSpec\(test_patch=\.\.\., fail_to_pass="):
        old = Task("t", msgs, source_dir="/src", test_patch="diff --git a/t.py b/t.py\n",  # type: ignore[call-arg]
                   fail_to_pass=["t.py::test_a"], pass_to_pass=("t.py::test_b",))
    assert old == new and old.grading == new.grading
    with pytest.warns(DeprecationWarning, match=r"read task\.grading\.fail_to_pass"):
        assert old.fail_to_pass == ("t.py::test_a",)
    # Old keywords beside grading= (what dataclasses.replace passes) replace those fields.
    with pytest.warns(DeprecationWarning):
        moved = dataclasses.replace(new, pass_to_pass=())  # type: ignore[call-arg]
    assert moved.grading == dataclasses.replace(new.grading, pass_to_pass=())
    assert moved.source_dir == "/src" and moved.grading.fail_to_pass == ("t.py::test_a",)
    # The old spelling is still checked like the new one.
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="lists a test twice"):
        Task("t", msgs, source_dir="/src", fail_to_pass=("t.py::a", "t.py::a"))  # type: ignore[call-arg]


def test_task_fields_after_agent_loop_are_keyword_only():
    # A positional source_dir (its old place) fails loudly instead of landing in reward_fn.
    with pytest.raises(TypeError, match="positional"):
        Task("t", (Message("user", "x"),), (), None, None, "/src")  # type: ignore[misc]
