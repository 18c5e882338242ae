"""A small repository that is not graded by pytest, and SWE-bench-format rows for it:

    python -m envs.tasks.build_runner_tasks OUT_DIR [--images] [--runner bin/test]

The repository (`minitext`, a few text helpers) has django's layout: the package at the
top, tests as modules of app folders under tests/, and its own runner `tests/runtests.py`
(unittest, `--verbosity 2`, test labels as module names), which prints one
`test_x (app.module.Class.test_x) ... ok|FAIL|ERROR` line per test: the output
swebench's `parse_log_django` reads. Each row is an instance the way SWE-bench publishes
them (5.x fields included): the base commit carries one bug, `test_patch` adds the
regression tests that catch it (FAIL_TO_PASS), the existing tests are PASS_TO_PASS,
`patch` is the fix, `eval_script` runs the runner between SWE-bench's markers and
`log_parser` names the parser. FAIL_TO_PASS / PASS_TO_PASS are found by running the
runner here and reading its output with that same parser.

`--runner bin/test` makes the rows run the suite the way sympy's do, through a script
outside the test folders (`bin/test`, which imports its sibling `bin/suite_paths.py`
and then the runner): the shape whose script grading must protect by the command
itself (reward.grading.runner_tests), since no folder name marks it as a test file.

With --images each row also gets its own image (envs.tasks.images: base + the repository
at the base commit at /testbed, no dependencies) and `"workdir": "/testbed"`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from envs.tasks.build_swe_smith import IDENTITY, WORKDIR

log = logging.getLogger(__name__)

REPO = "sluice-examples/minitext"
LOG_PARSER = "parse_log_django"
TEST_MODULES = ("text_tests.tests", "text_tests.test_regressions")
RUNNERS = ("tests/runtests.py", "bin/test")  # the scripts a row's command may run
TEST_COMMAND = "python3 tests/runtests.py --verbosity 2 " + " ".join(TEST_MODULES)
REGRESSIONS = "tests/text_tests/test_regressions.py"

TEXT = '''\
"""Small text helpers."""

import re


def slugify(value):
    value = re.sub(r"[^\\w\\s-]", "", value.lower())
    return re.sub(r"[-\\s]+", "-", value).strip("-_")


def truncate_words(text, num, suffix="..."):
    words = text.split()
    if len(words) <= num:
        return " ".join(words)
    return " ".join(words[:num]) + suffix


def camel_to_snake(name):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def capfirst(value):
    return value[:1].upper() + value[1:] if value else value


def get_text_list(items, last_word="or"):
    if not items:
        return ""
    if len(items) == 1:
        return str(items[0])
    return "%s %s %s" % (", ".join(str(i) for i in items[:-1]), last_word, items[-1])
'''

EXISTING_TESTS = '''\
import unittest

from minitext.text import camel_to_snake, capfirst, get_text_list, slugify, truncate_words


class SlugifyTests(unittest.TestCase):
    def test_lowercases(self):
        self.assertEqual(slugify("abc"), "abc")

    def test_spaces(self):
        self.assertEqual(slugify("a b"), "a-b")


class TruncateTests(unittest.TestCase):
    def test_short(self):
        self.assertEqual(truncate_words("a b", 5), "a b")

    def test_long(self):
        self.assertEqual(truncate_words("a b c d", 2), "a b...")


class CamelTests(unittest.TestCase):
    def test_inner_capital(self):
        self.assertEqual(camel_to_snake("camelCase"), "camel_case")


class CapfirstTests(unittest.TestCase):
    def test_empty(self):
        self.assertEqual(capfirst(""), "")


class TextListTests(unittest.TestCase):
    def test_single(self):
        self.assertEqual(get_text_list(["a"]), "a")

    def test_empty(self):
        self.assertEqual(get_text_list([]), "")
'''

RUNTESTS = '''\
#!/usr/bin/env python3
"""The repository's own test runner (django-style): test labels are module names
under tests/."""
import argparse
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("labels", nargs="+")
    parser.add_argument("--verbosity", type=int, default=1)
    args = parser.parse_args()
    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    suite = unittest.defaultTestLoader.loadTestsFromNames(args.labels)
    result = unittest.TextTestRunner(verbosity=args.verbosity).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
'''

BIN_TEST = '''#!/usr/bin/env python3
"""Runs the test suite from the repository root, as sympy's bin/test does:
bin/test [--verbosity N] LABEL..."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite_paths import runner_dir  # noqa: E402

