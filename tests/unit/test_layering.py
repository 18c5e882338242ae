"""Architecture rules from DESIGN.md, checked on the source: packages are ranked and
imports flow one way (envs <- reward <- rollout <- buffer <- trainer <- launch), with no
exemption and no cycle; inside trainer, the train side (trainer.train) never imports the
run (trainer.run), and the run reaches the train side only through its entry points;
heavy frameworks are imported only inside the code that needs them, never at module top
level, except in the thin Ray shells."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Lower rank = lower layer. A module may import its own package and lower ranks only.
RANK = {"envs": 0, "reward": 1, "rollout": 2, "buffer": 3, "trainer": 4, "launch": 5}
PACKAGES = tuple(RANK)
HEAVY = {"ray", "vllm", "deepspeed", "wandb"}
# Inside trainer: trainer.train (ranks, backends, loss, weight sending) is the lower half
# and imports nothing else of trainer; trainer.run (the composition root, the controller)
# imports trainer.train only through these modules, the train side's public face.
TRAIN, RUN = "trainer.train", "trainer.run"
TRAIN_ENTRY_POINTS = {f"{TRAIN}.config",  # its recipe sections, composed by trainer.run.config
                      f"{TRAIN}.outcomes",  # what it reports through the controller's seam
                      f"{TRAIN}.advantages",  # GRPO advantages, taken when a batch is made
                      f"{TRAIN}.train_actor",  # the Ray shell: TrainGroup, RayTrainer
                      f"{TRAIN}.weight_sync",  # the push transport the run picks from config
                      f"{TRAIN}.backends"}  # the train.backend plug-in point, checked before start
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


def unit_of(module: str) -> str:
    """The node of `module` in the printed graph: its top package, or trainer's subpackage."""
    for sub in (TRAIN, RUN):
        if module == sub or module.startswith(sub + "."):
            return sub
    return module.split(".")[0]


def unit_graph() -> dict[str, set[str]]:
    """package graph with trainer split into trainer.train, trainer.run and its top-level
    modules (main, the CLI shims): what the README shows."""
    graph: dict[str, set[str]] = {}
    for name, tree in _modules().items():
        unit = unit_of(name)
        graph.setdefault(unit, set())
        for imported in _imports(tree):
            if imported.split(".")[0] in RANK and unit_of(imported) != unit:
                graph[unit].add(unit_of(imported))
    return graph


def test_the_train_side_never_imports_the_run():
    bad = [f"{name} imports {imported}" for name, tree in _modules().items()
           if unit_of(name) == TRAIN for imported in _imports(tree)
           if imported.split(".")[0] == "trainer" and unit_of(imported) != TRAIN]
    assert bad == []


def test_the_run_reaches_the_train_side_only_through_its_entry_points():
    bad = [f"{name} imports {imported}" for name, tree in _modules().items()
           if unit_of(name) == RUN for imported in _imports(tree)
           if unit_of(imported) == TRAIN and imported not in TRAIN_ENTRY_POINTS]
    assert bad == []


def test_nothing_in_trainer_imports_its_entry_point_or_shims():
    # trainer's top-level modules (main, the CLI shims) sit above trainer.run: one way.
    top = {n for n in _modules() if unit_of(n) == "trainer"} - {"trainer"}
    bad = [f"{name} imports {imported}" for name, tree in _modules().items()
           if unit_of(name) in (TRAIN, RUN) for imported in _imports(tree) if imported in top]
    assert bad == []


def test_trainer_reaches_reward_only_through_rollout():
    # The reward loop runs in the agent-loop worker: rollout composes the reward section
    # (rollout.config) and hosts its plug-in point (rollout.reward_plugins).
    assert "reward" not in package_graph()["trainer"]


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


def _order(unit: str) -> tuple[int, int]:
    return RANK[unit.split(".")[0]], {TRAIN: 0, RUN: 1}.get(unit, 2)


if __name__ == "__main__":  # the import graph, for the README and review: python tests/unit/test_layering.py
    for unit, deps in sorted(unit_graph().items(), key=lambda kv: _order(kv[0])):
        print(f"{unit:13s} -> {', '.join(sorted(deps, key=_order)) or '(nothing)'}")


def test_test_modules_have_unique_names():
    # `make test` collects tests/unit and tests/integration in one pytest run, which
    # imports test modules by file name: two with one name fail the whole collection.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
