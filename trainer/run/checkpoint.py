"""Checkpoints: the backend's state (model, optimizer, scheduler, version) plus the run's
own state (the controller's `ControllerState`: version, data cursor, tasks in flight, the
buffer's groups and totals; and the RNG states), written atomically so a crash mid-write
leaves the previous checkpoint usable.

Layout under the run folder:
    checkpoints/step-000012/{backend/, run_state.pkl, model/}   one folder per checkpoint
    checkpoints/latest                                   name of the newest complete one
`model/` holds the policy folder's files other than weights (config, tokenizer, chat
template), so `python -m trainer.export` can turn any checkpoint into a Hugging Face
folder without the run's caches.
A checkpoint folder is written under a temporary name and renamed when complete; `latest`
is replaced with os.replace. Resume restarts at the saved version (no step counted twice)
and re-admits the tasks that were in flight.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from trainer.run.controller import ControllerState

log = logging.getLogger(__name__)

LATEST = "latest"
MODEL_FILES = "model"  # the policy folder's non-weight files, inside each checkpoint
# Weight files (and their shard indexes) of a Hugging Face folder: never copied along.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


class Checkpointable(Protocol):
    def save_state(self, folder: Path) -> None: ...
    def load_state(self, folder: Path) -> None: ...


@dataclass(slots=True)
class RunState:
    controller: ControllerState  # owned and produced by the controller
    rng: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:  # completed training steps (== policy version)
        return self.controller.version


def capture_rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.random.get_rng_state()}


def restore_rng(rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.random.set_rng_state(rng["torch"])


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(root: str | Path, backend: Checkpointable, state: RunState,
                    keep_last: int = 2, model_dir: str | Path | None = None) -> Path:
    """Write checkpoint `step-<state.step>` atomically, point `latest` at it, prune old ones.
    `model_dir`: the policy's Hugging Face folder, whose non-weight files are kept along."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.step:06d}"
    final, tmp = root / name, root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    backend.save_state(tmp / "backend")
    if model_dir is not None:
        copy_model_files(model_dir, tmp / MODEL_FILES)
    state.rng = capture_rng()
    with (tmp / "run_state.pkl").open("wb") as f:
        pickle.dump(state, f)
    _fsync_tree(tmp)
    if final.exists():  # a re-save of the same step (e.g. after resume): replace it whole
        shutil.rmtree(final)
    tmp.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / LATEST)
    _prune(root, keep_last)
    log.info("checkpoint %s written", final)
    return final


def copy_model_files(model_dir: str | Path, dst: str | Path, skip: tuple[str, ...] = ()) -> None:
    """Copy a Hugging Face folder's files except its weights (config, generation config,
    tokenizer files, chat template) and those named in `skip` into `dst`."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name not in skip:
            shutil.copy2(path, dst / path.name)


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "run_state.pkl").is_file() else None


def read_run_state(path: str | Path) -> RunState:
    """The run state of a checkpoint folder alone (no backend, no RNG restored)."""
    path = Path(path)
    if not (path / "run_state.pkl").is_file():
        raise ValueError(f"{path} is not a complete sluice checkpoint (no run_state.pkl); "
                         f"set checkpoint.resume_from to a step-* folder or 'latest'")
    with (path / "run_state.pkl").open("rb") as f:
        state: RunState = pickle.load(f)
    return state


def load_checkpoint(path: str | Path, backend: Checkpointable) -> RunState:
    """Load backend and run state from a checkpoint folder; restores the RNG states."""
    state = read_run_state(path)
    backend.load_state(Path(path) / "backend")
    restore_rng(state.rng)
    return state
