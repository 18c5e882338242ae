"""`make test-gpu` runs the prepared GPU checks (tests/gpu/run_gpu_checks.py) as one test;
the report (memory vs length, bf16 packed parity, flash-attn / DeepSpeed when present) is
printed and left in the test's temporary folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "run_gpu_checks.py"


def test_gpu_checks(tmp_path):
    out = tmp_path / "gpu_checks.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True,
                         text=True, timeout=900)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert all(c["ok"] for c in json.loads(out.read_text())["checks"].values())
