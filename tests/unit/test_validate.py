"""Start-up validation (trainer.run.validate), as a user meets it: `python -m trainer.main
recipe=... [--dry-run]` with a broken YAML file, broken task rows, unimportable or
ill-shaped plug-ins and a bad model folder exits 2 with every problem listed, no
traceback, and creates nothing on disk (issue 13, finding 8)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from envs.tasks import unbuilt_set_note
from envs.tasks.build_swe_smith import bundled_image_set_dir, bundled_set_dir
from trainer.run.recipe import load_config
from trainer.run.validate import check_plugin, validate_run

ROOT = Path(__file__).resolve().parents[2]

PLUGINS = '''
"""Plug-ins of a user package, good and bad, for the validation tests."""
from envs.tools.base import ToolResult, function_schema


class GoodLoop:
    async def run(self, task, ctx):
        raise NotImplementedError


class LoopWithoutCtx:
    async def run(self, task):
        raise NotImplementedError


class SyncLoop:
    def run(self, task, ctx):
        raise NotImplementedError


class LoopNeedingArgs:
    def __init__(self, temperature):
        self.temperature = temperature

    async def run(self, task, ctx):
        raise NotImplementedError


class GoodReward:
    async def __call__(self, trajectory, task, ctx):
        raise NotImplementedError


class SyncReward:
    def __call__(self, trajectory, task, ctx):
        return 1.0


class EchoTool:
    name = "echo"
    schema = function_schema("echo", "Repeat the text.", {"text": {"type": "string"}},
                             required=("text",))

    def __init__(self, env):
        self.env = env

    async def execute(self, arguments):
        return ToolResult(arguments["text"])


class ToolWithoutSchema:
    name = "bad"

    def __init__(self, env):
        pass

    async def execute(self, arguments):
        return ToolResult("")


class ToolWithoutEnv:
    name = "noenv"
    schema = function_schema("noenv", "Takes no env.", {})

    def __init__(self):
        pass

    async def execute(self, arguments):
        return ToolResult("")
'''


@pytest.fixture()
def user_package(tmp_path, monkeypatch):
    """A package `userpkg` on sys.path (and PYTHONPATH for subprocesses): good and bad
    plug-ins, plus a module that raises on import."""
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plugins.py").write_text(PLUGINS)
    (pkg / "broken.py").write_text("import os\nraise RuntimeError('the database is down')\n")
    (pkg / "typo.py").write_text("def f(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("userpkg")]:
        del sys.modules[name]
    return tmp_path


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_main(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "trainer.main", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def problems_of(stderr: str) -> list[str]:
    return [line[4:] for line in stderr.splitlines() if line.startswith("  - ")]


# --- as a user: python -m trainer.main -----------------------------------------------------

def test_yaml_syntax_error_is_one_line_with_file_and_line(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model:\n  path: tiny\ntrain:\n  lr: 1e-4\n   num_steps: 3\n")
    proc = run_main(tmp_path, f"recipe={recipe}", "--dry-run")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"config error: {recipe}:5:13: mapping values are not allowed here "
                     "(the recipe is not valid YAML)"]


def test_bad_override_value_names_the_override(tmp_path):
    proc = run_main(tmp_path, "recipe=quickstart.yaml", "train.lr=[1,", "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "override 'train.lr=[1,': its value is not valid YAML" in proc.stderr


def test_dry_run_lists_every_problem_at_once_and_creates_nothing(tmp_path, user_package):
    tasks = write_rows(tmp_path / "tasks.jsonl", [
        {"id": "ok", "prompt": "2+2?", "answer": "4"},
        '{"id": "broken", "prompt": ',                                   # not JSON
        {"id": "typo", "promt": "2+2?"},                                 # unknown field
        {"id": "needs-echo", "prompt": "say hi", "tools": ["echo", "python"]},
        {"id": "own-loop", "prompt": "x", "agent_loop": "userpkg.missing:Loop"},
        {"id": "own-reward", "prompt": "x", "reward_fn": "userpkg.plugins:SyncReward"},
    ])
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        model: {{path: tiny}}
        agent: {{loop: userpkg.plugins:LoopWithoutCtx}}
        reward: {{fn: userpkg.plugins:NoSuchReward}}
        envs:
          tasks: {tasks}
          tools: {{shout: userpkg.broken:Shout}}
        eval: {{tasks: {tmp_path / "missing.jsonl"}}}
        logging: {{output_dir: {tmp_path / "runs"}}}
        """))
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_main(tmp_path, f"recipe={recipe}", "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    problems = problems_of(proc.stderr)
    expected = [
        "agent.loop: agent loop 'userpkg.plugins:LoopWithoutCtx': LoopWithoutCtx.run(self, task) "
        "must accept (self, task, ctx)",
        "reward.fn: reward fn 'userpkg.plugins:NoSuchReward': userpkg.plugins has no attribute "
        "'NoSuchReward'",
        "envs.tools.shout: tool 'userpkg.broken:Shout' raised RuntimeError: the database is down "
        "while loading; fix that module",
        f"envs.tasks: {tasks} row 2: not valid JSON",
        f"envs.tasks: {tasks} row 3, field 'promt': unknown field; did you mean 'prompt'?",
        "envs.tasks: task 'needs-echo' names tool 'echo', which is neither a built-in",
        "envs.tasks: task 'own-loop' agent_loop: agent loop 'userpkg.missing:Loop': cannot import "
        "'userpkg.missing'",
        "envs.tasks: task 'own-reward' reward_fn: reward fn 'userpkg.plugins:SyncReward' must "
        "define `async def __call__(self, trajectory, task, ctx) -> RewardResult`",
        f"eval.tasks: task file '{tmp_path / 'missing.jsonl'}' does not exist",
    ]
    assert len(problems) == len(expected), proc.stderr
    for problem, start in zip(problems, expected):
        assert problem.startswith(start), f"{problem!r} does not start with {start!r}"
    assert proc.stderr.startswith(f"config error: {len(expected)} problems before start:")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run folder, nothing else


def test_a_real_run_with_a_bad_task_file_stops_before_anything_starts(tmp_path):
    tasks = write_rows(tmp_path / "tasks.jsonl", [{"id": "a", "prompt": "x", "tools": ["nope"]}])
    runs = tmp_path / "runs"
    proc = run_main(tmp_path, "recipe=quickstart.yaml", f"envs.tasks={tasks}",
                    f"logging.output_dir={runs}", "model.warm_start=null")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert problems_of(proc.stderr) == [
        "envs.tasks: task 'a' names tool 'nope', which is neither a built-in (calculator, screenshot, bash, "
        "python, read_file, write_file, str_replace, run_tests, submit) nor in envs.tools; add "
        "envs.tools.nope=package.module:Class to the recipe or fix the task's 'tools'"]
    assert not runs.exists()


# --- validate_run in process ---------------------------------------------------------------

def test_the_shipped_quickstart_validates_clean():
    assert validate_run(load_config("quickstart.yaml")) == []


def test_user_plugins_that_keep_the_protocols_pass(tmp_path, user_package):
    tasks = write_rows(tmp_path / "t.jsonl", [
        {"id": "a", "prompt": "x", "tools": ["echo"], "agent_loop": "userpkg.plugins:GoodLoop",
         "reward_fn": "userpkg.plugins:GoodReward"}])
    cfg = load_config("quickstart.yaml", [
        "agent.loop=userpkg.plugins:GoodLoop", "reward.fn=userpkg.plugins:GoodReward",
        "envs.tools.echo=userpkg.plugins:EchoTool", f"envs.tasks={tasks}",
        "model.warm_start=null", "eval.tasks=null"])
    assert validate_run(cfg) == []


@pytest.mark.parametrize("kind,value,expected", [
    ("agent loop", "userpkg.plugins:SyncLoop", "must be a class with `async def run(self, task, ctx)"),
    ("agent loop", "userpkg.plugins:LoopNeedingArgs", "LoopNeedingArgs() cannot be built without "
                                                      "arguments"),
    ("agent loop", "userpkg.typo:Loop", "raised SyntaxError: invalid syntax"),
    ("tool", "userpkg.plugins:ToolWithoutSchema", "ToolWithoutSchema.schema must be an OpenAI "
                                                  "function schema"),
    ("tool", "userpkg.plugins:ToolWithoutEnv", "ToolWithoutEnv() must accept (env) (tools are "
                                               "built as cls(env))"),
    ("reward fn", "no_such_builtin", "is neither a built-in nor an import string"),
    ("reward fn", "exact_mach", "did you mean 'exact_match'?; reward.fn (or a task's reward_fn) "
                                "takes a built-in (exact_match, "),
    ("train backend", "userpkg.plugins:GoodLoop", "GoodLoop lacks compute_proximal_logprobs"),
    ("train backend", "deepspeeed", "did you mean 'deepspeed'?; train.backend takes a built-in"),
    ("sandbox backend", "userpkg.plugins:GoodLoop", "needs `async def create(cls, spec)`"),
    ("warm start", "userpkg.plugins:GoodReward", "() must accept (base_model_dir, cfg)"),
])
def test_plugins_that_break_their_protocol_are_named(user_package, kind, value, expected):
    problem = check_plugin(kind, value, name="x")
    assert problem is not None and expected in problem, problem


def test_model_folder_problems(tmp_path, tiny_model_path):
    cfg = load_config("quickstart.yaml", ["model.warm_start=null", "eval.tasks=null",
                                          f"model.path={tmp_path / 'nowhere'}"])
    assert validate_run(cfg) == [f"model.path: '{tmp_path / 'nowhere'}' is not a folder; give a "
                                 "Hugging Face model folder (config.json, weights, tokenizer) or "
                                 "'tiny' (text) or 'tiny-vl' (vision-language) for a local test model"]
    # A copy of the tiny model without weights and without a chat template.
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_model_path.iterdir():
        if not f.name.endswith(".safetensors") and not f.name.startswith("chat_template"):
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = load_config("quickstart.yaml", ["model.warm_start=null", "eval.tasks=null",
                                          f"model.path={folder}"])
    assert validate_run(cfg) == [
        f"model.path: {folder} holds no weights (*.safetensors or *.bin)",
        f"model.path: the tokenizer in {folder} has no chat template; add chat_template.jinja "
        "(or 'chat_template' in tokenizer_config.json)"]


def test_the_run_start_checks_run_in_validation_too():
    """What a real start checks before its engines (the chat family and its parsers
    against the template) fails validation, so --dry-run catches it."""
    problems = validate_run(load_config("quickstart.yaml", ["agent.chat_family=llama3"]))
    assert len(problems) == 1, problems
    assert problems[0].startswith("agent.chat_family: chat template check failed with "
                                  "agent.chat_family='llama3'")


def test_row_problems_are_capped_per_file(tmp_path):
    tasks = write_rows(tmp_path / "t.jsonl", ['{"id": '] * 50)
    cfg = load_config("quickstart.yaml", ["model.warm_start=null", "eval.tasks=null",
                                          f"envs.tasks={tasks}"])
    problems = validate_run(cfg)
    assert len(problems) == 21
    assert problems[-1].startswith("envs.tasks: stopped after 20 problems")


# --- a dry run builds no slow task set; Ctrl-C during the checks ---------------------------

def test_a_dry_run_says_a_slow_task_set_is_not_built_instead_of_building_it(tmp_path,
                                                                           tiny_model_path):
    """swe_mini.yaml names swe_smith_images, whose first build takes many minutes: the dry
    run warns that the first run builds it, builds nothing and exits 0."""
    cache = tmp_path / "cache"
    env = dict(os.environ, SLUICE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainer.main", "recipe=swe_mini.yaml",
                           f"model.path={tiny_model_path}", "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    where = bundled_image_set_dir(str(cache))
    assert (f"envs.tasks: the task set swe_smith_images is not built yet: the first run builds "
            f"it (about 5 min on 2 cores, more under load: each mutation's tests run to keep "
            f"only real bugs, then one podman image a task) into {where}") in proc.stderr
    assert not (cache / "swe_smith").exists()  # nothing was built
    assert took < 120, f"the dry run took {took:.0f} s"


def test_unbuilt_set_note_only_for_slow_sets_not_built(tmp_path):
    assert unbuilt_set_note("toy_arithmetic", str(tmp_path)) is None
    assert unbuilt_set_note(str(tmp_path / "t.jsonl"), str(tmp_path)) is None
    note = unbuilt_set_note("swe_smith_hjson", str(tmp_path))
    assert note is not None and note.startswith("the task set swe_smith_hjson is not built yet")
    os.makedirs(bundled_set_dir(str(tmp_path)))
    assert unbuilt_set_note("swe_smith_hjson", str(tmp_path)) is None


SLOW_PLUGIN = '''
"""An agent loop whose module takes a minute to import: Ctrl-C lands in the checks."""
import os
import time
from pathlib import Path

Path(os.environ["SLUICE_TEST_MARKER"]).touch()
time.sleep(60)
'''


def test_ctrl_c_during_the_start_up_checks_stops_cleanly(tmp_path, user_package):
    """SIGINT while a real run's checks import a plug-in: one line, exit 130, no
    traceback, no run folder."""
    (tmp_path / "userpkg" / "slow.py").write_text(SLOW_PLUGIN)
    marker, runs = tmp_path / "importing", tmp_path / "runs"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
               SLUICE_TEST_MARKER=str(marker))
    proc = subprocess.Popen([sys.executable, "-m", "trainer.main", "recipe=quickstart.yaml",
                             "agent.loop=userpkg.slow:Loop", f"logging.output_dir={runs}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the checks never imported the plug-in"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.rstrip().endswith("stopped before the run started; nothing to resume")
    assert not runs.exists()
