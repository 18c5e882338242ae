"""The circuit breaker: signatures mask what varies per task, the breaker trips on a
repeated error or on nothing succeeding, a success resets it, and log lines are counted."""

from __future__ import annotations

import logging

import pytest

from buffer.breaker import FailureBreaker, failure_signature, group_failure
from envs.types import Group, Trajectory
from test_types import make_traj


def test_signatures_mask_names_numbers_and_paths_but_keep_the_error():
    a = failure_signature("ValueError: task 'a1' names unknown tools ['grep']; registered: ['bash']\ntb")
    b = failure_signature("ValueError: task 'b22' names unknown tools ['grep']; registered: ['bash']")
    assert a == b == "ValueError: task '…' names unknown tools ['…']; registered: ['…']"
    assert failure_signature("KeyError: 3") != failure_signature("ValueError: 3")


def test_trips_after_threshold_same_failures_and_resets_on_success():
    breaker = FailureBreaker(3)
    assert breaker.failed("E: x 'a'") is None and breaker.failed("E: x 'b'") is None
    breaker.succeeded()
    assert breaker.failed("E: x 'c'") is None and breaker.failed("E: x 'd'") is None
    tripped = breaker.failed("E: x 'e'")
    assert tripped is not None and tripped.count == 3 and "E: x 'c'" in tripped.example
    assert tripped.message().splitlines()[:2] == [
        "stopped: 3 groups in a row failed with the same error (buffer.max_repeated_failures=3); "
        "the first of them:", "  E: x 'c'"]


def test_the_stop_message_shows_the_error_as_it_was_not_its_masked_signature():
    breaker = FailureBreaker(2)
    breaker.failed("exceeded agent.trajectory_timeout_s=120 while tool 'sleepy' ran for 118 s")
    message = breaker.failed("exceeded agent.trajectory_timeout_s=120 while tool 'sleepy' ran for 119 s")
    assert message is not None
    assert "trajectory_timeout_s=120 while tool 'sleepy' ran for 118 s" in message.message()
    assert "=N" not in message.message() and "'…'" not in message.message()


def test_mixed_failures_trip_at_three_times_the_threshold():
    breaker = FailureBreaker(2)
    results = [breaker.failed(f"{kind}Error: boom") for kind in ["A", "B", "C", "D", "E", "F"]]
    assert results[:5] == [None] * 5 and results[5] is not None
    assert results[5].signature == "every group fails"
    text = results[5].message()
    assert text.startswith("stopped: no group succeeded in the last 6 (3 x "
                           "buffer.max_repeated_failures=2)")
    assert "(x1) AError: boom" in text and "'…'" not in text


def test_repeated_errors_cost_log_lines_in_log2(caplog):
    breaker = FailureBreaker(10_000)
    with caplog.at_level(logging.ERROR, logger="buffer.breaker"):
        for _ in range(1000):
            breaker.failed("RuntimeError: the same thing")
    assert len(caplog.records) == 10  # 1, 2, 4, ..., 512


def test_group_failure_only_when_every_trajectory_failed():
    def traj(i, reason):
        return Trajectory("t", "g", i, [1], [2], [1], [-0.5], [0], reason,
                          termination_detail="ValueError: reward boom 7")
    assert group_failure(Group("t", "g", (traj(0, "error"), traj(1, "finished")))) is None
    assert group_failure(Group("t", "g", (traj(0, "error"), traj(1, "timeout")))) == \
        "ValueError: reward boom N"
    with pytest.raises(ValueError, match="max_repeated_failures"):
        FailureBreaker(0)


def test_deadline_drops_trip_only_when_a_whole_admission_window_is_dropped():
    breaker = FailureBreaker(2, deadline_threshold=5)
    for _ in range(4):  # a burst of drops, more than max_repeated_failures: not a failure
        assert breaker.dropped_at_deadline("dropped at the deadline") is None
    breaker.succeeded()  # a group trained on: the window starts again
    for _ in range(4):
        assert breaker.dropped_at_deadline("dropped at the deadline") is None
    tripped = breaker.dropped_at_deadline("dropped at the deadline")
    assert tripped is not None and tripped.count == 5
    assert tripped.message().startswith("stopped: the last 5 groups to come back")


def test_a_group_its_deadline_cut_whole_is_not_a_failure():
    cut = Group("t0", "g0", tuple(make_traj(i, 0.0, termination="deadline") for i in range(2)))
    assert group_failure(cut) is None
