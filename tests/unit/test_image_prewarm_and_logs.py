"""Image prewarm's decisions (present, loaded from an archive, pulled, missing: named) on
a fake engine, the pool metrics it feeds, and the swebench log path's reading of a
runner's output: statuses, forged lines, exit-code cross-check; and which backend a
recipe's image tasks need."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from envs.pool_metrics import PoolMetrics
from envs.sandbox import images
from envs.sandbox.engine import ContainerEngine
from envs.types import GradingSpec, Message, Task
from reward.grading.junit import Outcome

FAKE_ENGINE = ContainerEngine("podman", "/fake/podman", "/fake/catatonit")


class FakeStorage:
    """A fake engine's image storage: `load -i` adds what the archive holds, `pull`
    reaches no registry unless `registry` has the image."""

    def __init__(self, present: set[str], registry: set[str] = frozenset()) -> None:
        self.present, self.registry, self.calls = set(present), set(registry), []

    def exists(self, engine: ContainerEngine, image: str) -> bool:
        return image in self.present

    def run(self, engine: ContainerEngine, *args: str, **kw: object) -> str:
        self.calls.append(args[0])
        if args[0] == "load":
            self.present.add(Path(args[2]).read_text())
        elif args[0] == "pull":
            if args[-1] not in self.registry:
                raise OSError("no registry reachable")
            self.present.add(args[-1])
        return ""


@pytest.fixture
def storage(monkeypatch: pytest.MonkeyPatch) -> FakeStorage:
    fake = FakeStorage({"localhost/a"}, registry={"docker.io/x/pulled"})
    monkeypatch.setattr(images.engines, "image_exists", fake.exists)
    monkeypatch.setattr(images.engines, "run_engine", fake.run)
    return fake


def test_prewarm_loads_archives_pulls_where_it_can_and_names_the_missing(
        storage: FakeStorage, tmp_path: Path) -> None:
    (tmp_path / images.archive_name("localhost/b:1")).write_text("localhost/b:1")
    got = images.prewarm_images(["localhost/a", "localhost/b:1", "docker.io/x/pulled",
                                 "localhost/a"], str(tmp_path), FAKE_ENGINE)
    assert (got.num_ready, got.num_loaded, got.num_pulled) == (1, 1, 1)
    with pytest.raises(ValueError, match=r"2 task image\(s\).*\['localhost/gone', "
                                         r"'quay.io/y/none'\].*localhost_gone.tar"):
        images.prewarm_images(["localhost/a", "quay.io/y/none", "localhost/gone"],
                              str(tmp_path), FAKE_ENGINE)
    assert storage.calls.count("pull") == 2  # localhost/ names are never pulled


def test_prewarm_counts_reach_env_metrics() -> None:
    from envs.pool import DurationRecorder, PoolStats

    summary = DurationRecorder((1.0,)).summary()
    stats = PoolStats(max_sandboxes=1, num_in_use=0, num_warm=0, num_creating=0,
                      queue_length=0, queue_wait=summary, create=summary, exec=summary,
                      num_acquires=0, num_warm_hits=0, num_evictions=0, num_create_failures=0,
                      num_execs=0, num_timeouts=0, num_oom_kills=0, num_crashes=0,
                      num_recreates=0, num_recreate_failures=0, num_snapshots=0,
                      num_snapshot_failures=0, num_images_ready=20, num_images_loaded=2)
    out = PoolMetrics().update([stats, stats])
    assert (out["env/images_ready"], out["env/images_loaded"], out["env/images_pulled"]) == \
        (40.0, 4.0, 0.0)


TEST = "test_a (app.tests.T.test_a)"
RUNNER_TASK = Task("r", (Message("user", "x"),), image="localhost/r", workdir="/testbed",
                   grading=GradingSpec(fail_to_pass=(TEST,), pass_to_pass=("test_b (app.tests.T.test_b)",),
                                       test_command="python3 tests/runtests.py app",
                                       log_parser="parse_log_django"))


def test_runner_output_statuses_and_forged_lines() -> None:
    pytest.importorskip("swebench")
    from reward.grading.swebench_log import exit_code_finding, parse_statuses

    log = (f"{TEST} ... FAIL\ntest_b (app.tests.T.test_b) ... ok\n\n"
           f"======\nFAIL: {TEST}\n------\nAssertionError\n")
    statuses, forged = parse_statuses(RUNNER_TASK, log)
    # (swebench's django parser also files the "FAIL: test_a (...)" header as "test_a")
    assert statuses[TEST] is Outcome.FAILED
    assert statuses["test_b (app.tests.T.test_b)"] is Outcome.PASSED
    assert forged == [] and exit_code_finding(statuses, 1) == []
    # A line the agent's code printed ahead of the real one: swebench's parser alone
    # would keep the last status; both are there, so it is tampering.
    _, forged = parse_statuses(RUNNER_TASK, f"{TEST} ... ok\n" + log)
    assert [f.name for f in forged] == ["report_disagreed"] and TEST in forged[0].detail
    ok = {TEST: Outcome.PASSED}
    assert [f.name for f in exit_code_finding(ok, 1)] == ["report_disagreed"]
    assert exit_code_finding(ok, 0) == []


def test_runner_tasks_need_command_and_parser_together() -> None:
    with pytest.raises(ValueError, match="test_command and log_parser go together"):
        GradingSpec(fail_to_pass=(TEST,), log_parser="parse_log_django")
    with pytest.raises(ValueError, match="is not a pytest node id"):
        GradingSpec(fail_to_pass=(TEST,))
    with pytest.raises(ValueError, match="workdir.*needs an image"):
        Task("r", (Message("user", "x"),), source_dir="/s", workdir="/testbed")


def test_recipe_images_and_the_backend_they_need() -> None:
    from trainer.run.config import SluiceConfig
    from trainer.run.system import task_images

    local = Task("l", (Message("user", "x"),), source_dir="/s", image="localhost/l")
    cfg = SluiceConfig()
    assert cfg.envs.sandbox_backend == "local"
    assert task_images(cfg, [local, local]) == ["localhost/l"]  # ignored by local pools
    with pytest.raises(ValueError, match="envs.sandbox_backend=container"):
        task_images(cfg, [RUNNER_TASK])  # its repository is in its image: local cannot run it
    cfg = dataclasses.replace(cfg, envs=dataclasses.replace(cfg.envs, sandbox_backend="container"))
    assert task_images(cfg, [local, RUNNER_TASK, local]) == ["localhost/l", "localhost/r"]
