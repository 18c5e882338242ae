"""Architecture rules from DESIGN.md, checked on the source: imports flow one way
(types/config <- envs, reward <- rollout <- buffer <- trainer) and heavy frameworks are
imported only inside the code that needs them, never at module top level."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "rollout", "buffer", "reward", "envs", "launch")
# The bottom layer: importable from anywhere, importing no other project module.
BASE = {"rollout.types", "trainer.config", "launch.tiny_model"}
RANK = {"envs": 1, "reward": 1, "rollout": 2, "buffer": 3, "trainer": 4, "launch": 5}
HEAVY = {"ray", "vllm", "deepspeed", "wandb"}
# Thin Ray shells may import ray at top level; list them here as they are added.
TOP_LEVEL_HEAVY_ALLOWED: set[str] = {"rollout.engine_actor", "rollout.worker_actor", "trainer.train_actor",
                                     "envs.pool_actor"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_imports_flow_one_way():
    bad = []
    for name, tree in _modules().items():
        pkg = name.split(".")[0]
        for imported in _imports(tree):
            top = imported.split(".")[0]
            if top not in PACKAGES or top == pkg and name not in BASE:
                continue
            if imported in BASE or any(imported.startswith(b + ".") for b in BASE):
                if name not in BASE:
                    continue
            if name in BASE or RANK[top] > RANK[pkg]:
                bad.append(f"{name} imports {imported}")
    assert bad == []


def test_heavy_frameworks_are_not_imported_at_module_top_level():
    bad = []
    for name, tree in _modules().items():
        if name in TOP_LEVEL_HEAVY_ALLOWED:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for imported in _imports(node):
                    if imported.split(".")[0] in HEAVY:
                        bad.append(f"{name} imports {imported} at top level")
    assert bad == []


def test_every_module_opens_with_a_docstring():
    missing = [n for n, tree in _modules().items()
               if ast.get_docstring(tree) is None]
    assert missing == []
