"""SWE-bench-style instances -> Tasks: a repository at a base commit, an issue text, a test
patch and the FAIL_TO_PASS / PASS_TO_PASS pytest node ids.

Row fields (SWE-bench's names; others such as the gold `patch`, `hints_text`, `version`,
`environment_setup_commit` are ignored and never reach the agent):

    instance_id, problem_statement, base_commit, test_patch, FAIL_TO_PASS, PASS_TO_PASS
    repo_dir   local repository or snapshot folder (relative to the task file); default
               <task file folder>/repos/<repo with '/' as '__'>
    tools      optional tool names (default SWE_TOOLS)
    workdir    where the image keeps the repository (image-only rows; default /testbed)
    requirements   pinned pip requirements of the row's image (read only by
               `python -m envs.tasks.images build`, which builds it)
    test_cmd / eval_script, log_parser   rows graded by the repository's own runner: the
               command (ours, or the lines between SWE-bench 5.x's eval_script markers)
               and the swebench parser of its output (default: swebench's parser of `repo`)

The published variants read the same way (FIELD_ALIASES): SWE-Gym uses SWE-bench's names;
SWE-smith rows name their image in `image_name` and carry no `test_patch` (the bug is
injected, the repository's own tests catch it; a local row says so with "test_patch": "");
R2E-Gym rows use `docker_image`, `repo_name` and `commit_hash`. A row's image becomes
Task.image. A row with an image and no local repository folder, or with a `workdir` (ours:
where the image keeps the repository), is an image-only task (source_dir None,
Task.workdir = `workdir`, default IMAGE_WORKDIR): its repository lives in the image, and the container backend seeds the
workspace from there and mounts it at that path (envs.sandbox.images); the prompt names
that path.

The agent's copy holds no history after the base commit, nor before it: the base
commit's tree is exported through a temporary index (`git read-tree` + `checkout-index`,
which, unlike `git archive`, ignores export-ignore/export-subst attributes and so gives
the exact tree) into a fresh folder that becomes a new repository with one commit. No
object, ref, reflog or remote of the source repository is copied, so no later commit
(the fix) can be reached; the agent still gets `git diff`/`git status` against the base.
A snapshot folder that is not a git repository is copied as is (without any .git).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping

from envs.cache import build_once
from envs.sandbox.base import WORKSPACE_MOUNT
from envs.tasks.rows import Row, RowRef, get_str, get_str_list
from envs.types import GradingSpec, Message, Task

SWE_TOOLS = ("bash", "read_file", "write_file", "str_replace", "submit")
IMAGE_WORKDIR = "/testbed"  # where SWE-bench, SWE-Gym and SWE-smith images keep the repository
SYSTEM_PROMPT = ("You are an expert software engineer working in a sandbox. The repository is "
                 "at {workdir}; use the tools to inspect and edit it.")
PROMPT = ("Resolve the issue below by changing the repository's source code in {workdir} "
          "(a git repository at the commit the issue was reported against). Do not modify "
          "or add tests: hidden tests will check your change. Call submit when you are done."
          "\n\n<issue>\n{problem_statement}\n</issue>")
BASE_DATE = "2000-01-01T00:00:00+0000"  # fixed, so the same tree gives the same commit id


# Task attribute -> the row fields that give it, first present wins.
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "image": ("image_name", "docker_image", "image"),  # SWE-smith, R2E-Gym, ours
    "repo": ("repo", "repo_name"),  # SWE-bench/SWE-Gym/SWE-smith, R2E-Gym
    "base_commit": ("base_commit", "commit_hash"),  # SWE-bench, R2E-Gym
}


def is_swe_row(row: Row) -> bool:
    return "problem_statement" in row and ("instance_id" in row or "docker_image" in row)


def aliased_field(ref: RowRef, row: Row, name: str) -> str | None:
    """The value of the first of `name`'s FIELD_ALIASES that the row has."""
    for field in FIELD_ALIASES[name]:
        value = get_str(ref, row, field)
        if value is not None:
            return value
    return None


START_TEST_OUTPUT, END_TEST_OUTPUT = ">>>>> Start Test Output", ">>>>> End Test Output"


def test_command_from_eval_script(script: str) -> str | None:
    """The test command of a SWE-bench (5.x) `eval_script`: its lines between the start
    and end markers (the reset and test-patch lines around them are grading's own steps
    here); None without the markers."""
    lines = script.splitlines()
    start = next((i for i, line in enumerate(lines) if START_TEST_OUTPUT in line), None)
    end = next((i for i, line in enumerate(lines) if END_TEST_OUTPUT in line), None)
    if start is None or end is None or end <= start + 1:
        return None
    return "\n".join(lines[start + 1:end]).strip() or None


