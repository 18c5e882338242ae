"""Capturing the agent's final workspace as WorkspaceChanges: a workspace snapshot tar (or
a host folder) compared with the task's source folder, on the host that holds both (the
sandbox pool's), so only the changed files travel on to grading.

The workspace content is hostile: names that are absolute, climb out with `..`, or pass
through `.git` are dropped, only regular files are taken (symlinks, FIFOs and devices
never), and the total size and file count are capped. Changes over the cap are not an
error: they come back as a WorkspaceChanges with a `problem` and no files, which grading
scores 0.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import IO

from envs.sandbox.base import Snapshot
from envs.types import WorkspaceChanges, clean_relative_path

MAX_CHANGED_BYTES = 64 << 20  # default cap (envs.max_workspace_changes_mb); more than any honest edit
MAX_CHANGED_FILES = 10_000
IGNORED_TOP_DIRS = (".git",)  # version-control state is not part of the answer
# Bytecode caches that running code leaves anywhere: grading never applies them
# (reward.grading.prepare), so they are not shipped or counted as changes of the agent's.
IGNORED_DIRS = ("__pycache__",)
_CHUNK_BYTES = 1 << 20


def changes_from_snapshot(snapshot: Snapshot, source_dir: str | None,
                          max_bytes: int = MAX_CHANGED_BYTES) -> WorkspaceChanges:
    """Compare a sandbox snapshot tar with the task's source folder."""
    if not os.path.isfile(snapshot.tar_path):
        raise ValueError(f"snapshot {snapshot.tar_path} does not exist (discarded?); take "
                         "the snapshot after the trajectory and before releasing it")
    with tarfile.open(snapshot.tar_path, mode="r:") as tar:  # ours: never compressed
        return _compare(_tar_files(tar), source_dir, max_bytes)


def changes_from_dir(workspace_dir: str, source_dir: str | None,
                     max_bytes: int = MAX_CHANGED_BYTES) -> WorkspaceChanges:
    """Compare a workspace folder on this host with the task's source folder."""
    return _compare(_dir_files(workspace_dir), source_dir, max_bytes)


@dataclass(frozen=True, slots=True)
class _Entry:
    """One non-directory entry of the workspace; `open` is None for a non-regular one."""

    name: str
    size: int
    open: Callable[[], IO[bytes]] | None


def _tar_files(tar: tarfile.TarFile) -> Iterator[_Entry]:
    for member in tar:
        if member.isdir():
            continue
        if member.isfile():
            yield _Entry(member.name, member.size, partial(_extracted, tar, member))
        else:
            yield _Entry(member.name, 0, None)


def _extracted(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    f = tar.extractfile(member)
    assert f is not None  # regular members always have content
    return f


def _dir_files(root: str) -> Iterator[_Entry]:
    for dirpath, dirnames, filenames in os.walk(root):  # never follows symlinked dirs
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        linked_dirs = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in [*sorted(filenames), *linked_dirs]:
            path = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                yield _Entry(rel, st.st_size, partial(_open_no_follow, path))
            else:
                yield _Entry(rel, 0, None)


def _open_no_follow(path: str) -> IO[bytes]:
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


def _source_files(source_dir: str | None) -> dict[str, str]:
    """Regular files of the source folder: relative path -> host path."""
    if source_dir is None:
        return {}
    found = {}
    for dirpath, dirnames, filenames in os.walk(source_dir):
        rel_dir = os.path.relpath(dirpath, source_dir)
        if rel_dir.split(os.sep)[0] in IGNORED_TOP_DIRS:
            dirnames.clear()
            continue
        for name in filenames:
            path = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if stat.S_ISREG(os.lstat(path).st_mode) and not _ignored(rel):
                found[rel] = path
    return found


def _ignored(path: str) -> bool:
    parts = path.split("/")
    return parts[0] in IGNORED_TOP_DIRS or any(f in IGNORED_DIRS for f in parts[:-1])


def _compare(entries: Iterator[_Entry], source_dir: str | None,
             max_bytes: int) -> WorkspaceChanges:
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be >= 1; raise "
                         "envs.max_workspace_changes_mb")
    source = _source_files(source_dir)
    written: dict[str, bytes] = {}
    present: set[str] = set()
    skipped: list[str] = []
    total = 0
    for entry in entries:
        name = clean_relative_path(entry.name)
        if name is None or _ignored(name):
            if name is None:
                skipped.append(entry.name)
            continue
        present.add(name)
        if entry.open is None:
            # A link or special file is not handed over; the source's entry (if any) stays.
            skipped.append(name)
            continue
        if name in source and _same_content(source[name], entry):
            continue  # unchanged files never count against the cap, however big
        total += entry.size
        if total > max_bytes or len(written) >= MAX_CHANGED_FILES:
            return WorkspaceChanges(problem=(
                f"the agent's changes exceed {max_bytes} bytes or {MAX_CHANGED_FILES} files "
                f"(at {name!r}); such a workspace is not graded (envs.max_workspace_changes_mb "
                "sets the cap)"))
        with entry.open() as f:
            content = f.read(entry.size + 1)
        if len(content) != entry.size:
            raise ValueError(f"workspace file {name!r} changed size while it was read")
        written[name] = content
    deleted = tuple(p for p in source if p not in present)
    return WorkspaceChanges(written=written, deleted=deleted, skipped=tuple(skipped))


def _same_content(path: str, entry: _Entry) -> bool:
    """Whether the source file at `path` holds exactly the entry's bytes (streamed)."""
    assert entry.open is not None
    if os.path.getsize(path) != entry.size:
        return False
    with open(path, "rb") as src, entry.open() as f:
        while True:
            a, b = src.read(_CHUNK_BYTES), f.read(_CHUNK_BYTES)
            if a != b:
                return False
            if not a:
                return True
