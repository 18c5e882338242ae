"""`make test-gpu` runs the prepared GPU checks (tests/gpu/run_gpu_checks.py: SDPA kernel,
packed parity, the backend's train step with YaRN, memory against model_check, the weight
push between processes, DeepSpeed when present) as one test; the report is printed and
its JSON left in the test's temporary folder. A skipped check (DeepSpeed not installed)
passes, and says why in the printed summary."""

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
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    assert all(c["ok"] for c in checks.values())
    assert not any(c.get("skipped") for n, c in checks.items() if n != "deepspeed")