sys.path.insert(0, runner_dir())
import runtests  # noqa: E402

if __name__ == "__main__":
    sys.exit(runtests.main())
'''

SUITE_PATHS = '''"""Where bin/test finds the runner."""
import os


def runner_dir():
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
'''


@dataclass(frozen=True, slots=True)
class RunnerBug:
    function: str
    wrong: str  # the line of TEXT the bug replaces ...
    buggy: str  # ... and what replaces it
    regression: str  # the test class test_patch adds
    issue: str


BUGS = (
    RunnerBug("slugify", '    return re.sub(r"[-\\s]+", "-", value).strip("-_")',
              '    return re.sub(r"[-\\s]+", "-", value)',
              '''class SlugifyEdgeTests(unittest.TestCase):
    def test_strips_edges(self):
        self.assertEqual(slugify(" Hello World! "), "hello-world")
''', "slugify(' Hello World! ') returns '-hello-world-'; leading and trailing dashes "
        "should be stripped."),
    RunnerBug("truncate_words", "    if len(words) <= num:", "    if len(words) < num:",
              '''class TruncateExactTests(unittest.TestCase):
    def test_exact_length(self):
        self.assertEqual(truncate_words("a b c", 3), "a b c")
''', "truncate_words adds the suffix to a text that has exactly `num` words."),
    RunnerBug("camel_to_snake", '    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()',
              '    return re.sub(r"(?=[A-Z])", "_", name).lower()',
              '''class CamelLeadingTests(unittest.TestCase):
    def test_leading_capital(self):
        self.assertEqual(camel_to_snake("CamelCase"), "camel_case")
''', "camel_to_snake('CamelCase') gives '_camel_case' instead of 'camel_case'."),
    RunnerBug("capfirst", "    return value[:1].upper() + value[1:] if value else value",
              "    return value[:1].upper() + value[2:] if value else value",
              '''class CapfirstWordTests(unittest.TestCase):
    def test_capitalises(self):
        self.assertEqual(capfirst("hello"), "Hello")
''', "capfirst('hello') returns 'Hllo': a letter is lost."),
    RunnerBug("get_text_list",
              '    return "%s %s %s" % (", ".join(str(i) for i in items[:-1]), last_word, items[-1])',
              '    return "%s or %s" % (", ".join(str(i) for i in items[:-1]), items[-1])',
              '''class TextListWordTests(unittest.TestCase):
    def test_last_word(self):
        self.assertEqual(get_text_list(["a", "b"], "and"), "a and b")
