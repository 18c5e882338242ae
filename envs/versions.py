"""Installed package versions, as a run's record (trainer.run.system.run_info), its report
(launch.report) and cache keys (rollout.template_check) name them."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable


def installed_versions(names: Iterable[str]) -> dict[str, str]:
    """name -> installed version, for each of `names` installed here (absent ones left out)."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
