"""A task's test patch, applied where the agent never wrote: to copies of the task source's
own versions of the files it touches, in a fresh scratch folder, by a git that reads no
configuration at all. The result (path -> new content, or None for a deleted file) is
then written into the grading folder after the agent's changes, independently of them.

Why not `git apply` in the grading folder: that folder holds the agent's files, and git
reads configuration from them (a `.gitconfig` where HOME points, `.config/git/*`,
`.gitattributes` naming a filter whose command git runs) as the user that runs it: root,
on the grading host. Every file a test patch touches is test-related (reward.grading.prepare
drops the agent's versions of them), so the patch always applies to the source's content
and its result depends on the task alone; it is computed once per task.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass

from envs.types import Task

# git with every configuration source off: no system or global file, no HOME or XDG
# folder of anyone's, no attributes file, no hooks, no fsmonitor, no repository around.
_GIT_CONFIG = ("-c", "core.hooksPath=/dev/null", "-c", "core.attributesFile=/dev/null",
               "-c", "core.fsmonitor=false", "-c", "safe.directory=")
_MAX_CACHED_TASKS = 4096


@dataclass(frozen=True, slots=True)
class PatchedFile:
    """A file as the test patch leaves it."""

    data: bytes
    executable: bool


def patched_paths(test_patch: str | None) -> frozenset[str]:
    """Files a unified diff touches (both sides of renames)."""
    found = set()
    for line in (test_patch or "").splitlines():
        if line.startswith("diff --git "):
            for token in line.split()[2:4]:
                found.add(token[2:] if token[:2] in ("a/", "b/") else token)
        elif line.startswith(("--- ", "+++ ")):
            token = line[4:].split("\t")[0].strip()
            if token != "/dev/null":
                found.add(token[2:] if token[:2] in ("a/", "b/") else token)
    return frozenset(found)


_cache: dict[tuple[str, str | None, str], dict[str, PatchedFile | None]] = {}
_lock = threading.Lock()


def patched_files(task: Task) -> dict[str, PatchedFile | None]:
    """What `task.grading.test_patch` makes of the source files it touches: path -> the file's
    new content, or None where the patch deletes it. Cached per task (task id, source
    folder and patch text); ValueError when the patch does not apply to the source."""
    if not task.grading.test_patch:
        return {}
    key = (task.id, task.source_dir, task.grading.test_patch)
    with _lock:
        cached = _cache.get(key)
    if cached is None:
        cached = _apply_in_scratch(task)
        with _lock:
            if len(_cache) >= _MAX_CACHED_TASKS:
                _cache.clear()
            _cache[key] = cached
    return dict(cached)


def _apply_in_scratch(task: Task) -> dict[str, PatchedFile | None]:
    assert task.grading.test_patch is not None
    paths = patched_paths(task.grading.test_patch)
    with tempfile.TemporaryDirectory(prefix="sluice-test-patch-") as scratch:
        tree, home = os.path.join(scratch, "tree"), os.path.join(scratch, "home")
        os.mkdir(tree)
        os.mkdir(home)
        for rel in paths:
            _copy_source_file(task, rel, tree)
        _git_apply(task, tree, home)
        return {rel: _read_result(task, tree, rel) for rel in sorted(paths)}


def _copy_source_file(task: Task, rel: str, tree: str) -> None:
    if task.source_dir is None:
        return
    src = os.path.join(task.source_dir, rel)
    if not os.path.lexists(src):
        return  # a file the patch creates
    if not stat.S_ISREG(os.lstat(src).st_mode):
        raise ValueError(f"task {task.id!r}: test_patch touches {rel!r}, which is not a regular "
                         "file in the task source; test patches may only change files")
    dest = os.path.join(tree, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copy2(src, dest)


def _git_apply(task: Task, tree: str, home: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "XDG_CONFIG_HOME": home,
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_ATTR_NOSYSTEM": "1",
           "GIT_CEILING_DIRECTORIES": os.path.dirname(tree), "LANG": "C"}
    proc = subprocess.run(["git", *_GIT_CONFIG, "apply", "--whitespace=nowarn", "-"], cwd=tree,
                          env=env, input=task.grading.test_patch.encode() if task.grading.test_patch else b"",
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise ValueError(f"task {task.id!r}: test_patch does not apply to the task source: "
                         f"{proc.stderr.decode(errors='replace').strip()}; regenerate it "
                         "against the base commit")


def _read_result(task: Task, tree: str, rel: str) -> PatchedFile | None:
    path = os.path.join(tree, rel)
    if not os.path.lexists(path):
        return None
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"task {task.id!r}: test_patch makes {rel!r} something other than a "
                         "regular file (a symlink?); test patches may only write files")
    with open(path, "rb") as f:
        return PatchedFile(f.read(), bool(st.st_mode & stat.S_IXUSR))
