"""Per-task container images for the bundled SWE-smith-style tasks, built locally with
podman from a local root filesystem (these machines pull nothing):

    base     a root filesystem of this host's own files: /usr/bin/python3.11 and its
             standard library, a shell, coreutils, git, and the shared libraries they
             load (ldd closure)  --podman import-->  localhost/sluice-swe-base:<hash>
    project  FROM base + the project's pinned dependencies, installed from the package
             index (pip --target on the host, same Python ABI) into
             /usr/local/lib/python3.11/dist-packages  --podman build-->
             localhost/sluice-swe-deps.<project>:<hash>
    task     FROM project + the repository at the task's base commit (a fresh one-commit
             git repository) at /testbed  --podman build-->
             localhost/swesmith.x86_64.<owner>_1776_<name>.<commit[:8]> (SWE-smith's name)

Every layer is keyed by what built it (file list and host Python for the base, the pins
for a project, the commit for a task): an image whose tag exists is not rebuilt, and the
root filesystems and dependency folders are cached under $SLUICE_CACHE_DIR/images. Images
live in podman's storage and, with `save_archive`, as `podman save` archives that
envs.sandbox.images.prewarm_images loads on other sandbox nodes; none is committed.

Images for a user's own SWE-style rows (docs/tasks.md, "Images for your own rows"):

    python -m envs.tasks.images build ROWS.jsonl [--out DIR] [--archive]

reads each row's instance_id, repo (or repo_name), base_commit (or commit_hash), optional
`requirements` (pinned pip requirements: the project layer) and `repo_dir` (the local
repository; default repos/<owner>__<name> beside the rows), checks every row first (all
problems listed, exit 2, nothing built), builds each task's image with `build_image_for`
(the bundled builders' path too) and writes DIR/tasks.jsonl: the rows as image-only rows
(`image_name`, `"workdir": "/testbed"`).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from envs.cache import build_once, default_cache_dir
from envs.progress import FirstUse
from envs.sandbox import engine as engines
from envs.sandbox.images import archive_name, default_archive_dir
from envs.tasks.rows import Row, RowRef, get_str, get_str_list, read_rows
from envs.tasks.swe import (IMAGE_WORKDIR, aliased_field, export_base_snapshot, find_repo_dir,
                            resolve_commit)

log = logging.getLogger(__name__)
T = TypeVar("T")

BUILDER_VERSION = "1"  # bump when the recipe of the base changes
PROJECT_LAYER_VERSION = "2"  # ... of a project's layer (2: shared libraries its wheels load)
BASE_REPO = "localhost/sluice-swe-base"
PYTHON = "/usr/bin/python3.11"
SITE_PACKAGES = "/usr/local/lib/python3.11/dist-packages"  # on Debian's python3.11 sys.path
TOOLS = ("sh", "dash", "bash", "env", "ls", "cat", "cp", "mv", "rm", "mkdir", "rmdir", "chmod",
         "touch", "head", "tail", "grep", "sed", "find", "xargs", "diff", "patch", "sort", "uniq",
         "wc", "tr", "cut", "timeout", "sleep", "true", "false", "echo", "test", "dirname",
         "basename", "readlink", "realpath", "which", "tee", "id", "ln", "stat", "date", "awk",
         "mawk", "git", "python3.11")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "nsswitch.conf")
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"


def image_storage_dir() -> str:
    return str(default_cache_dir() / "images")


def _digest(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def _host_files() -> list[str]:
    """Every host file the base needs: the tools, python's standard library, git's
    helpers, and the shared libraries all of their binaries load."""
    files: set[str] = set()
    for name in TOOLS:
        path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if path is None:
            raise ValueError(f"the base image needs `{name}` from this host; install it")
        files.add(os.path.realpath(path) if not path.startswith("/usr/") else path)
        files.add(os.path.realpath(path))
    for root in ("/usr/lib/python3.11", "/usr/lib/git-core"):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "test", "idlelib",
                                                            "tkinter", "turtledemo", "ensurepip")]
            files.update(os.path.join(dirpath, f) for f in filenames)
    binaries = [f for f in files if _is_elf(f)]
    files.update(_shared_libraries(binaries))
    files.update(f"/etc/{n}" for n in ETC_FILES if os.path.isfile(f"/etc/{n}"))
    return sorted(files)


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _shared_libraries(binaries: list[str]) -> set[str]:
    found: set[str] = set()
    for i in range(0, len(binaries), 200):
        out = subprocess.run(["ldd", *binaries[i:i + 200]], capture_output=True, text=True,
                             check=False).stdout
        for line in out.splitlines():
            parts = line.split()
            for p in parts:
                if p.startswith("/") and os.path.exists(p):
                    found.add(p)
                    found.add(os.path.realpath(p))
    return found


def _write_rootfs(files: list[str], dest: str) -> None:
    for name, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"),
                         ("lib64", "usr/lib64")):
        os.makedirs(os.path.join(dest, target), exist_ok=True)
        os.symlink(target, os.path.join(dest, name))
    for name in ("tmp", "var/tmp"):
        os.makedirs(os.path.join(dest, name), exist_ok=True)
        os.chmod(os.path.join(dest, name), 0o1777)
    for name in ("proc", "dev", "sys", "run", "root", "testbed", "etc", SITE_PACKAGES[1:]):
        os.makedirs(os.path.join(dest, name), exist_ok=True)
    _write_files(files, dest)
    for link, to in (("usr/bin/python3", "python3.11"), ("usr/bin/python", "python3.11")):
        if not os.path.lexists(os.path.join(dest, link)):
            os.symlink(to, os.path.join(dest, link))
    with open(os.path.join(dest, "etc/passwd"), "w") as f:
        f.write(PASSWD)
    with open(os.path.join(dest, "etc/group"), "w") as f:
        f.write(GROUP)
    with open(os.path.join(dest, "etc/hosts"), "w") as f:
        f.write("127.0.0.1 localhost\n")


def _write_files(files: Iterable[str], dest: str) -> None:
    """Copy host `files` under `dest` at their paths (links as links)."""
    for path in files:
        # Through the host's merged-/usr links: /lib/x -> usr/lib/x in the image.
        rel = os.path.relpath(path, "/")
        first = rel.split("/", 1)[0]
        if first in ("bin", "sbin", "lib", "lib64"):
            rel = f"usr/{rel}"
        target = os.path.join(dest, rel)
        if os.path.lexists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        else:
            shutil.copy2(path, target)


def ensure_base_image(engine: engines.ContainerEngine) -> str:
    """The base image's tag, built (rootfs cached) and imported unless present."""
    files = _host_files()
    stamp = [BUILDER_VERSION, *(f"{p}:{os.lstat(p).st_size}" for p in files)]
    tag = f"{BASE_REPO}:{_digest(stamp)}"
    if engines.image_exists(engine, tag):
        return tag
    with FirstUse(f"the base image {tag} (this host's python3.11, shell, coreutils, git)",
                  f"{engine.name}'s image storage"):
        rootfs = build_once(os.path.join(image_storage_dir(), "rootfs", tag.rsplit(":", 1)[1]),
                            lambda tmp: _write_rootfs(files, tmp))
        log.info("importing %s from %s", tag, rootfs)
        with tempfile.TemporaryDirectory(prefix="sluice-base-") as tmp:
            archive = os.path.join(tmp, "rootfs.tar")
            subprocess.run(["tar", "-C", rootfs, "--numeric-owner", "-cf", archive, "."],
                           check=True)
            engines.run_engine(engine, "import", archive, tag, timeout_s=600)
    return tag