def _runner(ref: RowRef, row: Row) -> tuple[str | None, str | None]:
    """(test command, swebench log parser) of a row graded by its repository's own runner:
    `test_cmd` (ours) or SWE-bench's `eval_script`; the parser from `log_parser`, else the
    one swebench maps the row's `repo` to. (None, None) for a pytest-node-id row."""
    command = get_str(ref, row, "test_cmd")
    eval_script = get_str(ref, row, "eval_script")
    if command is None and eval_script is not None:
        command = test_command_from_eval_script(eval_script)
        if command is None:
            raise ref.error("eval_script", f"has no test command between the "
                            f"{START_TEST_OUTPUT!r} and {END_TEST_OUTPUT!r} markers")
    parser = get_str(ref, row, "log_parser")
    if command is None:
        if parser is not None:
            raise ref.error("log_parser", "needs the test command (test_cmd or eval_script)")
        return None, None
    if parser is None:
        repo = aliased_field(ref, row, "repo")
        try:  # deferred: only rows graded through swebench's parsers need the package
            from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY
        except ImportError:
            raise ref.error("log_parser", "is not given and the swebench package that maps "
                            "repositories to parsers is not installed") from None
        if repo not in MAP_REPO_TO_PARSER_PY:
            raise ref.error("log_parser", f"is required: swebench has no parser for repo "
                            f"{repo!r}; name one, e.g. parse_log_django or parse_log_pytest")
        parser = MAP_REPO_TO_PARSER_PY[repo].__name__
    return command, parser


def swe_task_from_row(ref: RowRef, row: Row, cache_dir: str) -> Task:
    image = aliased_field(ref, row, "image")
    # R2E-Gym rows have no instance id: their image names the instance.
    instance_id = get_str(ref, row, "instance_id", required="docker_image" not in row) or image
    problem = get_str(ref, row, "problem_statement", required=True)
    # SWE-smith injects bugs into the repository's own tested code: no test patch (an
    # `image_name` row, or "test_patch": "" for a local one whose tests are in the repo).
    test_patch = get_str(ref, row, "test_patch",
                         required="image_name" not in row and row.get("test_patch") != "")
    fail_to_pass = get_str_list(ref, row, "FAIL_TO_PASS")
    if not fail_to_pass:
        raise ref.error("FAIL_TO_PASS", "is empty; an instance needs at least one test that the "
                        "fix makes pass")
    workdir = get_str(ref, row, "workdir")
    if workdir is not None and (image is None or not workdir.startswith("/")):
        raise ref.error("workdir", "is the absolute path of the repository inside the row's "
                        "image (e.g. /testbed); it needs image_name / docker_image")
    repo_dir = None if workdir is not None else find_repo_dir(ref, row, optional=image is not None)
    if repo_dir is None and image is not None:
        workdir = workdir or IMAGE_WORKDIR
    base_commit = aliased_field(ref, row, "base_commit")
    source = None
    if repo_dir is not None:
        try:
            source = export_base_snapshot(repo_dir, base_commit, cache_dir, str(instance_id))
        except ValueError as exc:
            raise ref.error("base_commit" if base_commit else "repo_dir", str(exc)) from None
    assert instance_id is not None and problem is not None
    shown = workdir or WORKSPACE_MOUNT
    test_command, log_parser = _runner(ref, row)
    try:
        return Task(id=instance_id, tools=get_str_list(ref, row, "tools") or SWE_TOOLS,
                    messages=(Message("system", SYSTEM_PROMPT.format(workdir=shown)),
                              Message("user", PROMPT.format(problem_statement=problem.strip(),
                                                            workdir=shown))),
                    source_dir=source, image=image, workdir=workdir,
                    grading=GradingSpec(test_patch=test_patch or None, fail_to_pass=fail_to_pass,
                                        pass_to_pass=get_str_list(ref, row, "PASS_TO_PASS"),
                                        test_command=test_command, log_parser=log_parser),
                    reward_fn="reward.grading.hidden_tests:HiddenTests")
    except ValueError as exc:
        raise ref.error(None, str(exc)) from None


