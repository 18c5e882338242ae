"""Stopping and resuming the whole system as a user does it, through `python -m
trainer.main`, in two starts: a SIGKILLed driver's leftovers (Ray processes, sandbox
mounts and folders) are reaped by the next start, which resumes the run
(`checkpoint.resume_from=latest` with the same run name) and continues the same metrics
file without a repeated step, with totals carried across the resume, the staleness bound
held and no more admissions than a fresh run would make; Ctrl-C (SIGINT; SIGTERM takes
the same path) mid-run then stops at a step boundary with a checkpoint, prints the resume
command, and leaves no Ray process, sandbox mount or sandbox folder behind.

The trajectories are six turns long (durable_plugins.SixTurnLogLoop, each turn appending a
line to a file in its sandbox), and those in flight when the driver is SIGKILLed continue
after the resume from their journals (rollout.durable): their journaled turns are not
generated again (their timeline rows keep the original start times and token counts), and
the file they print at the end holds each line once, in order, across the kill."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from durable_plugins import TURNS, expected_log

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # durable_plugins, the runs' agent loop
ETA = 1
B = 2


def overrides(tmp_path: Path, steps: int) -> list[str]:
    return ["recipe=quickstart.yaml", "model.warm_start=null", "eval.tasks=null",
            f"train.num_steps={steps}", "train.group_size=2", f"train.groups_per_step={B}",
            f"buffer.max_staleness={ETA}", "checkpoint.every_steps=1", "train.backend=torch",
            "agent.loop=durable_plugins:SixTurnLogLoop", f"agent.max_turns={TURNS}",
            "agent.max_new_tokens_per_turn=16", "agent.max_response_tokens=1024",
            "logging.num_transcripts_per_step=100",
            f"logging.output_dir={tmp_path}", "logging.run_name=stoppable",
            "logging.wandb_mode=disabled", "logging.console=false"]


def start(tmp_path: Path, steps: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    return subprocess.Popen([sys.executable, "-m", "trainer.main", *overrides(tmp_path, steps), *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Bounds catch hangs, not slowness: beside the suite's other whole-system run a start took
# over 240 s once (Ray's node start timed out after 40 s and was retried, then the engine
# took a minute to come up).
STEP_TIMEOUT_S = 540
pytestmark = pytest.mark.timeout(1800)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int,
                  timeout_s: float = STEP_TIMEOUT_S, metric: str = "reward/mean") -> None:
    """Until a step >= `step` logged `metric` (with a value > 0 unless it is reward/mean)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.get("step", 0) >= step and metric in r and (metric == "reward/mean" or r[metric] > 0)
               for r in metric_rows(run_dir)):
            return
        if proc.poll() is not None:
            pytest.fail(f"the run exited {proc.returncode} early:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout_s} s:\n{proc.stdout.read()[-4000:]}")


def trained_turns(run_dir: Path, after_step: int) -> dict[str, list[tuple[int, float, int]]]:
    """Per trajectory trained after `after_step`: (turn, start time, tokens) of its turns."""
    out: dict[str, list[tuple[int, float, int]]] = {}
    for e in read_rows(run_dir / "events.jsonl"):
        if e.get("kind") == "turn" and e["step"] > after_step:
            out.setdefault(e["traj"], []).append((e["turn"], e["t0"], e["tokens"]))
    return out


def wait_until_trained(proc: subprocess.Popen, run_dir: Path, after_step: int, trajs: set[str],
                       timeout_s: float = STEP_TIMEOUT_S) -> None:
    """Until one of `trajs` is trained after `after_step` (its turns on the timeline)."""
    deadline = time.monotonic() + timeout_s
    while not trajs & set(trained_turns(run_dir, after_step)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"none of {sorted(trajs)} trained after step {after_step}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.5)


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "checkpoints" / "latest").is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no checkpoint within {timeout_s} s:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.5)


def latest_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])


def wait_for_journaled_turn(proc: subprocess.Popen, run_dir: Path, timeout_s: float = STEP_TIMEOUT_S) -> None:
    """Until an in-flight trajectory's journal holds a generation that a resume from the
    latest checkpoint keeps (on a loaded machine the trajectories admitted after step 1
    may not have generated yet when its checkpoint is written)."""
    deadline = time.monotonic() + timeout_s
    while not journaled_turns(run_dir / "inflight", latest_step(run_dir)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no journaled turn within {timeout_s} s:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.2)


def sandbox_mounts(root: Path) -> list[str]:
    """The sandbox mounts under `root`: the test's own temp folder (own_tmpdir), which its
    runs' sandboxes use; other runs on this machine mount elsewhere."""
    with open("/proc/self/mounts") as f:
        return [line for line in f if f" {root}/" in line]


def process_tree(root: int) -> set[int]:
    """`root` and every process descending from it now (Ray's GCS, raylet, dashboard and
    runtime-env agents, actors, vLLM's engine core, sandboxes)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parent.items() if p == pid and c not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def alive(pids: set[int]) -> list[str]:
    out = []
    for pid in sorted(pids):
        try:
            out.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
        except OSError:
            pass
    return out


def assert_nothing_left(run_pids: set[int], run_mounts: list[str], timeout_s: float = 60) -> None:
    """None of the run's processes lives, and none of the mounts it made."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = alive(run_pids)
        with open("/proc/self/mounts") as f:
            mounts = [m for m in f if m in run_mounts]
        if (not left and not mounts) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == [] and mounts == []


