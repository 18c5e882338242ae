"""tests/gpu/run_gpu_checks.py runs its CPU-safe parts here (a smaller Qwen3 shape, short
sequences, the real 151,936-entry vocabulary) and imports nothing beyond torch,
transformers and the sluice modules they need; on a GPU machine the same script is the
GPU check (`python tests/gpu/run_gpu_checks.py --out results.json`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "run_gpu_checks.py"
HEAVY = {"ray", "vllm", "omegaconf", "wandb", "datasets", "deepspeed", "flash_attn"}


def test_gpu_script_cpu_mode_passes_and_stays_light(tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--layers",
                          "1", "--lengths", "64,160", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["checks"]) == {"memory_vs_length", "packed_parity", "deepspeed"}
    assert all(c["ok"] for c in report["checks"].values())
    assert report["checks"]["deepspeed"].get("skipped")  # CUDA only
    assert [r["tokens"] for r in report["memory_vs_length"]] == [64, 160]
    parity = report["checks"]["packed_parity"]["detail"]["sluice_packed_sdpa"]
    assert parity["packed_vs_alone_max"] < 1e-4  # fp32 on CPU: the same kernels per sequence
    assert not HEAVY & set(report["modules"]), HEAVY & set(report["modules"])
