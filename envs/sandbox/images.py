"""Task images on a sandbox node: make every image a recipe names present before the first
step (prewarm), and read the repository an image keeps at its workdir (`/testbed` for
SWE-bench and SWE-smith images) out into a host folder.

    prewarm_images(images, archive_dir)
        in local storage?  -> ready
        else archive_dir/<image as file name>.tar?  -> `load -i` -> loaded
        else a registry reachable?  -> `pull` -> pulled
        else missing: ValueError naming every missing image and where it was looked for

    image_workdir_source(image, workdir) -> host folder with the image's <workdir>, copied
        out once per image id (content-addressed: a rebuilt image gets a new folder) under
        $SLUICE_CACHE_DIR/image_src; the workspace of a sandbox on that image is filled
        from it and the agent's changes are computed against it.

The workspace stays a host folder (the container backend binds it at the workdir), so
snapshots, file tools, the final-workspace capture and the grading locks work the same
on an image as on a source folder.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass

from envs.cache import build_once, default_cache_dir
from envs.sandbox import engine as engines
from envs.types import Task

log = logging.getLogger(__name__)

ARCHIVE_SUFFIX = ".tar"


@dataclass(frozen=True, slots=True)
class ImagePrewarm:
    """What prewarm found and did on one node (the env/images_* metrics)."""

    num_ready: int = 0  # already in local storage
    num_loaded: int = 0  # loaded from a local archive
    num_pulled: int = 0  # pulled from a registry


def archive_name(image: str) -> str:
    """The archive file name of `image` (`podman save -o`): its name with every character
    outside [A-Za-z0-9_.-] as '_'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", image) + ARCHIVE_SUFFIX


def default_archive_dir() -> str:
    return str(default_cache_dir() / "images" / "archives")


def prewarm_images(images: list[str] | tuple[str, ...], archive_dir: str | None = None,
                   engine: engines.ContainerEngine | None = None) -> ImagePrewarm:
    """Make every image in `images` present in this node's engine storage (see the module
    docstring); ValueError naming the missing ones."""
    wanted = sorted(set(images))
    if not wanted:
        return ImagePrewarm()
    engine = engine or engines.detect_engine()
    archive_dir = archive_dir or default_archive_dir()
    ready = loaded = pulled = 0
    missing = []
    for image in wanted:
        if engines.image_exists(engine, image):
            ready += 1
            continue
        archive = os.path.join(archive_dir, archive_name(image))
        if os.path.isfile(archive):
            log.info("loading image %s from %s", image, archive)
            engines.run_engine(engine, "load", "-i", archive, timeout_s=1800)
            if engines.image_exists(engine, image):
                loaded += 1
                continue
        if _pull(engine, image):
            pulled += 1
            continue
        missing.append(image)
    if missing:
        raise ValueError(
            f"{len(missing)} task image(s) are not on this sandbox node and could not be "
            f"loaded or pulled: {missing}; build them here (python -m envs.tasks.build_swe_smith "
            f"... --images), or put `{engine.name} save -o` archives named like "
            f"{archive_name(missing[0])!r} in {archive_dir}")
    return ImagePrewarm(num_ready=ready, num_loaded=loaded, num_pulled=pulled)


def _pull(engine: engines.ContainerEngine, image: str) -> bool:
    """Pull `image` if a registry serves it; False when none is reachable (these
    machines reach none) or the image is unknown. Local names are never pulled."""
    if image.startswith("localhost/"):
        return False
    try:
        engines.run_engine(engine, "pull", "--quiet", image, timeout_s=600)
    except OSError as e:
        log.info("pulling %s failed: %s", image, str(e)[-200:])
        return False
    return engines.image_exists(engine, image)


def image_id(engine: engines.ContainerEngine, image: str) -> str:
    return engines.run_engine(engine, "image", "inspect", "--format", "{{.Id}}", image,
                              timeout_s=60).strip()


def image_workdir_source(image: str, workdir: str, cache_dir: str | None = None,
                         engine: engines.ContainerEngine | None = None) -> str:
    """A host folder holding what `image` keeps at `workdir` (see the module docstring)."""
    if not os.path.isabs(workdir) or workdir.rstrip("/") in ("", "/usr", "/etc"):
        raise ValueError(f"workdir {workdir!r} must be an absolute path of the image's "
                         "repository, such as /testbed")
    engine = engine or engines.detect_engine()
    if not engines.image_exists(engine, image):
        raise ValueError(f"image {image!r} is not in {engine.name}'s local storage on this "
                         "node; build it here or put its `podman save` archive in "
                         f"{default_archive_dir()} for prewarm")
    digest = image_id(engine, image)[:16]
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{image}{workdir}")[-80:]
    dest = os.path.join(cache_dir or str(default_cache_dir()), "image_src", f"{safe}-{digest}")
    return build_once(dest, lambda tmp: _copy_out(engine, image, workdir, tmp))


def _copy_out(engine: engines.ContainerEngine, image: str, workdir: str, dest: str) -> None:
    if engine.name != "podman":
        raise ValueError(f"reading {workdir} out of {image!r} needs podman's `image mount`; "
                         f"{engine.name} has none")
    root = engines.run_engine(engine, "image", "mount", image, timeout_s=120).strip()
    try:
        src = os.path.join(root, workdir.lstrip("/"))
        if not os.path.isdir(src) or os.path.islink(src):
            raise ValueError(f"image {image!r} has no folder {workdir}; set the row's "
                             "workdir to where the image keeps the repository")
        shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
    finally:
        engines.run_engine(engine, "image", "unmount", image, timeout_s=120)


_sources: dict[tuple[str, str], str] = {}  # (image, workdir) -> its folder, this process


def task_source_dir(task: Task) -> str | None:
    """The folder a sandbox for `task` starts from on this node: its source_dir, or for an
    image-only task (Task.workdir) the image's repository read out of it (looked up once
    per process: images do not change under a running job)."""
    if task.source_dir is not None or task.workdir is None:
        return task.source_dir
    assert task.image is not None  # Task checks that a workdir has an image
    key = (task.image, task.workdir)
    if key not in _sources or not os.path.isdir(_sources[key]):
        _sources[key] = image_workdir_source(task.image, task.workdir)
    return _sources[key]
