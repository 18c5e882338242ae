"""The agent's final workspace as a value: the files it wrote and the files it deleted,
relative to the task's source folder. This is how the final state is handed to grading.

It is built on the host from a workspace snapshot tar (or a host folder) and treats
that content as hostile: names that are absolute, climb out with `..`, or pass through
`.git` are dropped, only regular files are taken (symlinks, FIFOs and devices never),
and the total size and file count are capped. Grading then applies it to a fresh copy
of the task source; it never runs anything of the agent's sandbox.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from envs.sandbox.base import Snapshot

MAX_CHANGED_BYTES = 64 << 20  # more than any honest edit of a task repository
MAX_CHANGED_FILES = 10_000
IGNORED_TOP_DIRS = (".git",)  # version-control state is not part of the answer


@dataclass(frozen=True, slots=True)
class WorkspaceChanges:
    """Files written (path -> content) and deleted, relative to the workspace root."""

    written: Mapping[str, bytes] = field(default_factory=dict)
    deleted: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # entries not handed over (links, special files, bad names)

    def __post_init__(self) -> None:
        written = dict(self.written)
        for path in [*written, *self.deleted]:
            if clean_relative_path(path) != path:
                raise ValueError(f"WorkspaceChanges path {path!r} is not a clean relative "
                                 "path; use forward slashes, no '..', no leading '/'")
        object.__setattr__(self, "written", written)
        object.__setattr__(self, "deleted", tuple(sorted(set(self.deleted))))
        object.__setattr__(self, "skipped", tuple(self.skipped))

    @property
    def num_bytes(self) -> int:
        return sum(len(v) for v in self.written.values())

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, source_dir: str | None) -> WorkspaceChanges:
        """Compare a sandbox snapshot tar with the task's source folder."""
        if not os.path.isfile(snapshot.tar_path):
            raise ValueError(f"snapshot {snapshot.tar_path} does not exist (discarded?); take "
                             "the snapshot after the trajectory and before releasing it")
        with tarfile.open(snapshot.tar_path, mode="r") as tar:
            return _compare(_tar_files(tar), source_dir)

    @classmethod
    def from_dir(cls, workspace_dir: str, source_dir: str | None) -> WorkspaceChanges:
        """Compare a workspace folder on this host with the task's source folder."""
        return _compare(_dir_files(workspace_dir), source_dir)


def clean_relative_path(path: str) -> str | None:
    """`path` normalised ('a/./b' -> 'a/b'), or None if it is absolute, empty, climbs out
    of the root, or holds a NUL or backslash."""
    if not path or "\0" in path or "\\" in path or path.startswith("/"):
        return None
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


# (name, content or None for a non-regular entry) of every non-directory entry.
_Entry = tuple[str, bytes | None]


def _tar_files(tar: tarfile.TarFile) -> Iterator[_Entry]:
    for member in tar:
        if member.isdir():
            continue
        if member.isfile():
            if member.size > MAX_CHANGED_BYTES:
                raise ValueError(f"workspace file {member.name!r} is {member.size} bytes, over "
                                 f"the {MAX_CHANGED_BYTES} byte limit of a graded workspace")
            f = tar.extractfile(member)
            assert f is not None  # regular members always have content
            yield member.name, f.read()
        else:
            yield member.name, None


def _dir_files(root: str) -> Iterator[_Entry]:
    for dirpath, dirnames, filenames in os.walk(root):  # never follows symlinked dirs
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        linked_dirs = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in [*sorted(filenames), *linked_dirs]:
            path = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                yield rel, None
                continue
            with open(path, "rb") as f:
                yield rel, f.read(MAX_CHANGED_BYTES + 1)


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
            if stat.S_ISREG(os.lstat(path).st_mode):
                found[name if rel_dir == "." else f"{rel_dir}/{name}"] = path
    return found


def _compare(entries: Iterator[_Entry], source_dir: str | None) -> WorkspaceChanges:
    source = _source_files(source_dir)
    written: dict[str, bytes] = {}
    present: set[str] = set()
    skipped: list[str] = []
    total = 0
    for raw_name, content in entries:
        name = clean_relative_path(raw_name)
        if name is None or name.split("/")[0] in IGNORED_TOP_DIRS:
            if name is None:
                skipped.append(raw_name)
            continue
        if content is None:
            # A link or special file is not handed over; the source's entry (if any) stays.
            present.add(name)
            skipped.append(name)
            continue
        present.add(name)
        if name in source and _same_content(source[name], content):
            continue
        total += len(content)
        if total > MAX_CHANGED_BYTES or len(written) >= MAX_CHANGED_FILES:
            raise ValueError(f"the agent's changes exceed {MAX_CHANGED_BYTES} bytes or "
                             f"{MAX_CHANGED_FILES} files; such a workspace is not graded")
        written[name] = content
    deleted = tuple(p for p in source if p not in present)
    return WorkspaceChanges(written=written, deleted=deleted, skipped=tuple(skipped))


def _same_content(path: str, content: bytes) -> bool:
    if os.path.getsize(path) != len(content):
        return False
    with open(path, "rb") as f:
        return f.read() == content
