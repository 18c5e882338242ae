"""Where everything sluice builds on this host lives (bundled code tasks written out, SWE base
snapshots exported), and how they are built: into a temporary sibling, then renamed into
place, so a folder that exists is complete even if a builder crashed or raced another."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_cache_dir() -> Path:
    """The one cache root of sluice: $SLUICE_CACHE_DIR, else $XDG_CACHE_HOME/sluice, else
    ~/.cache/sluice (tiny model, warm starts, task folders, runtimes)."""
    if os.environ.get("SLUICE_CACHE_DIR"):
        return Path(os.environ["SLUICE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice"


def build_once(dest: str, build: Callable[[str], None]) -> str:
    """`dest`, created by `build(tmp_folder)` unless it already exists."""
    if os.path.isdir(dest):
        return dest
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
    try:
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
