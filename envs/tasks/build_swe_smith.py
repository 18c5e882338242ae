"""Build SWE-smith-style tasks offline from an installed open-source Python project.

    python -m envs.tasks.build_swe_smith OUT_DIR [--project hjson] [--max-tasks 20] [--images]

SWE-smith's recipe, on a project's released sources and tests as installed here: copy the
package, inject a bug into one function (a procedural mutation: an operator swapped, an
`if` inverted, an assignment removed, a constant shifted), run the project's own tests,
and keep the mutation when some tests that pass on the original now fail: those are
FAIL_TO_PASS, the ones passing on both are PASS_TO_PASS. The gold `patch` is the diff
that undoes the bug.

Output (the published SWE-smith row format, plus `repo_dir`, since the repository lives
on this machine rather than in an image):

    OUT_DIR/tasks.jsonl          one row per task: instance_id, repo, base_commit, patch,
                                 FAIL_TO_PASS, PASS_TO_PASS, problem_statement, image_name
                                 (null: local sandbox), test_patch "" (tests are in the repo)
    OUT_DIR/repos/<owner>__<name>  a git repository: the pristine release as one commit and
                                 one commit per bug on top of it (each task's base_commit);
                                 envs.tasks.swe exports a task's commit alone, so no agent
                                 sees the pristine tree.

Without --images the tasks run on the local sandbox backend (source_dir workspaces). With
--images every task gets its own container image (envs.tasks.images: a local root
filesystem, the project's pinned dependencies from the package index, the repository at
the task's base commit at /testbed), named in the row's `image_name` (SWE-smith's naming)
with `"workdir": "/testbed"`: the row is image-only, its repository lives in the image,
and it needs envs.sandbox_backend=container. Discovery runs the tests on this host with
the interpreter given (the builder's code is trusted: the bugs are ours); grading later
goes through the hardened path (`python -m reward.validate OUT_DIR/tasks.jsonl`).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Project:
    """An installed package whose released sources ship their tests."""

    repo: str  # upstream owner/name, as SWE-smith's `repo` field
    package: str  # the importable package, copied from where it is installed
    tests: str  # the test folder, relative to the repository root
    modules: tuple[str, ...]  # source files bugs are injected into
    drop: tuple[str, ...] = ()  # files removed from the copy (tests needing unshipped assets)
    requirements: tuple[str, ...] = ()  # pinned dependencies its image installs (name==version)


PROJECTS = {
    "hjson": Project(repo="hjson/hjson-py", package="hjson", tests="hjson/tests",
                     modules=("hjson/decoder.py", "hjson/encoder.py", "hjson/scanner.py",
                              "hjson/encoderH.py"),
                     drop=("hjson/tests/test_hjson.py",),  # reads assets the wheel omits
                     requirements=("pytest==9.2.0",)),
    "referencing": Project(repo="python-jsonschema/referencing", package="referencing",
                           tests="referencing/tests",
                           modules=("referencing/_core.py", "referencing/jsonschema.py",
                                    "referencing/retrieval.py"),
                           # needs the JSON-Schema-Test-Suite checkout, not in the wheel
                           drop=("referencing/tests/test_referencing_suite.py",),
                           requirements=("attrs==26.1.0", "rpds-py==2026.9.1",
                                         "typing-extensions==4.16.0", "pytest==9.2.0")),
}
IDENTITY = {"GIT_AUTHOR_NAME": "sluice", "GIT_AUTHOR_EMAIL": "sluice@localhost",
            "GIT_COMMITTER_NAME": "sluice", "GIT_COMMITTER_EMAIL": "sluice@localhost",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
            "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000"}
SET_NAME = "swe_smith_hjson"  # the built-in set (envs.tasks) these defaults build
BUNDLED_NUM_TASKS = 20
IMAGES_SET_NAME = "swe_smith_images"  # the built-in set with one image per task
IMAGES_SET_TASKS = {"hjson": 12, "referencing": 10}  # project -> tasks in that set
WORKDIR = "/testbed"
RESULT_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)")


@dataclass(frozen=True, slots=True)
class Bug:
    """One injected bug: where, what kind, and the file's buggy text."""

    module: str
    function: str
    kind: str
    buggy_text: str


# --- mutations: each takes a function's AST and changes one node in place (True if done)

_OP_SWAPS: dict[type, type] = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE,
                               ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                               ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Is: ast.IsNot,
                               ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
                               ast.And: ast.Or, ast.Or: ast.And}


def _op_swap(fn: ast.AST, rng: random.Random) -> bool:
    nodes = [n for n in ast.walk(fn) if isinstance(n, (ast.Compare, ast.BinOp, ast.BoolOp))
             and type(n.ops[0] if isinstance(n, ast.Compare) else n.op) in _OP_SWAPS]
    if not nodes:
        return False
    node = rng.choice(nodes)
    if isinstance(node, ast.Compare):
        node.ops[0] = _OP_SWAPS[type(node.ops[0])]()
    else:
        node.op = _OP_SWAPS[type(node.op)]()
    return True


def _invert_if(fn: ast.AST, rng: random.Random) -> bool:
    nodes = [n for n in ast.walk(fn) if isinstance(n, ast.If)]
    if not nodes:
        return False
    node = rng.choice(nodes)
    node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
    return True


def _remove_assign(fn: ast.AST, rng: random.Random) -> bool:
    bodies = [body for n in ast.walk(fn) if isinstance(body := getattr(n, "body", None), list)]
    spots = [(body, i) for body in bodies for i, stmt in enumerate(body)
             if isinstance(stmt, (ast.Assign, ast.AugAssign)) and len(body) > 1]
    if not spots:
        return False
    body, i = rng.choice(spots)
    del body[i]
    return True


def _shift_constant(fn: ast.AST, rng: random.Random) -> bool:
    spots = [(n, n.value) for n in ast.walk(fn) if isinstance(n, ast.Constant)
             and isinstance(n.value, int) and not isinstance(n.value, bool) and 0 <= n.value <= 16]
    if not spots:
        return False
    node, value = rng.choice(spots)
    node.value = value + 1
    return True


MUTATIONS: dict[str, Callable[[ast.AST, random.Random], bool]] = {
    "op_swap": _op_swap, "invert_if": _invert_if, "remove_assign": _remove_assign,
    "shift_constant": _shift_constant}


def candidate_bugs(root: str, project: Project, seed: int) -> Iterator[Bug]:
    """Mutations of the project's functions, in a seeded order; each rewrites one function
    and leaves the rest of its file byte-identical (a small gold patch)."""
    rng = random.Random(seed)
    spots = []
    for module in project.modules:
        text = open(os.path.join(root, module), encoding="utf-8").read()
        tree = ast.parse(text)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not fn.decorator_list:
                spots.extend((module, text, fn, kind) for kind in MUTATIONS)
    rng.shuffle(spots)
    for module, text, fn, kind in spots:
        mutated = copy.deepcopy(fn)
        if not MUTATIONS[kind](mutated, rng):
            continue
        lines = text.splitlines(keepends=True)
        indent = " " * fn.col_offset
        body = "".join(indent + line + "\n" if line else "\n"
                       for line in ast.unparse(mutated).splitlines())
        assert fn.end_lineno is not None
        buggy = "".join(lines[:fn.lineno - 1]) + body + "".join(lines[fn.end_lineno:])
        yield Bug(module, fn.name, kind, buggy)


