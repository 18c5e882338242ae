"""Kill-and-resume with the real DeepSpeed backend: a run killed mid-step resumes from its
last checkpoint with the same step counter, version, optimizer state, data order and RNG,
so its losses equal an uninterrupted run's."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.run.checkpoint import latest_checkpoint

SCRIPT = Path(__file__).with_name("resume_run.py")
ROOT = Path(__file__).resolve().parents[2]


def run(run_dir: Path, *args: str) -> tuple[int, list[dict]]:
    # A fresh process group: earlier in-process DeepSpeed tests leave RANK/MASTER_PORT set
    # in this process, and the child would collide with the port they still hold.
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(run_dir), *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode not in (0, -9):
        pytest.fail(f"resume_run.py {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.returncode, rows


def test_killed_run_resumes_exactly(tmp_path):
    code, straight = run(tmp_path / "straight", "--steps", "5")
    assert code == 0, "uninterrupted run failed"
    code, first = run(tmp_path / "killed", "--steps", "5", "--kill-during-step", "3")
    assert code == -9 and [r["step"] for r in first] == [1, 2, 3]
    assert latest_checkpoint(tmp_path / "killed").name == "step-000003"
    code, resumed = run(tmp_path / "killed", "--steps", "5", "--resume")
    assert code == 0
    assert [r["step"] for r in resumed] == [4, 5]  # no step counted twice
    assert [r["cursor"] for r in first + resumed] == [r["cursor"] for r in straight]
    for a, b in zip(first + resumed, straight):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    kept = sorted(p.name for p in (tmp_path / "killed").glob("step-*"))
    assert kept == ["step-000004", "step-000005"]  # keep_last=2


def test_a_half_written_checkpoint_is_ignored(tmp_path):
    from resume_run import fresh_state

    from trainer.run.checkpoint import save_checkpoint

    class Backend:
        def save_state(self, folder):
            Path(folder).mkdir(parents=True)
            (Path(folder) / "w").write_text("ok")

    state = fresh_state()
    state.controller = dataclasses.replace(state.controller, version=1, data_cursor=1)
    save_checkpoint(tmp_path, Backend(), state)
    (tmp_path / ".tmp-step-000002-123").mkdir()  # a crash while writing step 2
    assert latest_checkpoint(tmp_path).name == "step-000001"
