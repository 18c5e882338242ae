"""Rule verifiers (answer extraction, exact and numeric matching, hedging earns nothing),
the RewardFn plug-in point (resolution, result validation, the contract every built-in
rule verifier meets), the final-text helper, JUnit parsing and workspace hand-over."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from envs.sandbox.base import Snapshot
from reward.base import (REWARD_FNS, RewardContext, RewardFn, RewardResult, check_reward_fn,
                         last_model_text, load_reward_fn)
from reward.grading.junit import Outcome, junit_key, parse_junit
from reward.rules import ExactMatch, NumericMatch, extract_final_answer, parse_number
from reward.workspace import (WorkspaceChanges, changes_from_dir, changes_from_snapshot,
                              clean_relative_path)
from envs.types import NO_VERSION, Message, Task, Trajectory

TASK = Task("t", (Message("user", "q"),), answer="1234")


def traj(mask: list[int] | None = None, ids: list[int] | None = None) -> Trajectory:
    ids = ids or [10, 11, 12, 13, 14]
    mask = mask or [1, 1, 0, 1, 1]
    return Trajectory(task_id="t", group_id="g", index=0, prompt_ids=[1], response_ids=ids,
                      response_mask=mask, logprobs=[-0.1 if m else 0.0 for m in mask],
                      versions=[0 if m else NO_VERSION for m in mask], termination="finished")


async def score(fn: RewardFn, text: str, task: Task = TASK) -> RewardResult:
    return await fn(traj(), task, RewardContext(final_text=text))


@pytest.mark.parametrize("text, answer", [
    ("so it is \\boxed{1234}.", "1234"),
    ("\\boxed{\\frac{1}{2}} then \\boxed{x^{2}}", "x^{2}"),  # the last box, nested braces
    ("Answer: 42", "42"),
    ("**Final Answer:** 1,234.", "1,234"),
    ("The answer is 17.", "17"),
    ("answer:\n\n  99  \nthanks", "99"),  # value on the next non-empty line
    ("Answer: 5\nwait, Answer: 6", "6"),  # the last one
    ("I got 3 apples and then -12.5 more", "-12.5"),  # last number
    ("x = 6.02e23", "6.02e23"),
    ("<think>answer: 1</think>The answer is 2", "2"),  # thinking never counts
    ("reasoning with 7 ...</think> Answer: 8", "8"),  # template-opened thinking
    ('<tool_call>{"expression": "3*4"}</tool_call>', None),  # a tool call is no answer
    ("no digits here", None),
    ("\\boxed{unclosed 5", "5"),
])
def test_extract_final_answer(text: str, answer: str | None) -> None:
    assert extract_final_answer(text) == answer


def test_parse_number() -> None:
    assert parse_number("1,234") == 1234
    assert parse_number("3/4") * 4 == 3
    assert parse_number("-2.50") == parse_number("-5/2")
    assert parse_number("1e3") == 1000
    assert parse_number("1e99999999") is None  # would build a huge int: refused
    assert parse_number("12,34") is None and parse_number("abc") is None
    assert parse_number("1/0") is None


async def test_exact_match() -> None:
    fn = ExactMatch()
    assert (await score(fn, "Answer: 1,234")).reward == 1.0
    assert (await score(fn, "Answer: 1234.0")).reward == 1.0
    wrong = await score(fn, "Answer: 1235")
    assert wrong.reward == 0.0 and wrong.components == {"correct": 0.0, "answer_found": 1.0}
    none = await score(fn, "I don't know")
    assert none.components == {"correct": 0.0, "answer_found": 0.0}
    text_task = Task("t", (Message("user", "q"),), answer="Paris")
    assert (await score(fn, "Final answer:  paris", text_task)).reward == 1.0


@pytest.mark.parametrize("text", ["Answer: 1234 or 1235", "\\boxed{1235} \\boxed{1234 or 1}",
                                  "Answer: 1233, 1234, 1235", "1234 1235"])
async def test_hedged_answers_earn_nothing(text: str) -> None:
    assert (await score(ExactMatch(), text)).reward == 0.0
    assert (await score(NumericMatch(), text)).reward == 0.0


async def test_numeric_match_tolerance() -> None:
    task = Task("t", (Message("user", "q"),), answer="3.14159")
    assert (await score(NumericMatch(rel_tol=1e-3), "\\boxed{3.1416}", task)).reward == 1.0
    assert (await score(NumericMatch(), "\\boxed{3.1416}", task)).reward == 0.0
    assert (await score(NumericMatch(), "answer: 314159/100000", task)).reward == 1.0
    huge = await score(NumericMatch(), "Answer: 1e999", task)
    assert huge.reward == 0.0 and huge.components["answer_found"] == 1.0
    with pytest.raises(ValueError, match="tolerances"):
        NumericMatch(rel_tol=-1)


async def test_rule_verifiers_need_an_answer() -> None:
    bare = Task("t", (Message("user", "q"),))
    for fn in (ExactMatch(), NumericMatch()):
        with pytest.raises(ValueError, match="has no answer"):
            await score(fn, "1", bare)
    with pytest.raises(ValueError, match="is not a number"):
        await score(NumericMatch(), "1", Task("t", (Message("user", "q"),), answer="Paris"))


@pytest.mark.parametrize("name", ["reward.rules:ExactMatch", "reward.rules:NumericMatch"])
async def test_rule_builtins_meet_the_reward_fn_contract(name: str) -> None:
    fn = load_reward_fn(name)
    assert isinstance(fn, RewardFn)
    for text in ("", "Answer: 1234", "\x00\ufffd" * 1000, "\\boxed{" * 100):
        result = await score(fn, text)
        assert isinstance(result, RewardResult) and 0.0 <= result.reward <= 1.0
        assert set(result.components) == {"correct", "answer_found"}
        assert result == await score(fn, text)  # deterministic


def test_load_reward_fn_errors() -> None:
    assert set(REWARD_FNS.builtins.values()) == {
        "reward.rules:ExactMatch", "reward.rules:NumericMatch",
        "reward.grading.hidden_tests:HiddenTests", "reward.judge:GenerativeJudge"}
    for name, path in REWARD_FNS.builtins.items():  # the short name and the import string alike
        assert type(load_reward_fn(name)) is type(load_reward_fn(path))
        check_reward_fn(name)  # every built-in passes the plug-in point's contract check
    for bad, message in [("reward.rules.ExactMatch", "neither a built-in nor an import string"),
                         ("reward.nope:X", "cannot import 'reward.nope'"),
                         ("reward.rules:Nope", "has no attribute 'Nope'"),
                         ("reward.rules:MAX", "has no attribute"),
                         ("reward.rules:parse_number", "cannot be built without arguments"),
                         ("reward.base:RewardContext", "must define `async def __call__")]:
        with pytest.raises(ValueError, match=message):
            load_reward_fn(bad)


def test_reward_result_validates() -> None:
    r = RewardResult(1, {"a": True})
    assert r.reward == 1.0 and r.components == {"a": 1.0}
    with pytest.raises(ValueError, match="finite"):
        RewardResult(float("nan"))
    with pytest.raises(ValueError, match="not finite"):
        RewardResult(0.0, {"x": float("inf")})
    with pytest.raises(ValueError, match="timeout_s"):
        RewardContext(timeout_s=0)


def test_last_model_text_is_the_last_model_turn() -> None:
    decoded = []
    text = last_model_text(traj(), lambda ids: decoded.append(ids) or "final")
    assert text == "final" and decoded == [[13, 14]]
    assert last_model_text(traj(mask=[0, 0, 0, 0, 0]), lambda ids: "x") == ""
    assert last_model_text(traj(mask=[1, 1, 1, 0, 0]), lambda ids: str(ids)) == "[10, 11, 12]"


# --- JUnit --------------------------------------------------------------------------

JUNIT = b"""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>
<testcase classname="pkg.tests.test_a" name="test_ok" />
<testcase classname="pkg.tests.test_a.TestK" name="test_m[1-x::y]" />
<testcase classname="pkg.tests.test_a" name="test_f"><failure message="x"/></testcase>
<testcase classname="pkg.tests.test_a" name="test_e"><error message="x"/></testcase>
<testcase classname="pkg.tests.test_a" name="test_s"><skipped message="x"/></testcase>
<testcase classname="pkg.tests.test_a" name="test_dup" />
<testcase classname="pkg.tests.test_a" name="test_dup"><error message="teardown"/></testcase>
<testcase classname="pkg.tests.test_a" name="test_p[0]" />
<testcase classname="pkg.tests.test_a" name="test_p[1]"><failure/></testcase>
<testcase classname="pkg.tests.test_a" name="test_q[0]" />
<testcase classname="" name="pkg.tests.test_broken"><error message="collection failure"/></testcase>
</testsuite></testsuites>"""


def test_junit_keys_and_outcomes() -> None:
    assert junit_key("pkg/tests/test_a.py::TestK::test_m[1-x::y]") == ("pkg.tests.test_a.TestK",
                                                                        "test_m[1-x::y]")
    report = parse_junit(JUNIT)
    f = "pkg/tests/test_a.py::"
    assert [report.outcome(f + n) for n in ("test_ok", "TestK::test_m[1-x::y]", "test_f",
                                             "test_e", "test_s", "test_dup", "test_gone")] == [
        Outcome.PASSED, Outcome.PASSED, Outcome.FAILED, Outcome.ERROR, Outcome.SKIPPED,
        Outcome.ERROR, Outcome.MISSING]
    # A bare id of a parametrized test stands for all its cases.
    assert report.outcome(f + "test_p") is Outcome.FAILED
    assert report.outcome(f + "test_q") is Outcome.PASSED
    assert report.outcome(f + "test_q[1]") is Outcome.MISSING
    assert ("", "pkg.tests.test_broken") in report.keys_under("pkg.tests")
    assert report.keys_under("pkg.other") == []


@pytest.mark.parametrize("data, message", [
    (b"<testsuites><testcase", "not well-formed"),
    (b'<!DOCTYPE x [<!ENTITY a "aaaa">]><testsuites/>', "DTD"),
])
def test_junit_rejects_hostile_reports(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_junit(data)


# --- workspace hand-over ------------------------------------------------------------

def test_clean_relative_path() -> None:
    assert clean_relative_path("a/./b//c") == "a/b/c"
    for bad in ("", "/etc/passwd", "../x", "a/../../x", "a\\b", "a\0b", "."):
        assert clean_relative_path(bad) is None


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("A = 1\n")
    (src / "pkg" / "b.py").write_text("B = 1\n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref\n")
    return src


def test_changes_from_dir(tmp_path: Path) -> None:
    src = _source(tmp_path)
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "a.py").write_text("A = 2\n")  # changed; b.py deleted
    (ws / "new.py").write_text("N = 1\n")
    (ws / ".git").mkdir()
    (ws / ".git" / "HEAD").write_text("tampered\n")  # version control is never handed over
    os.symlink("/etc/passwd", ws / "link")
    changes = changes_from_dir(str(ws), str(src))
    assert changes.written == {"pkg/a.py": b"A = 2\n", "new.py": b"N = 1\n"}
    assert changes.deleted == ("pkg/b.py",)
    assert changes.skipped == ("link",)


def test_changes_from_a_hostile_snapshot_tar(tmp_path: Path) -> None:
    src = _source(tmp_path)
    tar_path = tmp_path / "snap.tar"
    with tarfile.open(tar_path, "w") as tar:
        def add(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.linkname = kind, len(data), link
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        add("pkg/a.py", b"A = 1\n")  # unchanged
        add("pkg/b.py", b"B = 2\n")
        add("../escape.py", b"x")
        add("/abs.py", b"x")
        add("pkg/link.py", kind=tarfile.SYMTYPE, link="/etc/shadow")
        add("fifo", kind=tarfile.FIFOTYPE)
    snapshot = Snapshot(str(tar_path), os.path.getsize(tar_path))
    changes = changes_from_snapshot(snapshot, str(src))
    assert changes.written == {"pkg/b.py": b"B = 2\n"}
    assert changes.deleted == ()
    assert set(changes.skipped) == {"../escape.py", "/abs.py", "pkg/link.py", "fifo"}
    snapshot.discard()
    with pytest.raises(ValueError, match="does not exist"):
        changes_from_snapshot(snapshot, str(src))


def test_changes_validate_paths() -> None:
    with pytest.raises(ValueError, match="clean relative path"):
        WorkspaceChanges(written={"../x": b""})
    with pytest.raises(ValueError, match="clean relative path"):
        WorkspaceChanges(deleted=("/x",))
