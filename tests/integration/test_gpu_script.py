"""tests/gpu/run_gpu_checks.py in its dry mode (`--device cpu --tiny`): every check's code
path on CPU with tiny shapes, each check run (only DeepSpeed skipped, NCCL replaced by
gloo and said so), its figures sane, and nothing heavy imported. On a GPU machine the same
script is the GPU check (`python tests/gpu/run_gpu_checks.py --out results.json`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "run_gpu_checks.py"
HEAVY = {"ray", "vllm", "omegaconf", "wandb", "datasets", "deepspeed", "flash_attn"}
CHECKS = {"sdpa_kernel", "packed_parity", "train_step", "memory_vs_length", "memory_vs_estimate",
          "weight_push", "deepspeed"}


def test_gpu_script_dry_mode_runs_every_check_and_stays_light(tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert "summary:" in run.stdout and "6 passed, 0 failed, 1 skipped (deepspeed)" in run.stdout
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert set(checks) == CHECKS
    assert all(c["ok"] and not c["failures"] for c in checks.values()), checks
    assert {n for n, c in checks.items() if c.get("skipped")} == {"deepspeed"}
    assert "needs CUDA" in checks["deepspeed"]["reason"]
    assert not HEAVY & set(report["modules"]), HEAVY & set(report["modules"])

    kernel = checks["sdpa_kernel"]  # on CPU: reported, the not-math claim is CUDA's
    assert kernel["default_backends"] and not kernel["asserted_not_math"]
    assert sum(kernel["trainer_forward"]["forward"].values()) == kernel["trainer_forward"]["num_sequences"]
    assert kernel["calls"]["tiny"]["max_rel_vs_math"] < 1e-5
    parity = checks["packed_parity"]["attentions"]["sluice_packed_sdpa"]
    assert parity["packed_vs_alone_max"] < 1e-4  # fp32 on CPU: the same kernels per sequence

    cases = checks["train_step"]["models"]["tiny"]["cases"]
    assert set(cases) == {"short", "long"}
    for case in cases.values():
        assert case["behaviour_mean"] < -5 and case["behaviour_std"] > 0  # an HF forward's, not zeros
        assert case["proximal_vs_hf_max"] < 1e-4 and abs(case["is_weight_mean"] - 1) < 1e-4
        assert case["is_capped_frac"] == 0 and min(case["moved_fraction"].values()) > 0.5
    long = cases["long"]
    assert long["past_original_positions"]  # the long sequence passes YaRN's original positions
    assert long["plain_rope_vs_yarn_mean"] > 100 * long["proximal_vs_hf_mean"]

    rows = checks["memory_vs_length"]["rows"]
    assert [r["tokens"] for r in rows] == [256, 1024]
    assert not any(r["chunked"]["oom"] or r["unchunked"]["oom"] for r in rows)
    estimate = checks["memory_vs_estimate"]
    assert {"weights", "grads", "optimizer"} <= set(estimate["estimate_parts_gib"])
    assert estimate["estimate_without_optimizer_gib"] > 0 and set(estimate["slices"]) == {"1", "2"}

    push = checks["weight_push"]
    assert push["transport"] == "gloo" and not push["nccl_exercised"]
    assert "NCCL not exercised" in push["transport_reason"]
    two = push["scenarios"]["two_pushes"]
    assert len(set(two["sent_checksums"])) == 2 and two["buckets"] > 1
    assert all(got == two["sent_checksums"] for got in two["received_checksums"].values())
    for fault in ("kill", "stop"):
        scenario = push["scenarios"][fault]
        assert scenario["gone"] == ["victim"] and scenario["served"] == ["survivor"]
        assert scenario["survivor_checksum"] == [scenario["sent_checksum"]]
    kill, stop = push["scenarios"]["kill"], push["scenarios"]["stop"]
    assert kill["seconds"] <= kill["bound_s"] < kill["timeout_s"]  # a dead peer needs no deadline
    assert stop["rank0_left_s"] <= stop["timeout_s"] + stop["grace_s"]
    assert stop["first_attempt_s"] <= stop["bound_s"]
