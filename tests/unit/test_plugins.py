"""The plug-in resolver (envs.plugins) and every plug-in point's table: each built-in lives in
the package that owns its point and passes that point's contract check."""

from __future__ import annotations

import pytest

from envs.plugins import PluginPoint, check_reference, signature_problem
from envs.sandbox.backends import SANDBOX_BACKENDS, load_sandbox_backend
from envs.tools.base import TOOLS, load_tool_class
from reward.base import REWARD_FNS, check_reward_fn
from rollout.agent_loop import AGENT_LOOPS, check_agent_loop
from trainer.train.backends import TRAIN_BACKENDS, load_train_backend

POINT = PluginPoint("widget", "widgets.kind", {"round": "envs.plugins:PluginPoint",
                                               "square": "envs.plugins:check_reference"})


def test_a_built_in_name_and_its_import_string_resolve_to_the_same_object():
    assert POINT.resolve("round") is POINT.resolve("envs.plugins:PluginPoint") is PluginPoint
    assert POINT.resolve("envs.plugins:PluginPoint.resolve") is PluginPoint.resolve  # dotted attr


@pytest.mark.parametrize("value,expected", [
    ("rund", "widget 'rund' is neither a built-in nor an import string; did you mean 'round'?; "
             "widgets.kind takes a built-in (round, square) or an import string "
             "'package.module:Class'"),
    ("no_such_pkg.mod:Widget", "widget 'no_such_pkg.mod:Widget': cannot import 'no_such_pkg.mod' "
                               "(No module named 'no_such_pkg'); widgets.kind takes a built-in"),
    ("envs.plugins:PluginPoin", "widget 'envs.plugins:PluginPoin': envs.plugins has no attribute "
                                "'PluginPoin'; did you mean 'envs.plugins:PluginPoint'?"),
])
def test_resolve_errors_name_the_key_and_the_closest_built_ins(value, expected):
    with pytest.raises(ValueError) as info:
        POINT.resolve(value)
    assert str(info.value).startswith(expected), str(info.value)
    assert POINT.check_name("round") is None and POINT.check_name("a.b:C") is None
    assert POINT.check_name("a.b.C") is not None


def test_the_bottom_layer_checks_only_the_shape_of_a_reference():
    assert check_reference("reward fn", "exact_match") is None
    assert check_reference("reward fn", "pkg.mod:Cls") is None
    assert "neither a built-in name nor an import string" in check_reference("reward fn", "a.b")


def test_signature_problem_names_what_the_contract_needs():
    def two(a, b):
        return a, b

    assert signature_problem(two, ("x", "y")) is None
    assert signature_problem(two, ("x",)) == "(a, b) must accept (x)"
    assert signature_problem(len, ("x",)) is None  # builtins without a signature pass


@pytest.mark.parametrize("point,package", [
    (AGENT_LOOPS, "rollout."), (REWARD_FNS, "reward."), (TOOLS, "envs.tools."),
    (SANDBOX_BACKENDS, "envs.sandbox."), (TRAIN_BACKENDS, "trainer.train.backends.")])
def test_every_built_in_lives_in_the_package_of_its_plug_in_point(point, package):
    # A built-in elsewhere would be an import edge the layering test cannot see.
    for name, path in point.builtins.items():
        assert path.startswith(package), (point.kind, name, path)


def test_every_built_in_passes_its_plug_in_points_contract_check():
    for name in AGENT_LOOPS.builtins:
        check_agent_loop(name)
    for name in REWARD_FNS.builtins:
        check_reward_fn(name)
    for name in TOOLS.builtins:
        load_tool_class(name, name)
    for name in SANDBOX_BACKENDS.builtins:
        load_sandbox_backend(name)
    for name in TRAIN_BACKENDS.builtins:  # inspected, never built: deepspeed stays out
        load_train_backend(name)
