"""The Python snippets of docs/custom_agent.md are real code, and the loop it teaches works.

Each snippet runs by itself, imports included, and names nothing it does not define or
import (pyflakes); a snippet that shows an example file is that file, less its docstring;
and the from-scratch loop of "A loop from scratch" (examples/my_agent/hint_loop.py) does
what the page says on a scripted engine: a wrong answer gets the user's hint as context
(mask 0), the second answer is trained (mask 1), and the ids stay what the engine saw.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs.types import Message, Task, TerminationReason
from examples.my_agent.hint_loop import HINT
from rollout.agent_loop import check_agent_loop
from rollout.chat import check_continuity
from tests.unit import test_agent_loop as agent_loop_tests
from tests.unit.test_agent_loop import assert_continuity, make_worker
from tests.unit.test_docs_commands import ROOT, Block, code_blocks

GUIDE = ROOT / "docs" / "custom_agent.md"
EXAMPLE = ROOT / "examples" / "my_agent"
SNIPPETS = [block for block in code_blocks(GUIDE) if block.lang == "python"]
HINT_LOOP = "examples.my_agent.hint_loop:HintLoop"
TASK = Task("t0", (Message("system", "Answer."), Message("user", "Compute 2+3.")), answer="5")

tokenizer = agent_loop_tests.tokenizer  # the tiny model's tokenizer (a module fixture)


def code_of(block: Block) -> str:
    return "\n".join(block.lines) + "\n"


def body_of(path: Path) -> str:
    """The file less its module docstring: what the guide shows of it."""
    text = path.read_text()
    docstring_end = ast.parse(text).body[0].end_lineno
    return "\n".join(text.splitlines()[docstring_end:]).lstrip("\n") + "\n"


def shown_file(block: Block) -> Path | None:
    """The example file that defines the classes the snippet defines, if any."""
    classes = {node.name for node in ast.parse(code_of(block)).body if isinstance(node, ast.ClassDef)}
    for path in sorted(EXAMPLE.glob("*.py")):
        if classes and classes <= {node.name for node in ast.parse(path.read_text()).body
                                   if isinstance(node, ast.ClassDef)}:
            return path
    return None


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"custom_agent.md:{b.line}" for b in SNIPPETS])
def test_each_snippet_runs_by_itself(snippet):
    code = code_of(snippet)
    tree = ast.parse(code)  # compiles
    imports: list[ast.stmt] = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports, "a snippet names its imports"
    exec(compile(ast.Module(body=imports, type_ignores=[]), str(GUIDE), "exec"), {})
    exec(compile(code, f"{GUIDE}:{snippet.line}", "exec"), {"__name__": "snippet"})


def test_the_snippets_name_nothing_they_do_not_import(tmp_path):
    for block in SNIPPETS:
        (tmp_path / f"snippet_{block.line}.py").write_text(code_of(block))
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "F",
                           "--output-format", "concise", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"docs/custom_agent.md (snippet_<line>.py):\n{done.stdout}{done.stderr}"


def test_snippets_that_show_an_example_file_are_that_file():
    shown = {block.line: shown_file(block) for block in SNIPPETS}
    assert {p.name for p in shown.values() if p} == {"loop.py", "hint_loop.py", "reward.py", "tools.py"}
    for block in SNIPPETS:
        if (path := shown[block.line]) is not None:
            assert code_of(block) == body_of(path), f"custom_agent.md:{block.line} differs from {path.name}"
    text = GUIDE.read_text()
    section = text[text.index("### A loop from scratch"):text.index("\n## 3.")]
    assert f"```python\n{body_of(EXAMPLE / 'hint_loop.py')}```" in section


def test_the_hint_loop_passes_the_agent_loop_contract():
    check_agent_loop(HINT_LOOP)


async def test_a_wrong_answer_gets_a_hint_as_context_and_the_second_answer_is_trained(tokenizer):
    worker, engine = make_worker(tokenizer, ["Answer: 4", "Answer: 5"], default_loop=HINT_LOOP)
    traj = await worker.run_trajectory(TASK, "g", 0)
    assert traj.termination is TerminationReason.FINISHED and traj.reward == 1.0
    first, second = traj.turns
    ids, mask = traj.response_ids.tolist(), traj.response_mask
    hint = slice(first.num_generated, second.response_start)
    assert first.num_observation == second.response_start - first.num_generated > 0
    assert tokenizer.decode(ids[:first.num_generated]) == "Answer: 4<|im_end|>"
    assert tokenizer.decode(ids[hint]) == f"\n<|im_start|>user\n{HINT}<|im_end|>\n<|im_start|>assistant\n"
    assert np.all(mask[:first.num_generated] == 1) and np.all(mask[hint] == 0)
    assert np.all(mask[second.response_start:] == 1)
    assert tokenizer.decode(ids[second.response_start:]) == "Answer: 5<|im_end|>"
    assert [t.tool_parse_status for t in traj.turns] == ["no_call", "no_call"]
    assert_continuity(tokenizer, traj, engine)  # every prompt sent is a prefix of the trajectory
    # ... and the whole sequence is what the template renders for the conversation.
    conversation = [*TASK.messages, Message("assistant", "Answer: 4"), Message("user", HINT),
                    Message("assistant", "Answer: 5")]
    assert check_continuity(tokenizer, conversation, None, traj.input_ids().tolist()) is None


@pytest.mark.parametrize("script, reason, num_turns, reward", [
    (["Answer: 5"], TerminationReason.FINISHED, 1, 1.0),  # right at once: no hint
    (["Answer: 4", "Answer: 6"], TerminationReason.FINISHED, 2, 0.0),  # one hint, then it ends
    (["LENGTH:Answer: 4"], TerminationReason.MAX_TOKENS, 1, 0.0),  # cut off: no hint either
])
async def test_the_hint_loop_ends_with_the_right_reason(tokenizer, script, reason, num_turns, reward):
    worker, engine = make_worker(tokenizer, script, default_loop=HINT_LOOP)
    traj = await worker.run_trajectory(TASK, "g", 0)
    assert (traj.termination, len(traj.turns), traj.reward) == (reason, num_turns, reward)
    assert int((traj.response_mask == 0).sum()) == sum(t.num_observation for t in traj.turns)
    assert_continuity(tokenizer, traj, engine)
