"""Inputs and statistics shared by the sandbox and pool benchmarks."""

from __future__ import annotations

from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_source_tree(root: Path, num_files: int = 200, file_bytes: int = 8192) -> None:
    """A small repository-like tree: nested packages of Python-sized files."""
    for i in range(num_files):
        path = root / f"pkg{i % 10}" / f"sub{i % 3}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"# x\n" * (file_bytes // 4))