def ensure_project_image(engine: engines.ContainerEngine, project: str,
                         requirements: tuple[str, ...]) -> str:
    """FROM base + `requirements` (pinned `name==version`) installed from the package
    index; built unless its tag exists."""
    base = ensure_base_image(engine)
    digest = _digest([PROJECT_LAYER_VERSION, base, *sorted(requirements)])
    tag = f"localhost/sluice-swe-deps.{project}:{digest}"
    if engines.image_exists(engine, tag):
        return tag
    count = f"{len(requirements)} pinned requirement{'s' if len(requirements) != 1 else ''}"
    with FirstUse(f"the project layer {tag} ({count} from the package index)",
                  f"{engine.name}'s image storage"):
        site = build_once(os.path.join(image_storage_dir(), "site", digest),
                          lambda tmp: _pip_install(requirements, tmp))
        # Binary wheels load shared libraries (libgcc_s, libstdc++) the base may not have.
        base_files = {os.path.relpath(p, "/") for p in _host_files()}
        libs = sorted(p for p in _shared_libraries(
            [os.path.join(d, f) for d, _, fs in os.walk(site) for f in fs if ".so" in f])
            if os.path.relpath(p, "/") not in base_files and not p.startswith(site))
        with tempfile.TemporaryDirectory(prefix="sluice-libs-") as extra:
            _write_files(libs, extra)
            _build(engine, tag, f"FROM {base}\nCOPY site {SITE_PACKAGES}\nCOPY libs /\n",
                   {"site": site, "libs": extra})
    return tag


def unpinned(requirements: Iterable[str]) -> list[str]:
    """The requirements a project layer cannot take: each must pin one version (name==x),
    since the layer is keyed by them."""
    return [r for r in requirements if "==" not in r]


def _pip_install(requirements: tuple[str, ...], dest: str) -> None:
    if not requirements:
        return  # a project without dependencies: an empty layer
    if unpinned(requirements):
        raise ValueError(f"image requirements must be pinned (name==version): "
                         f"{unpinned(requirements)}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
                    "--disable-pip-version-check", "--target", dest, *requirements], check=True)


def build_task_image(engine: engines.ContainerEngine, project_image: str, name: str,
                     testbed: str) -> str:
    """FROM the project's image + `testbed` at /testbed, tagged `name`; rebuilt when the
    existing one was built on another project image (its `sluice.parent` label)."""
    if not engines.image_exists(engine, name) or engines.run_engine(
            engine, "image", "inspect", "--format", '{{index .Labels "sluice.parent"}}',
            name).strip() != project_image:
        _build(engine, name, f"FROM {project_image}\nLABEL sluice.parent={project_image}\n"
               "COPY testbed /testbed\n", {"testbed": testbed})
    return name


def _build(engine: engines.ContainerEngine, tag: str, containerfile: str,
           folders: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory(prefix="sluice-imgctx-") as ctx:
        for name, src in folders.items():
            shutil.copytree(src, os.path.join(ctx, name), symlinks=True)
        with open(os.path.join(ctx, "Containerfile"), "w") as f:
            f.write(containerfile)
        log.info("building %s", tag)
        engines.run_engine(engine, "build", "--pull=never", "--quiet", "-t", tag, "-f",
                           os.path.join(ctx, "Containerfile"), ctx, timeout_s=900)


def save_archive(engine: engines.ContainerEngine, image: str,
                 archive_dir: str | None = None) -> str:
    """`podman save` of `image` where prewarm looks for it; the archive's path."""
    archive_dir = archive_dir or default_archive_dir()
    os.makedirs(archive_dir, exist_ok=True)
    path = os.path.join(archive_dir, archive_name(image))
    if not os.path.isfile(path):
        engines.run_engine(engine, "save", "--quiet", "-o", path, image, timeout_s=900)
    return path


def image_size_mb(engine: engines.ContainerEngine, image: str) -> float:
    size = engines.run_engine(engine, "image", "inspect", "--format", "{{.Size}}", image)
    return int(size.strip()) / 1e6


def swe_smith_image_name(repo: str, commit: str) -> str:
    """SWE-smith's image name for `repo` (owner/name) at `commit`, in local storage."""
    owner, name = repo.split("/", 1)
    return f"localhost/swesmith.x86_64.{owner}_1776_{name}.{commit[:8]}".lower()


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """What one task's image is built from."""

    instance_id: str
    repo: str  # owner/name: names the image (SWE-smith's naming)
    base_commit: str  # the commit whose tree goes to /testbed
    repo_dir: str  # the local repository (or snapshot folder) holding it
    project: str  # names the project layer (lowercase letters, digits, . _ -)
    requirements: tuple[str, ...] = ()  # pinned: the project layer's pip install


def build_image_for(engine: engines.ContainerEngine, spec: ImageSpec, work_dir: str, *,
                    archive: bool = False) -> str:
    """The task image of `spec` (base, project layer, the repository at its base commit
    at /testbed), built unless present; its exported tree is kept under
    `work_dir`/testbeds. `archive`: also `podman save`d where prewarm looks."""
    project_image = ensure_project_image(engine, spec.project, spec.requirements)
    testbed = export_base_snapshot(spec.repo_dir, spec.base_commit,
                                   os.path.join(work_dir, "testbeds"), spec.instance_id)
    name = build_task_image(engine, project_image,
                            swe_smith_image_name(spec.repo, spec.base_commit), testbed)
    if archive:
        save_archive(engine, name)
    return name


# --- python -m envs.tasks.images build ROWS.jsonl ----------------------------------------

def image_spec_from_row(ref: RowRef, row: Row) -> tuple[ImageSpec | None, list[str]]:
    """The ImageSpec of one user row, or every problem it has (each naming the field and
    the fix)."""
    problems: list[str] = []

    def read(fn: Callable[[], T]) -> T | None:  # a field's value, or its problem kept
        try:
            return fn()
        except ValueError as exc:
            problems.append(str(exc))
            return None

    instance_id = read(lambda: get_str(ref, row, "instance_id", required=True))
    repo = read(lambda: aliased_field(ref, row, "repo"))
    if repo is None and "repo" not in row and "repo_name" not in row:
        problems.append(str(ref.error("repo", "is required: the repository as owner/name "
                                      "(R2E-Gym rows: repo_name)")))
    elif repo is not None and repo.count("/") != 1:
        problems.append(str(ref.error("repo", f"must be owner/name, got {repo!r}")))
        repo = None
    commit = read(lambda: aliased_field(ref, row, "base_commit"))
    if commit is None and "base_commit" not in row and "commit_hash" not in row:
        problems.append(str(ref.error("base_commit", "is required: the commit whose tree the "
                                      "image holds at /testbed (R2E-Gym rows: commit_hash)")))
    requirements = read(lambda: get_str_list(ref, row, "requirements")) or ()
    if unpinned(requirements):
        problems.append(str(ref.error("requirements", f"{unpinned(requirements)} must pin one "
                                      "version each (name==version): the project layer is "
                                      "keyed by them")))
    repo_dir = None
    if repo is not None or "repo_dir" in row:
        repo_dir = read(lambda: find_repo_dir(ref, row))
    if repo_dir is not None and commit is not None:
        try:  # the full id (as given for a plain snapshot folder)
            commit = resolve_commit(repo_dir, commit) or commit
        except ValueError as exc:
            problems.append(str(ref.error("base_commit", str(exc))))
    if problems:
        return None, problems
    assert instance_id and repo and commit and repo_dir
    project = re.sub(r"[^a-z0-9._-]+", "-", repo.split("/", 1)[1].lower()).strip(".-_") or "project"
    return ImageSpec(instance_id, repo, commit, repo_dir, project, tuple(requirements)), []


def read_image_rows(path: str) -> tuple[list[tuple[Row, ImageSpec]], list[str]]:
    """Every row of `path` with its ImageSpec, and every problem of every row (a row that
    is not JSON, a missing or bad field, an instance id used twice)."""
    specs: list[tuple[Row, ImageSpec]] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    try:
        for ref, row in read_rows(path, on_error=lambda exc: problems.append(str(exc))):
            spec, row_problems = image_spec_from_row(ref, row)
            problems.extend(row_problems)
            if spec is None:
                continue
            if spec.instance_id in seen:
                problems.append(str(ref.error("instance_id", f"{spec.instance_id!r} is also row "
                                              f"{seen[spec.instance_id]}'s; ids must be unique")))
            seen[spec.instance_id] = ref.row
            specs.append((row, spec))
    except ValueError as exc:  # the file itself
        problems.append(str(exc))
    if not specs and not problems:
        problems.append(f"{path} holds no rows; write one JSON object per line")
    return specs, problems


def build_images(path: str, out_dir: str, *, archive: bool = False) -> str:
    """The images of every row of `path`, and `out_dir`/tasks.jsonl with the rows as
    image-only rows; ValueError listing every problem of the rows (nothing built)."""
    specs, problems = read_image_rows(path)
    if problems:
        raise ValueError(f"{len(problems)} problem(s) in {path}, nothing was built:\n  "
                         + "\n  ".join(problems))
    engine = engines.detect_engine()
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for i, (row, spec) in enumerate(specs, 1):
        start = time.monotonic()
        name = build_image_for(engine, spec, out_dir, archive=archive)
        log.info("image %d/%d: %s -> %s (%.1f s)", i, len(specs), spec.instance_id, name,
                 time.monotonic() - start)
        image_only = {k: v for k, v in row.items() if k != "repo_dir"}
        rows.append({**image_only, "image_name": name, "workdir": IMAGE_WORKDIR})
    out = os.path.join(out_dir, "tasks.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.tasks.images",
                                     description="Per-task container images for SWE-style rows.")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser(
        "build", help="build each row's image (base, project layer, repository at /testbed)",
        description="Build each row's image: the base, a project layer with the row's pinned "
        "`requirements`, the repository (repo_dir, default repos/<owner>__<name> beside the "
        "rows) at base_commit at /testbed. Writes OUT/tasks.jsonl: the rows as image-only rows.")
    build.add_argument("rows", help="a .jsonl file of SWE-style rows")
    build.add_argument("--out", help="where tasks.jsonl and the exported trees go "
                       "(default: ./<ROWS name>.images)")
    build.add_argument("--archive", action="store_true",
                       help="also `podman save` each image where prewarm loads it on other nodes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stem = os.path.splitext(os.path.basename(args.rows))[0]
    out_dir = args.out or os.path.abspath(f"{stem}.images")
    start = time.monotonic()
    try:
        out = build_images(args.rows, out_dir, archive=args.archive)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"rows with their images: {out} ({time.monotonic() - start:.1f} s); train on them with "
          f"envs.tasks={out} envs.sandbox_backend=container")
    return 0


if __name__ == "__main__":
    sys.exit(main())
