"""The models sluice builds locally instead of downloading, by the name a recipe gives
them (`model.path`, `reward.judge.model_path`): built into the cache on first use, on every
node from code, so that a run on a machine without a model hub still has a policy.

    tiny      the ~0.5M-parameter text model (trainer.run.tiny_model)
    tiny-vl   the tiny Idefics3 vision-language model (trainer.run.tiny_vl_model)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def _tiny() -> Path:
    from trainer.run.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


def _tiny_vl() -> Path:
    from trainer.run.tiny_vl_model import ensure_tiny_vl_model

    return ensure_tiny_vl_model()


LOCAL_MODELS: dict[str, Callable[[], Path]] = {"tiny": _tiny, "tiny-vl": _tiny_vl}
LOCAL_MODELS_HELP = "'tiny' (text) or 'tiny-vl' (vision-language) for a local test model"


def is_local_model(path: str) -> bool:
    return path in LOCAL_MODELS


def local_model_folder(path: str) -> Path | None:
    """The cached folder of the local model `path` names (built first where missing); None
    when `path` names none (it is then a folder of the user's)."""
    build = LOCAL_MODELS.get(path)
    return build() if build is not None else None
