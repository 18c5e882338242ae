"""Host-side work on a sandbox's folder and workspace, shared by the backends that keep
the workspace on this host (local, container): making and deleting the folder, the
size-capped tmpfs, filling it from a source folder, file reads and writes from the
trainer, and snapshots as tar files.

These run as root on the host while no sandboxed process runs (the sandbox serializes
them with its commands, and a command leaves no process behind), so the checks on
symlinks and file types below cannot race with the sandboxed code changing the tree.

Every byte this module writes or reads on a sandbox's behalf (snapshot tars, restores,
file reads) is bounded by the sandbox's own cap, `SandboxLimits.disk_mb`, counted on
apparent size: a sparse file costs its full length in a tar or a read, however few
blocks it holds on the (size-capped) workspace tmpfs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import AsyncGenerator, Callable
from typing import BinaryIO

from envs.owner import owner_tag
from envs.sandbox.base import SandboxCapabilities, Snapshot, resolve_workspace_path
from envs.sandbox.hostuid import HostUidLease

log = logging.getLogger(__name__)

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


class WorkspaceOverCapError(ValueError):
    """The workspace content, counted on apparent size, exceeds the sandbox's cap."""


def _over_cap(what: str, num_bytes: int, max_bytes: int) -> WorkspaceOverCapError:
    return WorkspaceOverCapError(
        f"{what} holds {num_bytes} bytes (apparent size: sparse files count in full), over "
        f"the sandbox's cap of {max_bytes} bytes (SandboxLimits.disk_mb); refused, so the "
        "host never stores more than the cap. Delete the large files in the sandbox, or "
        "raise disk_mb")


def read_file(workspace: str, path: str, max_bytes: int) -> bytes:
    resolved = resolve_workspace_path(workspace, path)
    # O_NONBLOCK: a FIFO planted by the sandbox must not hang the trainer on open.
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FileNotFoundError(f"no file {path!r} in the workspace") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"workspace path {path!r} is not a regular file; read files only")
        if st.st_size > max_bytes:
            raise _over_cap(f"workspace file {path!r}", st.st_size, max_bytes)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(max_bytes)
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