def run_tests(root: str, project: Project, python: str, timeout_s: float = 120.0,
              ) -> dict[str, bool] | None:
    """Test id -> passed, from the project's suite run in `root`; None if the run did not
    complete (a collection error or a crash: such a mutation is discarded)."""
    try:
        proc = subprocess.run([python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                               "-o", "addopts=", project.tests], cwd=root, capture_output=True,
                              text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    except subprocess.TimeoutExpired:  # subprocess.run killed it
        return None
    if proc.returncode not in (0, 1):
        return None
    results = {}
    for line in proc.stdout.splitlines():
        match = RESULT_LINE.match(line)
        if match:
            results[match.group(2)] = match.group(1) in ("PASSED", "XFAIL")
    return results


def _git(repo: str, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": repo, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, **IDENTITY}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout


def copy_release(project: Project, dest: str) -> None:
    """The installed package (its released sources and tests) at dest/<package>."""
    module = __import__(project.package)
    src = os.path.dirname(os.path.abspath(module.__file__ or ""))
    shutil.copytree(src, os.path.join(dest, project.package),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for rel in project.drop:
        os.unlink(os.path.join(dest, rel))


def problem_statement(bug: Bug, fail_to_pass: list[str]) -> str:
    shown = ", ".join(f"`{t}`" for t in fail_to_pass[:3])
    more = f" and {len(fail_to_pass) - 3} more" if len(fail_to_pass) > 3 else ""
    return (f"`{bug.function}` in `{bug.module}` no longer behaves as documented. Tests that "
            f"used to pass now fail: {shown}{more}. Find and fix the bug in the library code.")


def build_tasks(out_dir: str, project_name: str = "hjson", max_tasks: int = 20,
                max_tries: int = 80, seed: int = 0, python: str = sys.executable,
                images: bool = False, archive: bool = False) -> list[dict]:
    """Build up to `max_tasks` tasks into out_dir (see the module docstring); the rows.
    `images`: one container image per task (`archive`: also saved for prewarm)."""
    project = PROJECTS[project_name]
    repo = os.path.join(out_dir, "repos", project.repo.replace("/", "__"))
    if os.path.exists(repo):
        raise ValueError(f"{repo} exists; pass an empty OUT_DIR (the builder never merges)")
    os.makedirs(repo)
    copy_release(project, repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "release")
    pristine = _git(repo, "rev-parse", "HEAD").strip()
    start = time.monotonic()
    baseline = run_tests(repo, project, python)
    # A mutation can loop forever (an inverted loop exit): a few baselines' time is enough.
    budget_s = max(10.0, 4 * (time.monotonic() - start))
    if not baseline:
        raise ValueError(f"the {project_name} test suite does not run here with {python}")
    passing = {t for t, ok in baseline.items() if ok}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sluice-smith-") as scratch:
        tree = os.path.join(scratch, "tree")
        shutil.copytree(repo, tree, ignore=shutil.ignore_patterns(".git"))
        for tries, bug in enumerate(candidate_bugs(repo, project, seed), 1):
            if len(rows) >= max_tasks or tries > max_tries:
                break
            start = time.monotonic()
            target = os.path.join(tree, bug.module)
            original = open(target, encoding="utf-8").read()
            with open(target, "w", encoding="utf-8") as f:
                f.write(bug.buggy_text)
            try:
                results = run_tests(tree, project, python, budget_s)
            finally:
                with open(target, "w", encoding="utf-8") as f:
                    f.write(original)
            if results is None:
                continue
            f2p = sorted(t for t in passing if results.get(t) is False)
            p2p = sorted(t for t in passing if results.get(t) is True)
            if not f2p:
                continue
            rows.append(_commit_task(repo, pristine, project, bug, f2p, p2p, len(rows)))
            log.info("task %d: %s.%s %s: %d F2P, %d P2P (%.1fs)", len(rows), bug.module,
                     bug.function, bug.kind, len(f2p), len(p2p), time.monotonic() - start)
    _git(repo, "checkout", "-q", pristine)  # the work tree shows no task's bug
    if images:
        rows = [with_image(row, repo, project, out_dir, archive) for row in rows]
    with open(os.path.join(out_dir, "tasks.jsonl"), "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def with_image(row: dict, repo: str, project: Project, out_dir: str, archive: bool) -> dict:
    """`row` as an image-only row: its task's image built (the repository at its base
    commit at /testbed) and named in `image_name`."""
    from envs.sandbox.engine import detect_engine
    from envs.tasks.images import ImageSpec, build_image_for

    spec = ImageSpec(row["instance_id"], project.repo, row["base_commit"], repo,
                     project.package, project.requirements)
    name = build_image_for(detect_engine(), spec, out_dir, archive=archive)
    return {**row, "image_name": name, "workdir": WORKDIR}


def bundled_image_set_dir(cache_dir: str) -> str:
    """Where the built-in set IMAGES_SET_NAME is built under `cache_dir` (keyed by the
    projects' versions); it exists once built."""
    from importlib.metadata import version

    versions = "-".join(f"{p}{version(PROJECTS[p].package)}x{n}"
                        for p, n in sorted(IMAGES_SET_TASKS.items()))
    return os.path.join(cache_dir, "swe_smith", f"images-{versions}-seed0")


def build_bundled_image_set(cache_dir: str) -> str:
    """The tasks.jsonl of the built-in set IMAGES_SET_NAME (several projects, one image per
    task), built once under `cache_dir`; images missing from this host's storage (a
    cleaned podman store) are rebuilt from the cached repositories."""
    from envs.cache import build_once

    dest = bundled_image_set_dir(cache_dir)
    build_once(dest, _build_image_set, f"the built-in task set {IMAGES_SET_NAME} ("
               f"{sum(IMAGES_SET_TASKS.values())} tasks: each mutation's tests run to keep only "
               "real bugs, then one image a task; minutes to tens of minutes)")
    path = os.path.join(dest, "tasks.jsonl")
    _ensure_images(dest, path)
    return path


def _build_image_set(out_dir: str) -> None:
    rows = []
    for name, num in sorted(IMAGES_SET_TASKS.items()):
        sub = os.path.join(out_dir, name)
        built = build_tasks(sub, name, num, images=True)
        if not built:
            raise ValueError(f"no {name} task could be built for {IMAGES_SET_NAME}")
        rows += built
    with open(os.path.join(out_dir, "tasks.jsonl"), "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _ensure_images(out_dir: str, path: str) -> None:
    """Every row's image present and built on its project's current image (rebuilt from
    the cached repositories otherwise); one listing of the storage checks them all."""
    from envs.sandbox.engine import detect_engine, run_engine
    from envs.tasks.images import ensure_project_image

    engine = detect_engine()
    listed = run_engine(engine, "images", "--filter", "label=sluice.parent", "--format",
                        '{{.Repository}} {{index .Labels "sluice.parent"}}')
    parents = dict(line.split(" ", 1) for line in listed.splitlines() if " " in line)
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by_repo = {p.repo: (n, p) for n, p in PROJECTS.items()}
    project_images: dict[str, str] = {}
    for row in rows:
        name, project = by_repo[row["repo"]]
        if name not in project_images:
            project_images[name] = ensure_project_image(engine, project.package,
                                                        project.requirements)
        if parents.get(row["image_name"]) != project_images[name]:
            repo = os.path.join(out_dir, name, "repos", project.repo.replace("/", "__"))
            with_image(row, repo, project, os.path.join(out_dir, name), archive=False)


def bundled_set_dir(cache_dir: str) -> str:
    """Where the built-in set SET_NAME is built under `cache_dir`; it exists once built."""
    version = getattr(__import__(PROJECTS["hjson"].package), "__version__", "unknown")
    return os.path.join(cache_dir, "swe_smith", f"hjson-{version}-seed0-{BUNDLED_NUM_TASKS}")


def build_bundled_set(cache_dir: str) -> str:
    """The tasks.jsonl of the built-in set SET_NAME, built once under `cache_dir`."""
    from envs.cache import build_once

    dest = bundled_set_dir(cache_dir)
    build_once(dest, lambda tmp: _build_nonempty(tmp),
               f"the built-in task set {SET_NAME} ({BUNDLED_NUM_TASKS} tasks: each mutation's "
               "tests run to keep only real bugs; minutes)")
    return os.path.join(dest, "tasks.jsonl")


def _build_nonempty(out_dir: str) -> None:
    if not build_tasks(out_dir, "hjson", BUNDLED_NUM_TASKS):
        raise ValueError(f"no {SET_NAME} task could be built here; run python -m "
                         "envs.tasks.build_swe_smith OUT_DIR to see why")


def _commit_task(repo: str, pristine: str, project: Project, bug: Bug, f2p: list[str],
                 p2p: list[str], index: int) -> dict:
    _git(repo, "checkout", "-q", "--detach", pristine)
    with open(os.path.join(repo, bug.module), "w", encoding="utf-8") as f:
        f.write(bug.buggy_text)
    _git(repo, "commit", "-q", "-am", f"inject {bug.kind} into {bug.function}")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    gold = _git(repo, "diff", commit, pristine)
    name = project.repo.replace("/", "__")
    instance_id = f"{name}.{bug.kind}__{index:03d}"
    _git(repo, "tag", instance_id)  # keeps the commit reachable (SWE-smith: a branch per bug)
    return {"instance_id": instance_id, "repo": project.repo, "base_commit": commit,
            "patch": gold, "test_patch": "", "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
            "problem_statement": problem_statement(bug, f2p), "image_name": None,
            "bug_kind": bug.kind, "bug_location": f"{bug.module}::{bug.function}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--project", default="hjson", choices=sorted(PROJECTS))
    parser.add_argument("--max-tasks", type=int, default=20)
    parser.add_argument("--max-tries", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", action="store_true",
                        help="build one container image per task (podman), image-only rows")
    parser.add_argument("--archive", action="store_true",
                        help="with --images: also `podman save` each image for prewarm")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    rows = build_tasks(args.out_dir, args.project, args.max_tasks, args.max_tries, args.seed,
                       images=args.images, archive=args.archive)
    print(f"{len(rows)} tasks in {os.path.join(args.out_dir, 'tasks.jsonl')} "
          f"({time.monotonic() - start:.0f}s)")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