''', "get_text_list ignores its last_word argument and always says 'or'."),
)


def regression_module(bug: RunnerBug) -> str:
    return ("import unittest\n\nfrom minitext.text import camel_to_snake, capfirst, "
            "get_text_list, slugify, truncate_words  # noqa: F401\n\n\n" + bug.regression)


def new_file_patch(path: str, text: str) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..1111111\n"
            f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}")


def test_command(runner: str = RUNNERS[0]) -> str:
    """The rows' test command through the runner script `runner` (one of RUNNERS)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner {runner!r} is not one of {RUNNERS}")
    return f"python3 {runner} --verbosity 2 " + " ".join(TEST_MODULES)


def eval_script(base_commit: str, test_patch: str, command: str = TEST_COMMAND) -> str:
    """SWE-bench 5.x's eval_script shape: reset the test files, apply the test patch, run
    the tests between the markers, reset again."""
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "cd /testbed",
        f"git checkout {base_commit} {REGRESSIONS} 2>/dev/null || rm -f {REGRESSIONS}",
        "git apply -v - <<'EOF_114329324912'", test_patch.rstrip("\n"), "EOF_114329324912",
        ": '>>>>> Start Test Output'", command, ": '>>>>> End Test Output'",
        f"rm -f {REGRESSIONS}"])


def _git(repo: str, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": repo, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, **IDENTITY}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout


def write_release(repo: str) -> None:
    files = {"minitext/__init__.py": "", "minitext/text.py": TEXT,
             "tests/__init__.py": "", "tests/runtests.py": RUNTESTS,
             "bin/test": BIN_TEST, "bin/suite_paths.py": SUITE_PATHS,
             "tests/text_tests/__init__.py": "", "tests/text_tests/tests.py": EXISTING_TESTS,
             "README.md": "minitext: text helpers. Run the tests with "
                          "`python3 tests/runtests.py --verbosity 2 text_tests.tests`.\n"}
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(repo, rel)), exist_ok=True)
        with open(os.path.join(repo, rel), "w", encoding="utf-8") as f:
            f.write(text)
    for script in RUNNERS:
        os.chmod(os.path.join(repo, script), 0o755)


def run_statuses(tree: str, python: str) -> dict[str, str]:
    """The runner's results in `tree`, read by swebench's parser."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    proc = subprocess.run([python, "tests/runtests.py", "--verbosity", "2", *TEST_MODULES],
                          cwd=tree, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    # swebench types every parser's test spec as required; django's never reads it.
    return PARSER_REGISTRY[LOG_PARSER](proc.stdout + proc.stderr, None)  # pyrefly: ignore[bad-argument-type]


def build_runner_tasks(out_dir: str, images: bool = False, python: str = "/usr/bin/python3",
                       runner: str = RUNNERS[0]) -> list[dict]:
    command = test_command(runner)
    repo = os.path.join(out_dir, "repos", REPO.replace("/", "__"))
    if os.path.exists(repo):
        raise ValueError(f"{repo} exists; pass an empty OUT_DIR")
    os.makedirs(repo)
    write_release(repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "release")
    pristine = _git(repo, "rev-parse", "HEAD").strip()
    rows = []
    for index, bug in enumerate(BUGS, 1):
        assert bug.wrong in TEXT, bug.function
        _git(repo, "checkout", "-q", "--detach", pristine)
        with open(os.path.join(repo, "minitext/text.py"), "w", encoding="utf-8") as f:
            f.write(TEXT.replace(bug.wrong, bug.buggy))
        _git(repo, "commit", "-q", "-am", f"break {bug.function}")
        base = _git(repo, "rev-parse", "HEAD").strip()
        instance_id = f"sluice-examples__minitext-{index}"
        _git(repo, "tag", instance_id)
        gold = _git(repo, "diff", base, pristine)
        module = regression_module(bug)
        with tempfile.TemporaryDirectory(prefix="sluice-runner-") as tmp:
            tree = os.path.join(tmp, "tree")
            shutil.copytree(repo, tree, ignore=shutil.ignore_patterns(".git"))
            with open(os.path.join(tree, REGRESSIONS), "w", encoding="utf-8") as f:
                f.write(module)
            before = run_statuses(tree, python)
            with open(os.path.join(tree, "minitext/text.py"), "w", encoding="utf-8") as f:
                f.write(TEXT)
            after = run_statuses(tree, python)
        f2p = sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) != "PASSED")
        p2p = sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) == "PASSED")
        if not f2p:
            raise ValueError(f"bug {bug.function}: no regression test fails before the fix")
        test_patch = new_file_patch(REGRESSIONS, module)
        rows.append({
            "instance_id": instance_id, "repo": REPO, "base_commit": base, "patch": gold,
            "test_patch": test_patch,
            "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p),
            "version": "0.1", "environment_setup_commit": pristine,
            "problem_statement": bug.issue, "hints_text": "", "created_at": "2000-01-01",
            "eval_script": eval_script(base, test_patch, command), "log_parser": LOG_PARSER,
            "eval_type": "pass_and_fail"})
        log.info("%s: %s, %d F2P, %d P2P", instance_id, bug.function, len(f2p), len(p2p))
    _git(repo, "checkout", "-q", pristine)
    if images:
        rows = [_with_image(row, repo, out_dir) for row in rows]
    with open(os.path.join(out_dir, "tasks.jsonl"), "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def _with_image(row: dict, repo: str, out_dir: str) -> dict:
    from envs.sandbox.engine import detect_engine
    from envs.tasks.images import ImageSpec, build_image_for

    spec = ImageSpec(row["instance_id"], REPO, row["base_commit"], repo, "minitext")
    return {**row, "image": build_image_for(detect_engine(), spec, out_dir), "workdir": WORKDIR}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--images", action="store_true", help="one podman image per row")
    parser.add_argument("--runner", default=RUNNERS[0], choices=RUNNERS,
                        help="the script the rows' command runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    rows = build_runner_tasks(args.out_dir, images=args.images, runner=args.runner)
    print(f"{len(rows)} rows in {os.path.join(args.out_dir, 'tasks.jsonl')} "
          f"({time.monotonic() - start:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
