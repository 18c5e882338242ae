"""The quickstart's warm-start demonstrations: careful and sloppy python calls in the
real tool's output format, answers that copy what the tool printed."""

from __future__ import annotations

import re

from envs.tools.calculator import evaluate_arithmetic
from launch.quickstart import SLOPPY_FRACTION, build_demonstrations


def test_demonstrations_call_the_tool_carefully_or_sloppily_and_copy_its_output():
    demos = build_demonstrations("toy_arithmetic_easy", max_observation_tokens=256)
    careful = 0
    for demo in demos:
        user, call, tool, answer = [m for m in demo.messages if m.role != "system"]
        expression = re.fullmatch(r"What is (.+)\? Reply.*", user.content)[1]
        printed = re.fullmatch(r"print\((.+)\)", call.tool_calls[0].arguments["code"])[1]
        shown = re.search(r"stdout:\n(-?\d+)\n", tool.content)[1]
        assert answer.content == f"Answer: {shown}"  # always a copy of the tool's output
        if printed == expression:
            careful += 1
            assert int(shown) == evaluate_arithmetic(expression)
        else:
            assert printed == shown == expression.split(" ")[0]  # the first number only
    assert abs(1 - careful / len(demos) - SLOPPY_FRACTION) < 0.05
