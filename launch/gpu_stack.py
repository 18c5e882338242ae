"""The GPU software stack of a node as the doctor checks it: the NVIDIA driver against the
CUDA version torch was built for (torch 2.13's CUDA 13.0 build needs an R580 driver, and
many H100 fleets run R535-R570: every rank would die with "torch sees no GPU"), and the
NCCL and nvcc versions beside it. `probe_gpu_stack` runs on the node (plain data back
through Ray); `check_gpu_stacks` is a pure function over what the nodes report.
`python -m launch.gpu_stack` checks this machine the same way: GPU set-up
(`SLUICE_DEVICE=gpu make setup`) runs it last."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launch.checks import Check

# The oldest driver each CUDA major runs on (NVIDIA's CUDA toolkit release notes, table 3:
# minor-version compatibility; Linux x86_64).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
FORWARD_COMPAT = ("or, on datacenter GPUs, CUDA forward compatibility: the cuda-compat-{major}-{minor} "
                  "package on the node and its compat folder first on LD_LIBRARY_PATH "
                  "(/usr/local/cuda-{major}.{minor}/compat)")


@dataclass(frozen=True, slots=True)
class GpuStack:
    """What one node reports; None where the part is missing."""

    driver: str | None = None  # nvidia-smi's driver_version, e.g. "570.86.15"
    gpus: int = 0  # GPUs nvidia-smi lists
    torch_cuda: str | None = None  # torch.version.cuda: the CUDA torch was built for
    nccl: str | None = None  # the NCCL torch carries
    nvcc: str | None = None  # nvcc's release (only builds from source need it)


def probe_gpu_stack() -> GpuStack:
    """Runs on one node."""
    import torch
    import torch.cuda.nccl

    driver, gpus = None, 0
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            driver, gpus = (out[0], len(out)) if out else (None, 0)
        except (OSError, subprocess.TimeoutExpired):
            pass
    nccl = None
    try:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except (RuntimeError, AttributeError):  # a CPU build of torch has no NCCL
        pass
    nvcc = None
    if shutil.which("nvcc"):
        try:
            text = subprocess.run(["nvcc", "--version"], capture_output=True, text=True,
                                  timeout=30).stdout
            found = re.search(r"release (\d+\.\d+)", text)
            nvcc = found.group(1) if found else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return GpuStack(driver, gpus, torch.version.cuda, nccl, nvcc)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def check_gpu_stacks(stacks: Mapping[str, GpuStack]) -> list[Check]:
    """One check per node that offers GPUs; a cluster none of whose GPU nodes has a driver
    (logical GPUs, as ray.cluster_utils makes) is one skipped check saying what it would do."""
    if not stacks:
        return []
    if all(s.driver is None for s in stacks.values()):
        return [Check(True, "gpu stack", f"skipped: no GPU (no NVIDIA driver on any of the "
                      f"{len(stacks)} GPU nodes; logical GPUs only): would check the driver "
                      f"against the CUDA torch was built for, and report NCCL and nvcc")]
    return [_check_node(node, s) for node, s in sorted(stacks.items())]


def _check_node(node: str, s: GpuStack) -> Check:
    what = f"gpu stack {node}"
    if s.driver is None:
        return Check(False, what, "no NVIDIA driver answers (nvidia-smi missing or failing) on a "
                     "node that offers GPUs: install the driver, or start the node without GPUs")
    if s.torch_cuda is None:
        return Check(False, what, f"driver {s.driver}, but torch is a CPU build: set the node up "
                     f"with `SLUICE_DEVICE=gpu make setup`")
    major, minor = (_version(s.torch_cuda) + (0, 0))[:2]
    need = MIN_DRIVER.get(major)
    found = f"driver {s.driver}, torch built for CUDA {s.torch_cuda}, NCCL {s.nccl or 'none'}" + \
        (f", nvcc {s.nvcc}" if s.nvcc else ", no nvcc (needed only to build flash-attn)")
    if need is not None and _version(s.driver) < _version(need):
        return Check(False, what, f"{found}: CUDA {major}.x needs driver >= {need}; install an "
                     f"R{_version(need)[0]}+ driver, " + FORWARD_COMPAT.format(major=major, minor=minor))
    if s.nvcc is not None and _version(s.nvcc)[:1] != (major,):
        return Check(False, what, f"{found}: nvcc's CUDA {s.nvcc} differs from torch's "
                     f"{s.torch_cuda} in its major version; builds from source (flash-attn) fail: "
                     f"put CUDA {major}.x's nvcc first on PATH")
    return Check(True, what, found)


def main(argv: Sequence[str] | None = None) -> int:
    """This machine's GPU stack as the doctor checks a GPU node: 0 when it can run the CUDA
    torch installed here, 1 with what to install when it cannot. A machine without any
    NVIDIA driver (a CPU head node preparing a shared environment) only gets a note."""
    parser = argparse.ArgumentParser(
        prog="python -m launch.gpu_stack",
        description="Check this machine's NVIDIA driver against the CUDA version torch was "
                    "built for, and report NCCL and nvcc (what `launch.doctor` checks on "
                    "every GPU node of a cluster).")
    parser.parse_args(argv)
    stack = probe_gpu_stack()
    if stack.driver is None:
        print("gpu stack: no NVIDIA driver answers here (nvidia-smi): nothing to check on this "
              "machine; `python -m launch.doctor recipe=...` checks every GPU node of the cluster")
        return 0
    check = _check_node("here", stack)
    print(f"gpu stack: {'ok' if check.ok else 'PROBLEM'}: {check.detail}")
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
