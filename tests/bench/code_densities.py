"""Code-habit densities over the package sources: run by hand, prints a table.

Counts what STYLE.md asks to keep rare (``Any``, broad ``except``, three-argument
``getattr`` duck typing, ``# type: ignore`` / ``# pyrefly: ignore``) per 1,000 lines, so a round's drift is a
number rather than an impression. Usage::

    python tests/bench/code_densities.py [ROOT ...]

Each ROOT is a checkout (default: the repository this file lives in); one row per root.
Lines are physical lines of the ``.py`` files under the package folders.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("trainer", "rollout", "buffer", "reward", "envs", "launch", "examples")
BROAD = {"Exception", "BaseException"}


@dataclass(slots=True)
class Counts:
    """Totals over one tree."""

    files: int = 0
    lines: int = 0
    any_uses: int = 0
    broad_excepts: int = 0
    getattr_defaults: int = 0
    type_ignores: int = 0
    unparsed: int = 0
    unexplained: list[str] = field(default_factory=list)  # "path:line" of broad excepts without a reason


def _is_broad(handler: ast.ExceptHandler) -> bool:
    kind = handler.type
    if kind is None:
        return True
    names = kind.elts if isinstance(kind, ast.Tuple) else [kind]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def _comment_lines(source: str) -> set[int]:
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
            if "type: ignore" in token.string or "pyrefly: ignore" in token.string:
                lines.add(-token.start[0])  # negative marks a type-ignore comment
    return lines


def count_file(path: Path, counts: Counts) -> None:
    """Adds one file's figures to ``counts``."""
    source = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError:  # an old commit may hold a file this Python cannot parse: count it apart
        counts.unparsed += 1
        return
    comments = _comment_lines(source)
    counts.files += 1
    counts.lines += len(source.splitlines())
    counts.type_ignores += sum(1 for line in comments if line < 0)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Any":
            counts.any_uses += 1
        elif isinstance(node, ast.Attribute) and node.attr == "Any":
            counts.any_uses += 1
        elif isinstance(node, ast.ExceptHandler) and _is_broad(node):
            counts.broad_excepts += 1
            if node.lineno not in comments:
                counts.unexplained.append(f"{path}:{node.lineno}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            counts.getattr_defaults += 1


def count_tree(root: Path, per_file: dict[str, Counts] | None = None) -> Counts:
    """Figures over the package folders of one checkout; ``per_file`` collects each file's own."""
    counts = Counts()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            count_file(path, counts)
            if per_file is not None:
                count_file(path, per_file.setdefault(str(path.relative_to(root)), Counts()))
    return counts


def print_files(per_file: dict[str, Counts]) -> None:
    """The files that hold any of the counted habits, most first."""
    def weight(c: Counts) -> int:
        return c.any_uses + c.broad_excepts + c.getattr_defaults + c.type_ignores

    print(f"{'file':48}  {'lines':>5}  {'Any':>4}  {'broad':>5}  {'getattr':>7}  {'ignore':>6}")
    for name, c in sorted(per_file.items(), key=lambda kv: -weight(kv[1])):
        if weight(c):
            print(
                f"{name:48}  {c.lines:5}  {c.any_uses:4}  {c.broad_excepts:5}  "
                f"{c.getattr_defaults:7}  {c.type_ignores:6}"
            )


def _per_k(value: int, lines: int) -> str:
    return f"{value} ({1000 * value / max(lines, 1):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[Path(__file__).resolve().parents[2]])
    parser.add_argument("--files", action="store_true", help="also list each file's counts (first root)")
    args = parser.parse_args()
    header = ("tree", "files", "lines", "Any", "broad except", "  no reason", "getattr(x,'n',d)", "ignore")
    rows = []
    for root in args.roots:
        c = count_tree(root)
        rows.append(
            (
                str(root),
                str(c.files),
                str(c.lines),
                _per_k(c.any_uses, c.lines),
                _per_k(c.broad_excepts, c.lines),
                str(len(c.unexplained)),
                _per_k(c.getattr_defaults, c.lines),
                _per_k(c.type_ignores, c.lines),
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    print("counts (per 1k lines); 'no reason' = broad excepts without a comment on the except line")
    if args.files:
        per_file: dict[str, Counts] = {}
        count_tree(args.roots[0], per_file)
        print()
        print_files(per_file)


if __name__ == "__main__":
    main()