def journaled_turns(folder: Path, max_version: int) -> dict[str, list[tuple[float, int]]]:
    """Per trajectory ("g3/1"), the (start time, tokens) of each generation its journal
    holds now (rollout.durable), up to the first of a version over `max_version` (weights
    a resume from that checkpoint does not have: generated again)."""
    from rollout.durable import CODEC, TurnGenerated

    out = {}
    for path in folder.glob("*/*.journal"):
        gens = [r for r in CODEC.read(str(path)).records if isinstance(r, TurnGenerated)]
        kept = [(round(g.started_at, 4), len(g.token_ids)) for g in
                itertools.takewhile(lambda g: int(g.versions.max()) <= max_version, gens)]
        if kept:
            out[f"{path.parent.name}/{path.stem}"] = kept
    return out


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def snapshot(proc: subprocess.Popen, root: Path) -> tuple[set[int], list[str]]:
    """The run's processes and its sandbox mounts now."""
    return process_tree(proc.pid), sandbox_mounts(root)


def test_a_sigkilled_run_is_reaped_resumed_and_stopped_by_ctrl_c_leaving_nothing(tmp_path, own_tmpdir):
    run_dir = tmp_path / "stoppable"
    assert sandbox_mounts(own_tmpdir) == []
    proc = start(tmp_path, 200)
    wait_for_step(proc, run_dir, 1)
    wait_for_checkpoint(proc, run_dir)  # step 1's metrics are written before its checkpoint
    wait_for_journaled_turn(proc, run_dir)
    killed_pids, killed_mounts = snapshot(proc, own_tmpdir)
    assert len(killed_pids) > 5 and killed_mounts  # Ray's processes, the engine, sandbox mounts
    os.kill(proc.pid, signal.SIGKILL)  # the driver only: its Ray processes and mounts stay
    proc.wait(timeout=30)
    killed_at = max(r["step"] for r in metric_rows(run_dir))
    # The killed run's workers go on until the resume reaps them: its journals may grow,
    # and what they hold now is replayed at least.
    journaled = journaled_turns(run_dir / "inflight", latest_step(run_dir))
    assert journaled, "the journaled turn seen before the kill is gone"  # its group returned meanwhile

    # The resume reaps what SIGKILL left, continues the run, and stops at a step boundary
    # on one Ctrl-C (SIGTERM takes the same path) with a checkpoint and the resume command.
    proc = start(tmp_path, 200, "checkpoint.resume_from=latest")
    wait_for_step(proc, run_dir, killed_at + 1)
    # ... and until a continued trajectory is trained (on the timeline after the resume),
    # its replay counted: a continued group may come back steps after the first.
    wait_for_step(proc, run_dir, killed_at + 1, metric="durable/turns_replayed")
    wait_until_trained(proc, run_dir, killed_at, set(journaled))
    pids, mounts = snapshot(proc, own_tmpdir)
    assert mounts
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, out[-4000:]  # stopped, not done: the documented code
    assert "resume with:" in out and "checkpoint.resume_from=" in out, out[-2000:]
    rows = [r for r in metric_rows(run_dir) if "reward/mean" in r]
    steps = [r["step"] for r in rows]
    stopped_at = steps[-1]
    assert stopped_at > killed_at and steps == list(range(1, stopped_at + 1)), steps  # none twice
    # The step it stopped at is checkpointed; the killed run's leftovers were reaped by the
    # resume, and the resumed run left nothing behind.
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{stopped_at:06d}"
    assert_nothing_left(killed_pids | pids, killed_mounts + mounts)

    admitted = [r["buffer/admitted"] for r in rows]
    trained = [r["buffer/trained"] for r in rows]
    assert trained == [B * s for s in steps]  # totals across the resume, not restarting at 0
    assert all(a2 >= a1 for a1, a2 in zip(admitted, admitted[1:]))
    # Never more than (eta + 1) * B groups alive (running + buffered) at a step boundary,
    # before or after a resume: admitted - trained - dropped is exactly that number.
    for r in rows:
        dropped = sum(v for k, v in r.items() if k.startswith("buffer/dropped_"))
        assert r["buffer/admitted"] - r["buffer/trained"] - dropped <= (ETA + 1) * B
    assert all(r["staleness/max"] <= ETA for r in rows)
    assert (run_dir / "config.yaml").is_file()
    assert [r for r in rows if "rollout/tool_parse/ok" in r]  # tool-parse counts reach metrics.jsonl

    # In-flight trajectories continued from their journals: their journaled turns were not
    # generated again (the timeline shows them with the start times the killed run gave them)
    # and their sandboxes came back as they were (each line of the file once, in order).
    resumed = [r for r in rows if r["step"] > killed_at]
    replayed = max(r.get("durable/turns_replayed", 0) for r in resumed)
    assert journaled and max(r.get("durable/continued", 0) for r in resumed) >= 1 and replayed >= 1
    trained = trained_turns(run_dir, killed_at)
    continued = {traj: sorted(trained[traj]) for traj in journaled if traj in trained}
    assert continued, (sorted(journaled), sorted(trained))
    for traj, rows_of in continued.items():
        before = journaled[traj]
        assert [(t0, n) for _, t0, n in rows_of[:len(before)]] == before, traj
    logs = [t["response"] for t in read_rows(run_dir / "transcripts.jsonl") if t["step"] > killed_at
            and f"{t['group_id']}/{t['index']}" in continued and t["termination"] == "finished"]
    assert logs and all(text.count(expected_log()) == 1 and text.count("turn-1\n") == 1 for text in logs)
    print(f"\njournaled turns at the kill: {sum(len(v) for v in journaled.values())} in {len(journaled)} "
          f"trajectories (all generated again before durable trajectories); replayed after the resume: "
          f"{replayed}; {len(continued)} of them trained after the resume, none of their journaled turns "
          f"generated again")