def tar_budget(workspace: str) -> tuple[int, int]:
    """(content bytes, header bytes) a tar of `workspace` needs at most: regular files at
    their apparent size, each inode once (tar stores further hard links as links), and
    per entry a header with room for a long name's extended header."""
    content, headers, seen = 0, 20 << 10, set()  # end-of-archive and record padding
    for dirpath, dirnames, filenames in os.walk(workspace):  # never follows symlinks
        for name in (*dirnames, *filenames):
            st = os.lstat(os.path.join(dirpath, name))
            headers += 2048 + 2 * len(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                content += st.st_size + 512  # padded to whole blocks
    return content, headers


class _CappedWriter:
    """The write side of a file that refuses to grow past `limit` bytes (what tarfile
    uses of it: write and tell): the backstop of the size check made before a tar is
    written, should a file grow between the two."""

    def __init__(self, f: BinaryIO, limit: int, max_bytes: int) -> None:
        self._f, self._limit, self._max_bytes, self._written = f, limit, max_bytes, 0

    def write(self, data: bytes) -> int:
        self._written += len(data)
        if self._written > self._limit:
            raise _over_cap("the workspace snapshot", self._written, self._max_bytes)
        return self._f.write(data)

    def tell(self) -> int:
        return self._written


def snapshot(workspace: str, snapshot_dir: str | None, max_bytes: int) -> Snapshot:
    content, headers = tar_budget(workspace)
    if content > max_bytes:
        raise _over_cap("the workspace", content, max_bytes)
    # The owner tag lets envs.reaper delete the tars of a worker that died.
    fd, tar_path = tempfile.mkstemp(prefix=f"sluice-snapshot-{owner_tag()}-", suffix=".tar",
                                    dir=snapshot_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            capped = _CappedWriter(f, content + headers, max_bytes)
            with tarfile.open(fileobj=capped, mode="w") as tar:  # type: ignore[arg-type]
                for name in sorted(os.listdir(workspace)):
                    # Symlinks are stored as links, never followed.
                    tar.add(os.path.join(workspace, name), arcname=name,
                            filter=_keep_in_snapshot)
    except BaseException:  # cancellation included: the partial tar is removed, then re-raised
        os.unlink(tar_path)
        raise
    return Snapshot(tar_path=tar_path, num_bytes=os.path.getsize(tar_path))


def clear(workspace: str) -> None:
    for name in os.listdir(workspace):
        path = os.path.join(workspace, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def restore(workspace: str, snap: Snapshot, max_bytes: int) -> None:
    """Replace the workspace content by the tar's. The "data" filter refuses absolute
    names, links leading outside and special files, so even a tampered tar cannot
    write outside the workspace; a tar of a sandbox with a larger cap is refused."""
    if not os.path.isfile(snap.tar_path):
        raise ValueError(f"snapshot {snap.tar_path} does not exist (discarded?); take a new one")
    with tarfile.open(snap.tar_path, mode="r:") as tar:  # ours: never compressed
        content = sum(m.size for m in tar.getmembers() if m.isfile())
        if content > max_bytes:
            raise _over_cap(f"snapshot {snap.tar_path}", content, max_bytes)
        clear(workspace)
        tar.extractall(workspace, filter="data")


def make_sandbox_dir(root: str, uid: int, prefix: str, etc_files: dict[str, str]) -> str:
    """<root>/<prefix><uid>-XXXX (root-owned, 0711) holding workspace/ (the sandbox uid's,
    0700) and etc/ with `etc_files` (name -> text, 0644) for the backend to mount."""
    sandbox_dir = tempfile.mkdtemp(prefix=f"{prefix}{uid}-", dir=root)
    os.chmod(sandbox_dir, 0o711)
    ws = os.path.join(sandbox_dir, "workspace")
    os.mkdir(ws, 0o700)
    os.chown(ws, uid, uid)
    etc = os.path.join(sandbox_dir, "etc")
    os.mkdir(etc, 0o755)
    for name, text in etc_files.items():
        with open(os.path.join(etc, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(etc, name), 0o644)
    return sandbox_dir


def mount_capped_workspace(ws: str, disk_mb: int, uid: int) -> int | None:
    """The workspace's size cap in MB, or None where tmpfs cannot be mounted here (no
    CAP_SYS_ADMIN in the worker's container): then it stays a plain folder."""
    try:
        mount_tmpfs(ws, disk_mb, uid)
        return disk_mb
    except OSError as e:
        if "tmpfs" not in _warned:
            _warned.add("tmpfs")
            log.warning("sandbox workspaces stay plain folders without a size cap: %s", e)
        return None


_warned: set[str] = set()


def remove_sandbox_dir(sandbox_dir: str) -> None:
    """Unmount the workspace tmpfs (if any), then delete the folder. rmtree never follows
    symlinks, so links the sandbox planted cannot redirect the deletion."""
    for point in sorted(mounts_starting_with(sandbox_dir + "/"), reverse=True):
        unmount(point)
    shutil.rmtree(sandbox_dir, ignore_errors=True)
    if os.path.lexists(sandbox_dir):
        log.error("sandbox folder %s could not be deleted", sandbox_dir)


def clear_dir_fd(dir_fd: int) -> None:
    """Delete everything inside the folder open as `dir_fd` (a sandbox's private /tmp seen
    from the host). Every step is relative to a file descriptor and never follows a
    symlink, so a link planted inside cannot point the deletion at a host path."""
    for name in os.listdir(dir_fd):
        if stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode):
            shutil.rmtree(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)


def command_argv(cmd: str | list[str], timeout_s: float) -> list[str]:
    """The argv of an exec call (a string goes through /bin/sh -c), checked."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"cmd must be a shell string or a non-empty list of str, got {cmd!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return argv


class HostWorkspace:
    """The workspace half of a sandbox whose workspace is a folder on this host: the
    trainer's file operations and snapshots, serialized with the sandbox's commands (one
    at a time, so no sandboxed process races the host-side checks) and refused after
    release. Backends hold one and delegate to it."""

    def __init__(self, path: str, owner_uid: int, snapshot_dir: str | None,
                 max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes  # the sandbox's cap (disk_mb), on apparent size
        self._owner_uid = owner_uid
        self._snapshot_dir = snapshot_dir
        self._lock = asyncio.Lock()
        self._released = False

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncGenerator[None, None]:
        """Hold the sandbox for one command."""
        async with self._lock:
            self._check_live()
            yield

    async def read_file(self, path: str) -> bytes:
        async with self.turn():
            return await asyncio.to_thread(read_file, self.path, path, self.max_bytes)

    async def write_file(self, path: str, data: bytes | bytearray) -> None:
        # A bytearray is copied before the thread writes it, so the caller may reuse it.
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"write_file takes bytes, got {type(data).__name__}; "
                             "encode text first (e.g. text.encode())")
        async with self.turn():
            await asyncio.to_thread(write_file, self.path, path, bytes(data), self._owner_uid)

    async def snapshot(self) -> Snapshot:
        async with self.turn():
            return await asyncio.to_thread(snapshot, self.path, self._snapshot_dir,
                                           self.max_bytes)

    async def restore(self, snap: Snapshot) -> None:
        async with self.turn():
            await asyncio.to_thread(restore, self.path, snap, self.max_bytes)
            await chown_tree(self.path, self._owner_uid)

    async def release(self, teardown: Callable[[], None]) -> None:
        """Run `teardown` (in a thread) once; later calls do nothing."""
        async with self._lock:
            if self._released:
                return
            self._released = True
            await asyncio.to_thread(teardown)

    def _check_live(self) -> None:
        if self._released:
            raise ValueError("this sandbox was released; create a new one (and restore a "
                             "snapshot into it to resume)")


class HostWorkspaceSandbox:
    """What every backend whose workspace is a host folder shares: the Sandbox protocol's
    capabilities, file and snapshot operations and release, over `self._capabilities`,
    `self._lease` (the leased host uid), `self._ws` (a HostWorkspace) and
    `self._teardown` (the backend's own clean-up, run by release)."""

    _capabilities: SandboxCapabilities
    _lease: HostUidLease
    _ws: HostWorkspace

    def _teardown(self) -> None:
        raise NotImplementedError

    def capabilities(self) -> SandboxCapabilities:
        return self._capabilities

    @property
    def host_uid(self) -> int:
        return self._lease.uid

    @property
    def workspace_dir(self) -> str:
        """The workspace's host path (for host-side checks; commands see /workspace)."""
        return self._ws.path

    async def read_file(self, path: str) -> bytes:
        return await self._ws.read_file(path)

    async def write_file(self, path: str, data: bytes) -> None:
        await self._ws.write_file(path, data)

    async def snapshot(self) -> Snapshot:
        return await self._ws.snapshot()

    async def restore(self, snapshot: Snapshot) -> None:
        await self._ws.restore(snapshot)

    async def release(self) -> None:
        await self._ws.release(self._teardown)
