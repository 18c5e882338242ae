"""Shared fixtures and the marker policy: tests under integration/ and gpu/ are marked
by folder, so `pytest tests/unit` stays fast and `-m "not integration"` works anywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        if parts[0] == "integration":
            item.add_marker(pytest.mark.integration)
        elif parts[0] == "gpu":
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The cached tiny model (built on first use)."""
    from trainer.run.tiny_model import ensure_tiny_model

    return ensure_tiny_model()