def find_repo_dir(ref: RowRef, row: Row, optional: bool = False) -> str | None:
    """The local repository folder; None for an image-only row (`optional`) that names
    none and has none at the default place."""
    value = get_str(ref, row, "repo_dir")
    if value is None:
        repo = aliased_field(ref, row, "repo")
        if repo is None:
            if optional:
                return None
            raise ref.error("repo_dir", "is required (or 'repo', looked up as "
                            "repos/<owner>__<name> next to the task file)")
        value = os.path.join("repos", repo.replace("/", "__"))
        if optional and not os.path.isdir(os.path.join(ref.base_dir, value)):
            return None
    path = value if os.path.isabs(value) else os.path.join(ref.base_dir, value)
    if not os.path.isdir(path):
        raise ref.error("repo_dir", f"folder {path!r} does not exist; point repo_dir at a local "
                        "clone or snapshot of the repository")
    return os.path.abspath(path)


def _git(args: list[str], cwd: str, env: Mapping[str, str] | None = None) -> str:
    base = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0",
            # Never discover a repository above the one we mean.
            "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(cwd))}
    proc = subprocess.run(["git", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ValueError(f"git {' '.join(args[:2])} failed in {cwd}: {proc.stderr.strip()}")
    return proc.stdout


def is_git_repo(path: str) -> bool:
    """Whether `path` is the top of a git work tree (not merely inside one)."""
    try:
        top = _git(["rev-parse", "--show-toplevel"], path).strip()
    except ValueError:
        return False
    return os.path.realpath(top) == os.path.realpath(path)


def resolve_commit(repo_dir: str, base_commit: str | None) -> str | None:
    """The full id of `base_commit` in the git repository `repo_dir`; None when
    `repo_dir` is a plain snapshot folder (exported as it is). ValueError says what to
    fix: no base commit given, or one the repository does not hold."""
    if not is_git_repo(repo_dir):
        return None
    if not base_commit:
        raise ValueError(f"{repo_dir} is a git repository: give the base_commit to export")
    try:
        return _git(["rev-parse", "--verify", "--quiet", f"{base_commit}^{{commit}}"],
                    repo_dir).strip()
    except ValueError:
        raise ValueError(f"{base_commit!r} is not a commit of {repo_dir}; fetch it there "
                         "or fix base_commit") from None


def export_base_snapshot(repo_dir: str, base_commit: str | None, cache_dir: str,
                         name: str) -> str:
    """A folder holding `repo_dir` at `base_commit` as a fresh one-commit repository (see
    the module docstring), built once under `cache_dir`."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
    commit = resolve_commit(repo_dir, base_commit)
    if commit is not None:
        dest = os.path.join(cache_dir, "swe", f"{safe}-{commit[:16]}")
        return build_once(dest, lambda tmp: _export_commit(repo_dir, commit, tmp))
    dest = os.path.join(cache_dir, "swe", f"{safe}-{_folder_digest(repo_dir)}")
    return build_once(dest, lambda tmp: _copy_snapshot(repo_dir, tmp))


def _export_commit(repo_dir: str, commit: str, dest: str) -> None:
    with tempfile.TemporaryDirectory(prefix="sluice-index-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        _git(["read-tree", commit], repo_dir, env)
        _git(["checkout-index", "--all", "--force", f"--prefix={dest}/"], repo_dir, env)
    _init_single_commit_repo(dest)


def _copy_snapshot(src: str, dest: str) -> None:
    shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True,
                    ignore=lambda d, names: [".git"] if d == src else [])
    _init_single_commit_repo(dest)


def _init_single_commit_repo(folder: str) -> None:
    identity = {"GIT_AUTHOR_NAME": "sluice", "GIT_AUTHOR_EMAIL": "sluice@localhost",
                "GIT_COMMITTER_NAME": "sluice", "GIT_COMMITTER_EMAIL": "sluice@localhost",
                "GIT_AUTHOR_DATE": BASE_DATE, "GIT_COMMITTER_DATE": BASE_DATE}
    _git(["init", "--quiet", "--initial-branch=main"], folder)
    # -f: files tracked at the base commit stay tracked even if .gitignore matches them.
    _git(["add", "--all", "--force"], folder)
    _git(["-c", "commit.gpgsign=false", "commit", "--quiet", "--no-verify", "--allow-empty",
          "-m", "base"], folder, identity)


def _folder_digest(folder: str) -> str:
    """Identity of a plain snapshot folder: names, sizes and mtimes of its files."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in sorted(filenames):
            st = os.lstat(os.path.join(dirpath, name))
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            h.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
