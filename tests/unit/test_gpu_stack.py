"""The doctor's GPU stack check (launch.gpu_stack) on reports as GPU nodes would send them:
torch's CUDA 13.0 build on an R570 driver is named with what to install, a matching stack
passes with its versions, and a cluster of logical GPUs is one skipped check. GPU set-up
(scripts/setup.sh with SLUICE_DEVICE=gpu) checks its own machine the same way every time
(`python -m launch.gpu_stack`) and fails saying why; a machine without a driver gets a note."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch import gpu_stack
from launch.gpu_stack import GpuStack, check_gpu_stacks, probe_gpu_stack

ROOT = Path(__file__).resolve().parents[2]

H100_R580 = GpuStack(driver="580.82.07", gpus=8, torch_cuda="13.0", nccl="2.28.3", nvcc=None)


def test_a_cuda_13_torch_on_an_r570_driver_says_what_to_install():
    old = GpuStack(driver="570.172.08", gpus=8, torch_cuda="13.0", nccl="2.28.3")
    [ok, missing] = check_gpu_stacks({"10.0.0.1": H100_R580, "10.0.0.2": old})
    assert ok.ok and ok.what == "gpu stack 10.0.0.1"
    assert "driver 580.82.07, torch built for CUDA 13.0, NCCL 2.28.3" in ok.detail
    assert not missing.ok and missing.what == "gpu stack 10.0.0.2"
    assert "CUDA 13.x needs driver >= 580.65.06; install an R580+ driver" in missing.detail
    assert "cuda-compat-13-0" in missing.detail and "/usr/local/cuda-13.0/compat" in missing.detail


def test_a_cpu_torch_no_driver_or_a_mismatched_nvcc_are_named():
    checks = check_gpu_stacks({
        "a": GpuStack(driver="580.82.07", gpus=8, torch_cuda=None),
        "b": GpuStack(driver=None),
        "c": GpuStack(driver="580.82.07", gpus=8, torch_cuda="13.0", nccl="2.28.3", nvcc="12.4"),
        "d": GpuStack(driver="535.104.05", gpus=8, torch_cuda="12.8", nccl="2.26.2", nvcc="12.8")})
    assert [c.ok for c in checks] == [False, False, False, True]
    assert "SLUICE_DEVICE=gpu make setup" in checks[0].detail
    assert "no NVIDIA driver answers" in checks[1].detail
    assert "put CUDA 13.x's nvcc first on PATH" in checks[2].detail


def test_logical_gpus_only_is_one_skipped_check_and_this_machine_probes_as_such():
    here = probe_gpu_stack()  # a CPU machine: no driver, torch's CPU build
    assert here.driver is None and here.torch_cuda is None
    [check] = check_gpu_stacks({"n1": here, "n2": here})
    assert check.ok and check.detail.startswith("skipped: no GPU (no NVIDIA driver on any of the 2")
    assert check_gpu_stacks({}) == []


def test_this_machines_check_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(gpu_stack, "probe_gpu_stack",
                        lambda: GpuStack("570.86.15", 8, "13.0", "2.27.7", None))
    assert gpu_stack.main([]) == 1
    out = capsys.readouterr().out
    assert "gpu stack: PROBLEM: driver 570.86.15" in out and "needs driver >= 580.65.06" in out
    assert "cuda-compat-13-0" in out
    monkeypatch.setattr(gpu_stack, "probe_gpu_stack", lambda: H100_R580)
    assert gpu_stack.main([]) == 0 and "gpu stack: ok: driver 580" in capsys.readouterr().out


def _gpu_setup(tmp_path: Path, path: str) -> subprocess.CompletedProcess:
    """scripts/setup.sh for a GPU machine whose environment is already set up (its stamp
    matches), with this environment's Python standing in for it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()
                            + (ROOT / "scripts" / "setup.sh").read_bytes()).hexdigest()
    (venv / ".sluice-setup").write_text(f"{digest}-gpu-flash0\n")
    env = {**os.environ, "SLUICE_VENV": str(venv), "SLUICE_DEVICE": "gpu", "PATH": path}
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=120)


def test_gpu_setup_checks_the_stack_every_time_and_fails_saying_why(tmp_path):
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 570.86.15\n")  # a driver, beside this CPU build of torch
    smi.chmod(0o755)
    done = _gpu_setup(tmp_path, f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "is up to date" in done.stdout
    assert "gpu stack: PROBLEM: driver 570.86.15, but torch is a CPU build" in done.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a driver")
def test_gpu_setup_without_a_driver_only_notes_it(tmp_path):
    done = _gpu_setup(tmp_path, os.environ["PATH"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no NVIDIA driver answers here" in done.stdout
