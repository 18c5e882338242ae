"""GPU tests run only where CUDA is available; elsewhere they are skipped with the reason."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu); this machine has no GPU")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
