"""Architecture rules from DESIGN.md, checked on the source: packages are ranked and
imports flow one way (envs <- reward <- rollout <- buffer <- trainer <- launch), with no
exemption and no cycle; heavy frameworks are imported only inside the code that needs
them, never at module top level, except in the thin Ray shells."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Lower rank = lower layer. A module may import its own package and lower ranks only.
RANK = {"envs": 0, "reward": 1, "rollout": 2, "buffer": 3, "trainer": 4, "launch": 5}
PACKAGES = tuple(RANK)
HEAVY = {"ray", "vllm", "deepspeed", "wandb"}
# Thin Ray shells may import ray at top level; list them here as they are added.
TOP_LEVEL_HEAVY_ALLOWED: set[str] = {"rollout.engine_actor", "rollout.worker_actor", "trainer.train.train_actor",
                                     "envs.pool_actor"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _imports(tree: ast.AST) -> list[str]:
    """Every project import anywhere in the module (deferred and TYPE_CHECKING ones too)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def package_graph() -> dict[str, set[str]]:
    """package -> the other project packages it imports."""
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for name, tree in _modules().items():
        pkg = name.split(".")[0]
        for imported in _imports(tree):
            top = imported.split(".")[0]
            if top in RANK and top != pkg:
                graph[pkg].add(top)
    return graph


def test_imports_flow_down_the_ranks():
    bad = []
    for name, tree in _modules().items():
        pkg = name.split(".")[0]
        for imported in _imports(tree):
            top = imported.split(".")[0]
            if top in RANK and RANK[top] > RANK[pkg]:
                bad.append(f"{name} imports {imported}")
    assert bad == []


def test_the_package_graph_has_no_cycle():
    graph = package_graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    cycles = [c for p in PACKAGES if p not in state and (c := visit(p, []))]
    assert cycles == []


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


if __name__ == "__main__":  # the import graph, for the README and review: python tests/unit/test_layering.py
    for pkg, deps in sorted(package_graph().items(), key=lambda kv: RANK[kv[0]]):
        print(f"{pkg:8s} -> {', '.join(sorted(deps, key=RANK.get)) or '(nothing)'}")


def test_test_modules_have_unique_names():
    # `make test` collects tests/unit and tests/integration in one pytest run, which
    # imports test modules by file name: two with one name fail the whole collection.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
