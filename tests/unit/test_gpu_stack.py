"""The doctor's GPU stack check (launch.gpu_stack) on reports as GPU nodes would send them:
torch's CUDA 13.0 build on an R570 driver is named with what to install, a matching stack
passes with its versions, and a cluster of logical GPUs is one skipped check."""

from __future__ import annotations

from launch.gpu_stack import GpuStack, check_gpu_stacks, probe_gpu_stack

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
