"""Where everything sluice builds on this host lives (bundled code tasks written out, SWE base
snapshots exported), and how they are built: into a temporary sibling, then renamed into
place, so a folder that exists is complete even if a builder crashed or raced another.
Builds that replace an outdated folder hold `build_lock` instead, so that concurrent
builders (parallel test workers, two runs) wait for the first and never replace a folder
another process is reading."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path

from envs.progress import FirstUse

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """The one cache root of sluice: $SLUICE_CACHE_DIR, else $XDG_CACHE_HOME/sluice, else
    ~/.cache/sluice (tiny model, warm starts, task folders, runtimes)."""
    if os.environ.get("SLUICE_CACHE_DIR"):
        return Path(os.environ["SLUICE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice"


def build_once(dest: str, build: Callable[[str], None], what: str | None = None) -> str:
    """`dest`, created by `build(tmp_folder)` unless it already exists. `what` names a
    build long enough to announce (envs.progress): what it is, that it is first use, where
    it is cached, how long it took."""
    if os.path.isdir(dest):
        return dest
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
    try:
        if what is None:
            build(tmp)
        else:
            with FirstUse(what, dest):
                build(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isdir(dest):  # not a lost race: a real failure
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


@contextmanager
def build_lock(dest: str | os.PathLike[str]) -> Generator[None, None, None]:
    """Held while `dest` is checked and built: an exclusive flock on `<dest>.lock`, which
    the kernel drops if the holder dies, so a crashed builder never blocks the next."""
    lock = f"{os.fspath(dest)}.lock"
    os.makedirs(os.path.dirname(lock) or ".", exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds it: say why this one is quiet
            log.info("waiting for another process to finish building %s", os.fspath(dest))
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock
