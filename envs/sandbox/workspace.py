"""Host-side work on a sandbox's workspace folder: filling it from a source folder,
file reads and writes from the trainer, and snapshots as tar files.

These run as root on the host while no sandboxed process runs (the sandbox serializes
them with its commands, and a command leaves no process behind), so the checks on
symlinks and file types below cannot race with the sandboxed code changing the tree.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import stat
import tarfile
import tempfile

from envs.sandbox.base import Snapshot, resolve_workspace_path


_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(path: str, size_mb: int, owner_uid: int) -> None:
    """Put a size-capped tmpfs on `path`: the workspace cannot fill the host's disk, and
    release is one unmount instead of deleting a tree. Pages the sandbox writes there
    are charged to its memory cgroup, like any tmpfs."""
    # Inodes are capped too: millions of empty files would otherwise cost kernel memory.
    options = (f"size={size_mb}m,nr_inodes={max(4096, size_mb * 256)},mode=0700,"
               f"uid={owner_uid},gid={owner_uid}")
    if _libc.mount(b"sluice-workspace", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                   options.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount tmpfs on {path}: {os.strerror(errno)}")


def unmount(path: str) -> None:
    if _libc.umount2(path.encode(), 0) != 0:
        errno = ctypes.get_errno()
        # Busy would mean a process still uses it: detach it from the tree anyway, the
        # kernel frees it when the last user is gone.
        if _libc.umount2(path.encode(), _MNT_DETACH) != 0:
            raise OSError(errno, f"umount {path}: {os.strerror(errno)}")


def mounts_starting_with(prefix: str) -> list[str]:
    """Mount points whose path starts with `prefix`, in this process's mount namespace."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # Mount points escape blanks as octal (\040); sandbox paths have none.
            point = line.split()[4]
            if point.startswith(prefix):
                found.append(point)
    return found


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise OSError(f"{argv[0]} failed ({proc.returncode}): {err.decode(errors='replace')}")


async def fill_from_source(source_dir: str, workspace: str, owner_uid: int) -> None:
    """Copy `source_dir`'s content into `workspace` and give it to the sandbox's uid.
    `cp --reflink=auto -a` shares blocks on CoW filesystems and copies elsewhere; the
    tree is then chowned because root's copy keeps the source's owners, and the uid
    inside (65534) maps to `owner_uid` on the host."""
    await _run("cp", "--reflink=auto", "-a", "--", os.path.join(source_dir, "."), workspace)
    await chown_tree(workspace, owner_uid)


async def chown_tree(path: str, owner_uid: int) -> None:
    # -h: change symlinks themselves, never their targets (a workspace link may point
    # at a host file).
    await _run("chown", "-R", "-h", f"{owner_uid}:{owner_uid}", "--", path)


def read_file(workspace: str, path: str) -> bytes:
    resolved = resolve_workspace_path(workspace, path)
    # O_NONBLOCK: a FIFO planted by the sandbox must not hang the trainer on open.
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FileNotFoundError(f"no file {path!r} in the workspace") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"workspace path {path!r} is not a regular file; read files only")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def write_file(workspace: str, path: str, data: bytes, owner_uid: int) -> None:
    resolved = resolve_workspace_path(workspace, path)
    parent = os.path.dirname(resolved)
    _make_dirs_owned(parent, owner_uid)
    if os.path.lexists(resolved) and not stat.S_ISREG(os.lstat(resolved).st_mode):
        raise ValueError(f"workspace path {path!r} exists and is not a regular file; "
                         "remove it first")
    fd = os.open(resolved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        os.fchown(f.fileno(), owner_uid, owner_uid)
        f.write(data)


def _make_dirs_owned(directory: str, owner_uid: int) -> None:
    # `directory` comes from realpath, so every existing part of it is a real folder
    # inside the workspace and the new ones are created under it.
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for d in reversed(missing):
        os.mkdir(d, 0o755)
        os.lchown(d, owner_uid, owner_uid)


def _keep_in_snapshot(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    # FIFOs and device nodes are left out: restoring them is refused anyway.
    return info if info.isfile() or info.isdir() or info.issym() or info.islnk() else None


def snapshot(workspace: str, snapshot_dir: str | None) -> Snapshot:
    fd, tar_path = tempfile.mkstemp(prefix="sluice-snapshot-", suffix=".tar", dir=snapshot_dir)
    with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
        for name in sorted(os.listdir(workspace)):
            # Symlinks are stored as links, never followed.
            tar.add(os.path.join(workspace, name), arcname=name, filter=_keep_in_snapshot)
    return Snapshot(tar_path=tar_path, num_bytes=os.path.getsize(tar_path))


def clear(workspace: str) -> None:
    for name in os.listdir(workspace):
        path = os.path.join(workspace, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def restore(workspace: str, snap: Snapshot) -> None:
    """Replace the workspace content by the tar's. The "data" filter refuses absolute
    names, links leading outside and special files, so even a tampered tar cannot
    write outside the workspace."""
    if not os.path.isfile(snap.tar_path):
        raise ValueError(f"snapshot {snap.tar_path} does not exist (discarded?); take a new one")
    clear(workspace)
    with tarfile.open(snap.tar_path, mode="r") as tar:
        tar.extractall(workspace, filter="data")
